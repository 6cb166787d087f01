"""MindSpore adapter: ``wrap(network)`` on the same bucketing core as the PyTorch adapter.

PyNative mode (the overlap path): a hook on each trainable ``Parameter`` copies its
gradient into its bucket's flat buffer as backward produces it; a full bucket launches
an async ``mint.distributed.all_reduce`` at once, in plan order. ``reduce(grads)`` waits
for the in-flight buckets, reduces whatever is left, and returns the averaged gradients.

On CPU (MCCL) there is no separate communication stream: a collective launched during
backward stalls it, so ``overlap`` defaults to off there and on for Ascend/GPU PyNative.

GRAPH mode: parameter hooks do not run inside compiled graphs, so ``reduce(grads)``
reduces the gradient tuple after backward, with the same plan (``bucket_size_mb``
buckets, one fused collective each). ``comm_stats()['mode']`` says which path ran.

MindSpore tensors have no flat views to hand out, so gradients are copied into the
buffers (``gradient_as_bucket_view`` does not apply) and the results are returned as
new tensors, in the order of the gradient tuple given.

The wrapper is a ``Cell``: ``mindspore.train.Model(wrapped, loss_fn, optimizer)`` builds an
``nn.TrainOneStepCell`` (or its loss-scale subclass) over it, and every such cell built over
a network that holds a wrapper takes the wrapper's reduction (``_adopt``); one built over the
wrapped network without its wrapper is refused, since nothing would reduce its steps.
"""

from __future__ import annotations

import contextlib
import logging
import time
import weakref
from collections.abc import Sequence
from typing import Any

import mindspore as ms
import numpy as np
from mindspore import nn
from mindspore.train import amp

from .. import runtime
from ..adapter import BucketedWrapper
from ..bucketing import (
    DEFAULT_BUCKET_MB,
    ParamSpec,
    allreduce_hook,
    fused_collective,
    plan_buckets,
)
from ..bucketing.hooks import COMPRESSIONS
from ..comm.mindspore_engine import MindSporeEngine, dtype_name
from ..consistency import check_same_on_all_ranks, options_entry, plan_entry
from ..online_tune import auto_tune_start, choose_online
from ..options import WrapOptions, resolve_options
from ._compat import TRAINING_PATCHES, amp_loss_scale_manager

logger = logging.getLogger("collective_ops")

BROADCAST_BUCKET_MB = 250.0

# id(wrapped network) -> its live wrapper: a training cell built over the bare network is refused (see _adopt)
_WRAPPED: weakref.WeakValueDictionary[int, DataParallel] = weakref.WeakValueDictionary()


def _refuse_misordered(grads: Sequence[ms.Tensor], params: Sequence[Any]) -> None:
    """Each gradient must have its parameter's shape: a tuple in another order (an optimizer with parameter
    groups lists its parameters group by group) would otherwise fail deep in the reduction, or, where the
    shapes happen to agree, reduce each gradient as another parameter's."""
    for position, (grad, param) in enumerate(zip(grads, params)):
        if tuple(grad.shape) != tuple(param.shape):
            raise ValueError(
                f"gradient {position} has shape {tuple(grad.shape)} but parameter {param.name!r}, the one at that "
                f"position, has shape {tuple(param.shape)}: the gradients are not in the order of the parameters. "
                "Pass the parameters they were taken for: reduce(grads, params=optimizer.parameters) (an "
                "optimizer with parameter groups orders them group by group, unless given 'order_params')"
            )


def _same_values(a: ms.Tensor, b: ms.Tensor) -> bool:
    """True if ``a`` and ``b`` are one tensor's memory, or hold the same values."""
    if a is b or a.data_ptr() == b.data_ptr():
        return True
    if tuple(a.shape) != tuple(b.shape):
        return False
    same = (a == b) | (a.isnan() & b.isnan())
    return bool(same.all())


def _pynative() -> bool:
    return ms.get_context("mode") == ms.PYNATIVE_MODE


class DataParallel(BucketedWrapper, nn.Cell):
    """A data-parallel MindSpore network: a ``Cell`` that runs the network it wraps.

    Functional loops: ``net = collective_ops.wrap(net)``; ``loss, grads = grad_fn(x, y)``;
    ``grads = net.reduce(grads)``; ``optimizer(grads)``. ``mindspore.train.Model(net, loss_fn, opt)``
    and ``nn.TrainOneStepCell(nn.WithLossCell(net, loss_fn), opt)`` reduce through it as well (the
    training cell's gradient reducer becomes this wrapper's, see ``_adopt``). Its parameters keep the
    network's names, so checkpoints load into the plain network and back.
    """

    def __init__(self, network: nn.Cell, bucket_size_mb: float | str = DEFAULT_BUCKET_MB, **options: Any) -> None:
        """``options``: the keywords of :class:`collective_ops.options.WrapOptions` that MindSpore takes (each
        documented there); a torch-only one is refused with what MindSpore does instead."""
        super().__init__(auto_prefix=False)  # the parameters keep the network's names (checkpoints stay plain)
        if isinstance(network, DataParallel):
            raise ValueError("this network is already wrapped by collective_ops; wrap the original network once")
        if not isinstance(network, nn.Cell):
            raise TypeError(f"wrap() takes a mindspore.nn.Cell, got {type(network).__name__}")
        self.options = o = WrapOptions.build("mindspore", bucket_size_mb, options)
        compression, comm_hook, overlap = o.compression, o.comm_hook, o.overlap
        check_step_alignment = bool(o.check_step_alignment)  # (WrapOptions: None is off on MindSpore)
        self._auto_tune_at, bucket_size_mb = auto_tune_start(o.bucket_size_mb, o.auto_tune_step)
        _refuse_auto_in_graph(self._auto_tune_at)
        self.auto_tune_report: list | None = None  # with "auto": every candidate's prediction, best first
        bucket_size_mb, first_bucket_mb, reduce_op, hook = resolve_options(
            bucket_size_mb, o.first_bucket_mb, o.reduce_op, compression, comm_hook
        )  # first_bucket_mb None: chosen below, once overlap is known
        low_rank = hasattr(hook, "bind_shapes")  # PowerSGD: works on each gradient's matrix, eagerly
        if not runtime.is_initialized("mindspore"):
            runtime.init(framework="mindspore")
        self.engine: MindSporeEngine = runtime.get_engine("mindspore")
        self.network = network
        self.compression = compression
        # not through Cell.__setattr__: a list of Parameters there would become parameters of this Cell
        object.__setattr__(self, "_grad_params", list(network.trainable_params()))
        if not self._grad_params:
            raise ValueError("the network has no trainable parameters (requires_grad=True): nothing to synchronize")
        self._index = {p.name: i for i, p in enumerate(self._grad_params)}
        if len(self._index) != len(self._grad_params):
            raise ValueError("two trainable parameters share a name; give every Parameter a unique name")

        if overlap is None:
            # On CPU (MCCL) collectives run in the same queue as backward's kernels: launching them
            # mid-backward only stalls it (measured: docs/mindspore.md), so reduce after backward there.
            overlap = _pynative() and self.engine.backend != "mccl"
        self.overlap = overlap
        if self.overlap and not _pynative():
            raise ValueError("overlap=True needs PyNative mode: parameter hooks do not run inside GRAPH-mode graphs")
        if first_bucket_mb is None:
            # A small first bucket starts communication early in backward; after backward it only adds a call.
            first_bucket_mb = 1.0 if self.overlap else bucket_size_mb
        specs = [
            ParamSpec(p.name, int(p.size), dtype_name(p.dtype), self.engine.device, int(p.itemsize))
            for p in self._grad_params
        ]
        plan = plan_buckets(specs, bucket_size_mb, first_bucket_mb)
        signature = [
            (
                "parameter",
                p.name,
                {"shape": list(p.shape), "dtype": dtype_name(p.dtype), "requires_grad": p.requires_grad},
            )
            for p in network.get_parameters()
        ]
        # the options that decide a step's collectives: a rank that differs would pair them wrongly
        options = {
            "find_unused_parameters": o.find_unused_parameters,
            "broadcast_parameters": o.broadcast_parameters,
            "rebuild_buckets": o.rebuild_buckets,
            "overlap": overlap,
            "compile_reduction": o.compile_reduction,
            "check_step_alignment": check_step_alignment,
            "reduce_op": reduce_op,
            "compression": compression if compression is None or isinstance(compression, str) else repr(compression),
            "comm_hook": comm_hook,
            "bucket_size_mb auto": self._auto_tune_at,
        }
        check_same_on_all_ranks([*signature, plan_entry(plan), options_entry(options)], self.engine.allgather_bytes)
        if o.broadcast_parameters and self.engine.world_size > 1:
            self._broadcast_parameters(src=0)
        if low_rank:  # the plan knows element counts only
            hook.bind_shapes([tuple(p.shape) for p in self._grad_params])
        self.manager = self._start_manager(plan, reduce_op, hook, check_step_alignment)
        # After backward, the whole plan can be reduced by one compiled graph (CompiledReduction) when the
        # default hook or a dtype compression applies: no Python between kernels, as DistributedGradReducer's @jit.
        # PowerSGD reduces eagerly (its factors are formed between a bucket's two allreduces, its state kept
        # between steps): reduce() from Python, never inside a compiled step (graph_reducer refuses).
        self._low_rank = low_rank
        self._compile = o.compile_reduction and (hook is allreduce_hook or isinstance(compression, str))
        self._wire_dtype = COMPRESSIONS[compression.lower()] if isinstance(compression, str) else None
        # (plan fingerprint, gradient order) -> CompiledReduction, or None where unsupported
        self._compiled: dict[tuple[str, tuple[int, ...]], Any] = {}
        self.compiled_collectives: int | None = None  # a step's collectives in the graph_reducer() last handed out
        self._hook_handles = []
        self._hooked: dict[int, ms.Tensor] = {}  # this step's gradients as the hooks handed them to the buckets
        if self.overlap:
            for i, p in enumerate(self._grad_params):
                self._hook_handles.append(p.register_hook(self._make_hook(i)))
        self._last_mode = "overlap" if self.overlap else "fused-after-backward"
        self._joining = False
        self._own_steps = 0  # steps this rank ran inside join()
        self._sharded_optimizer = False  # a DistributedOptimizer(shard=True) reduces this network's gradients
        # the DistributedOptimizer whose per-bucket updates may be owed (its synchronize() applies them): set by it
        self._participant: Any = None
        _WRAPPED[id(network)] = self  # a training cell over the bare network is refused (see _adopt)
        _install_training_patches(self)

    def _broadcast_parameters(self, src: int) -> None:
        """Rank ``src``'s parameters to every rank, in few fused collectives."""
        handle, _ = fused_collective(
            self.engine,
            list(self.network.get_parameters()),
            BROADCAST_BUCKET_MB,
            lambda buffer: self.engine.broadcast(buffer, src, async_op=True),
        )
        handle.wait()

    # -- uneven inputs ----------------------------------------------------------------
    @contextlib.contextmanager
    def join(self) -> Any:
        """``with net.join():`` ranks with fewer batches shadow the others' steps until all are done.

        As torch DDP's ``join()``: every step starts (at the network's call) with one small
        collective counting the ranks still active; a rank that ran out of data answers 0 and
        takes part in each remaining step's bucket collectives with zero gradients, so the
        average divides by the initial world size. At the end every rank takes the parameters
        of the (highest) rank that ran the most steps. PyNative mode: ``reduce()`` loops, and
        ``Model(net, ...).train`` / a training cell over ``net`` (one network call and one reduction a step).
        """
        if not _pynative():
            raise ValueError("net.join() needs PyNative mode: a rank that ran out of data shadows steps from Python")
        if self._joining:
            raise RuntimeError("already inside net.join()")
        if self._sharded_optimizer:
            raise ValueError(
                "net.join() with DistributedOptimizer(shard=True) is not supported: a rank out of data would have "
                "to shadow the optimizer's reduce-scatters and all-gathers, which it does not. Give every rank the "
                "same number of batches, or use shard=False"
            )
        if self._participant is not None:
            self._participant.synchronize()  # a rank out of data runs no forward that would apply them
        self._joining, self._own_steps = True, 0
        try:
            yield self
            while self._count_active(active=False) > 0:  # a peer still has data: take part with zeros
                self.manager.shadow_step()
        finally:
            self._joining = False
        steps = self.engine.allgather(np.array([self._own_steps], dtype=np.float32))
        last_joiner = max(rank for rank, count in enumerate(steps) if count == steps.max())
        self._broadcast_parameters(src=last_joiner)

    def _count_active(self, active: bool) -> int:
        """The ranks still active in this step (one float32 sum: MCCL's CPU allreduce supports it)."""
        return int(self.engine.allreduce(np.array([1.0 if active else 0.0], dtype=np.float32), "sum")[0])

    # -- backward -------------------------------------------------------------------
    def _make_hook(self, index: int):
        def hook(grad: ms.Tensor) -> None:
            if self.manager.sync_enabled:
                self.manager.mark_ready(index, grad, write_back=False)
                self._hooked[index] = grad
            return None  # the gradient itself is left as it is

        return hook

    def reduce(self, grads: Sequence[ms.Tensor], params: Sequence[Any] | None = None) -> tuple[ms.Tensor, ...]:
        """Averaged (or summed) gradients, in the order of ``grads``.

        ``params`` names the parameters ``grads`` belong to (default: the network's
        trainable parameters, as ``optimizer.parameters`` usually are). Buckets whose
        gradients arrived during backward are already in flight; the rest are reduced now.
        """
        reduced = self._reduce(grads, params)
        # the end of a reduction is a point every rank shares (inside join() a rank out of data shadows steps
        # without reducing: the tune waits for the first reduction after it)
        if self._auto_tune_at is not None and self.manager.steps_synced >= self._auto_tune_at and not self._joining:
            self._auto_tune()
        return reduced

    def reduce_deferred(self, grads: Sequence[ms.Tensor], params: Sequence[Any] | None = None) -> tuple | None:
        """``reduce()``, except where the buckets are reduced one by one (launched by the hooks during backward,
        or without the compiled reduction): then it returns None once every bucket is launched, and the caller
        takes each bucket's results with :meth:`finish_bucket` (a ``DistributedOptimizer``'s per-bucket
        updates). The compiled reduction (one graph: every bucket at once), a step inside ``join()``, the first
        step (its rebuild is a collective every rank runs at the same point) and a pending ``"auto"`` reduce
        as ``reduce()`` does and return the averaged gradients."""
        manager = self.manager
        first_rebuild = manager.rebuild_after_first_step and manager.steps_synced == 0
        if self._joining or self._auto_tune_at is not None or first_rebuild:
            return self.reduce(grads, params)
        return self._reduce(grads, params, defer=True)

    def finish_bucket(self, bucket: int) -> dict[int, ms.Tensor]:
        """After :meth:`reduce_deferred`: wait for ``bucket``'s reduction; its averaged gradients by parameter
        index (into the network's trainable parameters)."""
        self.manager.wait_bucket(bucket)
        members = self.manager.plan.buckets[bucket].param_indices
        results = self.manager.bucket_results(bucket)
        return {i: r.reshape(tuple(self._grad_params[i].shape)) for i, r in zip(members, results)}

    def _reduce(
        self, grads: Sequence[ms.Tensor], params: Sequence[Any] | None, defer: bool = False
    ) -> tuple[ms.Tensor, ...] | None:
        if self._participant is not None:
            self._participant.synchronize()  # a reduction while updates are owed: they are applied first
        params = self._grad_params if params is None else list(params)
        grads = tuple(grads)
        if len(grads) != len(params):
            raise ValueError(
                f"got {len(grads)} gradients for {len(params)} parameters; pass params= when the gradients "
                "are not of the network's trainable parameters (e.g. optimizer.parameters)"
            )
        _refuse_misordered(grads, params)
        indices = self._indices_of(params)
        manager = self.manager
        if not manager.sync_enabled:
            raise RuntimeError("reduce() inside no_sync(): leave the no_sync() block first")
        by_index = dict(zip(indices, grads))
        if self._compile and not self._joining and not manager.in_progress and len(by_index) == len(self._grad_params):
            compiled = self._compiled_reduction(indices)
            if compiled is not None:
                start = time.perf_counter()
                reduced = compiled(grads)
                manager.record_compiled_step(start, time.perf_counter(), compiled.collectives)
                self._last_mode = "fused-after-backward (compiled)"
                return tuple(reduced)
        mode = "overlap" if manager.in_progress else "fused-after-backward"
        for i in manager.plan.order:  # gradients no hook saw (GRAPH mode, or none arrived): launch in plan order
            if i in by_index and not manager.is_marked(i):
                manager.mark_ready(i, by_index[i], write_back=False)
        manager.finalize(force=True, defer=defer)  # deferred: every bucket launched, finish_bucket() each
        self._last_mode = mode
        hooked, self._hooked = self._hooked, {}
        self._refuse_changed_gradients(by_index, hooked)
        if defer:
            return None
        flat: dict[int, ms.Tensor] = {}
        for bucket_index, bucket in enumerate(manager.plan.buckets):
            flat.update(zip(bucket.param_indices, manager.bucket_results(bucket_index)))
        return tuple(flat[i].reshape(tuple(p.shape)) for i, p in zip(indices, params))

    @property
    def tune_pending(self) -> bool:
        """True until ``bucket_size_mb="auto"`` has settled on a size (False for a fixed size)."""
        return self._auto_tune_at is not None

    def _auto_tune(self) -> None:
        """Every candidate simulated on the step just reduced; rank 0's choice on every rank."""
        self._auto_tune_at = None
        # no optimizer simulation here: MindSpore's optimizers update after the reduction (nothing overlaps)
        tuned = choose_online(self.manager, self.engine, self.engine.device.lower(), lambda *_: {})
        self.set_bucket_size(tuned.bucket_size_mb, tuned.first_bucket_mb)
        self.auto_tune_report = tuned.predictions

    def _check_replannable(self) -> None:
        """PyNative only: a GRAPH-mode step compiled the plan in."""
        if not _pynative():
            raise ValueError(
                "set_bucket_size() needs PyNative mode: a GRAPH-mode training step has the bucket plan compiled "
                "into its graph; give wrap() the bucket_size_mb instead"
            )

    def _refuse_changed_gradients(self, given: dict[int, ms.Tensor], hooked: dict[int, ms.Tensor]) -> None:
        """With overlap, the buckets reduced the gradients the hooks saw during backward, not those given to
        ``reduce()``: where code in between changed them out of place (unscaled a loss scale, clipped, added
        a second micro-batch's), returning the reduction would silently drop the change. The same tensor
        (the same memory) passes at once; a copy passes if its values are equal (NaN equal to NaN)."""
        changed = [
            self.manager.plan.params[i].name
            for i, grad in given.items()
            if i in hooked and not _same_values(grad, hooked[i])
        ]
        if changed:
            raise ValueError(
                f"the gradients given to reduce() for {changed[:5]}{' ...' if len(changed) > 5 else ''} are not "
                "those backward produced: with overlap=True each bucket was reduced during backward from the "
                "gradients as they came, so a change made between backward and reduce() (unscaling a loss "
                "scale, clipping, summing micro-batches) would be lost. Reduce first and change the averaged "
                "gradients after (unscaling and summing commute with the average), accumulate micro-batches "
                "under net.no_sync(), or wrap with overlap=False to reduce what reduce() is given"
            )

    def _indices_of(self, params: Sequence[Any]) -> list[int]:
        indices = []
        for p in params:
            name = getattr(p, "name", None)
            if name not in self._index:
                raise ValueError(f"parameter {name!r} is not a trainable parameter of the wrapped network")
            indices.append(self._index[name])
        return indices

    def _compiled_reduction(self, indices: Sequence[int]) -> Any:
        """The plan's compiled reduction for gradients given in ``indices`` order (None if unsupported)."""
        plan = self.manager.plan
        key = (plan.fingerprint(), tuple(indices))
        if key not in self._compiled:
            position = {index: k for k, index in enumerate(indices)}
            self._compiled[key] = self.engine.compiled_reduction(
                [[position[i] for i in b.param_indices] for b in plan.buckets],
                [plan.params[i].numel for i in indices],
                [tuple(self._grad_params[i].shape) for i in indices],
                [plan.params[i].dtype for i in indices],
                self.manager.reduce_op,
                self._wire_dtype,
            )
        return self._compiled[key]

    def grad_reducer(self, params: Sequence[Any] | None = None):
        """A drop-in for ``nn.DistributedGradReducer``: a callable on the gradient tuple."""
        return lambda grads: self.reduce(grads, params)

    def graph_reducer(self, params: Sequence[Any] | None = None) -> nn.Cell:
        """A ``Cell`` that reduces the gradient tuple inside a compiled (GRAPH-mode) training step.

        The drop-in for ``nn.DistributedGradReducer`` where the whole step is one graph (e.g.
        ``nn.TrainOneStepCell`` in GRAPH mode): the current bucket plan's reduction compiled
        into the caller's graph. Python does not run inside that graph: the training cells of
        this module (and MindSpore's, built over the wrapper) account for each step from their
        call (``comm_stats()``, the trace); a step built otherwise is not seen. The plan is
        fixed into the graph when it compiles.
        """
        if self.tune_pending:
            raise ValueError(
                "bucket_size_mb='auto' settles on a size after a profiled step, from PyNative reduce() calls; a "
                "GRAPH-mode step compiles the plan in: give wrap() a number of MiB (or co.tune() in PyNative)"
            )
        if self._low_rank:
            raise ValueError(
                f"compression={self.compression!r} cannot reduce inside a compiled GRAPH-mode training step (Model, "
                "a training cell or a DistributedOptimizer in GRAPH mode): PowerSGD forms each bucket's low-rank "
                "factors between its two allreduces and keeps its state between steps, from Python. Train in "
                "PyNative mode (ms.set_context(mode=ms.PYNATIVE_MODE)), or call net.reduce(grads) from a Python loop "
                "(grad_fn may still be compiled), or use compression='fp16'/'bf16' in GRAPH mode"
            )
        params = self._grad_params if params is None else list(params)
        indices = self._indices_of(params)
        if len(set(indices)) != len(self._grad_params):
            raise ValueError("graph_reducer needs one gradient for every trainable parameter of the wrapped network")
        cell = self._compiled_reduction(indices) if self._compile else None
        if cell is None:
            raise ValueError(
                f"no compiled reduction for this network on {self.engine.backend!r} (custom comm_hook, mixed "
                "gradient dtypes, compile_reduction=False, or a dtype ops.AllReduce lacks there); "
                "use reduce() from PyNative mode instead"
            )
        self._last_mode = "in-graph (compiled)"
        self.compiled_collectives = cell.collectives
        return cell

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        """Gradient accumulation: hooks stay quiet; pass the summed gradients to reduce() afterwards."""
        return self.manager.no_sync()

    # -- the network's face ---------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # Python runs here for calls from Python (PyNative, and a GRAPH-mode top-level call); inside a compiled
        # training step only construct() is compiled into the step's graph
        if self.manager.alignment is not None and self.network.training:
            # a training forward: each rank's count behind its next reduction is compared (a rank that skipped
            # one would pair its gradients with its peers' of another iteration)
            self.manager.alignment.count_forward()
        if self._joining:  # a step starts: counted, so ranks that ran out of data know to shadow it
            self._count_active(active=True)
            self._own_steps += 1
        return super().__call__(*args, **kwargs)

    def construct(self, *inputs: Any, **kwargs: Any) -> Any:
        return self.network(*inputs, **kwargs)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)  # this Cell's own parameters and cells ("network")
        except AttributeError:
            network = self.__dict__.get("_cells", {}).get("network")
            if network is None or name.startswith("__"):
                raise
            return getattr(network, name)  # the wrapped network's attributes, as before it was wrapped

    @property
    def comm_mode(self) -> str:
        """How the last step reduced: ``"overlap"``, ``"fused-after-backward"`` or ``"in-graph (compiled)"``."""
        return self._last_mode

    def finish_owed_updates(self) -> None:
        if self._participant is not None:
            self._participant.synchronize()


class TrainOneStepCell(nn.TrainOneStepCell):
    """``nn.TrainOneStepCell`` whose gradient reducer is collective_ops'.

    PyNative: ``reduce()`` (hooks, stats and trace as in the functional loop). GRAPH: the
    compiled reduction inside the step's graph (``graph_reducer``), where
    ``DistributedGradReducer`` would sit.
    """

    def __init__(self, network: nn.Cell, optimizer: nn.Optimizer, data_parallel: DataParallel, sens: float = 1.0):
        super().__init__(network, optimizer, sens)
        self._distributed_over(data_parallel)

    def _distributed_over(self, data_parallel: DataParallel) -> None:
        _set_reducer(self, data_parallel)

    def __call__(self, *inputs: Any) -> Any:
        return _recorded_step(self, super().__call__, inputs)


_nonfinite = ms.ops.MultitypeFuncGraph("_nonfinite")


@_nonfinite.register("Tensor")
def _tensor_nonfinite(grad: ms.Tensor) -> ms.Tensor:
    """1.0 where ``grad`` holds an inf or a NaN, else 0.0."""
    return 1.0 - ms.ops.IsFinite()(grad).all().astype(ms.float32)


_unscale = ms.ops.MultitypeFuncGraph("_unscale")


@_unscale.register("Tensor", "Tensor")
def _tensor_unscale(scale: ms.Tensor, grad: ms.Tensor) -> ms.Tensor:
    """MindSpore's own unscaling arithmetic: times the scale's reciprocal, in the gradient's dtype."""
    return grad * ms.ops.cast(ms.ops.Reciprocal()(scale), grad.dtype)


class TrainOneStepWithLossScaleCell(nn.TrainOneStepWithLossScaleCell):
    """``nn.TrainOneStepWithLossScaleCell`` (mixed precision: a static or dynamic loss scale) whose gradient
    reducer is collective_ops'.

    The still-scaled gradients are reduced, then unscaled: with ``overlap`` the parameter hooks
    launched their buckets during backward, before anything could unscale them (MindSpore's cell
    unscales first). For a power-of-two scale (``DynamicLossScaleUpdateCell`` keeps one if it
    starts at one) scaling is exact, so the result is MindSpore's bit for bit; for another scale
    it is within rounding. Every rank takes the same decision to skip a step: the overflow flag is
    summed over ranks (as MindSpore's cell does in data-parallel mode), and an inf or NaN in any
    rank's gradient reaches every rank's reduced gradient anyway. On CPU, which has none of the
    Ascend/GPU float-status kernels, the overflow is an inf or NaN in the reduced gradients.
    """

    def __init__(
        self, network: nn.Cell, optimizer: nn.Optimizer, data_parallel: DataParallel, scale_sense: Any
    ) -> None:
        super().__init__(network, optimizer, scale_sense)
        self._distributed_over(data_parallel)

    def _distributed_over(self, data_parallel: DataParallel) -> None:
        _set_reducer(self, data_parallel)
        self.is_distributed = data_parallel.engine.world_size > 1  # the overflow flag summed over ranks
        self._cpu = ms.get_context("device_target") == "CPU"

    def __call__(self, *inputs: Any) -> Any:
        return _recorded_step(self, super().__call__, inputs)

    def construct(self, *inputs: Any) -> Any:
        loss = self.network(*inputs)
        scaling_sens = self.scale_sense
        status = ms.Tensor([0] * 8, ms.int32)
        scaling_sens_filled = ms.ops.ones_like(loss) * ms.ops.cast(scaling_sens, ms.ops.dtype(loss))
        grads = self.grad(self.network, self.weights)(*inputs, scaling_sens_filled)
        grads = self.grad_reducer(grads)  # still scaled: what the hooks saw
        grads = self.hyper_map(ms.ops.partial(_unscale, scaling_sens), grads)
        cond = self.get_overflow_status(status, grads)
        overflow = self.process_loss_scale(cond)
        if not overflow:
            loss = ms.ops.depend(loss, self.optimizer(grads))
        return loss, cond, scaling_sens

    def get_overflow_status(self, status: Any, compute_output: Any) -> Any:
        """MindSpore's check on Ascend/GPU; on CPU, an inf or NaN in any (reduced) gradient of any rank."""
        if not self._cpu:
            return super().get_overflow_status(status, compute_output)
        flags = ms.ops.AddN()(self.hyper_map(_nonfinite, compute_output))
        if self.is_distributed:
            flags = self.allreduce(flags)
        return self.less_equal(self.base, flags)


def _set_reducer(cell: nn.TrainOneStepCell, data_parallel: DataParallel) -> None:
    """A training cell's reducer: the wrapper's, or none where its optimizer reduces (DistributedOptimizer)."""
    if getattr(cell.optimizer, "reduces_gradients", False):
        cell.grad_reducer = nn.Identity()  # the optimizer's step reduces: a second reduction would only cost
    else:
        cell.grad_reducer = _our_reducer(data_parallel, list(cell.weights))
    cell.reducer_flag = True
    object.__setattr__(cell, "_data_parallel", data_parallel)  # not a sub-cell: no part of the step's graph


def _recorded_step(cell: nn.Cell, call: Any, inputs: tuple) -> Any:
    """Run a training cell's step; in GRAPH mode, where the reduction runs inside the step's graph and no Python of
    ours runs, account for it as one compiled step (comm_stats, trace: a step event and one per bucket). A call
    that compiled a graph (the first, or a new input shape) is traced as a compilation, not as a step: its
    seconds of compiling would read as one rank's wait skew. PyNative steps are recorded by reduce() itself."""
    if _pynative():
        return call(*inputs)
    compiled = len(cell.compile_cache)
    start = time.perf_counter()
    out = call(*inputs)
    end = time.perf_counter()
    manager = cell._data_parallel.manager
    if len(cell.compile_cache) > compiled:
        traced = getattr(manager.observer, "graph_compiled", None)
        if traced is not None:
            traced(type(cell).__name__, start, end)
    else:
        manager.record_compiled_step(start, end, cell._data_parallel.compiled_collectives)
    return out


def _our_reducer(data_parallel: DataParallel, weights: Sequence[Any]) -> nn.Cell:
    """The training cells' ``grad_reducer``: ``reduce()`` in PyNative, the compiled plan inside GRAPH's step."""
    if not isinstance(data_parallel, DataParallel):
        raise TypeError(
            f"the training cell reduces through the network collective_ops.wrap() returned, got a "
            f"{type(data_parallel).__name__}: net = co.wrap(network), then the cell over "
            "nn.WithLossCell(net.network, loss_fn) with net as its third argument"
        )
    if _pynative():
        return _EagerReducer(data_parallel, weights)
    return data_parallel.graph_reducer(weights)


class _EagerReducer(nn.Cell):
    """``DataParallel.reduce`` as a Cell (PyNative runs ``construct`` as Python)."""

    def __init__(self, data_parallel: DataParallel, params: Sequence[Any]) -> None:
        super().__init__(auto_prefix=False)
        self._reduce = data_parallel.grad_reducer(params)

    def construct(self, grads: Any) -> Any:
        return self._reduce(grads)


# -- MindSpore's own training cells (Model builds them) reduce through the wrapper -------------------------------
def _wrapper_in(network: nn.Cell) -> DataParallel | None:
    """The one DataParallel inside ``network`` (itself included), or None."""
    found = {id(cell): cell for _, cell in network.cells_and_names() if isinstance(cell, DataParallel)}
    if len(found) > 1:
        raise ValueError("a training cell over two collective_ops wrappers: wrap the whole network once")
    return next(iter(found.values()), None)


def _bare_wrapped_in(network: nn.Cell) -> DataParallel | None:
    """The wrapper of a network inside ``network`` that is there without its wrapper, or None."""
    for _, cell in network.cells_and_names():
        wrapper = _WRAPPED.get(id(cell))
        if wrapper is not None and wrapper.network is cell:
            return wrapper
    return None


def _adopt(cell: nn.TrainOneStepCell) -> None:
    """Give a MindSpore training cell (``nn.TrainOneStepCell`` as ``Model`` builds it, or the loss-scale one) the
    reduction of the wrapper inside its network; refuse one over a wrapped network without its wrapper, whose
    steps nothing would reduce (each rank would train on its own gradients, silently)."""
    wrapper = _wrapper_in(cell.network)
    if wrapper is None:
        bare = _bare_wrapped_in(cell.network)
        if bare is not None and not cell.reducer_flag:  # under DATA_PARALLEL MindSpore's own reducer runs
            raise ValueError(
                f"rank {bare.engine.rank}: this {type(cell).__name__} trains a network that collective_ops.wrap() "
                "wrapped, but without its wrapper, so no step of it would be reduced (each rank would train on its "
                "own gradients). Pass the wrapper itself: Model(wrapped, loss_fn, optimizer), "
                "nn.TrainOneStepCell(nn.WithLossCell(wrapped, loss_fn), optimizer), or "
                "collective_ops.mindspore.TrainOneStepCell(nn.WithLossCell(wrapped.network, loss_fn), optimizer, "
                "wrapped)"
            )
        return
    kind = type(cell)
    # the same object, as ours: our reducer, GRAPH steps recorded; the loss-scale one also reduces before unscaling
    if kind is nn.TrainOneStepWithLossScaleCell:
        cell.__class__ = TrainOneStepWithLossScaleCell
        cell._distributed_over(wrapper)
    elif kind is nn.TrainOneStepCell:
        cell.__class__ = TrainOneStepCell
        cell._distributed_over(wrapper)
    else:  # a subclass with a step of its own (boost, gradient accumulation): where to reduce is unknown
        raise ValueError(
            f"{kind.__name__} over a collective_ops wrapper is not supported: its step is its own, and the "
            "gradients' reduction has no known place in it. Use Model without boost_level / gradient "
            "accumulation, or collective_ops.mindspore.TrainOneStepCell(net_with_loss, optimizer, wrapped)"
        )


def _adopting(init: Any, adopts_in_subclass: type | None) -> Any:
    """``init``, then ``_adopt`` (ours set their reducer themselves; a loss-scale cell once its own init is done)."""

    def adopting_init(self: nn.TrainOneStepCell, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        ours = isinstance(self, (TrainOneStepCell, TrainOneStepWithLossScaleCell))
        if not ours and not (adopts_in_subclass is not None and isinstance(self, adopts_in_subclass)):
            _adopt(self)

    return adopting_init


# Model(net, ...) builds nn.TrainOneStepCell (or its loss-scale subclass) in mindspore.train.amp.build_train_network
# and takes its reducer from MindSpore's parallel context alone; every construction of one passes through here so
# that a wrapper in its network supplies the reduction. Networks without a wrapper are left exactly as they were.
TRAINING_PATCHES.add(nn.TrainOneStepCell, "__init__", lambda init: _adopting(init, nn.TrainOneStepWithLossScaleCell))
TRAINING_PATCHES.add(nn.TrainOneStepWithLossScaleCell, "__init__", lambda init: _adopting(init, None))


_BUILD_TRAIN_NETWORK = amp.build_train_network  # MindSpore's own (the wrappers replace it: below)


def _build_train_network(network: nn.Cell, optimizer: Any, loss_fn: Any = None, level: str = "O0", **kw: Any) -> Any:
    """``mindspore.train.amp.build_train_network`` (what ``Model`` calls), except for a wrapped network with a
    dynamic loss scale on CPU, which MindSpore refuses there (it has none of the float-status kernels its cell
    checks overflow with): collective_ops' ``TrainOneStepWithLossScaleCell`` trains it instead, skipping a step
    where any rank's reduced gradients hold an inf or NaN."""
    wrapper = _wrapper_in(network)
    manager = kw.get("loss_scale_manager", amp_loss_scale_manager(level))
    dynamic = manager is not None and manager.get_update_cell() is not None
    if wrapper is None or not dynamic or ms.get_context("device_target") != "CPU" or ms.get_context("enable_ge"):
        return _BUILD_TRAIN_NETWORK(network, optimizer, loss_fn, level, **kw)
    logger.info(
        "Model(wrapped, ..., loss_scale_manager=%s) on CPU: MindSpore's own loss-scale cell does not run there; "
        "collective_ops.mindspore.TrainOneStepWithLossScaleCell trains instead (overflow: an inf or NaN in any "
        "rank's reduced gradients)",
        type(manager).__name__,
    )
    plain = _BUILD_TRAIN_NETWORK(network, optimizer, loss_fn, level, **{**kw, "loss_scale_manager": None})
    return TrainOneStepWithLossScaleCell(plain.network, optimizer, wrapper, manager.get_update_cell()).set_train()


TRAINING_PATCHES.add(amp, "build_train_network", lambda original: _build_train_network)


def _install_training_patches(wrapper: DataParallel) -> None:
    """MindSpore's training cells, ``build_train_network`` and ``Cell.parameters_and_names`` replaced while a
    wrapper lives (:data:`~collective_ops.mindspore._compat.TRAINING_PATCHES`): MindSpore's own again at
    ``co.shutdown()``, or once the last wrapper is gone."""
    TRAINING_PATCHES.install()
    runtime.release_at_shutdown(TRAINING_PATCHES.remove)
    weakref.finalize(wrapper, _remove_training_patches_if_unwrapped)


def _remove_training_patches_if_unwrapped() -> None:
    if not list(_WRAPPED.values()):
        TRAINING_PATCHES.remove()


def _refuse_auto_in_graph(auto_tune_at: int | None) -> None:
    if auto_tune_at is not None and not _pynative():
        raise ValueError(
            "bucket_size_mb='auto' needs PyNative mode on MindSpore: it replans after a profiled reduce(), and a "
            "GRAPH-mode step has the bucket plan compiled into its graph. Give a number of MiB (default 25; larger "
            "buckets mean fewer collectives), or tune in PyNative (bucket_size_mb='auto' or co.tune) and wrap "
            "with the size it settles on"
        )


def wrap(network: nn.Cell, bucket_size_mb: float | str = DEFAULT_BUCKET_MB, **options: Any) -> DataParallel:
    """``DataParallel(network, bucket_size_mb, **options)``; the options checked against
    :class:`collective_ops.options.WrapOptions` (a torch-only one is refused with MindSpore's counterpart)."""
    return DataParallel(network, bucket_size_mb, **options)


__all__ = ["DataParallel", "TrainOneStepCell", "wrap"]
