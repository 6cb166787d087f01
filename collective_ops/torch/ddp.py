"""PyTorch adapter: ``wrap(model)`` -> bucketed AllReduce overlapped with backward.

Per-parameter ``register_post_accumulate_grad_hook`` marks gradients ready; full
buckets launch asynchronously during backward; a callback queued on the autograd
engine finalizes, so gradients are averaged when ``backward()`` returns (queued by a
hook on the forward's outputs on the backward that reaches them, so a backward nested
in it, as a reentrant checkpoint runs, does not end the step early). Gradients
live as views in the bucket buffers (``gradient_as_bucket_view``), so there is no
second copy of them. Nothing here is CUDA-specific: the collectives order themselves
against the current stream (NCCL, HCCL), so the same code runs on CPU, GPU and NPU.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import sys
import time
import warnings
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed.algorithms.join import Join, Joinable, JoinHook

from .. import runtime
from ..adapter import BucketedWrapper
from ..bucketing import (
    DEFAULT_BUCKET_MB,
    DEFAULT_FIRST_BUCKET_MB,
    BucketPlan,
    RowSparseReduction,
)
from ..bucketing.diagnosis import agreeing
from ..bucketing.hooks import allreduce_hook, reduces_rows
from ..bucketing.participant import UpdateParticipant
from ..comm.torch_engine import TorchEngine
from ..consistency import check_same_on_all_ranks, options_entry, plan_entry
from ..online_tune import auto_tune_start, choose_online, overlapped_steps
from ..options import WrapOptions, names_text, resolve_options
from . import _compat, guards
from ._compat import DDP_ACTIVE_MARKER, disable_dynamo
from .autograd_hooks import output_tensors, outputs_reached, remove_all, view_like, weak_grad_hook
from .ddp_hooks import DDPCommHook, ddp_comm_hook
from .ddp_keywords import check_ddp_keywords, inputs_to
from .model_sync import broadcast_tensors, highest_rank_where, model_signature, sync_buffers
from .model_watch import PlannedParameters, converted_error, requires_grad_change_error, stop_watching, watch
from .nonfinite import NonfiniteWatch
from .owned_gradients import OwnedGradients
from .row_sparse import plan_with_rows, record_lookups, row_sparse_tables
from .step_watch import LIVE_WRAPPERS, live_wrappers, stop_watching_optimizer_steps, watch_optimizer_steps

logger = logging.getLogger("collective_ops")

# the options that decide which collectives a step issues (besides the resolved ones): a rank that differs would
# pair them wrongly, so every rank compares them at wrap
_STRIDED = torch.strided  # (compared once per gradient)

COLLECTIVE_OPTIONS = ("find_unused_parameters", "broadcast_buffers", "rebuild_buckets", "check_finite", "init_sync")


class DistributedDataParallel(BucketedWrapper, nn.Module, Joinable):
    """A data-parallel ``torch.nn.Module`` on the collective_ops bucketing core.

    Use it as the model itself: ``loss.backward(); optimizer.step()``. ``.module``
    is the original model; ``state_dict()`` is the original's (no ``module.`` prefix),
    so checkpoints load into an unwrapped model.
    """

    # Parameters a conversion after wrap() changed (names, for the message): training is refused from then on.
    _converted_after_wrap: str | None = None
    # The attached DistributedOptimizer, weakly (attach_optimizer); a class default, so that the optimizer
    # property (which named_parameters asks) answers None on an instance whose __init__ has not set it yet.
    _optimizer_ref: weakref.ref | None = None
    # Where each forward moves its inputs (DDP's device_ids[0]); None: left as given.
    _input_device: torch.device | None = None

    def __init__(self, module: nn.Module, bucket_size_mb: float | str = DEFAULT_BUCKET_MB, **options: Any) -> None:
        """``options``: the keywords of :class:`collective_ops.options.WrapOptions` that torch takes (DDP's
        constructor keywords among them); each is documented there, and a MindSpore-only one is refused."""
        super().__init__()
        self.options = o = WrapOptions.build("torch", bucket_size_mb, options)
        self._join_config = _compat.disabled_join_config()  # Joinable: off outside join()
        self._divide_by_initial_world_size = True
        self._auto_tune_at, bucket_size_mb = auto_tune_start(o.bucket_size_mb, o.auto_tune_step)
        guards.refuse_unwrappable(module, DistributedDataParallel, LIVE_WRAPPERS)
        first_bucket_mb = DEFAULT_FIRST_BUCKET_MB if o.first_bucket_mb is None else o.first_bucket_mb
        bucket_size_mb, first_bucket_mb, reduce_op, hook = resolve_options(
            bucket_size_mb, first_bucket_mb, o.reduce_op, o.compression, o.comm_hook
        )
        check_step_alignment = o.check_step_alignment is not False  # (WrapOptions: None is on for torch)
        self.auto_tune_report = None
        # with a DistributedOptimizer planning its order: (size, first bucket) -> simulated overlapped step
        self.auto_tune_overlapped: dict[tuple[float, float], float] = {}
        # what the online tune charged overlapped communication (comm.measure.estimated_contention)
        self.auto_tune_contention = 0.0

        if not runtime.is_initialized("torch"):
            runtime.init(framework="torch")
        self.engine: TorchEngine = runtime.get_engine("torch")
        self.module = module
        self.gradient_as_bucket_view = o.gradient_as_bucket_view
        self.broadcast_buffers = o.broadcast_buffers
        # DDP's public switches, read at each forward as DDP reads them: no_sync() clears the first (loops such
        # as nanoGPT's set it directly); the second is set at the end of each forward and decides whether the
        # next one broadcasts the buffers
        self.require_backward_grad_sync = True
        self.require_forward_param_sync = True
        self.check_finite = o.check_finite
        self.compression = o.compression

        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError("the model has no trainable parameters (requires_grad=True): nothing to synchronize")
        guards.refuse_unsupported(module, named)
        self._params = [p for _, p in named]
        self._param_names = [n for n, _ in named]
        self._input_device = check_ddp_keywords(o, self._params, self.engine.world_size)  # (DDP's, ported code)

        # the built-in reductions send rows (a custom comm_hook reduces the whole bucket)
        tables = row_sparse_tables(module, named, o.row_sparse_embeddings, self.engine) if reduces_rows(hook) else {}
        plan = plan_with_rows(named, tables, bucket_size_mb, first_bucket_mb)
        collective_options = {name: getattr(o, name) for name in COLLECTIVE_OPTIONS}
        collective_options.update(check_step_alignment=check_step_alignment, reduce_op=reduce_op)
        compression = o.compression if o.compression is None or isinstance(o.compression, str) else repr(o.compression)
        collective_options.update({"compression": compression, "comm_hook": o.comm_hook})
        collective_options["bucket_size_mb auto"] = self._auto_tune_at
        self._verify_and_broadcast(plan, options_entry(collective_options), o.init_sync)
        if hasattr(hook, "bind_shapes"):  # a compression that works on each gradient's matrix (PowerSGD)
            hook.bind_shapes([tuple(p.shape) for p in self._params])
        self.manager = self._start_manager(plan, reduce_op, hook, check_step_alignment, on_rebuild=self._on_rebuild)
        self._start_side_groups(tables)
        self._views: list[torch.Tensor] = []
        self._make_views()
        self._start_step_state()
        self._install_hooks(tables)
        if os.environ.get("COLLECTIVE_OPS_LOG_PLAN") or logger.isEnabledFor(logging.DEBUG):
            logger.info("%s", plan.describe())

    # -- wrap time -----------------------------------------------------------------
    def _start_side_groups(self, tables: dict[str, nn.Module]) -> None:
        """The groups beside the buckets' (row-sparse masks, step alignment), let go of at shutdown."""
        if tables:  # the masks' own group: made on every rank alike (the tables are in the checked plan)
            self.manager.row_sparse = RowSparseReduction(self.engine.new_group())
        alignment = self.manager.alignment
        if tables or (alignment is not None and alignment.group is not None):
            runtime.finish_in_flight_before_leaving(self._let_go_of_groups)

    def _start_step_state(self) -> None:
        """What a step tracks from backward to backward, before the first one."""
        self._step_end_owed = False  # this backward delivered gradients: _end_of_backward finalizes the step
        self._end_of_backward_queued = False  # by a hook on this forward's outputs, on the outermost backward
        # when a backward last reached this forward's outputs, and when the last reducing backward began: there,
        # or at its first gradient if it did not pass the outputs (the DistributedOptimizer's order trial times
        # whole steps: from the outputs, the output layer's backward before its first gradient counts too)
        self._outputs_reached_at: float | None = None
        self.backward_began: float | None = None
        self._buffer_group: Any = None  # buffers broadcast on a group of their own (attach_optimizer)
        # gradients a DistributedOptimizer owns (end of backward to its update), guarded against in-place changes
        self.owned_gradients = OwnedGradients(
            self.manager, self._params, self._param_names, self.gradient_as_bucket_view
        )
        self._nonfinite = NonfiniteWatch(self._param_names, self._params, self.engine.rank)  # (check_finite)
        self._warned_local_step = False  # a plain optimizer stepped on gradients never averaged: warned once
        self._warned_gradient_kept = False  # a kept p.grad about to be overwritten by its bucket: warned once
        self._main_grads_stale: set[int] = set()  # buckets of main gradients zero_grad() cleared (zero_main_grads)
        self._stale_plan: BucketPlan | None = None  # the plan those bucket indices are of

    def _install_hooks(self, tables: dict[str, nn.Module]) -> None:
        """Each parameter's gradient hook (holding the wrapper weakly: deleting it detaches them and frees its
        buffers), the row-sparse tables' lookup hooks, and the watch on the model's later changes."""
        watch_optimizer_steps()
        this = weakref.ref(self)
        self._hook_handles = [
            p.register_post_accumulate_grad_hook(weak_grad_hook(this, i)) for i, p in enumerate(self._params)
        ]
        if tables:  # each forward's looked-up rows recorded, so the masks need not wait for the gradient
            self._hook_handles += record_lookups(tables, self.manager.row_sparse)
        weakref.finalize(self, remove_all, self._hook_handles)
        runtime.release_at_shutdown(functools.partial(remove_all, self._hook_handles))  # the model plain again
        LIVE_WRAPPERS[self.module] = this
        self._planned = PlannedParameters(self._params, self.module)  # (watched while this wrapper lives)
        watch(self.module, self._planned)
        # torch's global tables (the step and registration hooks) as before the first wrap: at co.shutdown(), or
        # once the last wrapper is gone
        runtime.release_at_shutdown(release_process_hooks)
        weakref.finalize(self, release_process_hooks_if_unused)

    def _verify_and_broadcast(self, plan: BucketPlan, options: tuple, broadcast: bool = True) -> None:
        """Every rank must hold the same model, plan the same buckets and pass the same collective-deciding
        options (an entry), or none starts training; then rank 0's weights are every rank's (``broadcast``; DDP's
        ``init_sync=False`` leaves each rank its own, where the caller made them equal)."""
        check_same_on_all_ranks([*model_signature(self.module), plan_entry(plan), options], self.engine.allgather_bytes)
        if broadcast and self.engine.world_size > 1:
            self._broadcast_model(src=0)

    def _broadcast_model(self, src: int) -> None:
        """Rank ``src``'s parameters and buffers to every rank (at wrap, and after join)."""
        with torch.no_grad():
            tensors = [p.detach() for p in self.module.parameters()] + list(self.module.buffers())
            broadcast_tensors(self.engine, tensors, src)

    def _make_views(self) -> None:
        """Each parameter's gradient view into its bucket, with the parameter's own strides (as DDP).

        A channels_last convolution weight gets a channels_last gradient view, so autograd accumulates
        into it without a layout change (a transposing copy per step on GPU/NPU otherwise).
        """
        self._views = []
        for i, p in enumerate(self._params):
            buffer, offset, _numel = self.manager.param_segment(i)
            self._views.append(view_like(p, buffer, offset))
        # where each view lies: a conversion of the inner module (net.to(...)) re-points p.grad, our view
        self._view_addresses = [view.data_ptr() for view in self._views]
        self._view_strides = [view.stride() for view in self._views]  # (compared with each fresh gradient's)
        # Parameters whose bucket keeps main gradients in another dtype (set_grad_dtype): each gradient autograd
        # makes in the parameter's dtype is added into the view and dropped, in every backward, no_sync() too.
        self._adds_in = [view.dtype != p.dtype for view, p in zip(self._views, self._params)]
        self._main_grads = any(self._adds_in)
        # References to a view held by this list and one local name alone (as _contribute counts): more, and a
        # p.grad from before zero_grad(set_to_none=True) is kept somewhere, which the next backward overwrites.
        probe = self._views[0]
        self._view_references_alone = sys.getrefcount(probe)

    def _on_rebuild(self, plan: BucketPlan) -> None:
        old = self._views
        self._make_views()
        if self._main_grads_stale and self._stale_plan is not plan:
            self._zero_stale_main_grads()
        if self.gradient_as_bucket_view:
            for p, old_view, new_view, adds_in in zip(self._params, old, self._views, self._adds_in):
                if p.grad is not None and p.grad.data_ptr() == old_view.data_ptr():
                    p.grad = None if adds_in else new_view  # the manager already moved the values
        del old  # (the old gradient buffers go before the optimizer lays its own out anew)
        logger.info("collective_ops: new bucket plan:\n%s", plan.describe())  # rebuild or set_bucket_size
        if self.optimizer is not None:
            self.optimizer.on_plan_change(plan)

    # -- backward --------------------------------------------------------------------
    def _grad_ready(self, index: int, param: torch.Tensor) -> None:
        """Runs in the autograd engine once ``param``'s gradient is fully accumulated."""
        manager = self.manager
        ref = self._optimizer_ref  # (self.optimizer, without the property's call: this runs once per gradient)
        optimizer = None if ref is None else ref()
        if optimizer is not None and optimizer.awaits_first_gradient:  # (under no_sync() too)
            optimizer.first_gradient_after_step(param)
        if self._main_grads and self._adds_in[index]:
            self._add_main_grad(index, param)
            return
        if not manager.sync_enabled:
            manager.mark_ready(index)  # only noted: used while accumulating (the usage map counts it)
            return
        grad = param.grad
        if grad.layout is not _STRIDED:
            raise self._sparse_gradient_error(index)
        if self.check_finite and not bool(torch.isfinite(grad).all()):
            # Not raised here: this rank's peers would wait for it. Every rank raises after the reduction.
            self._nonfinite.note_local(index)
        if not self._step_end_owed:
            self._start_reducing_backward(param)
        self._contribute(index, param, grad=grad)

    def _sparse_gradient_error(self, index: int) -> ValueError:
        return ValueError(
            f"parameter {self._param_names[index]!r} received a sparse gradient; collective_ops reduces dense "
            "gradients only: use sparse=False (nn.Embedding/EmbeddingBag) or densify the gradient"
        )

    def _start_reducing_backward(self, param: torch.Tensor) -> None:
        """At a synchronised backward's first gradient (``param``'s)."""
        self._refuse_training_if_model_changed()
        self.backward_began = self._outputs_reached_at or time.perf_counter()
        self._outputs_reached_at = None
        if self.optimizer is not None:
            self.optimizer.backward_starts(param)
        if not self._end_of_backward_queued:  # a backward that did not pass through the outputs
            _compat.queue_at_end_of_backward(self._end_of_backward)
        self._step_end_owed = True

    def _add_main_grad(self, index: int, param: torch.Tensor) -> None:
        """Main gradients (``set_grad_dtype``): ``param.grad`` added into its view of the bucket in the bucket's
        dtype, then dropped, so that accumulation across ``no_sync()`` micro-steps sums in the main dtype too
        (Megatron-core's ``main_grad``). A bucket's first gradient since ``zero_grad()`` starts it from zero."""
        manager = self.manager
        grad = param.grad
        if grad.layout is not _STRIDED:
            raise self._sparse_gradient_error(index)
        syncs = manager.sync_enabled
        if syncs:
            if self.check_finite and not bool(torch.isfinite(grad).all()):
                self._nonfinite.note_local(index)
            if not self._step_end_owed:  # (before the buffer is touched: updates still owed read it)
                self._start_reducing_backward(param)
        bucket = manager.plan.location[index][0]
        if bucket in self._main_grads_stale:
            self._main_grads_stale.discard(bucket)
            manager.buffers[bucket].zero_()
        # Added as it is, not prescaled: the buffer may hold an earlier backward's average (no zero_grad() in
        # between), which the reduction's own 1/world pass over the bucket scales as DDP's does.
        self._views[index].add_(grad)
        param.grad = None
        manager.mark_ready(index)

    def zero_main_grads(self) -> None:
        """Main gradients (``set_grad_dtype``) cleared as ``zero_grad()`` clears ``p.grad``: each bucket starts
        from zero at its next gradient (not now: an update still owed reads them)."""
        if self._main_grads:
            self._main_grads_stale = set(range(len(self.manager.plan.buckets)))
            self._stale_plan = self.manager.plan

    @property
    def main_grads_cleared(self) -> bool:
        """True from ``zero_grad()`` until the next gradient (main gradients)."""
        return bool(self._main_grads_stale)

    def _zero_stale_main_grads(self) -> None:
        """A new plan's buffers hold the old one's values: the parameters of buckets zero_grad() cleared are zeroed
        in them now (no update is owed at a replan, so nothing reads the old values any more)."""
        stale, self._main_grads_stale = self._main_grads_stale, set()
        for bucket in stale:
            for index in self._stale_plan.buckets[bucket].param_indices:
                self._views[index].zero_()

    def set_grad_dtype(self, dtype: torch.dtype | None) -> None:
        """Keep the gradients in ``dtype`` buffers from now on (None: the parameters' dtype): the fp32 main
        gradients of a bf16/fp16 model, accumulated and averaged in fp32. A parameter whose dtype differs has no
        ``p.grad`` after backward; its gradient is its view of the buffer (:meth:`main_grad`)."""
        self.check_grad_dtype(dtype)
        self.manager.set_grad_dtype(None if dtype is None else str(dtype).removeprefix("torch."))
        self.zero_main_grads()

    def check_grad_dtype(self, dtype: torch.dtype | None) -> None:
        """Raise where this model cannot keep its gradients in ``dtype`` buffers (:meth:`set_grad_dtype`)."""
        name = None if dtype is None else str(dtype).removeprefix("torch.")
        if name is not None and name != self.manager.grad_dtype:
            refuse = guards.main_grads_unsupported(self.options, self.manager.comm_hook is allreduce_hook)
            if refuse:
                raise ValueError(f"grad_dtype={name!r}: {refuse}")

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As ``nn.Module.zero_grad``; main gradients (``set_grad_dtype``) are cleared too."""
        super().zero_grad(set_to_none)
        self.zero_main_grads()

    def param_buffers(self, multiple: int = 1) -> list[torch.Tensor]:
        """Per bucket, the flat buffer of its parameters (the manager's, padded to a multiple of ``multiple``
        elements), each planned parameter made a view of it with its values kept: for an optimizer that updates a
        bucket as one tensor, or all-gathers it in place. The same buffers while the plan and ``multiple`` stand;
        a new plan's are laid out at the next call."""
        buffers, made = self.manager.param_buffers(multiple)
        if made:
            with torch.no_grad():
                for spec, buffer in zip(self.manager.plan.buckets, buffers):
                    for index, offset in zip(spec.param_indices, spec.offsets):
                        p = self._params[index]
                        if p.layout is _STRIDED:  # (a sparse-layout parameter keeps its storage)
                            view = view_like(p, buffer, offset)
                            view.copy_(p.detach())
                            p.data = view
        return buffers

    def main_grad(self, index: int) -> torch.Tensor:
        """Parameter ``index``'s (of :attr:`param_list`) gradient as its bucket holds it: its view of the bucket
        buffer, in the buffer's dtype (the main gradient, with ``set_grad_dtype``)."""
        return self._views[index]

    def _outputs_reached(self) -> None:
        """A backward reached this forward's outputs: the end of that backward finalizes the step.

        Queued here, not at the first gradient: the first gradient may come from a backward nested in
        it (a reentrant checkpoint around the output layer runs one of its own), which ends before the
        outer backward has delivered the gradients of the layers outside the checkpoint.
        """
        self._refuse_training_if_model_changed()  # (where every parameter was replaced, no gradient hook runs)
        if self.optimizer is not None:
            self.optimizer.backward_reaches_outputs()
        self._outputs_reached_at = time.perf_counter()
        if self._end_of_backward_queued or not self.manager.sync_enabled:
            return
        _compat.queue_at_end_of_backward(self._end_of_backward)
        self._end_of_backward_queued = True

    def _end_of_backward(self) -> None:
        """The step ends with a backward that reached parameters (a gradient penalty's autograd.grad may not);
        a second callback of the same backward finds nothing left to do."""
        self._end_of_backward_queued = False
        if self._step_end_owed:
            self._finalize()

    def _contribute(self, index: int, param: torch.Tensor, used: bool = True, grad: Any = None) -> None:
        """Hand ``param.grad`` (``grad``, where the caller read it) to its bucket (as a view, or copied in) and mark
        it ready."""
        manager = self.manager
        if grad is None:
            grad = param.grad
        if not self.gradient_as_bucket_view:
            manager.mark_ready(index, grad, used=used)
            return
        prescaled = False
        if grad.data_ptr() != self._view_addresses[index]:
            view = self._views[index]
            # The usual fresh gradient passes this first test (autograd makes it on its parameter's device: one
            # elsewhere comes of a conversion after wrap, refused at the backward's start); the full checks else.
            if grad.dtype is not view.dtype or grad.stride() != self._view_strides[index]:
                self._check_fresh_gradient(index, grad, view)
            if view.data_ptr() != self._view_addresses[index]:
                raise guards.view_moved_error(self._param_names[index])
            # A fresh gradient (the first step, or after zero_grad(set_to_none=True)): the copy into
            # the bucket also applies the 1/world scale, one pass instead of two, as DDP does.
            if sys.getrefcount(view) > self._view_references_alone and not self._warned_gradient_kept:
                self._warn_gradient_kept(index)
            scale = manager.copy_in_scale
            if scale is None:
                view.copy_(grad)
            else:
                torch.mul(grad, scale, out=view)
                prescaled = True
            param.grad = view  # from now on autograd accumulates straight into the bucket
        manager.mark_ready(index, prescaled=prescaled, used=used)

    def _check_fresh_gradient(self, index: int, grad: torch.Tensor, view: torch.Tensor) -> None:
        """A fresh gradient that is not laid out as its bucket view: refused where copying it in would be wrong."""
        if (grad.dtype, grad.device) != (view.dtype, view.device):  # copy_ would cast it silently
            self.manager.check_gradient(index, grad)
        if not guards.same_memory_order(grad, view):  # autograd lays a fresh gradient out as its parameter
            raise guards.relaid_out_error(self._param_names[index], grad, view)

    def _warn_gradient_kept(self, index: int) -> None:
        """Once: a gradient the loop kept across zero_grad(set_to_none=True) is about to be overwritten."""
        self._warned_gradient_kept = True
        warnings.warn(guards.gradient_kept_warning(self._param_names[index]), stacklevel=2)

    def _finalize(self) -> None:
        self._step_end_owed = False
        self._check_requires_grad_unchanged()
        if self.manager.find_unused_parameters:
            self._contribute_kept_gradients()
        # With a DistributedOptimizer the step ends bucket by bucket (finish_bucket), as updates need them.
        self.manager.finalize(defer=self.optimizer is not None and self.optimizer.defers)
        self.owned_gradients.forget()
        if self.manager.deferred_pending or self._owns_reduced_gradients():
            self.owned_gradients.note(range(len(self.manager.plan.buckets)))
        if self.manager.deferred_pending:
            # (where that finishes every bucket, the last finish_bucket ran _after_step; the settling then
            # waits for the next forward's end, a point every rank shares)
            self.optimizer.backward_ended()
        else:
            self._after_step()
            self._settle(forward_ended=False)

    def _let_go_of_groups(self) -> None:
        """co.shutdown(): the masks' and the buffers' groups let go of, so that destroying them joins their worker
        threads now."""
        self.manager.row_sparse = None
        self._buffer_group = None
        self.manager.alignment = None  # its host group (beside NCCL/HCCL) goes too: no step after shutdown

    def _after_step(self) -> None:
        """Once every bucket of a synchronised step is finished (local work only)."""
        self._give_unused_their_gradient()
        if self.check_finite and self.optimizer is None:  # a DistributedOptimizer checks before it updates
            self._nonfinite.note_step()

    def _settle(self, forward_ended: bool = True) -> None:
        """What a finished step left that needs collectives, at a point every rank shares: rebuild, auto-tune.

        ``forward_ended``: False at the end of a backward that finished every bucket (the optimizer's trial
        and forward timing count from forward ends only)."""
        self.manager.settle_deferred()
        if self._auto_tune_at is not None and self.manager.steps_synced >= self._auto_tune_at:
            self._auto_tune()
        if self.optimizer is not None:
            self.optimizer.on_settle(forward_ended)

    def finish_bucket(self, bucket_index: int) -> list[int]:
        """Finish one bucket of a deferred step; the indices of its parameters (their gradients now final)."""
        members = list(self.manager.plan.buckets[bucket_index].param_indices)
        self.owned_gradients.check_untouched([bucket_index], sharded=getattr(self.optimizer, "shards", False))
        self.manager.wait_bucket(bucket_index)
        if self._owns_reduced_gradients():
            self.owned_gradients.note([bucket_index])
        self._give_unused_their_gradient(members)
        if not self.manager.deferred_pending:
            self._after_step()
        return members

    # -- gradients a DistributedOptimizer owns between backward and its update -------------------
    def _owns_reduced_gradients(self) -> bool:
        """True where the optimizer owns gradients after their reduction too: sharded, ``p.grad`` is averaged
        only in this rank's shard until the optimizer binds it (unsharded, reduced gradients are final)."""
        return self.optimizer is not None and self.optimizer.shards

    def _owns_any(self, optimizer: torch.optim.Optimizer) -> bool:
        """True if ``optimizer`` (any torch optimizer) holds a parameter of this model."""
        optimized = getattr(optimizer, "model", None)
        if isinstance(optimized, DistributedDataParallel):  # a DistributedOptimizer trains its own model's only
            return optimized is self  # (and reading its param_groups before its step would finish its reductions)
        owned = {id(p) for p in self._params}
        return any(id(p) in owned for group in optimizer.param_groups for p in group["params"])

    @property
    def optimizer(self) -> UpdateParticipant | None:
        """The DistributedOptimizer attached to this model, if any."""
        return self._optimizer_ref() if self._optimizer_ref is not None else None

    # -- what an attached optimizer reads of the model ------------------------------------------------------
    @property
    def param_list(self) -> list[torch.Tensor]:
        """The parameters that train, in the order the bucket plan's indices name them."""
        return self._params

    @property
    def param_names(self) -> list[str]:
        """The names of :attr:`param_list`, in the same order."""
        return self._param_names

    @property
    def joined(self) -> bool:
        """True inside ``model.join()`` (a rank out of data shadows its peers' steps without forwards)."""
        return self._join_config.enable

    def attach_optimizer(self, optimizer: UpdateParticipant) -> None:
        """Called by DistributedOptimizer: its updates follow this model's buckets (one optimizer per model)."""
        self.refuse_second_optimizer(optimizer)
        self._optimizer_ref = weakref.ref(optimizer)
        # The next forward's buffer broadcast must not queue behind the reductions still in flight on the model's
        # group (a transport runs a group's collectives in issue order): with BatchNorm it made every forward wait
        # for the whole last backward's reduction. A group of its own (made here, on every rank).
        has_buffers = any(True for _ in self.module.buffers())
        if self._buffer_group is None and self.broadcast_buffers and self.engine.world_size > 1 and has_buffers:
            self._buffer_group = self.engine.new_group()
            runtime.finish_in_flight_before_leaving(self._let_go_of_groups)

    def refuse_second_optimizer(self, optimizer: UpdateParticipant) -> None:
        """Raise where another DistributedOptimizer trains this model already."""
        if self.optimizer is not None and self.optimizer is not optimizer:
            raise ValueError(
                "this model already has a DistributedOptimizer; use that one (one per model: a second one would "
                "update parameters of buckets whose updates the first still owes). For two optimizer classes over "
                "parts of the model (e.g. Muon for the matrices, AdamW for the rest) give both to one: "
                "DistributedOptimizer(model, [torch.optim.Muon(matrices, ...), torch.optim.AdamW(rest, ...)])"
            )

    def _check_requires_grad_unchanged(self) -> None:
        """The plan holds the parameters trainable at wrap time: one frozen or unfrozen since is refused (a
        frozen one added since passes: nothing to average). The model is walked only where something may have
        changed (a registration on it since wrap, a planned parameter frozen, a frozen one unfrozen)."""
        if self._planned.trainable_unchanged():
            return
        error = requires_grad_change_error(self.module, self._planned.ids, self._param_names, self._params)
        if error is not None:
            self.manager.abort_iteration()
            raise error

    def _contribute_kept_gradients(self) -> None:
        """A parameter this step did not use still contributes the gradient it holds, as in DDP.

        That is its gradient accumulated under no_sync() (used in earlier micro-steps), or zeros
        after ``zero_grad(set_to_none=False)``; parameters without a gradient contribute zeros.
        """
        manager = self.manager
        for i, p in enumerate(self._params):
            if p.grad is not None and not manager.is_marked(i):
                self._contribute(i, p, used=False)

    def _auto_tune(self) -> None:
        """Online mode: simulate every candidate on the step just profiled; rank 0's choice for all."""
        self._auto_tune_at = None
        tuned = choose_online(self.manager, self.engine, self.engine.device.type, self._overlapped_steps)
        self.auto_tune_contention, self.auto_tune_overlapped = tuned.contention, tuned.overlapped
        self.set_bucket_size(tuned.bucket_size_mb, tuned.first_bucket_mb)
        self.auto_tune_report = tuned.predictions

    def _overlapped_steps(self, predictions: list, cost: Any, contention: float) -> dict[tuple[float, float], float]:
        """The attached optimizer's simulated steps for each candidate (:func:`online_tune.overlapped_steps`)."""
        return overlapped_steps(self.optimizer, self.manager.plan, predictions, cost, contention)

    def nonfinite_gradient_names(self) -> list[str]:
        """The parameters whose gradient holds a NaN or Inf (after the reduction: the same on every rank)."""
        names = self._nonfinite.names()
        if self._main_grads:  # (their gradients are the buffers' views, no p.grad)
            views = zip(self._param_names, self._views, self._adds_in)
            names += [name for name, view, adds_in in views if adds_in and not bool(torch.isfinite(view).all())]
        return names

    def take_nonfinite_origin(self) -> str:
        """With ``check_finite``: the parameters whose gradient was not finite on this rank before the reduction
        (where a NaN came from), as a clause of an error message, "" where none; forgotten once taken."""
        return self._nonfinite.take_origin()

    def _give_unused_their_gradient(self, indices: list[int] | None = None) -> None:
        """A parameter unused here but used elsewhere gets the reduced gradient, as in DDP."""
        if not self.manager.find_unused_parameters:
            return
        unused_everywhere = self.manager.globally_unused
        for i in range(len(self._params)) if indices is None else indices:
            p = self._params[i]
            if p.grad is None and i not in unused_everywhere:
                view = self._views[i]
                p.grad = view if self.gradient_as_bucket_view else view.clone()

    def sync_gradients(self) -> None:
        """Reduce the current gradients now (custom loops, or after accumulating under no_sync()).

        Every rank must call it, outside backward; a parameter without a gradient counts as zero.
        The result equals DDP's for the same accumulation (the last backward outside no_sync()).
        """
        manager = self.manager
        if not self.require_backward_grad_sync:
            raise RuntimeError(
                "sync_gradients() inside no_sync() (require_backward_grad_sync is False): leave the no_sync() "
                "block (or set it True) first"
            )
        if self._main_grads:
            raise RuntimeError(
                "sync_gradients() with main gradients (grad_dtype / master_weights): each gradient is added into "
                "its bucket as it arrives; run the last micro-step's backward outside no_sync(), which reduces "
                "everything accumulated"
            )
        manager.set_sync(True)  # (the last forward may have run inside the block)
        if self._step_end_owed:
            raise RuntimeError(
                "sync_gradients() during backward, or after a backward that raised partway (its step cannot be "
                "resumed: restart the ranks from the last checkpoint): call it after loss.backward() returns"
            )
        for i, p in enumerate(self._params):
            if not manager.is_marked(i):
                used = p.grad is not None
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                self._contribute(i, p, used=used)
        self._finalize()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally; the first backward after the block synchronizes them all.

        As DDP's: it clears ``require_backward_grad_sync`` (which a loop may set itself) for the block, and the
        forward decides: a backward of a forward run inside the block is not reduced."""
        previous = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous

    def named_parameters(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, nn.Parameter]]:
        """As torch's; with a DistributedOptimizer, its work in flight is finished first (reductions waited for,
        owed updates applied), so code that takes the parameters through the model (``model.parameters()``:
        an EMA after ``step()``, ``clip_grad_norm_`` after ``backward()`` unsharded, ``model.zero_grad()``) sees
        final values, as under DDP. (That step loses its overlap with the next forward.) No collective: a loop
        may call it on one rank only (sharded gradients: ``opt.gather_gradients()`` on every rank)."""
        optimizer = self.optimizer
        if optimizer is not None and optimizer.in_flight and not torch.compiler.is_compiling():
            optimizer.synchronize()
        if _compat.called_by_torch_dcp():
            # torch.distributed.checkpoint names optimizer state by these; it drops torch DDP's "module." prefix
            # only: without ours too, the checkpoints' optimizer entries would not match the model's keys
            return self.module.named_parameters(*args, **kwargs)
        return super().named_parameters(*args, **kwargs)

    def _fqn_modifiers(self) -> dict[str, str]:
        """For torch.distributed.checkpoint (its hook for modules whose state-dict keys skip a level): the names
        under the wrapped model are the model's own, as this wrapper's state_dict() keys are, not ``module.*``."""
        inner = self.module
        return {name: "module" for name in _compat.direct_member_names(inner)}

    def _apply(self, fn: Any, recurse: bool = True) -> DistributedDataParallel:
        """``model.to(...)``, ``.half()``, ``.double()``, ``.cuda()``. One that changes a parameter's dtype,
        device, memory layout or storage leaves the model usable for evaluation and saving (``model.cpu()``
        at the end of training), but not for training: the gradient buckets (and, sharded, the parameters'
        shard buffers) were laid out for the parameters as wrap() found them, and gradients would be averaged
        from stale or reordered elements, the ranks parting silently. The next backward raises at its first
        gradient, before any collective (:meth:`_refuse_training_if_model_changed`). A conversion that changes
        nothing passes."""
        before = [guards.storage_layout(p) for p in self._params]
        result = super()._apply(fn, recurse)
        changed = guards.converted_names(self.module, self._param_names, self._params, before)
        if changed and self._converted_after_wrap is None:
            self._converted_after_wrap = names_text(changed, 3)
        return result

    def _refuse_training_if_model_changed(self) -> None:
        """A backward (at the outputs or the first gradient) after the model changed under the plan since wrap()
        (converted, or given trainable parameters the plan does not hold): refused, before any collective."""
        self._planned.refuse_training_if_added()
        if self._converted_after_wrap is not None:
            raise converted_error(self._converted_after_wrap)

    # -- forward -----------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._input_device is not None:  # device_ids given: inputs moved onto the model's device, as by DDP
            args, kwargs = inputs_to(self._input_device, args, kwargs)
        if torch.compiler.is_compiling():  # (eager calls never touch dynamo: importing it made exits abort)
            # Under torch.compile the module's forward is the graph; what comes before and after it runs as
            # Python, not traced (dynamo inlined the optimizer's per-module hooks: 34 graphs for a 3-layer MLP).
            start_compiled_forward(self)
            with compiled_as_ddp(self):
                output = self.module(*args, **kwargs)
            end_compiled_forward(self)
            return output
        self._start_forward()
        output = self.module(*args, **kwargs)
        self._end_forward()
        if torch.is_grad_enabled():
            this = weakref.ref(self)  # an output kept by the caller must not keep the wrapper alive
            for tensor in output_tensors(output):
                if tensor.requires_grad:
                    tensor.register_hook(functools.partial(outputs_reached, this))
        return output

    def _start_forward(self, compiled: bool = False) -> None:
        # A backward that raised after reaching the outputs never ran its end (autograd drops the callbacks of
        # a failed backward): the next one queues its own. (A forward inside backward, recomputing a checkpoint,
        # may have a second queued: _end_of_backward finalizes once.)
        self._end_of_backward_queued = False
        if compiled and self.optimizer is not None:
            self.optimizer.compiled_forward_starts()
        self._nonfinite.raise_if_applied()
        if self.manager.in_progress:
            raise RuntimeError(
                "forward() called while the previous backward's reduction is unfinished: that backward raised after "
                "some buckets were sent (its step cannot be resumed on any rank: restart the ranks from the last "
                "checkpoint), or a custom loop skipped the end of backward (call model.sync_gradients() after it)"
            )
        Join.notify_join_context(self)  # inside join(): "still active", before this step's collectives
        self._before_forward_collectives(active=True)

    def _end_forward(self) -> None:
        # As DDP's _post_forward: a forward under autograd decides whether its backward reduces, and whether the
        # next forward broadcasts the buffers (not after an evaluation forward, nor one inside no_sync())
        syncs = torch.is_grad_enabled() and self.require_backward_grad_sync
        if torch.is_grad_enabled():
            self.manager.set_sync(syncs)
        self.require_forward_param_sync = syncs
        if self.optimizer is not None and self.optimizer.in_flight:
            # Buckets of parameters this forward did not use: finished now, before any backward can touch them.
            self.optimizer.synchronize()
        if not (self.module.training and torch.is_grad_enabled()):
            # An evaluation may run on one rank alone (nanoGPT evaluates on rank 0, Lightning's sanity check on
            # whichever): it settles nothing, since settling may issue collectives. The next training forward does.
            return
        self._settle()  # the end of a training forward: the same point on every rank, whatever ended the last step
        if self.manager.alignment is not None:
            # a forward a backward may follow; counted once it completed: one that raised (a refused step's
            # error, met in its first wait) is run again or skipped by the loop, and must not count twice
            self.manager.alignment.count_forward()

    def _before_forward_collectives(self, active: bool) -> None:
        """join()'s count of active ranks, then rank 0's buffers (running statistics) to every rank, when DDP sends
        them: where the forward before ran under autograd outside no_sync() (``require_forward_param_sync``), so
        once per accumulated step and before the first of a run of evaluation forwards (inside ``join()``: the
        highest active rank's, :func:`sync_buffers`). Bounded by the stall timeout, as a bucket's wait."""
        with agreeing(self.manager, "the collectives before a forward (join()'s count, the buffers' broadcast)"):
            self._count_active_ranks(active)
            if self.require_forward_param_sync and self.broadcast_buffers and self.engine.world_size > 1:
                sync_buffers(self.engine, self.module, active, self._join_config.enable, self._buffer_group)

    def register_comm_hook(self, state: Any, hook: DDPCommHook) -> None:
        """As DDP's: ``hook(state, bucket)`` reduces each bucket and returns a ``torch.futures.Future`` of the
        reduced flat buffer (it averages itself, as under DDP). torch's own hooks work, e.g.
        ``model.register_comm_hook(None, torch.distributed.algorithms.ddp_comm_hooks.default_hooks.fp16_compress_hook)``
        (tested with fp16_compress_hook and allreduce_hook). For PowerSGD use ``compression=co.PowerSGD(...)``:
        torch's ``powerSGD_hook`` launches its later allreduces from completion callbacks, where on Gloo they can
        cross another bucket's between ranks. Once, before the first backward, as with DDP."""
        manager = self.manager
        if manager.steps_synced or manager.in_progress or manager.deferred_pending:
            raise RuntimeError("register_comm_hook() must be called before the first backward, as with DDP")
        if self.compression or manager.comm_hook is not allreduce_hook:
            raise RuntimeError(
                "this model already has a comm hook (wrap's comm_hook= or compression=, or an earlier "
                "register_comm_hook()): one per model, as with DDP"
            )
        if self.optimizer is not None and self.optimizer.shards:
            raise ValueError(
                "shard=True reduce-scatters gradients with its own hook: a DDP comm hook cannot replace it"
            )
        manager.set_comm_hook(
            ddp_comm_hook(
                state, hook, lambda indices: [self._params[i] for i in indices], lambda: len(manager.plan.buckets)
            )
        )

    # -- uneven inputs (torch.distributed.algorithms.Join) ---------------------------------
    def join(
        self, divide_by_initial_world_size: bool = True, enable: bool = True, throw_on_early_termination: bool = False
    ) -> Join:
        """``with model.join():`` ranks with fewer batches shadow the others' collectives until all are done
        (:func:`join_context`, as DDP's ``join()``)."""
        return join_context(self, divide_by_initial_world_size, enable, throw_on_early_termination)

    def join_hook(self, **kwargs: Any) -> JoinHook:
        """For ``Join([model, ...], divide_by_initial_world_size=...)``, as DDP's."""
        self._divide_by_initial_world_size = kwargs.get("divide_by_initial_world_size", True)
        return ShadowingHook(self)

    def _count_active_ranks(self, active: bool) -> None:
        """Inside join(divide_by_initial_world_size=False): one small collective per step (joined ranks add 0,
        as DDP's forward does), so the step averages over the ranks still active. Sharded, two more give the
        joined ranks the optimizer settings their active peers step with."""
        if self._join_config.enable and not self._divide_by_initial_world_size:
            count = int(self.engine.reduce_floats([1.0 if active else 0.0], "sum")[0])
            if active:
                self.manager.set_divisor(count)
        if self._join_config.enable and self.optimizer is not None:
            self.optimizer.settings_while_joined(active)  # (unsharded: nothing)

    @property
    def join_device(self) -> torch.device:
        return self.engine.device

    @property
    def join_process_group(self) -> Any:
        return torch.distributed.group.WORLD

    def _shadow_iteration(self) -> None:
        """One step of a rank that has run out of data: the collectives its active peers issue, with zeros.

        In the order an active rank issues them: step count, buffers, what the end of its forward
        settles (rebuild, auto-tune), then the step's reductions.
        """
        self._before_forward_collectives(active=False)
        self.require_forward_param_sync = True  # as DDP's joined rank: the step it shadows reduces
        self.finish_owed_updates()  # this rank's own last step, if a DistributedOptimizer deferred it
        self._settle()
        self.manager.shadow_step()
        if self.optimizer is not None and self.optimizer.shards:
            self.optimizer.step_while_joined()  # it still owns shards: updated and all-gathered, as its peers expect
        self._after_step()

    def finish_owed_updates(self) -> None:
        if self.optimizer is not None and self.optimizer.in_flight:
            self.optimizer.synchronize()

    def _sync_final_model(self, is_last_joiner: bool) -> None:
        """After join: every rank takes the parameters and buffers of (the highest) rank that joined last."""
        self.manager.set_divisor(None)
        self.finish_owed_updates()  # the last joiner's last step: its parameters are the ones broadcast
        if self.engine.world_size == 1:
            return
        self._broadcast_model(src=highest_rank_where(self.engine, is_last_joiner))

    # -- the unwrapped model's face ---------------------------------------------------
    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            module = self._modules.get("module")
            if module is None:
                raise
            return getattr(module, name)

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        self.finish_owed_updates()  # updates still owed by a DistributedOptimizer land first
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        return self.module.load_state_dict(state_dict, strict=strict, assign=assign)

    @property
    def bucket_bytes_cap(self) -> int:
        """The bucket size in bytes, which torch.compile's graph splitting reads as it does from DDP.

        Never below DDP's first bucket (1 MiB), which that splitting insists on: smaller buckets
        then share pieces (coarser overlap), rather than making compilation fail.
        """
        floor = _compat.ddp_first_bucket_bytes()
        return max(int(self.manager.plan.bucket_size_mb * 2**20), floor)

    def extra_repr(self) -> str:
        plan = self.manager.plan
        return f"buckets={len(plan.buckets)}, bucket_size_mb={plan.bucket_size_mb:g}, backend={self.engine.backend}"


# -- the forward under torch.compile: what runs around the compiled graph (not traced), and the graph split at
# bucket boundaries as torch's DDP has it ------------------------------------------------------------------------
@disable_dynamo
def start_compiled_forward(model: DistributedDataParallel) -> None:
    model._start_forward(compiled=True)


@disable_dynamo
def end_compiled_forward(model: DistributedDataParallel) -> None:
    model._end_forward()


@contextlib.contextmanager
@disable_dynamo(recursive=False)
def compiled_as_ddp(model: DistributedDataParallel) -> Iterator[None]:
    """Under ``torch.compile``, have the module's graph split at bucket boundaries as DDP's is.

    Dynamo splits a compiled graph into bucket-sized pieces (its DDPOptimizer) while torch's DDP
    marks itself active around its module's forward; without the split the compiled backward
    is one piece that hands every gradient over at its end, and no bucket overlaps it. The
    same marker, with this model's bucket size, gives collective_ops' buckets the same pieces.
    Skipped where this torch has no such marker.
    """
    ddp = nn.parallel.DistributedDataParallel
    if not hasattr(ddp, DDP_ACTIVE_MARKER):
        yield
        return
    previous = getattr(ddp, DDP_ACTIVE_MARKER)
    setattr(ddp, DDP_ACTIVE_MARKER, model)
    try:
        yield
    finally:
        setattr(ddp, DDP_ACTIVE_MARKER, previous)


# -- uneven inputs (torch.distributed.algorithms.Join): the hook a joined rank runs, shadowing its active peers'
# collectives with zeros until every rank has joined, then taking the final model of the rank that joined last -----
class ShadowingHook(JoinHook):
    """The wrapper's join hook: each shadowed step (``main_hook``), then the final model (``post_hook``)."""

    def __init__(self, model: DistributedDataParallel) -> None:
        self.model = model

    def main_hook(self) -> None:
        self.model._shadow_iteration()

    def post_hook(self, is_last_joiner: bool) -> None:
        self.model._sync_final_model(is_last_joiner)


def join_context(
    model: DistributedDataParallel, divide_by_initial_world_size: bool, enable: bool, throw_on_early_termination: bool
) -> Join:
    """``with model.join():`` ranks with fewer batches shadow the others' collectives until all are done.

    As DDP's ``join()``: gradients of the steps some ranks sit out are divided by the initial
    world size (with ``divide_by_initial_world_size=False``: by the ranks still active, agreed
    on by one small collective per step); a joined rank contributes zeros; at the end every
    rank gets the parameters and buffers of a rank that joined last. ``Join([model])`` works
    the same.
    """
    return Join(
        [model],
        enable=enable,
        throw_on_early_termination=throw_on_early_termination,
        divide_by_initial_world_size=divide_by_initial_world_size,
    )


def release_process_hooks() -> None:
    """The process-wide hooks the wrappers share, removed from torch's global tables."""
    stop_watching_optimizer_steps()
    stop_watching()


def release_process_hooks_if_unused() -> None:
    """A wrapper was collected: with none left, torch's global tables are as before the first wrap."""
    if not live_wrappers():
        release_process_hooks()


def wrap(model: nn.Module, bucket_size_mb: float | str = DEFAULT_BUCKET_MB, **options: Any) -> DistributedDataParallel:
    """``DistributedDataParallel(model, bucket_size_mb, **options)``."""
    return DistributedDataParallel(model, bucket_size_mb, **options)


__all__ = ["DistributedDataParallel", "view_like", "wrap"]  # (view_like: the sharded optimizer's too)
