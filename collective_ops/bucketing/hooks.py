"""Per-bucket communication hooks: how one full bucket is reduced.

A hook takes a :class:`BucketContext` and returns a :class:`Handle`; waiting on the
handle must leave the reduced values in ``ctx.buffer``. Averaging is applied by
pre-scaling with ``1/world_size`` before a sum, as PyTorch DDP does, which keeps the
result bit-identical to DDP's and halves the risk of overflow in low precision.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .interfaces import BucketEngine, Handle, ThenHandle
from .plan import BucketSpec


@dataclass
class BucketContext:
    bucket: BucketSpec
    buffer: Any
    engine: BucketEngine
    reduce_op: str  # "sum" or "avg"
    # True when every gradient in the buffer was already multiplied by 1/world_size as it was
    # copied in (BucketManager.copy_in_scale): the hook must not scale again.
    prescaled: bool = False

    @property
    def world_size(self) -> int:
        return self.engine.world_size


CommHook = Callable[[BucketContext], Handle]


def allreduce_prescale(engine: BucketEngine, reduce_op: str) -> float | None:
    """The factor :func:`allreduce_hook` multiplies a bucket by before summing, or None.

    1/world_size for "avg", as DDP does, except where the engine's framework averages after
    the sum (MindSpore's ``DistributedGradReducer``: sum, then times 1/world).
    """
    if reduce_op == "avg" and engine.world_size > 1 and not getattr(engine, "average_after_sum", False):
        return 1.0 / engine.world_size
    return None


def allreduce_hook(ctx: BucketContext) -> Handle:
    """The default: allreduce in the buffer's own precision, averaged as the framework's own reducer does."""
    if ctx.reduce_op == "avg" and ctx.world_size > 1 and getattr(ctx.engine, "average_after_sum", False):
        handle = ctx.engine.allreduce(ctx.buffer, "sum", async_op=True)
        return ThenHandle(handle, lambda: ctx.engine.scale_(ctx.buffer, 1.0 / ctx.world_size))
    factor = allreduce_prescale(ctx.engine, ctx.reduce_op)
    if factor is not None and not ctx.prescaled:
        ctx.engine.scale_(ctx.buffer, factor)
    return ctx.engine.allreduce(ctx.buffer, "sum", async_op=True)


def compression_hook(dtype: str) -> CommHook:
    """Communicate in ``dtype`` (``"float16"`` or ``"bfloat16"``), accumulate back in the buffer's dtype."""

    def hook(ctx: BucketContext) -> Handle:
        if ctx.bucket.dtype == dtype:
            return allreduce_hook(ctx)
        compressed = ctx.engine.cast(ctx.buffer, dtype)
        if ctx.reduce_op == "avg" and ctx.world_size > 1:
            ctx.engine.scale_(compressed, 1.0 / ctx.world_size)
        handle = ctx.engine.allreduce(compressed, "sum", async_op=True)
        return ThenHandle(handle, lambda: ctx.engine.copy_(ctx.buffer, compressed))

    hook.__name__ = f"{dtype}_compression_hook"
    return hook


COMPRESSIONS = {"fp16": "float16", "float16": "float16", "bf16": "bfloat16", "bfloat16": "bfloat16"}


def hook_for_compression(compression: str | None) -> CommHook:
    """The built-in hook for ``compression`` (None, "fp16" or "bf16")."""
    if compression is None or compression == "none":
        return allreduce_hook
    if isinstance(compression, str) and compression.lower() in COMPRESSIONS:
        return compression_hook(COMPRESSIONS[compression.lower()])
    raise ValueError(f"unknown compression {compression!r}; use None, 'fp16' or 'bf16'")
