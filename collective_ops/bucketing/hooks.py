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

from .interfaces import BucketEngine, Handle, ThenHandle, wait_with_timeout
from .plan import BucketSpec
from .row_sparse import RowSparseBucket


@dataclass
class BucketContext:
    bucket: BucketSpec
    buffer: Any
    engine: BucketEngine
    reduce_op: str  # "sum" or "avg"
    # True when every gradient in the buffer was already multiplied by 1/world_size as it was
    # copied in (BucketManager.copy_in_scale): the hook must not scale again.
    prescaled: bool = False
    # What "avg" divides by when not the world size: the ranks still active under join()
    # with divide_by_initial_world_size=False, as DDP.
    divisor: int | None = None
    # A bucket that is one row-sparse table (bucketing/row_sparse.py): the default hook reduces its rows.
    row_sparse: RowSparseBucket | None = None
    # How long a hook may block for its peers (a row-sparse table's rows) before raising TimeoutError,
    # which the manager reports as a stall naming the ranks not taking part (None: no limit).
    stall_timeout_s: float | None = None

    @property
    def world_size(self) -> int:
        return self.engine.world_size


CommHook = Callable[[BucketContext], Handle]


def allreduce_prescale(engine: BucketEngine, reduce_op: str, divisor: int | None = None) -> float | None:
    """The factor :func:`allreduce_hook` multiplies a bucket by before summing, or None.

    1/world_size (or 1/``divisor``) for "avg", as DDP does, except where the engine's framework
    averages after the sum (MindSpore's ``DistributedGradReducer``: sum, then times 1/world).
    """
    if reduce_op == "avg" and engine.world_size > 1 and not getattr(engine, "average_after_sum", False):
        return 1.0 / (divisor or engine.world_size)
    return None


def reduces_rows(hook: CommHook) -> bool:
    """True for the built-in hooks that reduce a row-sparse table by its rows (``ctx.row_sparse``)."""
    return hook is allreduce_hook or bool(getattr(hook, "reduces_rows", False))


def allreduce_hook(ctx: BucketContext) -> Handle:
    """The default: allreduce in the buffer's own precision, averaged as the framework's own reducer does."""
    if ctx.reduce_op == "avg" and ctx.world_size > 1 and getattr(ctx.engine, "average_after_sum", False):
        handle = ctx.engine.allreduce(ctx.buffer, "sum", async_op=True)
        return ThenHandle(handle, lambda: ctx.engine.scale_(ctx.buffer, 1.0 / ctx.world_size))
    factor = allreduce_prescale(ctx.engine, ctx.reduce_op, ctx.divisor)
    if ctx.row_sparse is not None:
        handle = _allreduce_rows(ctx, None if ctx.prescaled else factor)
        if handle is not None:
            return handle
    if factor is not None and not ctx.prescaled:
        ctx.engine.scale_(ctx.buffer, factor)
    return ctx.engine.allreduce(ctx.buffer, "sum", async_op=True)


def _allreduce_rows(ctx: BucketContext, factor: float | None, wire_dtype: str | None = None) -> Handle | None:
    """The union of the ranks' non-zero rows allreduced (sent as ``wire_dtype``, scaled by ``factor``), or
    None where the union is too dense to pay: the caller then reduces the whole bucket."""
    table, engine = ctx.row_sparse, ctx.engine
    if table.exchange is None:
        exchange = engine.rows_union(engine.nonzero_rows(ctx.buffer, table.rows, table.cols), group=table.mask_group)
        union = wait_with_timeout(exchange, ctx.stall_timeout_s)
        outside = None
    else:  # the looked-up rows, all-gathered while backward ran; this rank's gradient checked against its own
        union = wait_with_timeout(table.exchange.union, ctx.stall_timeout_s)
        outside = engine.rows_outside(ctx.buffer, table.rows, table.cols, table.exchange.local)
    if not table.record(len(union)):
        return None

    def densely() -> Any:
        """Some rank's gradient had rows outside the union (every rank saw it in the sum): the whole bucket."""
        table.distrust_lookups()
        wire = ctx.buffer if wire_dtype is None else engine.cast(ctx.buffer, wire_dtype)
        if factor is not None:
            engine.scale_(wire, factor)
        engine.allreduce(wire, "sum", group=table.mask_group)  # the group every rank's next collective is on
        if wire is not ctx.buffer:
            engine.copy_(ctx.buffer, wire)
        return ctx.buffer

    return engine.allreduce_rows(
        ctx.buffer,
        table.rows,
        table.cols,
        union,
        factor,
        wire_dtype=wire_dtype,
        outside=outside,
        if_outside=densely,
    )


WIRE_ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}  # bytes an element, by wire dtype


def _kept(store: dict[int, Any], ctx: BucketContext, description: tuple[int, str, str]) -> Any:
    """A buffer of ``description`` (numel, dtype, device) kept for this bucket between steps (made on first use
    and after a replan): a fresh one per step costs an allocation and its page faults on the autograd thread."""
    held = store.get(ctx.bucket.index)
    if held is None or ctx.engine.describe(held) != description:
        held = store[ctx.bucket.index] = ctx.engine.zeros(*description)
    return held


def compression_hook(dtype: str) -> CommHook:
    """Communicate in ``dtype`` (``"float16"`` or ``"bfloat16"``), accumulate back in the buffer's dtype.

    The cast goes into a wire buffer kept per bucket (24 buckets of 1 MiB: 1.3 ms per step against 6.3 ms
    casting into new tensors, on this VM's CPU), except on engines that assemble a new bucket each step.
    A bucket is launched again only after its previous reduction was waited for, so one buffer per bucket
    suffices.
    """
    wires: dict[int, Any] = {}

    def wire_for(ctx: BucketContext) -> Any:
        if getattr(ctx.engine, "assembles_buckets", False):
            return ctx.engine.cast(ctx.buffer, dtype)
        numel, _, device = ctx.engine.describe(ctx.buffer)
        wire = _kept(wires, ctx, (numel, dtype, device))
        ctx.engine.copy_(wire, ctx.buffer)
        return wire

    def hook(ctx: BucketContext) -> Handle:
        if ctx.bucket.dtype == dtype:
            return allreduce_hook(ctx)
        factor = 1.0 / (ctx.divisor or ctx.world_size) if ctx.reduce_op == "avg" and ctx.world_size > 1 else None
        if ctx.row_sparse is not None:  # the rows cast, then scaled, as the whole bucket is below
            handle = _allreduce_rows(ctx, factor, wire_dtype=dtype)
            if handle is not None:
                return handle
        compressed = wire_for(ctx)
        if factor is not None:
            ctx.engine.scale_(compressed, factor)
        handle = ctx.engine.allreduce(compressed, "sum", async_op=True)
        return ThenHandle(handle, lambda: ctx.engine.copy_(ctx.buffer, compressed))

    hook.__name__ = f"{dtype}_compression_hook"
    hook.reduces_rows = True
    hook.wire_itemsize = WIRE_ITEMSIZE[dtype]  # what each element costs on the wire (the step's byte count)
    return hook


def reduce_scatter_hook(wire_dtype: str | None = None, keep: Callable[[int, Any], None] | None = None) -> CommHook:
    """Sharded data parallel: each rank receives the averaged sum of its own shard of the bucket only.

    The buffer must be padded to a multiple of the world size (``BucketManager.set_padding``);
    afterwards this rank's shard of it (``engine.shard_of``) holds the result, averaged as
    :func:`allreduce_hook` averages (so the same two-operand sums at 2 ranks: bit-equal to it).
    With ``wire_dtype`` other than the bucket's (fp16 compression, or bf16 gradients reduced in
    fp32) the bucket is cast first and the reduced shard, in ``wire_dtype``, is handed to
    ``keep(bucket_index, shard)`` instead of being written back.
    """

    def hook(ctx: BucketContext) -> Handle:
        engine = ctx.engine
        factor = allreduce_prescale(engine, ctx.reduce_op, ctx.divisor)
        if wire_dtype is None or wire_dtype == ctx.bucket.dtype:
            if ctx.row_sparse is not None:  # the union's rows allreduced: every shard of the table is then reduced
                handle = _allreduce_rows(ctx, None if ctx.prescaled else factor)
                if handle is not None:
                    return handle
            if factor is not None and not ctx.prescaled:
                engine.scale_(ctx.buffer, factor)
            return engine.reduce_scatter_shard(ctx.buffer, async_op=True)
        if keep is None:
            raise ValueError("reduce_scatter_hook with a wire dtype needs keep= to receive the reduced shard")
        wire = engine.cast(ctx.buffer, wire_dtype)  # (freed with the handle: only its reduced shard is kept)
        if factor is not None and not ctx.prescaled:
            engine.scale_(wire, factor)
        handle = engine.reduce_scatter_shard(wire, async_op=True)
        return ThenHandle(handle, lambda: keep(ctx.bucket.index, _copy(engine, engine.shard_of(wire))))

    hook.__name__ = f"reduce_scatter_hook_{wire_dtype or 'native'}"
    if wire_dtype is not None:  # what each element costs on the wire (the step's byte count)
        hook.wire_itemsize = WIRE_ITEMSIZE[wire_dtype]
    hook.reduces_rows = wire_dtype is None  # a row-sparse table's rows in its own dtype (BucketManager.row_sparse)
    return hook


def _copy(engine: BucketEngine, tensor: Any) -> Any:
    """A copy of ``tensor`` (a view of a shard: kept as it is, it would keep the whole buffer alive)."""
    copy = engine.zeros(*engine.describe(tensor))
    engine.copy_(copy, tensor)
    return copy


COMPRESSIONS = {"fp16": "float16", "float16": "float16", "bf16": "bfloat16", "bfloat16": "bfloat16"}
