"""PowerSGD (Vogels et al., NeurIPS'19) as a comm hook of the bucket engine, as torch DDP's ``powerSGD_hook`` runs it.

Framework-free: this module decides which of a bucket's gradients are compressed, lays out their low-rank
factors, counts iterations and keeps each bucket's state (error-feedback memory, Q factors); the tensor
math (batched matmul, orthogonalisation, normal draws, division) is the engine's (see
:class:`~collective_ops.bucketing.interfaces.BucketEngine`), so another framework's engine can supply it.

The engine's segments of a buffer may be views (torch) or copies (MindSpore, which has no flat views to hand
out): results are written where they go by the engine (``bmm_into``, ``sub_into``, ``write``: in place on torch, a
new tensor written into its buffer on MindSpore) wherever the buffer is read afterwards (a collective, the bucket's
result, the next step's memory), and segments are taken again from a buffer a collective has reduced.

One compressed bucket takes two allreduces: its uncompressed gradients together with its P factors, then
its Q factors. The first is launched with the bucket (when it is full, as every bucket is); the second
once the first has landed, at the next bucket's launch or at the end of backward (``finalize``), whichever
comes first. Both happen on the thread that drives the buckets, in the same order on every rank, so the
collectives pair up without any agreement between ranks.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..hooks import BucketContext
from ..interfaces import Handle, wait_with_timeout


@dataclass(frozen=True)
class PowerSGD:
    """Low-rank gradient compression: ``co.wrap(model, compression=co.PowerSGD(rank=4, start_iter=100))``.

    The defaults are those of torch's ``PowerSGDState``, except ``start_iter`` (torch: 1000).
    """

    rank: int = 1
    """The rank of each compressed gradient's approximation (torch: ``matrix_approximation_rank``). Lower
    sends fewer bytes and approximates more coarsely; 1 to 4 is usual."""

    start_iter: int = 10
    """Steps reduced by a plain allreduce before compression starts (torch: ``start_powerSGD_iter``): the first
    steps of training are the most sensitive to approximate gradients. At least 2 with ``error_feedback`` or
    ``warm_start``, as torch's hook requires (DDP rebuilds its buckets after the first step; here the state
    follows its parameters into new buckets, but the first steps run as under DDP)."""

    min_compression_rate: float = 2.0
    """A gradient is compressed only where its elements exceed its factors' by this factor:
    ``(rows + cols) * rank * min_compression_rate < rows * cols``. Others (every 1-D gradient, at the
    default) are allreduced as they are, in the same collective as the bucket's P factors."""

    error_feedback: bool = True
    """Add what compression lost at the last step to this step's gradient before compressing
    (torch: ``use_error_feedback``). Keeps one gradient-sized buffer per bucket."""

    warm_start: bool = True
    """Start each step's power iteration from the last step's Q factors instead of new random ones."""

    orthogonalization_epsilon: float = 0.0
    """Added to each column's norm in Gram-Schmidt orthogonalisation (rank 1 and 2, and half precision;
    higher ranks in fp32 use a QR factorisation, as torch does): a small value such as 1e-8 guards against
    a column of zeros."""

    random_seed: int = 0
    """Seeds the Q factors' first draw (numpy's ``RandomState``, as torch's hook), the same on every rank."""

    def __post_init__(self) -> None:
        if not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(
                f"PowerSGD rank (of the low-rank approximation) must be a positive int such as 1 or 4, got {self.rank!r}"
            )
        if (self.error_feedback or self.warm_start) and self.start_iter < 2:
            raise ValueError(
                f"PowerSGD start_iter={self.start_iter}: with error_feedback or warm_start it must be at least 2 "
                "(as torch's PowerSGDState requires: the first steps, before the buckets' rebuild, reduce uncompressed)"
            )
        if self.min_compression_rate < 0 or self.orthogonalization_epsilon < 0:
            raise ValueError("PowerSGD min_compression_rate and orthogonalization_epsilon must be >= 0")


def should_compress(rows: int, cols: int, rank: int, min_compression_rate: float) -> bool:
    """True where a ``rows`` x ``cols`` gradient is worth its rank-``rank`` factors (torch's rule)."""
    return (rows + cols) * rank * min_compression_rate < rows * cols


@dataclass(frozen=True)
class Matrix:
    """One compressed gradient: its place in the bucket, its matrix shape, its factors' places."""

    offset: int  # in the bucket's buffer
    rows: int
    cols: int
    rank: int
    p_offset: int  # in the P factors (which follow the uncompressed gradients in the first allreduce)
    q_offset: int  # in the bucket's Q factors


@dataclass(frozen=True)
class BucketLayout:
    """Which of a bucket's gradients are compressed, in the order of torch's hook (grouped by shape, first
    seen first), and which go uncompressed (bucket order)."""

    signature: tuple  # the bucket's members and size: state kept for another layout is not reused
    matrices: tuple[Matrix, ...]
    uncompressed: tuple[tuple[int, int], ...]  # (offset, numel)
    uncompressed_numel: int
    p_numel: int
    q_numel: int

    @property
    def compressed_numel(self) -> int:
        """Elements sent for this bucket: uncompressed gradients, P and Q factors."""
        return self.uncompressed_numel + self.p_numel + self.q_numel


def bucket_layout(
    offsets: Sequence[int],
    shapes: Sequence[tuple[int, ...]],
    rank: int,
    min_compression_rate: float,
    signature: tuple = (),
) -> BucketLayout:
    """The layout of a bucket whose gradients (shaped ``shapes``) start at ``offsets``."""
    by_shape: dict[tuple[int, int], list[int]] = {}
    uncompressed, uncompressed_numel = [], 0
    for offset, shape in zip(offsets, shapes, strict=True):
        numel = _numel(shape)
        rows = shape[0] if shape else 1
        cols = numel // rows if rows else 0
        if should_compress(rows, cols, min(rows, cols, rank), min_compression_rate):
            by_shape.setdefault((rows, cols), []).append(offset)
        else:
            uncompressed.append((offset, numel))
            uncompressed_numel += numel
    matrices, p_numel, q_numel = [], 0, 0
    for (rows, cols), group in by_shape.items():
        r = min(rows, cols, rank)
        for offset in group:
            matrices.append(Matrix(offset, rows, cols, r, p_numel, q_numel))
            p_numel += rows * r
            q_numel += cols * r
    return BucketLayout(signature, tuple(matrices), tuple(uncompressed), uncompressed_numel, p_numel, q_numel)


def layout_flops(layout: BucketLayout) -> float:
    """Floating-point operations compression adds to one step of a bucket laid out so: per compressed ``n`` x ``m``
    gradient at rank ``r``, three matmuls (P = M Q, Q = M^T P, M = P Q^T: ``2 n m r`` each) and the
    orthogonalisation of Q and P (Gram-Schmidt: ``2 (m + n) r^2``)."""
    return float(sum(6 * m.rows * m.cols * m.rank + 2 * (m.rows + m.cols) * m.rank**2 for m in layout.matrices))


def _numel(shape: tuple[int, ...]) -> int:
    numel = 1
    for size in shape:
        numel *= size
    return numel


class _BucketState:
    """What one bucket keeps between steps: its layout, error-feedback memory, Q factors, the first allreduce's
    buffer (uncompressed gradients and P factors)."""

    def __init__(self, signature: tuple, layout: BucketLayout) -> None:
        self.signature = signature
        self.layout = layout
        self.error: Any = None
        self.q: Any = None
        self.wire: Any = None


class PowerSGDHook:
    """The comm hook ``compression=PowerSGD(...)`` installs: one per model, holding every bucket's state.

    ``bind_shapes`` gives it the parameters' shapes (the plan knows only element counts);
    ``state_dict`` / ``load_state_dict`` carry its state through a checkpoint.
    """

    def __init__(self, options: PowerSGD) -> None:
        self.options = options
        self.__name__ = f"powersgd_rank{options.rank}_hook"
        self.iteration = 0  # synchronised steps reduced so far (torch's state.iter)
        self._shapes: list[tuple[int, ...]] | None = None
        self._states: dict[int, _BucketState] = {}
        # Per parameter (index): error-feedback memory and Q factor not in a bucket's state, from a checkpoint (a
        # tensor) or a replan (a _Place in the old buffers, read when a bucket laid out with the parameter takes it
        # in: a reduction still in flight at the replan has written its results there by then).
        self._carried: dict[int, dict[str, Any]] = {}
        self._engine: Any = None
        self._seen: set[int] = set()  # buckets reduced in this step: one seen again starts the next step
        self._seeds: list[int] = []  # this step's seeds for new Q factors, by bucket index
        self._rng: Any = None  # numpy RandomState(random_seed), made on first use
        self._pending: list[_PowerSGDHandle] = []  # launched, first allreduce not yet followed by the second
        self.numel_before = 0  # elements reduced by compressed steps, and what they sent (torch's statistics)
        self.numel_after = 0

    # -- set-up ------------------------------------------------------------------------
    def bind_shapes(self, shapes: Sequence[tuple[int, ...]]) -> None:
        """The trainable parameters' shapes, in the plan's parameter order."""
        self._shapes = [tuple(int(s) for s in shape) for shape in shapes]

    def _layout(self, ctx: BucketContext) -> BucketLayout:
        if self._shapes is None:
            raise RuntimeError("the PowerSGD hook was not given the parameters' shapes (bind_shapes)")
        bucket = ctx.bucket
        signature = (bucket.param_indices, bucket.offsets, bucket.numel)
        state = self._states.get(bucket.index)
        if state is not None and state.signature == signature:
            return state.layout
        if state is not None:  # replanned: every bucket's memory goes by parameter into the new buckets
            for old in self._states.values():
                self._carried.update(self._by_parameter(old))
            self._states.clear()
        shapes = [self._shapes[i] for i in bucket.param_indices]
        layout = bucket_layout(bucket.offsets, shapes, self.options.rank, self.options.min_compression_rate, signature)
        self._states[bucket.index] = state = _BucketState(signature, layout)
        self._take_carried(state, ctx)
        return layout

    def _by_parameter(self, state: _BucketState) -> dict[int, dict[str, Any]]:
        """A bucket's memory by parameter: where each one's error memory and Q factor lie in its buffers."""
        layout = state.layout
        q_at = {m.offset: m for m in layout.matrices}
        out = {}
        for index, offset in zip(state.signature[0], state.signature[1]):
            numel = _numel(self._shapes[index])
            matrix = q_at.get(offset)
            out[index] = {
                "error": None if state.error is None else _Place(state.error, offset, numel),
                "q": None
                if state.q is None or matrix is None
                else _Place(state.q, matrix.q_offset, matrix.cols * matrix.rank),
            }
        return out

    def _take_carried(self, state: _BucketState, ctx: BucketContext) -> None:
        """A new bucket's memory from its parameters' carried memory (zeros where a parameter has none; Q factors
        only if every compressed one has them, else all are drawn anew)."""
        members = [i for i in state.signature[0] if i in self._carried]
        if not members:
            return
        engine, layout = ctx.engine, state.layout
        numel, dtype, device = engine.describe(ctx.buffer)
        carried = {
            i: {key: _read(engine, t) for key, t in self._carried.pop(i).items()} for i in members
        }  # (a _Place read now: its old bucket's last results are in)
        offsets = dict(zip(state.signature[0], state.signature[1]))
        errors = [(offsets[i], c["error"]) for i, c in carried.items() if c["error"] is not None]
        if errors and self.options.error_feedback:
            state.error = engine.zeros(numel, dtype, device)
            for offset, error in errors:
                engine.write(state.error, offset, error)
        param_at = {offset: index for index, offset in offsets.items()}
        qs = [(m, carried.get(param_at[m.offset], {}).get("q")) for m in layout.matrices]
        if qs and all(q is not None for _, q in qs) and self.options.warm_start:
            state.q = engine.zeros(layout.q_numel, dtype, device)
            for m, q in qs:
                engine.write(state.q, m.q_offset, q)

    # -- the hook ----------------------------------------------------------------------
    def __call__(self, ctx: BucketContext) -> Handle:
        if ctx.reduce_op != "avg":
            raise ValueError(f"PowerSGD averages gradients: it needs reduce_op='avg', got {ctx.reduce_op!r}")
        self._engine = ctx.engine
        self._count_step(ctx.bucket.index)
        self.advance_pending(ctx.stall_timeout_s)
        engine, divisor = ctx.engine, ctx.divisor or ctx.world_size
        if self.iteration < self.options.start_iter:  # vanilla allreduce, divided first as DDP's default hook
            if not ctx.prescaled:
                engine.divide_(ctx.buffer, divisor)
            return engine.allreduce(ctx.buffer, "sum", async_op=True)
        if not hasattr(engine, "orthogonalize_"):
            raise NotImplementedError(
                f"PowerSGD needs the low-rank operations of the engine (bmm_into, sub_into, orthogonalize_, ...), "
                f"which the {getattr(engine, 'framework', '') or type(engine).__name__} engine does not offer yet: "
                "use compression='fp16'/'bf16' with it"
            )
        handle = self._launch(ctx, divisor)
        self._pending.append(handle)
        return handle

    def _count_step(self, bucket_index: int) -> None:
        """Steps are counted by the buckets: a bucket reduced again begins the next step."""
        if bucket_index in self._seen:
            self.iteration += 1
            self._seen.clear()
            self._seeds.clear()
            # Left by a step given up after a failure (every finished bucket advanced them): their second
            # allreduce is never launched, where a peer that gave up elsewhere would not expect it.
            self._pending.clear()
        self._seen.add(bucket_index)

    def _seed(self, bucket_index: int) -> int:
        """The seed of this bucket's new Q factors: drawn for the buckets in index order, one each per step,
        as torch's hook draws them (DDP reduces its buckets in index order), whatever order they launch in."""
        if self._rng is None:
            import numpy as np

            self._rng = np.random.RandomState(self.options.random_seed)
        while len(self._seeds) <= bucket_index:
            self._seeds.append(int(self._rng.randint(1_000_000_000)))
        return self._seeds[bucket_index]

    def _launch(self, ctx: BucketContext, divisor: int) -> _PowerSGDHandle:
        """Error feedback, P = M Q, and the first allreduce (uncompressed gradients and P factors)."""
        engine, buffer, options = ctx.engine, ctx.buffer, self.options
        layout = self._layout(ctx)
        state = self._states[ctx.bucket.index]
        numel, dtype, device = engine.describe(buffer)
        if ctx.prescaled:  # only the default hook's gradients are scaled on copy-in; PowerSGD compresses sums
            raise RuntimeError("PowerSGD needs the gradients unscaled (BucketManager copy_in_scale is for allreduce)")
        # What is compressed, M: the gradients plus the error-feedback memory, summed into the memory itself (the
        # result, written into the bucket, is then subtracted from it in place: the next step's memory). One pass
        # fewer over the bucket than summing into the gradients and copying them aside.
        source = buffer
        if options.error_feedback:
            if state.error is None:
                state.error = _copied(engine, buffer)
            else:
                engine.add_(state.error, buffer)
            source = state.error
        wire_numel = layout.uncompressed_numel + layout.p_numel
        if state.wire is None or engine.describe(state.wire) != (wire_numel, dtype, device):
            state.wire = engine.zeros(wire_numel, dtype, device)
        wire = state.wire
        new_q = state.q is None or not options.warm_start
        if new_q:
            state.q = engine.zeros(layout.q_numel, dtype, device)
        matrices = [engine.segment(source, m.offset, m.rows * m.cols, (1, m.rows, m.cols)) for m in layout.matrices]
        base = layout.uncompressed_numel
        qs = [engine.segment(state.q, m.q_offset, m.cols * m.rank, (1, m.cols, m.rank)) for m in layout.matrices]
        if new_q and qs:
            engine.fill_normal_(qs, self._seed(ctx.bucket.index))
        for q in qs:  # (not written back: the second stage overwrites every Q factor with M^T P before its allreduce)
            engine.orthogonalize_(q, options.orthogonalization_epsilon)
        for m, matrix, q in zip(layout.matrices, matrices, qs):
            engine.bmm_into(wire, base + m.p_offset, matrix, q)
        position = 0
        for offset, count in layout.uncompressed:
            engine.write(wire, position, engine.segment(source, offset, count))
            position += count
        self.numel_before += numel
        self.numel_after += layout.compressed_numel
        first = engine.allreduce(wire, "sum", async_op=True) if wire_numel else None
        return _PowerSGDHandle(self, ctx, state, divisor, matrices, first)

    @property
    def compressing(self) -> bool:
        """True from ``start_iter`` on: steps reduce compressed (before, plain allreduces)."""
        return self.iteration >= self.options.start_iter

    def wire_nbytes(self, bucket: Any) -> int | None:
        """The bytes this step's reduction of ``bucket`` (a BucketSpec) sends: its uncompressed gradients and
        factors once compression has started; None (the whole bucket) before."""
        state = self._states.get(bucket.index)
        if self.iteration < self.options.start_iter or state is None:
            return None
        return state.layout.compressed_numel * (bucket.nbytes // max(bucket.numel, 1))

    def collectives(self, bucket: Any) -> int:
        """The allreduces this step's reduction of ``bucket`` (a BucketSpec, once launched) takes: two once it is
        compressed (the uncompressed gradients with the P factors, then the Q factors; an empty one is not
        launched), one before."""
        state = self._states.get(bucket.index)
        if self.iteration < self.options.start_iter or state is None:
            return 1
        layout = state.layout
        return int(layout.uncompressed_numel + layout.p_numel > 0) + int(layout.q_numel > 0)

    def planned_wire(self, bucket: Any) -> tuple[tuple[int, ...], float]:
        """What a compressed step's reduction of ``bucket`` (a BucketSpec of any plan: the live one or a candidate
        the bucket-size tune or the launch-order planner weighs) costs: the bytes of its two allreduces
        (uncompressed gradients and P factors, then Q factors) and the floating-point operations compression adds
        (:func:`layout_flops`). Laid out from the bucket's members' shapes, as :meth:`wire_nbytes` will find them."""
        if self._shapes is None:
            raise RuntimeError("the PowerSGD hook was not given the parameters' shapes (bind_shapes)")
        shapes = [self._shapes[i] for i in bucket.param_indices]
        layout = bucket_layout(bucket.offsets, shapes, self.options.rank, self.options.min_compression_rate)
        itemsize = bucket.nbytes // max(bucket.numel, 1)
        first, second = (layout.uncompressed_numel + layout.p_numel) * itemsize, layout.q_numel * itemsize
        collectives = tuple(n for n in (first, second) if n)  # an empty allreduce is not launched
        return collectives, layout_flops(layout)

    def step_wire_nbytes(self, buckets: Sequence[Any]) -> int:
        """What one compressed step sends for ``buckets`` (the plan's), by their layouts once laid out."""
        total = 0
        for bucket in buckets:
            sent = self.wire_nbytes(bucket)
            total += bucket.nbytes if sent is None else sent
        return total

    def advance_pending(self, timeout: float | None = None) -> None:
        """Every launched bucket whose second allreduce is not yet on its way: launched now, oldest first."""
        while self._pending:
            self._pending[0].second_stage(timeout)
            self._pending.pop(0)  # (after: a bucket whose stage failed stays named by pending_bucket)

    @property
    def pending_bucket(self) -> int | None:
        """The oldest bucket whose second allreduce is not yet launched (the one a failed advance was at)."""
        return self._pending[0]._ctx.bucket.index if self._pending else None

    # -- checkpoints -------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Iteration count, random state and, by parameter index, error-feedback memory and Q factor (copies, in
        the engine's tensors: ``torch.save`` them, or ``pickle`` them on MindSpore, on every rank, whose error
        memory is its own). By parameter, so a checkpoint loads into other buckets (another bucket size, or the plan
        before its first-step rebuild). Between steps only."""
        if self._pending:
            raise RuntimeError(
                "PowerSGD state_dict() during a step in flight: finish the step (optimizer.step()) first"
            )
        rng = None if self._rng is None else self._rng.get_state()
        params = dict(self._carried)
        for state in self._states.values():
            params.update(self._by_parameter(state))
        return {
            "options": dict(self.options.__dict__),
            "rank": None if self._engine is None else self._engine.rank,  # whose error memory this is
            # the step the next launch belongs to (the counter moves at a step's first launch)
            "iteration": self.iteration + (1 if self._seen else 0),
            "rng": None if rng is None else [rng[0], rng[1].tolist(), int(rng[2]), int(rng[3]), float(rng[4])],
            "params": {
                index: {
                    key: None if t is None else _copied(self._engine, _read(self._engine, t))
                    for key, t in entry.items()
                }
                for index, entry in sorted(params.items())
            },
        }

    def load_state_dict(self, state: dict[str, Any], engine: Any) -> None:
        """Restore :meth:`state_dict`'s output (its tensors copied onto ``engine``'s device at each bucket's next
        launch)."""
        if state["options"] != dict(self.options.__dict__):
            raise ValueError(
                f"PowerSGD state saved with {state['options']}, loaded into PowerSGD with {dict(self.options.__dict__)}: "
                "wrap the model with the same PowerSGD options as the checkpoint's"
            )
        saved_by = state.get("rank")
        if saved_by is not None and saved_by != engine.rank and any(state["params"].values()):
            warnings.warn(
                f"PowerSGD state saved by rank {saved_by} loaded on rank {engine.rank}: each rank's error-feedback "
                "memory is its own, so this rank trains on with another's (not as the saved run would). Save "
                "model.compression_state_dict() on every rank and give each rank its own (Lightning's and "
                "Accelerate's checkpoints through collective_ops do)",
                stacklevel=4,  # (the caller of the wrapper's load_compression_state_dict)
            )
        self.iteration = int(state["iteration"])
        self._seen, self._seeds, self._rng = set(), [], None
        if state["rng"] is not None:
            import numpy as np

            name, keys, pos, has_gauss, cached = state["rng"]
            self._rng = np.random.RandomState()
            self._rng.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
        self._states, self._pending, self._engine = {}, [], engine
        self._carried = {int(index): dict(entry) for index, entry in state["params"].items()}


def _copied(engine: Any, tensor: Any) -> Any:
    copy = engine.zeros(*engine.describe(tensor))
    engine.copy_(copy, tensor)
    return copy


@dataclass(frozen=True)
class _Place:
    """``numel`` elements of ``buffer`` from ``offset``: a parameter's memory in a bucket's buffer, read when needed."""

    buffer: Any
    offset: int
    numel: int


def _read(engine: Any, entry: Any) -> Any:
    """A carried entry's tensor: a _Place's segment as its buffer holds it now, a tensor (or None) as it is."""
    if isinstance(entry, _Place):
        return engine.segment(entry.buffer, entry.offset, entry.numel)
    return entry


class _PowerSGDHandle:
    """One bucket's compressed reduction: its two allreduces, then P Q^T written into the bucket."""

    def __init__(
        self,
        hook: PowerSGDHook,
        ctx: BucketContext,
        state: _BucketState,
        divisor: int,
        matrices: list,
        first: Handle | None,
    ) -> None:
        self._hook, self._ctx, self._state, self._divisor = hook, ctx, state, divisor
        # M (what is compressed), as segments, read until the end (it becomes the next step's error memory)
        self._matrices = matrices
        self._ps: list = []  # the P factors, taken from the first allreduce's result
        self._first: Handle | None = first
        self._second: Handle | None = None
        self._staged = False  # the second allreduce is launched
        self._done = False

    def second_stage(self, timeout: float | None = None) -> None:
        """The first allreduce landed: uncompressed gradients back, P orthogonalised, Q = M^T P allreduced."""
        if self._staged:
            return
        self._staged = True
        engine, layout, wire = self._ctx.engine, self._state.layout, self._state.wire
        if self._first is not None:
            wait_with_timeout(self._first, timeout)
            self._first = None
        # the allreduce replaced the wire's contents: its segments are taken now, from the result
        if layout.uncompressed_numel:
            reduced = engine.segment(wire, 0, layout.uncompressed_numel)  # read from here on, not from the wire
            engine.divide_(reduced, self._divisor)
            error = self._state.error if self._hook.options.error_feedback else None
            position = 0
            for offset, count in layout.uncompressed:
                result = engine.segment(reduced, position, count)
                engine.write(self._ctx.buffer, offset, result)
                if error is not None:  # (input as compressed) - (the reduced result)
                    engine.sub_into(error, offset, engine.segment(error, offset, count), result)
                position += count
        epsilon = self._hook.options.orthogonalization_epsilon
        base = layout.uncompressed_numel
        for m in layout.matrices:
            p = engine.segment(wire, base + m.p_offset, m.rows * m.rank, (1, m.rows, m.rank))
            engine.orthogonalize_(p, epsilon)
            self._ps.append(p)  # kept for the decompression: the wire is not read again this step
        for m, matrix, p in zip(layout.matrices, self._matrices, self._ps):
            engine.bmm_into(self._state.q, m.q_offset, matrix, p, transpose_a=True)
        if layout.q_numel:
            self._second = engine.allreduce(self._state.q, "sum", async_op=True)

    def wait(self, timeout: Any = None) -> Any:
        if self._done:
            return self._ctx.buffer
        seconds = timeout.total_seconds() if hasattr(timeout, "total_seconds") else timeout
        if not self._staged:
            self._hook.advance_pending(seconds)  # this one and every bucket launched before it, in order
            self.second_stage(seconds)
        engine, state = self._ctx.engine, self._state
        if self._second is not None:
            wait_with_timeout(self._second, seconds)
            self._second = None
            engine.divide_(state.q, self._divisor)
        error = state.error if self._hook.options.error_feedback else None
        for p, matrix, m in zip(self._ps, self._matrices, state.layout.matrices):
            q = engine.segment(state.q, m.q_offset, m.cols * m.rank, (1, m.cols, m.rank))  # as reduced
            result = engine.bmm_into(self._ctx.buffer, m.offset, p, q, transpose_b=True)
            if error is not None:  # the input as compressed (``matrix``, in the memory) minus the result, while hot
                engine.sub_into(error, m.offset, matrix, result)
        if not self._hook.options.warm_start:
            self._state.q = None
        self._done = True
        self._matrices = self._ps = []
        return self._ctx.buffer

    def is_completed(self) -> bool:
        """True once waited for, or once the second allreduce has completed. False before that allreduce is
        launched: launching it is left to the next bucket's launch, the end of backward and ``wait``, which come
        in the same order on every rank, so a poll for ready buckets (whose answer depends on each rank's timing, as
        DistributedOptimizer.step's) never leads a rank to launch a collective its peers do not."""
        if self._done:
            return True
        return self._staged and (self._second is None or self._second.is_completed())
