"""The bucket manager: fused buffers, readiness tracking, in-order async launch.

One manager serves one wrapped model. Per iteration an adapter calls
:meth:`BucketManager.mark_ready` from each parameter's gradient hook and
:meth:`BucketManager.finalize` once backward is over. Buckets are launched strictly in
plan order (or a launch order a schedule set, the same on every rank), so every rank issues
the same sequence of collectives whatever order its gradients arrive in. A launch order may
send a dense bucket as several chunks, each its own collective, so one large bucket need not
hold the link while another, needed sooner, waits behind it.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from .alignment import StepAlignment
from .diagnosis import (  # noqa: F401  (the errors, importable from here as before)
    DEFAULT_STALL_TIMEOUT_S,
    CommHookError,
    CommunicationError,
    StallError,
    agreeing,
    diagnose,
    is_transport_error,
    stall_timeout_from_env,
)
from .hooks import WIRE_ITEMSIZE, BucketContext, CommHook, allreduce_hook, allreduce_prescale, reduces_rows
from .interfaces import BucketEngine, ChunkedHandle, Handle, wait_with_timeout
from .plan import BucketPlan, BucketSpec, chunk_bounds, chunk_counts, complete_order, plan_buckets
from .row_sparse import RowSparseReduction, wire_nbytes
from .shard import padded_numel
from .stats import BucketTiming, StepStats, compiled_step_stats, stats_summary

logger = logging.getLogger(__name__)

REDUCE_OPS = ("avg", "sum")


class BucketManager:
    """Runtime state of one bucket plan.

    ``engine`` supplies buffers and collectives (see :class:`BucketEngine`).
    ``reduce_op`` is "avg" (the default, as in DDP) or "sum". ``comm_hook`` reduces
    one full bucket (default: allreduce in the buffer's dtype). With
    ``find_unused_parameters`` a parameter that got no gradient counts as zero and a
    usage map is reduced too, so :attr:`globally_unused` names those no rank used.
    ``rebuild_after_first_step`` replans from the observed ready order (rank 0's,
    broadcast) after the first synchronised iteration; ``on_rebuild`` is called with
    the new plan after buffers moved, so the adapter can re-point gradient views.
    ``stall_timeout_s`` (default: ``COLLECTIVE_OPS_STALL_TIMEOUT``, else 300 s; None or
    0 waits forever) bounds the wait for one bucket: past it every waiting rank raises a
    :class:`StallError` naming the ranks that are not in the same reduction.
    ``check_step_alignment`` compares, once per synchronised step, how many forwards each
    rank ran behind its backward (the adapter calls ``alignment.count_forward()``): where they
    differ, every rank raises :class:`~collective_ops.bucketing.StepMisalignedError` before the
    step's first bucket is finished (see :mod:`.alignment`).
    """

    def __init__(
        self,
        plan: BucketPlan,
        engine: BucketEngine,
        *,
        reduce_op: str = "avg",
        comm_hook: CommHook | None = None,
        find_unused_parameters: bool = False,
        rebuild_after_first_step: bool = True,
        on_rebuild: Callable[[BucketPlan], None] | None = None,
        observer: Any = None,
        stall_timeout_s: float | None | str = "env",
        check_step_alignment: bool = False,
    ) -> None:
        if reduce_op not in REDUCE_OPS:
            raise ValueError(f"reduce_op must be one of {REDUCE_OPS} for gradient reduction, got {reduce_op!r}")
        self.engine = engine
        self.reduce_op = reduce_op
        self.comm_hook: CommHook = comm_hook or allreduce_hook
        self._prescale_on_copy = self.comm_hook is allreduce_hook
        self.divisor: int | None = None  # "avg" divides by the world size unless set (set_divisor)
        self._copy_in_scale = allreduce_prescale(engine, reduce_op) if self._prescale_on_copy else None
        self.find_unused_parameters = find_unused_parameters
        self.rebuild_after_first_step = rebuild_after_first_step
        self.on_rebuild = on_rebuild
        self.observer = observer
        # How long finalize waits for one bucket before naming the ranks that are not taking part.
        self.stall_timeout_s = stall_timeout_from_env() if stall_timeout_s == "env" else stall_timeout_s
        # Engines without cheap flat views (MindSpore) concatenate a bucket's gradients at launch.
        self._assembles = bool(getattr(engine, "assembles_buckets", False))
        self.sync_enabled = True
        # Parameters whose gradients were accumulated under no_sync() since the last synchronised
        # step: they count as used in that step's usage map, as in DDP.
        self._accumulated: set[int] = set()
        self._owed_rebuild: list[int] | None = None
        self.steps_synced = 0
        self.globally_unused: frozenset[int] = frozenset()
        self.last_stats = StepStats()
        self.totals = {"collectives": 0, "bytes": 0, "steps": 0, "exposed_comm_s": 0.0}
        # Buffers are padded to a multiple of this (the world size when they are reduce-scattered).
        self.pad_multiple = 1
        # The gradient buffers' dtype where it is not the parameters' (fp32 main gradients of a bf16 model:
        # set_grad_dtype); None: each bucket's own.
        self.grad_dtype: str | None = None
        # Row-sparse tables reduced by rows (set by the adapter where the engine can): RowSparseReduction.
        self.row_sparse: RowSparseReduction | None = None
        # The adapter counts forwards (count_forward); each step's counts are compared across ranks.
        self.alignment = None
        if check_step_alignment and engine.world_size > 1:
            host_group = getattr(engine, "host_group", None)
            self.alignment = StepAlignment(*(host_group() if host_group else (None, plan.buckets[0].device)))
        self._set_plan(plan)
        self.buffers = [self._new_buffer(b) for b in plan.buckets]
        self._reset_iteration()

    # -- plan & buffers ----------------------------------------------------------
    def _set_plan(self, plan: BucketPlan) -> None:
        if plan is not getattr(self, "plan", None):  # (the same plan, padded or in another dtype: they stand)
            self._param_buffers: list[Any] | None = None
            self._param_multiple = 1
        self.plan = plan
        self._launch_order: tuple[int, ...] | None = None
        self._launch_position: dict[int, int] | None = None  # bucket -> its last place in _launch_order
        self._chunks = [1] * len(plan.buckets)  # collectives per bucket (the launch order's repeats)
        self._param_names = [p.name for p in plan.params]
        self._param_count = len(plan.params)  # (mark_ready's bounds, read per gradient)

    def wire_shares(self, plan: BucketPlan | None = None) -> dict[int, float]:
        """parameter index -> the share of its bytes its bucket sends (row-sparse tables; the rest send all)."""
        return {} if self.row_sparse is None else self.row_sparse.shares(plan or self.plan)

    def _new_buffer(self, bucket: BucketSpec) -> Any:
        numel = bucket.numel if self.pad_multiple == 1 else padded_numel(bucket.numel, self.pad_multiple)
        return self.engine.zeros(numel, self.grad_dtype or bucket.dtype, bucket.device)

    def set_comm_hook(self, hook: CommHook, prescale_on_copy: bool = False) -> None:
        """Reduce buckets with ``hook`` from the next step on (every rank alike).

        ``prescale_on_copy``: the hook averages as :func:`allreduce_hook` does (1/world, then a
        sum), so adapters may scale gradients as they copy them in (:attr:`copy_in_scale`).
        """
        if self.in_progress or self._deferred:
            raise RuntimeError("cannot change the comm hook while a step's buckets are in flight")
        self.comm_hook = hook
        if max(self._chunks) > 1 and not all(self.chunkable(b) for b in range(len(self.plan.buckets))):
            self.set_launch_order(None)  # chunks were for the default allreduce: this hook reduces whole buckets
        if not reduces_rows(hook):
            self.row_sparse = None  # a custom hook reduces the whole bucket: the tables now go dense
        self._prescale_on_copy = prescale_on_copy
        self.set_divisor(self.divisor)

    def set_divisor(self, divisor: int | None) -> None:
        """Average over ``divisor`` ranks instead of the world size from the next step (None: the world).

        For join(divide_by_initial_world_size=False): the ranks still active, agreed on by every rank.
        """
        if self.in_progress:
            raise RuntimeError("cannot change the averaging divisor in the middle of a backward pass")
        if divisor is not None and not 1 <= divisor <= self.engine.world_size:
            raise ValueError(f"divisor must be between 1 and the world size {self.engine.world_size}, got {divisor}")
        self.divisor = divisor
        scale = allreduce_prescale(self.engine, self.reduce_op, divisor)
        self._copy_in_scale = scale if self._prescale_on_copy else None

    def set_padding(self, multiple: int) -> None:
        """Pad every bucket buffer to a multiple of ``multiple`` elements (moving the gradients held)."""
        if multiple < 1:
            raise ValueError(f"padding multiple must be >= 1, got {multiple}")
        if multiple != self.pad_multiple:
            self.pad_multiple = multiple
            self._move_to(self.plan)

    def set_grad_dtype(self, dtype: str | None) -> None:
        """Keep every bucket's gradients in ``dtype`` (moving the gradients held): the main gradients a
        low-precision model accumulates and reduces in fp32, as Megatron-core's ``grad_reduce_in_fp32``. None:
        the parameters' dtype. The adapter adds each gradient into its segment (:meth:`param_segment`)."""
        if all(bucket.dtype == dtype for bucket in self.plan.buckets):
            dtype = None  # (the parameters' own: nothing to add in)
        if dtype != self.grad_dtype:
            self.grad_dtype = dtype
            self._move_to(self.plan)

    def param_buffers(self, multiple: int = 1) -> tuple[list[Any], bool]:
        """Per bucket of the plan, one flat buffer for its parameters' values, in the plan's dtype, padded to a
        multiple of ``multiple`` elements (the world size, where the buckets are sharded), laid out as the
        gradient buffers are (each parameter at its offset): for an optimizer that updates or all-gathers whole
        buckets. The same buffers while the plan and ``multiple`` stand; True where they were made now (zeros:
        the adapter moves the parameters' values into them)."""
        if self._param_buffers is not None and self._param_multiple == multiple:
            return self._param_buffers, False
        self._param_buffers = [
            self.engine.zeros(padded_numel(b.numel, multiple), b.dtype, b.device) for b in self.plan.buckets
        ]
        self._param_multiple = multiple
        return self._param_buffers, True

    def param_segment(self, index: int) -> tuple[Any, int, int]:
        """(buffer, offset, numel) of parameter ``index``'s gradient in its bucket."""
        bucket_index, slot = self.plan.location[index]
        bucket = self.plan.buckets[bucket_index]
        return self.buffers[bucket_index], bucket.offsets[slot], self.plan.params[index].numel

    def _reset_iteration(self) -> None:
        buckets = self.plan.buckets
        self._pending = [len(b.param_indices) for b in buckets]
        self._marked: set[int] = set()
        self._not_used: set[int] = set()  # marked with used=False: a kept gradient, not this step's
        self._prescaled: set[int] = set()
        self._copy_targets: dict[int, Any] = {}
        self._staged: dict[int, Any] = {}  # engines that assemble buckets at launch: the gradients
        self._handles: list[Handle | None] = [None] * len(buckets)
        self._chunks_launched = [0] * len(buckets)
        self._launch_prescaled: dict[int, bool] = {}  # chunked bucket -> its members were scaled on copy-in
        self._done = [False] * len(buckets)
        self._deferred = False
        self._used_map: tuple[Any, Handle] | None = None
        self._next_launch = 0
        self._step_started = False
        if self.alignment is not None:
            self.alignment.drop()
        self._stats = StepStats(step=self.steps_synced, buckets=[BucketTiming() for _ in buckets])

    @property
    def in_progress(self) -> bool:
        """True between the first gradient of an iteration and its finalize() (before a deferred one)."""
        return bool(self._marked) and not self._deferred

    def stats_summary(self) -> dict[str, Any]:
        """Buckets, collectives and bytes per step, and communication not hidden behind backward."""
        return stats_summary(self.last_stats, self.plan, self.totals, self.engine.world_size)

    def bucket_results(self, bucket_index: int) -> list[Any]:
        """The bucket's reduced values, one flat tensor per parameter in bucket order."""
        bucket = self.plan.buckets[bucket_index]
        numels = [self.plan.params[i].numel for i in bucket.param_indices]
        return self.engine.unpack(self.buffers[bucket_index], numels)

    @property
    def copy_in_scale(self) -> float | None:
        """The factor an adapter may apply while copying a gradient into its bucket (then
        ``mark_ready(..., prescaled=True)``), saving the default hook's separate scaling pass
        over the bucket, as DDP fuses it into its copy. None when the hook must see raw sums.
        """
        return self._copy_in_scale

    def is_marked(self, index: int) -> bool:
        """True if parameter ``index``'s gradient was marked ready this iteration."""
        return index in self._marked

    # -- per-gradient ------------------------------------------------------------
    def mark_ready(
        self, index: int, grad: Any = None, write_back: bool = True, prescaled: bool = False, used: bool = True
    ) -> None:
        """Parameter ``index``'s gradient is final for this iteration.

        Pass ``grad`` when the gradient is not a view into the bucket buffer: it is
        copied in now and, with ``write_back``, the reduced value is written back into
        it by finalize() (adapters that read results from the buffers pass False).
        ``prescaled``: the adapter wrote it into its segment already multiplied by
        ``copy_in_scale``. ``used=False``: the gradient is one the parameter already had
        (accumulated earlier), contributed although this step did not use the parameter;
        with ``find_unused_parameters`` it does not count as used in the usage map.
        """
        if not self.sync_enabled:
            if self.alignment is not None:
                self.alignment.backward_started()
            self._accumulated.add(index)
            return
        if not 0 <= index < self._param_count:
            raise IndexError(f"parameter index {index} is out of range for this plan")
        if self._deferred:
            raise RuntimeError(
                "a gradient arrived while the previous step's buckets are still being finished (a deferred "
                "step): finish them first (DistributedOptimizer.synchronize())"
            )
        if index in self._marked:
            name = self._param_names[index]
            raise RuntimeError(
                f"gradient of parameter {name!r} was marked ready twice in one iteration: the previous "
                "iteration's reduction has not been finalized. Call backward() once per step, or wrap "
                "extra backward passes in no_sync(); in a custom loop call sync_gradients() after each backward."
            )
        if self.observer is not None:
            self._note_completions()
        now = time.perf_counter()
        bucket_index, _slot = self.plan.location[index]
        if grad is not None:
            # Engines that assemble buckets (MindSpore) pay a pipeline wait to describe a tensor: their
            # gradients' layout is checked in the first synchronised step, whose shapes later ones repeat.
            if not (self._assembles and self.steps_synced > 0):
                self.check_gradient(index, grad)
            if self._assembles:
                self._staged[index] = grad  # concatenated with its bucket-mates at launch: one op
            else:
                buffer, offset, _ = self.param_segment(index)
                self.engine.write(buffer, offset, grad)
            if write_back:
                self._copy_targets[index] = grad
        if not self._marked:  # this backward's first gradient
            if self.alignment is not None:
                self.alignment.backward_started()  # (its later gradients find nothing more to count)
            self._stats.backward_start = now
            self._start_step_collectives()
        self._marked.add(index)
        if not used:
            self._not_used.add(index)
        if prescaled:
            if self._copy_in_scale is None:
                raise ValueError("prescaled=True, but this manager's hook expects unscaled gradients")
            self._prescaled.add(index)
        self._stats.ready_times[index] = now
        timing = self._stats.buckets[bucket_index]
        timing.first_ready = timing.first_ready or now
        self._pending[bucket_index] -= 1
        if self._pending[bucket_index] == 0:
            timing.last_ready = now
            self._launch_ready_buckets()

    @property
    def has_unreduced_accumulation(self) -> bool:
        """True if gradients were accumulated under ``no_sync()`` since the last synchronised step: averaged
        by no collective yet, so a step on them trains each rank on its own data (the replicas part). A
        synchronised backward whose buckets are still being finished (a deferred step) is reducing them."""
        return bool(self._accumulated) and not self._deferred

    def check_gradient(self, index: int, grad: Any) -> None:
        """Refuse a gradient that is not what the plan laid its bucket out for."""
        numel, dtype, device = self.engine.describe(grad)
        spec = self.plan.params[index]
        if (numel, dtype, device) != (spec.numel, spec.dtype, spec.device):
            raise ValueError(
                f"gradient of parameter {spec.name!r} has numel={numel}, dtype={dtype}, device={device}; "
                f"the bucket plan expects numel={spec.numel}, dtype={spec.dtype}, device={spec.device}. If the "
                "model was cast or moved after wrap(), cast and move it before wrapping"
            )

    def _launch_ready_buckets(self) -> None:
        order = self.launch_order
        while self._next_launch < len(order) and self._pending[order[self._next_launch]] == 0:
            self._launch(order[self._next_launch])
            self._next_launch += 1

    def _launched(self, bucket_index: int) -> bool:
        """True once the bucket's collective (every chunk's, if chunked) was launched."""
        position = bucket_index if self._launch_position is None else self._launch_position[bucket_index]
        return position < self._next_launch

    def _launch_through(self, bucket_index: int) -> None:
        """Launch every bucket up to ``bucket_index`` in launch order (each must be full)."""
        order = self.launch_order
        while not self._launched(bucket_index):
            if self._pending[order[self._next_launch]]:
                raise RuntimeError(f"bucket {order[self._next_launch]} is not full: it cannot be launched yet")
            self._launch(order[self._next_launch])
            self._next_launch += 1

    @property
    def launch_order(self) -> tuple[int, ...]:
        """The order buckets are launched in (each once it is full): plan order unless a schedule was set."""
        return self._launch_order if self._launch_order is not None else tuple(range(len(self.plan.buckets)))

    def set_launch_order(self, order: Sequence[int] | None) -> None:
        """Launch buckets in ``order`` (the plan's buckets; None: plan order).

        Each bucket is listed once, or ``k`` times to send it as ``k`` chunks (equal contiguous
        slices of its buffer, each reduced by its own collective, launched at its place in
        ``order``): only buckets :meth:`chunkable` says may be. Every rank must set the same
        order (decide on one rank and broadcast): collectives are matched by the order they are
        issued in. A later bucket waits for an earlier one in ``order`` even when it is full
        first: holding a bucket back is how a schedule gives the link to another. Reset to plan
        order whenever the plan changes.

        Launches depend only on which buckets are full, never on timing: by the end of backward
        every bucket of the step is launched on every rank, whatever the order, so code that runs
        on some ranks only after it (rank 0 saving a checkpoint) waits only for collectives every
        rank has issued.
        """
        if self.in_progress or self._deferred:
            raise RuntimeError("cannot change the launch order while a step's buckets are in flight")
        chunks = [1] * len(self.plan.buckets)
        if order is not None:
            order = tuple(int(b) for b in order)
            chunks = chunk_counts(order, self.plan, self.chunkable)
        self._launch_order = order
        self._launch_position = None if order is None else {bucket: i for i, bucket in enumerate(order)}
        self._chunks = chunks

    def chunkable(self, bucket_index: int, plan: BucketPlan | None = None) -> bool:
        """True if a launch order may send this bucket (of ``plan``, default the current) in chunks: a dense
        bucket whose hook reduces each element on its own (the default allreduce), on an engine that reduces
        the bucket's own buffer. A row-sparse table's reduction and the others' buffers are whole-bucket."""
        plan = plan or self.plan
        if self.comm_hook is not allreduce_hook or self._assembles or self.pad_multiple != 1:
            return False
        return self.row_sparse is None or self.row_sparse.for_bucket(plan, bucket_index) is None

    def _start_step_collectives(self, taking_part: bool = True) -> None:
        """Once per synchronised step, on every rank (its first gradient, or its first launch where a rank that
        computed none takes part), before any bucket: the step-alignment table and the row-sparse tables'
        looked-up rows start on their way. ``taking_part=False``: a shadowed step, whose counts are not this
        rank's."""
        if self._step_started:
            return
        self._step_started = True
        if self.alignment is not None:
            self.alignment.launch(self.engine, self.steps_synced, taking_part)
            self._stats.collectives += 1
        if self.row_sparse is not None:
            self.row_sparse.start_exchanges(self.engine)

    def _launch(self, bucket_index: int) -> None:
        """Launch the bucket's collective, or its next chunk's where the launch order sends it in chunks."""
        self._start_step_collectives()
        bucket = self.plan.buckets[bucket_index]
        chunk, chunks = self._chunks_launched[bucket_index], self._chunks[bucket_index]
        self._chunks_launched[bucket_index] += 1
        if chunk == 0:
            self._launch_prescaled[bucket_index] = self._prepare_launch(bucket_index)
        prescaled = self._launch_prescaled[bucket_index]
        if chunks == 1:
            self._handles[bucket_index] = self._call_hook(bucket_index, self.buffers[bucket_index], prescaled)
        else:
            if chunk == 0:
                self._handles[bucket_index] = ChunkedHandle(chunks)
            start, numel = chunk_bounds(bucket.numel, chunks)[chunk]
            piece = self.engine.segment(self.buffers[bucket_index], start, numel)
            self._handles[bucket_index].add(self._call_hook(bucket_index, piece, prescaled, numel))
        if chunk == 0 and self.observer is not None:
            self.observer.bucket_launched(self, bucket_index)

    def _prepare_launch(self, bucket_index: int) -> bool:
        """Before the bucket's first collective: its buffer assembled and scaled; True if prescaled."""
        bucket = self.plan.buckets[bucket_index]
        if self._assembles and any(i in self._staged for i in bucket.param_indices):
            members = []
            for i in bucket.param_indices:
                grad = self._staged.pop(i, None)
                if grad is None:  # a view-mode or unused parameter: its current segment
                    grad = self.engine.segment(*self.param_segment(i))
                members.append(grad)
            self.buffers[bucket_index] = self.engine.pack(members)
        prescaled = bool(self._prescaled) and self._scale_the_rest(bucket_index)
        self._stats.buckets[bucket_index].launched = time.perf_counter()
        return prescaled

    def _call_hook(self, bucket_index: int, buffer: Any, prescaled: bool, chunk_numel: int | None = None) -> Handle:
        """The comm hook on ``buffer``: the bucket's, or one chunk of it (``chunk_numel`` elements)."""
        bucket = self.plan.buckets[bucket_index]
        ctx = BucketContext(
            bucket,
            buffer,
            self.engine,
            self.reduce_op,
            prescaled,
            self.divisor,
            row_sparse=None if self.row_sparse is None else self.row_sparse.for_bucket(self.plan, bucket_index),
            stall_timeout_s=self.stall_timeout_s,
        )
        with self._giving_up(bucket_index):
            handle = self.comm_hook(ctx)
        count = getattr(self.comm_hook, "collectives", None)  # a hook of several collectives counts them (PowerSGD)
        self._stats.collectives += count(bucket) if callable(count) else 1
        nbytes = self._wire_nbytes(bucket)  # and of a row-sparse table, the share of its rows sent
        if chunk_numel is not None:
            self._stats.bytes_communicated += nbytes * chunk_numel // bucket.numel
        else:
            share = 1.0 if ctx.row_sparse is None else ctx.row_sparse.sent_share()
            self._stats.bytes_communicated += int(nbytes * share)
        return handle

    @property
    def wire_itemsize(self) -> int | None:
        """The element size a compressing hook sends (fp16/bf16: 2), or None: each bucket's own."""
        itemsize = getattr(self.comm_hook, "wire_itemsize", None)
        return WIRE_ITEMSIZE[self.grad_dtype] if itemsize is None and self.grad_dtype else itemsize

    def _wire_nbytes(self, bucket: Any) -> int:
        """What reducing ``bucket`` puts on the wire: its bytes, or its elements at a compressing hook's size, or
        what a low-rank hook says it sent (its ``wire_nbytes``)."""
        sent = getattr(self.comm_hook, "wire_nbytes", None)
        nbytes = None if sent is None else sent(bucket)
        return wire_nbytes(bucket, {}, self.wire_itemsize) if nbytes is None else nbytes

    def _scale_the_rest(self, bucket_index: int) -> bool:
        """Scale, one segment each, the members not scaled on copy-in; True if the bucket had any that were.

        A bucket with no prescaled member is left to the hook's single pass over the buffer.
        Unused parameters' zeros need no scaling.
        """
        members = self.plan.buckets[bucket_index].param_indices
        if not any(i in self._prescaled for i in members):
            return False
        factor = self._copy_in_scale
        for i in members:
            if i in self._marked and i not in self._prescaled:
                buffer, offset, numel = self.param_segment(i)
                self.engine.scale_(self.engine.segment(buffer, offset, numel), factor)
        return True

    # -- end of backward ---------------------------------------------------------
    def finalize(self, force: bool = False, defer: bool = False) -> None:
        """Launch what is left, wait for every bucket, write results back, reset.

        Does nothing when no gradient was marked this iteration, unless ``force``
        (a rank that must take part although it computed no gradient). With ``defer`` it
        returns once every bucket is launched: the caller then finishes buckets one by one
        (:meth:`wait_bucket`, in any order, e.g. as the next forward needs their parameters),
        and the step ends when the last one is finished (:attr:`deferred_pending` turns False).
        """
        if not self.sync_enabled or not (self._marked or force):
            return
        self._launch_remaining()
        self._launch_later_stages()
        if defer:
            self._deferred = True
            return
        for bucket_index in range(len(self.plan.buckets)):
            self.wait_bucket(bucket_index)

    def _launch_remaining(self) -> None:
        stats = self._stats
        stats.finalize_start = time.perf_counter()
        unused = [i for i in range(len(self._param_names)) if i not in self._marked]
        if unused and not self.find_unused_parameters:
            names = [self._param_names[i] for i in unused]
            shown = ", ".join(repr(n) for n in names[:10]) + (" ..." if len(names) > 10 else "")
            self._reset_iteration()
            raise RuntimeError(
                f"{len(names)} parameter(s) received no gradient this iteration: {shown}. If some parameters "
                "are legitimately unused in some steps, pass find_unused_parameters=True; otherwise freeze "
                "them (requires_grad=False) or remove them from the model."
            )
        for index in unused:
            buffer, offset, numel = self.param_segment(index)
            self.engine.fill_zero(buffer, offset, numel)
            bucket_index, _ = self.plan.location[index]
            self._pending[bucket_index] -= 1
        self._launch_ready_buckets()
        if self.find_unused_parameters:
            used_here = (self._marked - self._not_used) | self._accumulated
            used = [1 if i in used_here else 0 for i in range(len(self._param_names))]
            used_map = self.engine.int_tensor(used, self.plan.buckets[0].device)
            self._used_map = (used_map, self.engine.allreduce(used_map, "sum", async_op=True))
            stats.collectives += 1

    def _launch_later_stages(self) -> None:
        """A hook's collectives that follow a bucket's first (PowerSGD's Q factors) launched at the end of backward,
        alike on every rank: a deferred step would launch them in the next forward, after any collective that comes
        first there (torch's Join allreduce, where a joined rank's shadow step launches them before it)."""
        try:
            getattr(self.comm_hook, "advance_pending", lambda timeout: None)(self.stall_timeout_s)
        except Exception as exc:  # as a bucket's wait: the step given up, the bucket named
            raise self._give_up(self.comm_hook.pending_bucket, exc) from exc

    def shadow_step(self) -> None:
        """Take part in a step this rank has no data for (it joined): the same collectives, zero gradients.

        Every bucket is zeroed and marked (as unused, for the usage map), so its peers' reductions
        find a matching collective and receive nothing from this rank.
        """
        if self._marked:
            raise RuntimeError("cannot shadow a step while this rank's own gradients are being reduced")
        for bucket, buffer in zip(self.plan.buckets, self.buffers):
            self.engine.fill_zero(buffer, 0, bucket.numel)
        self._start_step_collectives(taking_part=False)  # this rank ran no forward of the step
        for bucket in dict.fromkeys(self.launch_order):  # a chunked bucket is listed once per chunk
            for index in self.plan.buckets[bucket].param_indices:
                self.mark_ready(index, used=False)
        self.finalize(force=True)

    @property
    def deferred_pending(self) -> bool:
        """True while a deferred step (``finalize(defer=True)``) has buckets not yet finished."""
        return self._deferred

    def bucket_finished(self, bucket_index: int) -> bool:
        """True once :meth:`wait_bucket` has finished this bucket in the current step."""
        return self._done[bucket_index]

    def bucket_ready(self, bucket_index: int) -> bool:
        """True if the bucket's collective has completed (finishing it would not block)."""
        if not self._launched(bucket_index):
            return False
        handle = self._handles[bucket_index]
        return self._done[bucket_index] or handle is None or handle.is_completed()

    def wait_bucket(self, bucket_index: int) -> None:
        """Finish one bucket of this step: wait for its collective, write its results back.

        The last bucket finished ends the step (usage map, counters, rebuild).
        """
        if self.observer is not None:
            self._note_completions()
        if self._done[bucket_index]:
            return
        if not self._launched(bucket_index):
            self._launch_through(bucket_index)  # waited for before the step's end launched it
        self._settle_alignment(bucket_index)
        handle = self._handles[bucket_index]
        if handle is not None:
            try:
                wait_with_timeout(handle, self.stall_timeout_s)
            except Exception as exc:
                raise self._give_up(bucket_index, exc) from exc
        stats = self._stats
        timing = stats.buckets[bucket_index]
        timing.completed = timing.completed or time.perf_counter()  # seen complete earlier, or just now
        if self.observer is not None:
            self.observer.bucket_completed(self, bucket_index)
        members = self.plan.buckets[bucket_index].param_indices
        targets = [i for i in members if i in self._copy_targets]
        if self._used_map is not None and any(i not in self._marked or i in self._not_used for i in members):
            self._resolve_used_map()  # which of this bucket's locally unused parameters some rank used
        for index in targets:
            if index not in self.globally_unused:
                buffer, offset, _ = self.param_segment(index)
                self.engine.write_back(self._copy_targets[index], buffer, offset)
        self._done[bucket_index] = True
        if all(self._done):
            self._resolve_used_map()
            stats.finalize_end = time.perf_counter()
            self._end_step(stats)

    def _note_completions(self) -> None:
        """Stamp the launched buckets whose collective has completed since the last look.

        Called, with an observer, at every gradient and every bucket finished, so a bucket's span in
        the trace ends about where its communication did, not where backward's end or the next
        forward finished it (a bucket that completed early in backward showed as long as backward).
        """
        now = None
        for handle, timing in zip(self._handles, self._stats.buckets):
            if timing.launched is not None and timing.completed is None and (handle is None or handle.is_completed()):
                now = now or time.perf_counter()
                timing.completed = now

    def _settle_alignment(self, bucket_index: int) -> None:
        """Before the step's first bucket is finished: every rank raises if the step mixes iterations."""
        if self.alignment is None or not self.alignment.pending:
            return
        try:
            misaligned = self.alignment.settle(self.engine, self.stall_timeout_s)
        except Exception as exc:  # issued before this bucket on the same group: its stall is the bucket's
            raise self._give_up(bucket_index, exc) from exc
        if misaligned is not None:
            self._abandon_iteration(None)
            raise misaligned

    def _resolve_used_map(self) -> None:
        if self._used_map is None:
            return
        used_map, handle = self._used_map
        handle.wait()
        counts = self.engine.to_list(used_map)
        self.globally_unused = frozenset(i for i, c in enumerate(counts) if c == 0)
        self._used_map = None

    def abort_iteration(self) -> None:
        """Give up the iteration in progress (an adapter found it cannot finish): settle what is in flight, reset."""
        self._abandon_iteration(None)

    def _abandon_iteration(self, first_failed: int | None, settle: bool = True) -> None:
        """After bucket ``first_failed`` failed: settle every other collective in flight, then reset.

        Collectives that can still finish are waited for (briefly: a transport that failed once
        usually fails the rest at once). Where one cannot be confirmed finished, its buffer is
        replaced by a fresh one, so a collective that completes later never writes into
        gradients the caller keeps using; the adapter re-points its views (``on_rebuild``).
        """
        settle_s = 5.0 if self.stall_timeout_s is None else min(self.stall_timeout_s, 5.0)
        deadline = time.monotonic() + (settle_s if settle else 0.0)
        unsettled = []
        for bucket_index, handle in enumerate(self._handles):
            if handle is None or bucket_index == first_failed:
                continue
            try:
                wait_with_timeout(handle, max(deadline - time.monotonic(), 0.01))
            except Exception:  # already reporting the first failure; this one only needs settling
                unsettled.append(bucket_index)
        if first_failed is not None:
            unsettled.append(first_failed)
        for bucket_index in unsettled:
            self.buffers[bucket_index] = self._new_buffer(self.plan.buckets[bucket_index])
        self._accumulated.clear()
        self._reset_iteration()
        if self.on_rebuild is not None:
            self.on_rebuild(self.plan)

    def record_compiled_step(self, start: float, end: float, collectives: int | None = None) -> None:
        """Account for a step whose buckets an engine reduced in one compiled call (all of them, in plan order),
        with ``collectives`` collectives (default: one a bucket). ``start``/``end`` bracket the call; engines that run
        it asynchronously return before the communication ends, so the step's exposed communication is then only the
        launch time. With step alignment, the step's table follows the buckets: where the ranks' forward counts
        differ, every rank raises here, before the adapter returns the reduced gradients."""
        if self._marked:
            raise RuntimeError("a compiled reduction cannot finish a step whose gradients were marked one by one")
        if self.alignment is not None:  # the step's table after its buckets: every rank raises before any update
            self.alignment.backward_started()  # the compiled call took every gradient at once
            self._start_step_collectives()
            self._settle_alignment(0)
        stats = compiled_step_stats(self.steps_synced, self.plan, start, end, self._wire_nbytes, collectives)
        stats.collectives += int(self.alignment is not None)  # (the step's alignment table)
        self.globally_unused = frozenset()  # every gradient was given
        self._end_step(stats)

    def _end_step(self, stats: StepStats) -> None:
        """Counters, observer, reset, and the first-step rebuild: the end of every synchronised step."""
        stats.exposed_comm_s = stats.finalize_end - stats.finalize_start
        observed = list(stats.ready_times)  # insertion order: the order gradients became ready
        self.last_stats = stats
        self.totals["collectives"] += stats.collectives
        self.totals["bytes"] += stats.bytes_communicated
        self.totals["steps"] += 1
        self.totals["exposed_comm_s"] += stats.exposed_comm_s
        self.steps_synced += 1
        self._accumulated.clear()
        if self.observer is not None:
            self.observer.step_finished(self, stats)
        deferred = self._deferred
        self._reset_iteration()
        if self.rebuild_after_first_step and self.steps_synced == 1:
            if deferred:
                # A deferred step ends wherever its last bucket is finished, which differs between ranks;
                # the rebuild's broadcast waits for settle_deferred(), called at a point every rank shares.
                self._owed_rebuild = observed
            else:
                self._rebuild(observed)

    def settle_deferred(self) -> None:
        """Run what a finished deferred step left owed (the first-step rebuild: a collective).

        Call it where every rank is at the same point of its program, with no step in flight.
        """
        if self._owed_rebuild is not None and not self._deferred:
            observed, self._owed_rebuild = self._owed_rebuild, None
            self._rebuild(observed)

    @contextlib.contextmanager
    def _giving_up(self, bucket_index: int) -> Iterator[None]:
        """A hook that gave up waiting for its peers, or a transport that refused a send at once (Gloo's point-to-point,
        to a peer gone), ends the iteration with the bucket's error; other errors are the hook's. A failure in an
        earlier bucket's later stage, which the hook launches first (PowerSGD's ``pending_bucket``), is that bucket's
        wait failing: any error ends the iteration, naming it, as at the end of backward."""
        try:
            yield
        except Exception as exc:
            earlier = getattr(self.comm_hook, "pending_bucket", None)
            if earlier is not None or isinstance(exc, TimeoutError) or self.is_transport_error(exc):
                raise self._give_up(bucket_index if earlier is None else earlier, exc) from exc
            raise

    def _give_up(self, bucket_index: int, exc: BaseException) -> RuntimeError:
        """The error for bucket ``bucket_index``, which did not complete, once the iteration is abandoned."""
        error = self.explain_failure(bucket_index, exc)
        # after a stall the later buckets (queued behind it) cannot finish either: not waited for
        self._abandon_iteration(bucket_index, settle=not isinstance(exc, TimeoutError))
        return error

    def is_transport_error(self, exc: BaseException) -> bool:
        """Whether ``exc`` is a failure of the transport (a peer gone, the network), as the engine tells it."""
        return is_transport_error(self.engine, exc)

    def explain_failure(self, bucket_index: int, exc: BaseException, collective: str = "") -> RuntimeError:
        """A clear error for bucket ``bucket_index``'s reduction, or another collective of it (``collective`` names
        it, e.g. the all-gather of its updated parameters), that failed or stalled, naming the ranks not taking
        part; the manager's own step is left as it is."""
        bucket = self.plan.buckets[bucket_index]
        names = [self._param_names[i] for i in bucket.param_indices]
        shown = ", ".join(repr(n) for n in names[:5]) + (" ..." if len(names) > 5 else "")
        where = (
            f"rank {self.engine.rank} waited for {collective + ' of ' if collective else ''}bucket {bucket_index} "
            f"of step {self.steps_synced} ({bucket.nbytes / 2**20:.2f} MiB: {shown})"
        )
        progress = {"step": self.steps_synced, "waiting_for_bucket": bucket_index, "buckets": len(self.plan.buckets)}
        progress.update(launched=self._next_launch, gradients_ready=len(self._marked), gradients=len(self._param_names))
        return diagnose(self.engine, where, exc, progress, self.stall_timeout_s)

    def _rebuild(self, observed: list[int]) -> None:
        """Replan from rank 0's observed ready order."""
        with agreeing(self, "the bucket rebuild after the first step (rank 0's gradient order, broadcast)"):
            order = self.engine.broadcast_ints(complete_order(observed, len(self._param_names)), src=0)
        if self._adopt(self.plan.rebuild(order)):
            logger.info("rebuilt buckets from the observed gradient order: %d bucket(s)", len(self.plan.buckets))

    def replan(self, bucket_size_mb: float, first_bucket_mb: float | None = None) -> BucketPlan:
        """Change the bucket size between iterations (same order); every rank must call it alike."""
        if self.in_progress:
            raise RuntimeError("cannot change the bucket size in the middle of a backward pass")
        first = self.plan.first_bucket_mb if first_bucket_mb is None else first_bucket_mb
        self._adopt(plan_buckets(self.plan.params, bucket_size_mb, min(first, bucket_size_mb), order=self.plan.order))
        return self.plan

    def _adopt(self, new_plan: BucketPlan) -> bool:
        """Switch to ``new_plan``, moving every gradient segment so nothing is lost. False if unchanged."""
        if new_plan.same_as(self.plan):
            return False
        self._move_to(new_plan)
        return True

    def _move_to(self, new_plan: BucketPlan) -> None:
        """New buffers for ``new_plan`` holding every gradient segment of the current ones."""
        if self.in_progress or self._deferred:
            raise RuntimeError("cannot move bucket buffers while a step's buckets are in flight")
        old_segments = [self.param_segment(i) for i in range(len(self._param_names))]
        new_buffers = [self._new_buffer(b) for b in new_plan.buckets]
        for index, (old_buffer, old_offset, numel) in enumerate(old_segments):
            bucket_index, slot = new_plan.location[index]
            segment = self.engine.segment(old_buffer, old_offset, numel)
            self.engine.write(new_buffers[bucket_index], new_plan.buckets[bucket_index].offsets[slot], segment)
        del old_segments, segment  # the old buffers are freed before on_rebuild (a sharded optimizer's relayout)
        self._set_plan(new_plan)
        self.buffers = new_buffers
        self._reset_iteration()
        if self.on_rebuild is not None:
            self.on_rebuild(new_plan)

    # -- modes ---------------------------------------------------------------------
    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Within the block gradients are not communicated (accumulation); sync resumes after it."""
        self.set_sync(False)
        try:
            yield
        finally:
            self.set_sync(True)

    def set_sync(self, enabled: bool) -> None:
        """Disable to accumulate gradients locally (no_sync); re-enable for the synchronising step."""
        if not enabled and self.in_progress:
            raise RuntimeError("cannot enter no_sync() in the middle of a backward pass")
        self.sync_enabled = enabled
