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

import collections
import contextlib
import dataclasses
import functools
import logging
import os
import sys
import time
import warnings
import weakref
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.algorithms.join import Join, Joinable, JoinHook, _JoinConfig
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from .. import runtime, tracing
from ..bucketing import (
    BucketManager,
    BucketPlan,
    CommHook,
    ParamSpec,
    RowSparseReduction,
    fused_collective,
    plan_buckets,
    validate_bucket_mb,
)
from ..bucketing.compression import PowerSGD
from ..bucketing.hooks import allreduce_hook, reduces_rows
from ..comm.torch_engine import TorchEngine, dtype_name
from ..consistency import check_same_on_all_ranks, options_entry, plan_entry
from ..options import names_text, resolve_options
from .ddp_hooks import DDPCommHook, ddp_comm_hook
from .ddp_keywords import check_flags, check_process_group, input_device, inputs_to
from .inplace import InPlaceGuard
from .model_watch import PlannedParameters, watch

logger = logging.getLogger("collective_ops")

# torch.distributed.checkpoint's get/set_state_dict() (and their model/optimizer halves): they map optimizer state
# to names through the model's named_parameters() and the optimizer's param_groups
TORCH_DCP_MODULE = "torch.distributed.checkpoint.state_dict"
BROADCAST_BUCKET_MB = 250.0  # as DDP: parameters and buffers are broadcast in large fused chunks
# model -> its live wrapper (weakly, both ways): wrapping a model twice would reduce its gradients twice.
_LIVE_WRAPPERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _storage_layout(p: torch.Tensor) -> tuple:
    """What a parameter's bucket and shard views were built for: dtype, device, strides, storage."""
    return p.dtype, p.device, p.stride(), p.data_ptr()


def called_by_torch_dcp() -> bool:
    """Whether the function that calls this was called from torch.distributed.checkpoint's state-dict module
    (:data:`TORCH_DCP_MODULE`): what it reads (parameter names, optimizer groups) it reads for checkpoints."""
    return sys._getframe(2).f_globals.get("__name__") == TORCH_DCP_MODULE


def _same_memory_order(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors of one shape lay out their elements alike (strides of size-1 dims say nothing)."""
    return all(size == 1 or x == y for size, x, y in zip(a.shape, a.stride(), b.stride()))


class DistributedDataParallel(nn.Module, Joinable):
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

    def __init__(
        self,
        module: nn.Module,
        bucket_size_mb: float | str = 25.0,
        *,
        first_bucket_mb: float = 1.0,
        reduce_op: str = "avg",
        gradient_as_bucket_view: bool = True,
        find_unused_parameters: bool = False,
        compression: str | PowerSGD | None = None,
        comm_hook: CommHook | None = None,
        broadcast_buffers: bool = True,
        rebuild_buckets: bool = True,
        check_finite: bool = False,
        trace: bool | None = None,
        auto_tune_step: int = 2,
        row_sparse_embeddings: bool | str = "auto",
        check_step_alignment: bool = True,
        device_ids: Sequence[int | torch.device] | None = None,
        output_device: int | torch.device | None = None,
        dim: int = 0,
        init_sync: bool = True,
        process_group: Any = None,
        static_graph: bool = False,
        check_reduction: bool = False,
    ) -> None:
        super().__init__()
        self._join_config = _JoinConfig.construct_disabled_join_config()  # Joinable: off outside join()
        self._divide_by_initial_world_size = True
        self._auto_tune_at, bucket_size_mb = _auto_tune_start(bucket_size_mb, auto_tune_step)
        _refuse_unwrappable(module)
        bucket_size_mb, first_bucket_mb, reduce_op, hook = resolve_options(
            bucket_size_mb, first_bucket_mb, reduce_op, compression, comm_hook
        )
        if hasattr(hook, "bind_shapes") and reduce_op != "avg":
            raise ValueError(
                f"compression={compression!r} averages gradients: it needs reduce_op='avg', got {reduce_op!r}"
            )
        self.auto_tune_report = None
        # with a DistributedOptimizer planning its order: (size, first bucket) -> simulated overlapped step
        self.auto_tune_overlapped: dict[tuple[float, float], float] = {}
        # what the online tune charged overlapped communication (tuning.estimated_contention)
        self.auto_tune_contention = 0.0

        if not runtime.is_initialized("torch"):
            runtime.init(framework="torch")
        self.engine: TorchEngine = runtime.get_engine("torch")
        self.module = module
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.broadcast_buffers = broadcast_buffers
        # DDP's public switches, read at each forward as DDP reads them: no_sync() clears the first (loops such
        # as nanoGPT's set it directly); the second is set at the end of each forward and decides whether the
        # next one broadcasts the buffers
        self.require_backward_grad_sync = True
        self.require_forward_param_sync = True
        self.check_finite = check_finite
        self.compression = compression

        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError("the model has no trainable parameters (requires_grad=True): nothing to synchronize")
        _refuse_unsupported(module, named)
        self._params = [p for _, p in named]
        self._param_names = [n for n, _ in named]
        # DDP's keywords, for code ported from it: static_graph and check_reduction ask nothing of the buckets (a
        # model whose graph changes trains either way), dim matters only to the multi-device DDP of old
        check_flags(dim=dim, init_sync=init_sync, static_graph=static_graph, check_reduction=check_reduction)
        check_process_group(process_group, self.engine.world_size)
        self._input_device = input_device(self._params, device_ids, output_device)

        # the built-in reductions send rows (a custom comm_hook reduces the whole bucket)
        tables = _row_sparse_tables(module, named, row_sparse_embeddings, self.engine) if reduces_rows(hook) else {}
        plan = _plan(named, tables, bucket_size_mb, first_bucket_mb)
        # the options that decide which collectives a step issues: a rank that differs would pair them wrongly
        options = {
            "find_unused_parameters": find_unused_parameters,
            "check_step_alignment": check_step_alignment,
            "broadcast_buffers": broadcast_buffers,
            "rebuild_buckets": rebuild_buckets,
            "check_finite": check_finite,
            "bucket_size_mb auto": self._auto_tune_at,
            "reduce_op": reduce_op,
            "compression": compression if compression is None or isinstance(compression, str) else repr(compression),
            "comm_hook": comm_hook,
            "init_sync": init_sync,
        }
        self._verify_and_broadcast(plan, options_entry(options), init_sync)
        if hasattr(hook, "bind_shapes"):  # a compression that works on each gradient's matrix (PowerSGD)
            hook.bind_shapes([tuple(p.shape) for p in self._params])
        self.manager = BucketManager(
            plan,
            self.engine,
            reduce_op=reduce_op,
            comm_hook=hook,
            find_unused_parameters=find_unused_parameters,
            rebuild_after_first_step=rebuild_buckets,
            on_rebuild=self._on_rebuild,
            observer=tracing.start(self.engine) if trace else tracing.get_tracer(),
            check_step_alignment=check_step_alignment,
        )
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
        self._nonfinite_local: list[str] = []
        # Each bucket's gradient tensors while a DistributedOptimizer owns them, from the end of backward until
        # it has consumed them, against in-place changes by other code (check_gradients_untouched).
        self._gradients_guard = InPlaceGuard()
        self._warned_local_step = False  # a plain optimizer stepped on gradients never averaged: warned once
        self._warned_gradient_kept = False  # a kept p.grad about to be overwritten by its bucket: warned once
        # (parameters whose reduced gradient was not finite, origin note): judged at the next forward
        self._nonfinite_pending: tuple[list[str], str] | None = None

    def _install_hooks(self, tables: dict[str, nn.Module]) -> None:
        """Each parameter's gradient hook (holding the wrapper weakly: deleting it detaches them and frees its
        buffers), the row-sparse tables' lookup hooks, and the watch on the model's later changes."""
        _watch_optimizer_steps()
        this = weakref.ref(self)
        self._hook_handles = [
            p.register_post_accumulate_grad_hook(_weak_hook(this, i)) for i, p in enumerate(self._params)
        ]
        if tables:  # each forward's looked-up rows recorded, so the masks need not wait for the gradient
            self._hook_handles += _record_lookups(tables, self.manager.row_sparse)
        weakref.finalize(self, _remove_all, self._hook_handles)
        _LIVE_WRAPPERS[self.module] = this
        self._planned = PlannedParameters(self._params)  # (watched while this wrapper lives)
        watch(self.module, self._planned)

    def _verify_and_broadcast(self, plan: BucketPlan, options: tuple, broadcast: bool = True) -> None:
        """Every rank must hold the same model, plan the same buckets and pass the same collective-deciding
        options (an entry), or none starts training; then rank 0's weights are every rank's (``broadcast``; DDP's
        ``init_sync=False`` leaves each rank its own, where the caller made them equal)."""
        signature = [
            ("parameter", n, {"shape": list(p.shape), "dtype": dtype_name(p.dtype), "requires_grad": p.requires_grad})
            for n, p in self.module.named_parameters()
        ]
        signature += [
            ("buffer", n, {"shape": list(b.shape), "dtype": dtype_name(b.dtype)})
            for n, b in self.module.named_buffers()
        ]
        signature += [plan_entry(plan), options]
        check_same_on_all_ranks(signature, self.engine.allgather_bytes)
        if broadcast and self.engine.world_size > 1:
            self._broadcast_model(src=0)

    def _broadcast_model(self, src: int) -> None:
        """Rank ``src``'s parameters and buffers to every rank (at wrap, and after join)."""
        with torch.no_grad():
            self._broadcast([p.detach() for p in self.module.parameters()] + list(self.module.buffers()), src)

    def _highest_rank_where(self, condition: bool) -> int:
        """The highest rank for which ``condition`` holds (-1 if none): one small collective every rank joins."""
        return int(self.engine.reduce_floats([self.engine.rank if condition else -1], "max")[0])

    def _broadcast(self, tensors: list[torch.Tensor], src: int = 0, group: Any = None) -> None:
        handle, _ = fused_collective(
            self.engine,
            tensors,
            BROADCAST_BUCKET_MB,
            lambda buffer: self.engine.broadcast(buffer, src, async_op=True, group=group),
        )
        handle.wait()

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
        # References to a view held by this list and one local name alone (as _contribute counts): more, and a
        # p.grad from before zero_grad(set_to_none=True) is kept somewhere, which the next backward overwrites.
        probe = self._views[0]
        self._view_references_alone = sys.getrefcount(probe)

    def _on_rebuild(self, plan: BucketPlan) -> None:
        old = self._views
        self._make_views()
        if self.gradient_as_bucket_view:
            for p, old_view, new_view in zip(self._params, old, self._views):
                if p.grad is not None and p.grad.data_ptr() == old_view.data_ptr():
                    p.grad = new_view  # the manager already moved the values
        del old  # (the old gradient buffers go before the optimizer lays its own out anew)
        logger.info("collective_ops: new bucket plan:\n%s", plan.describe())  # rebuild or set_bucket_size
        if self.optimizer is not None:
            self.optimizer.on_plan_change(plan)

    # -- backward --------------------------------------------------------------------
    def _grad_ready(self, index: int, param: torch.Tensor) -> None:
        """Runs in the autograd engine once ``param``'s gradient is fully accumulated."""
        manager = self.manager
        optimizer = self.optimizer
        if optimizer is not None and optimizer.awaits_first_gradient:  # (under no_sync() too)
            optimizer.first_gradient_after_step(param)
        if not manager.sync_enabled:
            manager.mark_ready(index)  # only noted: used while accumulating (the usage map counts it)
            return
        grad = param.grad
        if grad.layout != torch.strided:
            raise ValueError(
                f"parameter {self._param_names[index]!r} received a sparse gradient; collective_ops reduces dense "
                "gradients only: use sparse=False (nn.Embedding/EmbeddingBag) or densify the gradient"
            )
        if self.check_finite and not bool(torch.isfinite(grad).all()):
            # Not raised here: this rank's peers would wait for it. Every rank raises after the reduction.
            self._nonfinite_local.append(self._param_names[index])
        if not self._step_end_owed:  # this backward's first gradient
            self._refuse_training_if_model_changed()
            self.backward_began = self._outputs_reached_at or time.perf_counter()
            self._outputs_reached_at = None
            if self.optimizer is not None:
                self.optimizer.backward_starts(param)
            if not self._end_of_backward_queued:  # a backward that did not pass through the outputs
                torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
            self._step_end_owed = True
        self._contribute(index, param)

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
        torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
        self._end_of_backward_queued = True

    def _end_of_backward(self) -> None:
        """The step ends with a backward that reached parameters (a gradient penalty's autograd.grad may not);
        a second callback of the same backward finds nothing left to do."""
        self._end_of_backward_queued = False
        if self._step_end_owed:
            self._finalize()

    def _contribute(self, index: int, param: torch.Tensor, used: bool = True) -> None:
        """Hand ``param.grad`` to its bucket (as a view, or copied in) and mark it ready."""
        manager = self.manager
        grad = param.grad
        if not self.gradient_as_bucket_view:
            manager.mark_ready(index, grad, used=used)
            return
        view = self._views[index]
        prescaled = False
        if grad.data_ptr() != self._view_addresses[index]:
            if (grad.dtype, grad.device) != (view.dtype, view.device):  # copy_ would cast it silently
                self.manager.check_gradient(index, grad)
            if view.data_ptr() != self._view_addresses[index]:
                raise RuntimeError(
                    f"the gradient view of parameter {self._param_names[index]!r} no longer lies in its bucket: "
                    "the model was converted after wrap() through the inner module (net.to(...) re-points the "
                    "gradients it holds), so its gradients would not be averaged. Cast and move the model before "
                    "wrapping it"
                )
            if not _same_memory_order(grad, view):  # autograd lays a fresh gradient out as its parameter
                raise RuntimeError(
                    f"parameter {self._param_names[index]!r} was re-laid out after wrap() through the inner module "
                    f"(strides {tuple(grad.stride())}, planned {tuple(view.stride())}: net.to(memory_format=...)): "
                    "its gradient view and the bucket rebuild assume the planned layout and would permute its "
                    "averaged gradient. Convert the model before wrapping it: "
                    "co.wrap(net.to(memory_format=torch.channels_last))"
                )
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

    def _warn_gradient_kept(self, index: int) -> None:
        """Once: a gradient the loop kept across zero_grad(set_to_none=True) is about to be overwritten."""
        self._warned_gradient_kept = True
        warnings.warn(
            f"the gradient of {self._param_names[index]!r} from before the last zero_grad(set_to_none=True) is still "
            "referenced (p.grad kept across steps?). With gradient_as_bucket_view=True (the default) it is a view "
            "of its bucket, so this backward overwrites it, where DDP's default (False) would have kept it. Keep "
            "p.grad.clone() instead, or wrap(..., gradient_as_bucket_view=False). (Warned once.)",
            stacklevel=2,
        )

    def _finalize(self) -> None:
        self._step_end_owed = False
        self._check_requires_grad_unchanged()
        if self.manager.find_unused_parameters:
            self._contribute_kept_gradients()
        # With a DistributedOptimizer the step ends bucket by bucket (finish_bucket), as updates need them.
        self.manager.finalize(defer=self.optimizer is not None and self.optimizer.defers)
        self._gradients_guard.clear()
        if self.manager.deferred_pending or self._owns_reduced_gradients():
            self.note_gradients_owned(range(len(self.manager.plan.buckets)))
        if self.manager.deferred_pending:
            # (where that finishes every bucket, the last finish_bucket ran _after_step; the settling then
            # waits for the next forward's end, a point every rank shares)
            self.optimizer.backward_ended()
        else:
            self._after_step()
            self._settle(forward_ended=False)

    @property
    def tune_pending(self) -> bool:
        """True until ``bucket_size_mb="auto"`` has settled on a size (False for a fixed size)."""
        return self._auto_tune_at is not None

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
            self._note_nonfinite()

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
        self.check_gradients_untouched([bucket_index])
        self.manager.wait_bucket(bucket_index)
        if self._owns_reduced_gradients():
            self.note_gradients_owned([bucket_index])
        self._give_unused_their_gradient(members)
        if not self.manager.deferred_pending:
            self._after_step()
        return members

    # -- gradients a DistributedOptimizer owns between backward and its update -------------------
    def _gradient_tensors(self, bucket: int) -> list[torch.Tensor]:
        """What other code changes this bucket's gradients through: its buffer (each ``p.grad`` a view of
        it), and with ``gradient_as_bucket_view=False`` the members' own ``p.grad`` tensors."""
        tensors = [self.manager.buffers[bucket]]
        if not self.gradient_as_bucket_view:
            members = self.manager.plan.buckets[bucket].param_indices
            tensors += [self._params[i].grad for i in members if self._params[i].grad is not None]
        return tensors

    def _owns_reduced_gradients(self) -> bool:
        """True where the optimizer owns gradients after their reduction too: sharded, ``p.grad`` is averaged
        only in this rank's shard until the optimizer binds it (unsharded, reduced gradients are final)."""
        return self.optimizer is not None and self.optimizer.shards

    def note_gradients_owned(self, buckets: Iterable[int]) -> None:
        """These buckets' gradients are the optimizer's until it consumes them: their version counters are
        noted (an in-place change by other code, as ``clip_grad_norm_``'s, moves them)."""
        for bucket in buckets:
            self._gradients_guard.note(bucket, self._gradient_tensors(bucket))

    def forget_gradients_owned(self) -> None:
        """The optimizer handed the gradients to other code (final and the same on every rank): changes are theirs."""
        self._gradients_guard.clear()

    def check_gradients_untouched(self, buckets: Iterable[int]) -> None:
        """Raise where code outside the optimizer changed these buckets' gradients in place since they were
        noted: while their reduction was in flight (it races the reduction), or, sharded, where only this
        rank's shard is averaged. Either way the update would be silently wrong. (A bucket is checked once.)"""
        for bucket in buckets:
            if self._gradients_guard.changed(bucket, self._gradient_tensors(bucket)):
                raise self._changed_gradients_error(bucket)

    def bucket_members_text(self, bucket: int) -> str:
        """The names of a bucket's parameters, for errors: the first five."""
        return names_text([self._param_names[i] for i in self.manager.plan.buckets[bucket].param_indices])

    def _changed_gradients_error(self, bucket: int) -> RuntimeError:
        return RuntimeError(
            f"the gradients of bucket {bucket} ({self.bucket_members_text(bucket)}) were changed in place between "
            "backward() and the DistributedOptimizer's step, while it still owned them: its updates overlap the "
            "reduction with the next forward, so after backward() p.grad is not yet averaged (and with shard=True "
            "never is outside this rank's shard). Take the parameters through the model (model.parameters() "
            "finishes the reductions first; so does opt.param_groups, which scaler.unscale_(opt) reads), or call "
            "opt.finish_reductions() before code that reads or changes gradients between backward() and step(); "
            "with shard=True clip with opt.clip_grad_norm_(max_norm), or call opt.gather_gradients() on every rank "
            "before torch's clips"
        )

    def _owns_any(self, optimizer: torch.optim.Optimizer) -> bool:
        """True if ``optimizer`` (any torch optimizer) holds a parameter of this model."""
        optimized = getattr(optimizer, "model", None)
        if isinstance(optimized, DistributedDataParallel):  # a DistributedOptimizer trains its own model's only
            return optimized is self  # (and reading its param_groups before its step would finish its reductions)
        owned = {id(p) for p in self._params}
        return any(id(p) in owned for group in optimizer.param_groups for p in group["params"])

    @property
    def optimizer(self) -> Any:
        """The DistributedOptimizer attached to this model, if any."""
        return self._optimizer_ref() if self._optimizer_ref is not None else None

    def attach_optimizer(self, optimizer: Any) -> None:
        """Called by DistributedOptimizer: its updates follow this model's buckets (one optimizer per model)."""
        if self.optimizer is not None and self.optimizer is not optimizer:
            raise ValueError(
                "this model already has a DistributedOptimizer; use that one (one per model: a second one would "
                "update parameters of buckets whose updates the first still owes). For two optimizer classes over "
                "parts of the model (e.g. Muon for the matrices, AdamW for the rest) give both to one: "
                "DistributedOptimizer(model, [torch.optim.Muon(matrices, ...), torch.optim.AdamW(rest, ...)])"
            )
        self._optimizer_ref = weakref.ref(optimizer)
        # The next forward's buffer broadcast must not queue behind the reductions still in flight on the model's
        # group (a transport runs a group's collectives in issue order): with BatchNorm it made every forward wait
        # for the whole last backward's reduction. A group of its own (made here, on every rank).
        has_buffers = any(True for _ in self.module.buffers())
        if self._buffer_group is None and self.broadcast_buffers and self.engine.world_size > 1 and has_buffers:
            self._buffer_group = self.engine.new_group()
            runtime.finish_in_flight_before_leaving(self._let_go_of_groups)

    def _check_requires_grad_unchanged(self) -> None:
        """The plan holds the parameters trainable at wrap time: one frozen or unfrozen since is refused (a
        frozen one added since passes: nothing to average)."""
        planned = self._planned.ids
        if {id(p) for p in self.module.parameters() if p.requires_grad} == planned:
            return
        names = [n for n, p in self.module.named_parameters() if (id(p) in planned) != p.requires_grad]
        present = {id(p) for p in self.module.parameters()}
        gone = [self._param_names[i] for i, p in enumerate(self._params) if id(p) not in present]
        self.manager.abort_iteration()
        if gone:  # (a planned parameter replaced by another the plan holds: weights tied after wrap())
            raise RuntimeError(
                f"parameters the bucket plan holds are no longer in the model ({names_text(gone, 5)}): replaced "
                "after wrap() by another parameter (weights tied, model.tie_weights() after resizing embeddings). "
                "Tie or replace parameters before wrapping, as DDP requires, then wrap again (call remove_hooks() "
                "on this wrapper first)."
            )
        raise RuntimeError(
            f"requires_grad changed after wrap() for {names[:10]}: the bucket plan (the same on every rank) was built "
            "from the trainable parameters at wrap time. Freeze or unfreeze parameters before wrapping, then "
            "wrap again (call remove_hooks() on this wrapper first)."
        )

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
        from ..tuning import (
            CANDIDATES_MB,
            FIRST_BUCKET_CANDIDATES_MB,
            BackwardProfile,
            choose,
            estimated_contention,
            measure_alpha_beta,
            predict,
        )

        self._auto_tune_at = None
        stats = self.manager.last_stats
        start = stats.backward_start or 0.0
        profile = BackwardProfile(
            {i: t - start for i, t in stats.ready_times.items()},
            (stats.finalize_start or start) - start,
            0.0,
            self.manager.wire_shares(),
            self.manager.wire_itemsize,
        )
        cost = measure_alpha_beta()  # every rank is here, at the end of the same step
        contention = self.auto_tune_contention = estimated_contention(cost, self.engine.device.type)
        plan = self.manager.plan
        predictions = predict(
            plan.params, profile, cost, CANDIDATES_MB, FIRST_BUCKET_CANDIDATES_MB, plan.order, contention
        )
        self.auto_tune_overlapped = self._overlapped_steps(predictions, cost, contention)
        best = choose(predictions, self.auto_tune_overlapped)  # with updates overlapping the forward: that step
        chosen = self.engine.broadcast_ints([round(best.bucket_size_mb * 1000), round(best.first_bucket_mb * 1000)])
        choice, first = chosen[0] / 1000, chosen[1] / 1000  # rank 0's, on every rank
        self.set_bucket_size(choice, first)
        self.auto_tune_report = predictions
        logger.info(
            "collective_ops: bucket_size_mb='auto' settled on %g MiB, first bucket %g MiB (predicted exposed "
            "communication %.1f ms, %d collectives; alpha=%.1f us, beta=%.3f ns/B, contention %.2f); candidates: %s",
            choice,
            first,
            predictions[0].exposed_comm_s * 1e3,
            predictions[0].collectives,
            cost.alpha * 1e6,
            cost.beta * 1e9,
            contention,
            ", ".join(
                f"{p.bucket_size_mb:g}/{p.first_bucket_mb:g}: {p.exposed_comm_s * 1e3:.1f} ms" for p in predictions
            ),
        )
        if self.auto_tune_overlapped:
            logger.info(
                "collective_ops: chosen by the step simulated with updates overlapping the next forward: %s",
                ", ".join(
                    f"{mb:g}/{first:g}: {s * 1e3:.1f} ms" for (mb, first), s in self.auto_tune_overlapped.items()
                ),
            )

    def _overlapped_steps(self, predictions: list, cost: Any, contention: float) -> dict[tuple[float, float], float]:
        """With a DistributedOptimizer planning its launch order: each candidate's simulated step with its
        best order, keyed by (bucket_size_mb, first_bucket_mb); empty where it has no profile (local work).
        Communication that overlaps compute (all but the forward's waits) slows it by ``contention``."""
        predict_overlapped = getattr(self.optimizer, "predict_overlapped", None)
        if predict_overlapped is None:
            return {}
        plan, steps = self.manager.plan, {}
        for p in predictions:
            candidate = plan_buckets(plan.params, p.bucket_size_mb, p.first_bucket_mb, order=plan.order)
            result = predict_overlapped(candidate, cost)
            if result is None:
                return {}
            hidden = max(p.comm_s - result.forward_wait_s, 0.0)
            steps[(p.bucket_size_mb, p.first_bucket_mb)] = result.step_s + contention * hidden
        return steps

    def set_bucket_size(self, bucket_size_mb: float, first_bucket_mb: float | None = None) -> None:
        """Replan with another bucket size between steps (every rank must call it with the same value)."""
        bucket_size_mb = validate_bucket_mb(bucket_size_mb, "bucket_size_mb")
        if first_bucket_mb is not None:
            first_bucket_mb = validate_bucket_mb(first_bucket_mb, "first_bucket_mb")
        self.manager.replan(bucket_size_mb, first_bucket_mb)

    def _note_nonfinite(self) -> None:
        """Names the parameters whose reduced gradient is NaN/Inf (the same on every rank, through the sum).

        Judged before the next forward, not here: an optimizer may skip this step on purpose
        (``torch.amp.GradScaler`` does on an overflow), and only parameters that became
        non-finite mean training went wrong.
        """
        origin = self.take_nonfinite_origin()
        bad = self.nonfinite_gradient_names()
        self._nonfinite_pending = (bad, origin) if bad else None

    def nonfinite_gradient_names(self) -> list[str]:
        """The parameters whose gradient holds a NaN or Inf (after the reduction: the same on every rank)."""
        return [
            name
            for name, p in zip(self._param_names, self._params)
            if p.grad is not None and not bool(torch.isfinite(p.grad).all())
        ]

    def take_nonfinite_origin(self) -> str:
        """With ``check_finite``: the parameters whose gradient was not finite on this rank before the reduction
        (where a NaN came from), as a clause of an error message, "" where none; forgotten once taken."""
        local, self._nonfinite_local = self._nonfinite_local, []
        return f"; on rank {self.engine.rank} before reduction: {local}" if local else ""

    def _raise_if_parameters_not_finite(self) -> None:
        pending, self._nonfinite_pending = self._nonfinite_pending, None
        if pending is None:
            return
        bad, origin = pending
        by_name = dict(zip(self._param_names, self._params))
        if all(bool(torch.isfinite(by_name[name]).all()) for name in bad):
            logger.debug("non-finite gradients in %s were not applied (the optimizer skipped the step)", bad[:10])
            return
        raise FloatingPointError(
            f"non-finite gradients (NaN or Inf) after reduction in {len(bad)} parameter(s): {bad[:10]}{origin}; "
            "the optimizer applied them and the parameters are no longer finite. Lower the learning rate, use "
            "gradient clipping or loss scaling (torch.amp.GradScaler skips such steps), or check the data of that step."
        )

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
        manager.set_sync(True)  # (the last forward may have run inside the block)
        if self._step_end_owed:
            raise RuntimeError("sync_gradients() during backward: call it after loss.backward() returns")
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
        if called_by_torch_dcp():
            # torch.distributed.checkpoint names optimizer state by these; it drops torch DDP's "module." prefix
            # only: without ours too, the checkpoints' optimizer entries would not match the model's keys
            return self.module.named_parameters(*args, **kwargs)
        return super().named_parameters(*args, **kwargs)

    def _fqn_modifiers(self) -> dict[str, str]:
        """For torch.distributed.checkpoint (its hook for modules whose state-dict keys skip a level): the names
        under the wrapped model are the model's own, as this wrapper's state_dict() keys are, not ``module.*``."""
        inner = self.module
        return {name: "module" for name in (*inner._modules, *inner._parameters, *inner._buffers)}

    def _apply(self, fn: Any, recurse: bool = True) -> DistributedDataParallel:
        """``model.to(...)``, ``.half()``, ``.double()``, ``.cuda()``. One that changes a parameter's dtype,
        device, memory layout or storage leaves the model usable for evaluation and saving (``model.cpu()``
        at the end of training), but not for training: the gradient buckets (and, sharded, the parameters'
        shard buffers) were laid out for the parameters as wrap() found them, and gradients would be averaged
        from stale or reordered elements, the ranks parting silently. The next backward raises at its first
        gradient, before any collective (:meth:`_refuse_training_if_model_changed`). A conversion that changes
        nothing passes."""
        before = [_storage_layout(p) for p in self._params]
        result = super()._apply(fn, recurse)
        now = dict(self.module.named_parameters())  # (torch's overwrite-on-conversion mode makes new ones)
        changed = [
            name
            for name, p, old in zip(self._param_names, self._params, before)
            if now.get(name) is not p or _storage_layout(p) != old
        ]
        if changed and self._converted_after_wrap is None:
            self._converted_after_wrap = names_text(changed, 3)
        return result

    def _refuse_training_if_model_changed(self) -> None:
        """A backward (at the outputs or the first gradient) after the model changed under the plan since wrap()
        (converted, or given trainable parameters the plan does not hold): refused, before any collective."""
        self._planned.refuse_training_if_added()
        if self._converted_after_wrap is not None:
            raise RuntimeError(
                f"the model's parameters were cast, moved or re-laid out after wrap() ({self._converted_after_wrap}"
                "): evaluation and saving work, training does not, since its gradient buckets were planned for "
                "the parameters as they were and would average the wrong elements. Cast and move the model "
                "before wrapping it, as DDP requires: co.wrap(net.to(device, dtype, memory_format=...))"
            )

    # -- forward -----------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._input_device is not None:  # device_ids given: inputs moved onto the model's device, as by DDP
            args, kwargs = inputs_to(self._input_device, args, kwargs)
        if torch.compiler.is_compiling():  # (eager calls never touch dynamo: importing it made exits abort)
            # Under torch.compile the module's forward is the graph; what comes before and after it runs as
            # Python, not traced (dynamo inlined the optimizer's per-module hooks: 34 graphs for a 3-layer MLP).
            _start_compiled_forward(self)
            with _compiled_as_ddp(self):
                output = self.module(*args, **kwargs)
            _end_compiled_forward(self)
            return output
        self._start_forward()
        output = self.module(*args, **kwargs)
        self._end_forward()
        if torch.is_grad_enabled():
            this = weakref.ref(self)  # an output kept by the caller must not keep the wrapper alive
            for tensor in _output_tensors(output):
                if tensor.requires_grad:
                    tensor.register_hook(functools.partial(_outputs_reached, this))
        return output

    def _start_forward(self, compiled: bool = False) -> None:
        # A backward that raised after reaching the outputs never ran its end (autograd drops the callbacks of
        # a failed backward): the next one queues its own. (A forward inside backward, recomputing a checkpoint,
        # may have a second queued: _end_of_backward finalizes once.)
        self._end_of_backward_queued = False
        if compiled and self.optimizer is not None:
            self.optimizer.compiled_forward_starts()
        if self._nonfinite_pending is not None:
            self._raise_if_parameters_not_finite()
        if self.manager.in_progress:
            raise RuntimeError(
                "forward() called while the previous backward's reduction is unfinished; "
                "in a custom loop call sync_gradients() after backward"
            )
        Join.notify_join_context(self)  # inside join(): "still active", before this step's collectives
        self._count_active_ranks(active=True)
        self._sync_buffers(active=True)

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

    def _sync_buffers(self, active: bool) -> None:
        """Rank 0's buffers (running statistics) to every rank before a forward, when DDP does: where the
        forward before it ran under autograd outside no_sync() (``require_forward_param_sync``), so once per
        accumulated step (before its first micro-batch) and before the first of a run of evaluation forwards.

        Inside ``join()`` the source is the highest rank still active (a joined rank's buffers are
        stale), agreed on by one small collective that joined ranks shadow.
        """
        if not (self.require_forward_param_sync and self.broadcast_buffers and self.engine.world_size > 1):
            return
        buffers = list(self.module.buffers())
        if not buffers:
            return
        src = 0
        if self._join_config.enable:
            src = self._highest_rank_where(active)
        with torch.no_grad():
            self._broadcast(buffers, src, self._buffer_group)

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
        """``with model.join():`` ranks with fewer batches shadow the others' collectives until all are done.

        As DDP's ``join()``: gradients of the steps some ranks sit out are divided by the initial
        world size (with ``divide_by_initial_world_size=False``: by the ranks still active, agreed
        on by one small collective per step); a joined rank contributes zeros; at the end every
        rank gets the parameters and buffers of a rank that joined last. ``Join([model])`` works
        the same.
        """
        return Join(
            [self],
            enable=enable,
            throw_on_early_termination=throw_on_early_termination,
            divide_by_initial_world_size=divide_by_initial_world_size,
        )

    def join_hook(self, **kwargs: Any) -> JoinHook:
        """For ``Join([model, ...], divide_by_initial_world_size=...)``, as DDP's."""
        self._divide_by_initial_world_size = kwargs.get("divide_by_initial_world_size", True)
        return _ShadowingHook(self)

    def _count_active_ranks(self, active: bool) -> None:
        """Inside join(divide_by_initial_world_size=False): this step averages over the ranks still active.

        One small collective per step, which ranks that joined shadow with 0 (as DDP's forward does).
        """
        if self._join_config.enable and not self._divide_by_initial_world_size:
            count = int(self.engine.reduce_floats([1.0 if active else 0.0], "sum")[0])
            if active:
                self.manager.set_divisor(count)

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
        self._count_active_ranks(active=False)
        self._sync_buffers(active=False)
        self.require_forward_param_sync = True  # as DDP's joined rank: the step it shadows reduces
        self._finish_owed_updates()  # this rank's own last step, if a DistributedOptimizer deferred it
        self._settle()
        self.manager.shadow_step()
        if getattr(self.optimizer, "shards", False):
            self.optimizer.step_while_joined()  # it still owns shards: updated and all-gathered, as its peers expect
        self._after_step()

    def _finish_owed_updates(self) -> None:
        if self.optimizer is not None and self.optimizer.in_flight:
            self.optimizer.synchronize()

    def _sync_final_model(self, is_last_joiner: bool) -> None:
        """After join: every rank takes the parameters and buffers of (the highest) rank that joined last."""
        self.manager.set_divisor(None)
        self._finish_owed_updates()  # the last joiner's last step: its parameters are the ones broadcast
        if self.engine.world_size == 1:
            return
        self._broadcast_model(src=self._highest_rank_where(is_last_joiner))

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
        if self.optimizer is not None and self.optimizer.in_flight:
            self.optimizer.synchronize()  # updates still owed by a DistributedOptimizer land first
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        return self.module.load_state_dict(state_dict, strict=strict, assign=assign)

    def compression_state_dict(self) -> dict[str, Any]:
        """The compression's state between steps, for a checkpoint beside the model's and the optimizer's:
        with ``compression=co.PowerSGD(...)`` each bucket's error-feedback memory and Q factors, the step
        count and the random state (``{}`` for the stateless compressions)."""
        hook = self.manager.comm_hook
        if not hasattr(hook, "state_dict"):
            return {}
        if self.optimizer is not None and self.optimizer.in_flight:
            self.optimizer.synchronize()  # the step's last buckets land (and their error) before it is read
        return hook.state_dict()

    def load_compression_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`compression_state_dict` (a model wrapped with the same options, before its next step)."""
        hook = self.manager.comm_hook
        if not hasattr(hook, "load_state_dict"):
            if state:
                raise ValueError("this model's compression keeps no state: the checkpoint's is for another one")
            return
        hook.load_state_dict(state, self.engine)

    def remove_hooks(self) -> None:
        """Detach from the model's parameters (the model keeps working unwrapped)."""
        _remove_all(self._hook_handles)

    def comm_stats(self) -> dict[str, Any]:
        """Buckets, collectives and bytes per step, and communication time not hidden behind backward."""
        return {
            "mode": "overlap",
            "backend": self.engine.backend,
            "compression": self.compression,
            **self.manager.stats_summary(),
        }

    @property
    def bucket_bytes_cap(self) -> int:
        """The bucket size in bytes, which torch.compile's graph splitting reads as it does from DDP.

        Never below DDP's first bucket (1 MiB), which that splitting insists on: smaller buckets
        then share pieces (coarser overlap), rather than making compilation fail.
        """
        floor = getattr(torch.distributed, "_DEFAULT_FIRST_BUCKET_BYTES", 0)
        return max(int(self.manager.plan.bucket_size_mb * 2**20), floor)

    def describe_plan(self) -> str:
        return self.manager.plan.describe()

    def extra_repr(self) -> str:
        plan = self.manager.plan
        return f"buckets={len(plan.buckets)}, bucket_size_mb={plan.bucket_size_mb:g}, backend={self.engine.backend}"


def view_like(p: torch.Tensor, buffer: torch.Tensor, offset: int) -> torch.Tensor:
    """A view of ``buffer`` from ``offset`` shaped as ``p``, with ``p``'s strides where ``p`` is dense."""
    strides = torch.empty_like(p, device="meta").stride()
    return buffer.as_strided(p.shape, strides, buffer.storage_offset() + offset)


def _auto_tune_start(bucket_size_mb: float | str, auto_tune_step: int) -> tuple[int | None, float | str]:
    """(the step the online tune profiles, the size to start at): ``"auto"`` starts at 25 MiB, profiles step
    ``auto_tune_step``, then settles on the simulator's choice; a number is kept (no tune)."""
    if not isinstance(bucket_size_mb, str):
        return None, bucket_size_mb
    if bucket_size_mb != "auto":
        raise ValueError(f"bucket_size_mb must be a number of MiB or 'auto', got {bucket_size_mb!r}")
    if auto_tune_step < 1:
        raise ValueError(f"auto_tune_step must be >= 1, got {auto_tune_step}")
    return auto_tune_step, 25.0


def _refuse_unwrappable(module: Any) -> None:
    """A model wrapped already (by us or by torch's DDP), with a live wrapper of ours, or not a Module."""
    if isinstance(module, DistributedDataParallel):
        raise ValueError("this model is already wrapped by collective_ops; wrap the original model once")
    if isinstance(module, nn.parallel.DistributedDataParallel):
        raise ValueError("this model is wrapped by torch DistributedDataParallel; pass its .module instead")
    if not isinstance(module, nn.Module):
        raise TypeError(f"wrap() takes a torch.nn.Module, got {type(module).__name__}")
    previous = _LIVE_WRAPPERS.get(module)
    if previous is not None and previous() is not None and previous()._hook_handles:
        raise ValueError(
            "this model already has a live collective_ops wrapper (its gradients would be reduced twice); "
            "use that wrapper, or call its remove_hooks() (or delete it) before wrapping again"
        )


def _plan(
    named: list[tuple[str, torch.Tensor]], tables: dict[str, nn.Module], bucket_size_mb: float, first_bucket_mb: float
) -> BucketPlan:
    """The trainable parameters planned into buckets (a row-sparse table's rows counted, for its cost)."""
    specs = [
        ParamSpec(n, p.numel(), dtype_name(p.dtype), str(p.device), p.element_size(), rows=_rows(tables.get(n)))
        for n, p in named
    ]
    return plan_buckets(specs, bucket_size_mb, first_bucket_mb)


def _row_sparse_tables(
    module: nn.Module, named: list[tuple[str, torch.Tensor]], option: bool | str, engine: TorchEngine
) -> dict[str, nn.Module]:
    """name -> embedding module, for the tables whose gradients are reduced by rows (bucketing/row_sparse.py).

    ``"auto"``: the weights of ``nn.Embedding``/``nn.EmbeddingBag`` modules (``sparse=False``) on the CPU that no
    other module shares (a tied weight also gets the output layer's dense gradient); ``True``: on any
    device (not yet run on an accelerator; finding the rows synchronises the device); ``False``: none.
    """
    if option not in (True, False, "auto"):
        raise ValueError(f"row_sparse_embeddings must be True, False or 'auto', got {option!r}")
    if option is False or engine.world_size == 1:
        return {}
    owners = collections.Counter(id(p) for _, p in module.named_parameters(remove_duplicate=False))
    names = {id(p): n for n, p in named}
    tables = {}
    for sub in module.modules():
        if isinstance(sub, (nn.Embedding, nn.EmbeddingBag)) and not sub.sparse:
            weight = sub.weight
            shared = owners[id(weight)] > 1
            if id(weight) in names and not shared and (option is True or weight.device.type == "cpu"):
                tables[names[id(weight)]] = sub
    return tables


def _rows(table: nn.Module | None) -> int:
    return 0 if table is None else table.weight.shape[0]


class _LookedUpRows:
    """The rows of one embedding table its forwards looked up since the last exchange (row_sparse.LookedUpRows).

    Recorded after the module ran (its indices are checked by then), only where a gradient can follow.
    """

    def __init__(self, table: nn.Module) -> None:
        self._mask = torch.zeros(table.weight.shape[0], dtype=torch.bool, device=table.weight.device)

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        indices = kwargs.get("input", args[0] if args else None)
        if isinstance(indices, torch.Tensor) and torch.is_grad_enabled() and module.weight.requires_grad:
            self._mask.index_fill_(0, indices.reshape(-1).long(), True)  # int32 indices too, as the module takes

    def take(self) -> torch.Tensor:
        taken, self._mask = self._mask, torch.zeros_like(self._mask)
        return taken


def _record_lookups(tables: dict[str, nn.Module], reduction: RowSparseReduction) -> list:
    """A forward hook on each table's module feeding ``reduction.lookups``; the hooks' handles."""
    handles = []
    for name, table in tables.items():
        looked_up = reduction.lookups[name] = _LookedUpRows(table)
        handles.append(table.register_forward_hook(looked_up, with_kwargs=True))
    return handles


def _refuse_unsupported(module: nn.Module, named: list[tuple[str, torch.Tensor]]) -> None:
    """Sparse gradients, parameters on several devices or on the meta device: refused before anything is
    communicated (several devices first: a model half on meta is one to move, not to materialise)."""
    devices = sorted({str(p.device) for _, p in named})
    if len(devices) > 1:
        raise ValueError(
            f"the model's trainable parameters live on {len(devices)} devices ({', '.join(devices)}); collective_ops "
            "reduces one device per process (autograd runs one hook thread per device). Move the model to one "
            "device, and launch one process per device (torchrun --nproc-per-node)."
        )
    for name, p in named:
        if p.is_meta:  # its gradients would land in the meta buckets planned for it, never averaged
            raise ValueError(
                f"parameter {name!r} is on the meta device (no storage); materialise the model first "
                "(model.to_empty(device=...), then initialise it, e.g. each module's reset_parameters()), then wrap it"
            )
        if p.is_sparse or p.layout != torch.strided:
            raise ValueError(f"parameter {name!r} is sparse; collective_ops reduces dense gradients only")
    for module_name, sub in module.named_modules():
        if isinstance(sub, (nn.Embedding, nn.EmbeddingBag)) and sub.sparse and sub.weight.requires_grad:
            raise ValueError(
                f"{module_name or 'the model'} is an {type(sub).__name__}(sparse=True): its gradient is sparse, and "
                "collective_ops reduces dense gradients only. Build it with sparse=False (collective_ops then sends "
                "only the rows the ranks looked up: row_sparse_embeddings), or freeze it (requires_grad=False)."
            )


@torch._disable_dynamo
def _start_compiled_forward(model: DistributedDataParallel) -> None:
    model._start_forward(compiled=True)


@torch._disable_dynamo
def _end_compiled_forward(model: DistributedDataParallel) -> None:
    model._end_forward()


@contextlib.contextmanager
@torch._disable_dynamo(recursive=False)
def _compiled_as_ddp(model: DistributedDataParallel) -> Iterator[None]:
    """Under ``torch.compile``, have the module's graph split at bucket boundaries as DDP's is.

    Dynamo splits a compiled graph into bucket-sized pieces (its DDPOptimizer) while torch's DDP
    marks itself active around its module's forward; without the split the compiled backward
    is one piece that hands every gradient over at its end, and no bucket overlaps it. The
    same marker, with this model's bucket size, gives collective_ops' buckets the same pieces.
    Skipped where this torch has no such marker.
    """
    ddp = nn.parallel.DistributedDataParallel
    if not hasattr(ddp, "_active_ddp_module"):
        yield
        return
    previous, ddp._active_ddp_module = ddp._active_ddp_module, model
    try:
        yield
    finally:
        ddp._active_ddp_module = previous


class _ShadowingHook(JoinHook):
    def __init__(self, model: DistributedDataParallel) -> None:
        self.model = model

    def main_hook(self) -> None:
        self.model._shadow_iteration()

    def post_hook(self, is_last_joiner: bool) -> None:
        self.model._sync_final_model(is_last_joiner)


_STEP_WATCH: Any = None  # torch's global optimizer step pre-hook, registered at the first wrap()


def _watch_optimizer_steps() -> None:
    global _STEP_WATCH
    if _STEP_WATCH is None:
        _STEP_WATCH = (
            register_optimizer_step_pre_hook(_before_any_optimizer_step),
            register_optimizer_step_post_hook(_after_any_optimizer_step),
        )


def _before_any_optimizer_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """torch's global step pre-hook: what a wrapped model owes an optimizer about to step its parameters."""
    _finish_for_optimizer_beside(optimizer)
    if not _steps_with_closure(args, kwargs):
        _warn_unreduced_step(optimizer)


def _after_any_optimizer_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """torch's global step post-hook. A step given a closure (Lightning's, LBFGS's) runs the last micro-batch's
    backward inside it, after the pre-hook: whether that backward averaged the accumulation shows only now."""
    if _steps_with_closure(args, kwargs):
        _warn_unreduced_step(optimizer)


def _steps_with_closure(args: Any, kwargs: Any) -> bool:
    return (args[0] if args else kwargs.get("closure")) is not None


def _finish_for_optimizer_beside(optimizer: torch.optim.Optimizer) -> None:
    """A plain optimizer beside a model's DistributedOptimizer (AdamW for the parameters the DistributedOptimizer
    was not given) reads gradients whose reductions that optimizer's step may leave in flight: they are finished
    first (sharded, refused: outside this rank's shard they are never averaged)."""
    for ref in list(_LIVE_WRAPPERS.values()):
        wrapper = ref()
        ours = None if wrapper is None else wrapper.optimizer
        if ours is None or optimizer is ours or ours.stepping:
            continue
        if wrapper._owns_any(optimizer):
            ours.before_optimizer_beside(optimizer)


def _warn_unreduced_step(optimizer: torch.optim.Optimizer) -> None:
    """Before any optimizer's step: one that steps a wrapped model on gradients accumulated under no_sync() and
    never averaged (every backward of the step ran inside it) trains each rank on its own data, and the
    replicas part silently, as under DDP. Warned once per model, not refused: local SGD does it on purpose.
    (A DistributedOptimizer refuses it in its own step.)"""
    for ref in list(_LIVE_WRAPPERS.values()):
        wrapper = ref()
        if wrapper is None or wrapper._warned_local_step or wrapper.optimizer is not None:
            continue
        if not wrapper.manager.has_unreduced_accumulation:
            continue
        if wrapper._owns_any(optimizer):
            wrapper._warned_local_step = True
            warnings.warn(
                f"{type(optimizer).__name__}.step() is using gradients accumulated under model.no_sync() that no "
                "backward outside it has averaged across ranks: each rank trains on its own data and the ranks' "
                "weights now differ. Run the last micro-batch's backward outside no_sync() (it reduces "
                "everything accumulated). (Warned once; ignore it if you train locally on purpose.)",
                stacklevel=4,
            )


def _weak_hook(wrapper_ref: weakref.ref, index: int):
    def hook(param: torch.Tensor) -> None:
        wrapper = wrapper_ref()
        if wrapper is not None:
            wrapper._grad_ready(index, param)

    return hook


def _output_tensors(output: Any) -> Iterator[torch.Tensor]:
    """The tensors of a forward's output, in tuples, lists, dicts (model output classes subclass dict) and
    dataclasses, where DDP looks for them."""
    if isinstance(output, torch.Tensor):
        yield output
    elif isinstance(output, (list, tuple)):
        for item in output:
            yield from _output_tensors(item)
    elif isinstance(output, dict):
        for item in output.values():
            yield from _output_tensors(item)
    elif dataclasses.is_dataclass(output) and not isinstance(output, type):
        for field in dataclasses.fields(output):
            yield from _output_tensors(getattr(output, field.name))


def _outputs_reached(wrapper_ref: weakref.ref, grad: torch.Tensor) -> None:
    wrapper = wrapper_ref()
    if wrapper is not None:
        wrapper._outputs_reached()


def _remove_all(handles: list) -> None:
    for handle in handles:
        handle.remove()
    handles.clear()


def wrap(model: nn.Module, bucket_size_mb: float = 25.0, **options: Any) -> DistributedDataParallel:
    """``DistributedDataParallel(model, bucket_size_mb, **options)``."""
    return DistributedDataParallel(model, bucket_size_mb, **options)


__all__ = ["DistributedDataParallel", "wrap"]
