"""Run one collective over many tensors by fusing them into flat buffers (framework-free)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from .interfaces import BucketEngine, Handle, ThenHandle, wait_with_timeout
from .plan import ParamSpec, plan_buckets


def fused_collective(
    engine: BucketEngine,
    tensors: Sequence[Any],
    bucket_size_mb: float,
    collective: Callable[[Any], Handle | None],
) -> tuple[Handle, int]:
    """Launch ``collective(buffer)`` (async, in place) over ``tensors`` fused in order.

    Buffers hold at most ``bucket_size_mb`` MiB of one dtype and device; a lone
    contiguous tensor is communicated in place. Returns a handle whose ``wait()``
    writes the results back into ``tensors``, and the number of collectives launched.
    """
    if not tensors:
        return ThenHandle(None, lambda: None), 0
    specs = []
    for i, tensor in enumerate(tensors):
        numel, dtype, device = engine.describe(tensor)
        specs.append(ParamSpec(f"tensor{i}", numel, dtype, device, engine.itemsize(tensor)))
    plan = plan_buckets(specs, bucket_size_mb, bucket_size_mb, order=range(len(specs)))
    assembles = bool(getattr(engine, "assembles_buckets", False))
    launched: list[tuple[Handle | None, Any, list[tuple[Any, int]]]] = []
    for bucket in plan.buckets:
        members = [tensors[i] for i in bucket.param_indices]
        if len(members) == 1 and engine.is_contiguous(members[0]):
            launched.append((collective(members[0]), None, []))  # nothing to fuse: no copy
            continue
        if assembles:
            buffer = engine.pack(members)
        else:
            buffer = engine.zeros(bucket.numel, bucket.dtype, bucket.device)
            for tensor, offset in zip(members, bucket.offsets):
                engine.write(buffer, offset, tensor)
        launched.append((collective(buffer), buffer, list(zip(members, bucket.offsets))))

    def complete() -> None:
        for handle, buffer, members in launched:
            if handle is not None:
                handle.wait()
            if assembles and members:
                pieces = engine.unpack(buffer, [_numel(engine, t) for t, _ in members])
                for (tensor, _), piece in zip(members, pieces):
                    engine.copy_(tensor, piece)
                continue
            for tensor, offset in members:
                engine.write_back(tensor, buffer, offset)

    pending = [h for h, _, _ in launched if h is not None]
    return ThenHandle(_AllOf(pending), complete), len(launched)


def _numel(engine: BucketEngine, tensor: Any) -> int:
    return engine.describe(tensor)[0]


class _AllOf:
    """Completion of several handles; the waiting itself happens in order in the callback."""

    def __init__(self, handles: list[Handle]) -> None:
        self._handles = handles

    def wait(self, timeout: Any = None) -> None:
        """Every handle waited for, within ``timeout`` (seconds or a timedelta, for all of them: None, no limit),
        so that a bounded wait is bounded here, not only in the callback's own waits."""
        seconds = timeout.total_seconds() if hasattr(timeout, "total_seconds") else timeout
        deadline = None if seconds is None else time.monotonic() + seconds
        for handle in self._handles:
            wait_with_timeout(handle, None if deadline is None else max(deadline - time.monotonic(), 0.001))

    def is_completed(self) -> bool:
        return all(h.is_completed() for h in self._handles)
