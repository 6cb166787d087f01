"""The collectives people call directly. Each picks the engine that owns its tensor.

torch tensors and numpy arrays (CPU, shared memory, no copy) go through
torch.distributed; MindSpore tensors through MindSpore communication.
"""

from __future__ import annotations

from typing import Any

from .runtime import engine_for_tensor


def allreduce(tensor: Any, op: Any = "sum", *, group: Any = None, async_op: bool = False) -> Any:
    """Reduce ``tensor`` across ranks in place and return it (a handle if ``async_op``).

    ``op``: "sum", "avg", "max", "min", "prod" or a ``torch.distributed.ReduceOp``.
    """
    return engine_for_tensor(tensor).allreduce(tensor, op, async_op=async_op, group=group)


def broadcast(tensor: Any, src: int = 0, *, group: Any = None, async_op: bool = False) -> Any:
    """Overwrite ``tensor`` on every rank with rank ``src``'s, in place."""
    return engine_for_tensor(tensor).broadcast(tensor, src, async_op=async_op, group=group)


def allgather(tensor: Any, *, group: Any = None, async_op: bool = False) -> Any:
    """Every rank's ``tensor`` concatenated along the first dimension, in rank order."""
    return engine_for_tensor(tensor).allgather(tensor, async_op=async_op, group=group)


def reduce_scatter(tensor: Any, op: Any = "sum", *, group: Any = None, async_op: bool = False) -> Any:
    """Reduce ``tensor`` across ranks and return this rank's chunk of the first dimension."""
    return engine_for_tensor(tensor).reduce_scatter(tensor, op, async_op=async_op, group=group)
