"""The collectives people call directly. Each picks the engine that owns its tensor.

torch tensors and numpy arrays (CPU, shared memory, no copy) go through
torch.distributed; MindSpore tensors through MindSpore communication.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from . import tracing
from .runtime import engine_for_tensor


class _TracedHandle:
    """An async primitive's handle that records the call when it is waited on."""

    def __init__(self, handle: Any, record: Callable[[float], None]) -> None:
        self._handle = handle
        self._record: Callable[[float], None] | None = record

    def wait(self) -> Any:
        result = self._handle.wait()
        if self._record is not None:
            record, self._record = self._record, None
            record(time.perf_counter())
        return result

    def is_completed(self) -> bool:
        return self._handle.is_completed()


def _traced(op: str, tensor: Any, async_op: bool, call: Callable[[], Any]) -> Any:
    tracer = tracing.get_tracer()
    if tracer is None:
        return call()
    start = time.perf_counter()
    result = call()
    nbytes = int(getattr(tensor, "nbytes", 0))

    def record(end: float) -> None:
        tracer.primitive(op, nbytes, start, end, async_op)

    if async_op:
        return _TracedHandle(result, record)
    record(time.perf_counter())
    return result


def allreduce(tensor: Any, op: Any = "sum", *, group: Any = None, async_op: bool = False) -> Any:
    """Reduce ``tensor`` across ranks in place and return it (a handle if ``async_op``).

    ``op``: "sum", "avg", "max", "min", "prod" or a ``torch.distributed.ReduceOp``.
    """
    engine = engine_for_tensor(tensor)
    return _traced("allreduce", tensor, async_op, lambda: engine.allreduce(tensor, op, async_op=async_op, group=group))


def broadcast(tensor: Any, src: int = 0, *, group: Any = None, async_op: bool = False) -> Any:
    """Overwrite ``tensor`` on every rank with rank ``src``'s, in place."""
    engine = engine_for_tensor(tensor)
    return _traced("broadcast", tensor, async_op, lambda: engine.broadcast(tensor, src, async_op=async_op, group=group))


def allgather(tensor: Any, *, group: Any = None, async_op: bool = False) -> Any:
    """Every rank's ``tensor`` concatenated along the first dimension, in rank order."""
    engine = engine_for_tensor(tensor)
    return _traced("allgather", tensor, async_op, lambda: engine.allgather(tensor, async_op=async_op, group=group))


def reduce_scatter(tensor: Any, op: Any = "sum", *, group: Any = None, async_op: bool = False) -> Any:
    """Reduce ``tensor`` across ranks and return this rank's chunk of the first dimension."""
    engine = engine_for_tensor(tensor)
    return _traced(
        "reduce_scatter", tensor, async_op, lambda: engine.reduce_scatter(tensor, op, async_op=async_op, group=group)
    )
