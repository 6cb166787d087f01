"""``DistributedOptimizer``: per-bucket optimizer steps that hide communication behind the next forward.

With a plain optimizer, ``backward()`` returns only once every bucket is reduced, so the
last buckets' communication (the first layers' gradients, ready last) is always exposed.
Here backward returns as soon as every bucket is *launched*; ``step()`` updates the
parameters of each bucket whose reduction has landed, and the forward pre-hook of each
module finishes (waits for, then updates) the buckets holding the parameters it is about
to use, so the next forward overlaps the rest of the communication. The update itself is
the wrapped optimizer class's, applied to one bucket's parameters at a time with the
hyperparameters in force at ``step()``: the same arithmetic as DDP + that optimizer.

Everything that reads parameters or optimizer state sees them fully updated: the end of
every forward (parameters it did not use), ``state_dict``, ``synchronize()``,
``clip_grad_norm_``, the wrapped model's ``state_dict`` and its inner module's. A forward that
reads another module's parameters before that module runs (``MultiheadAttention`` reads
``out_proj.weight`` without calling ``out_proj``; ``h + self.head.bias.sum()`` in a parent's
forward) waits for their update at the read: while updates are owed, a torch function mode
(:class:`OwedReads`) sees each torch function's parameter arguments, finishes an owed bucket
before the function reads it, and records the reading module, whose pre-hook finishes that bucket
from then on.
"""

from __future__ import annotations

import functools
import time
import weakref
from typing import Any

import torch
from torch import nn
from torch.distributed.algorithms.join import Joinable, JoinHook

from ... import runtime
from ...bucketing.alignment import StepMisalignedError
from ...bucketing.hooks import allreduce_hook
from ...bucketing.update.overlap import ForwardReads, buckets_read
from ...bucketing.update.pending import PendingUpdates, groups_narrowed
from ...bucketing.update.planner import (
    CHUNK_CANDIDATES_MIB,
    SCHEDULE_AFTER_STEPS,
    LaunchOrderPlanner,
    chunk_sizes_mib,
    planner_inputs,
    planning_due,
    ranked_orders,
)
from ...bucketing.update.schedule import OrderPrediction
from ...bucketing.update.timeline import ForwardTimeline
from .. import _compat
from ..autograd_hooks import remove_all
from ..ddp import DistributedDataParallel
from ..inplace import InPlaceGuard
from .amp import found_inf_here, scaler_record, unscale_
from .checks import (
    UNREDUCED_ACCUMULATION,
    as_groups,
    changed_settings,
    check_settings_agree,
    frozen_setting,
    given_stepped_directly,
    nonfinite_gradients,
    params_changed_while_owed,
    refuse_foreign_params,
    refuse_group_mutation,
    refuse_shard_options,
    refuse_unusable,
    refuse_unwrapped,
)
from .flat_update import FlatUpdates, keep_saved_dtypes, refuse_unflat_masters, steps_flat
from .grads import clear_grad, clip_norm_
from .optimizer_set import OptimizerSet, given_optimizers, refuse_shared_params, watch_given
from .owed_reads import OwedReads, hook_model, without_autocast
from .precision import resolve_precision

SCHEDULES = ("auto", "plan")


class DistributedOptimizer(torch.optim.Optimizer, Joinable):
    """``optimizer_class`` over a wrapped model's parameters, updated bucket by bucket.

    ``DistributedOptimizer(model, torch.optim.AdamW, lr=1e-3, weight_decay=0.01)``; ``params``
    (default: the model's parameters) may be parameter groups, as for the class itself.
    ``overlap=False`` finishes every bucket in backward, as a plain optimizer sees it.
    ``schedule``: ``"auto"`` (the default, except with a custom comm hook)
    plans the launch order once per bucket plan from a measured step: the buckets the next
    forward needs first, ready last in backward, are sent first at its end, ahead of those
    held from earlier in backward (and, with ``bucket_size_mb="auto"``, the bucket size by the
    same simulated step). Orders that send large buckets in chunks (of each size in MiB of
    ``opt.chunk_candidates_mib``, default ``CHUNK_CANDIDATES_MIB``; ``()``: whole buckets only),
    part in backward and part held, are weighed too at 2 ranks (beyond, cutting a bucket changes its sum,
    so only whole-bucket orders, which all sum alike, are: the weights never depend on the trial's timing).
    The simulator's two best whole-bucket
    orders and its best chunked one then run in turn with plan order and with every bucket
    finished in backward (``TRIAL_ROUNDS`` x ``TRIAL_BLOCK_STEPS`` steps each),
    and the fastest measured is kept, overlapping only if more than 2% faster (``schedule_trial``,
    ``defers``). ``"plan"`` launches in plan order, overlapped. Either way every bucket is
    launched by the end of backward on every rank.
    """

    shards = False  # each rank holds all of the optimizer state (True: ShardedDistributedOptimizer)

    _chunk_candidates_mib: tuple[float, ...] = CHUNK_CANDIDATES_MIB
    # GradScaler.step(opt) then calls step(grad_scaler=scaler) instead of unscaling gradients itself:
    # it would read them while their reductions are still in flight.
    _step_supports_amp_scaling = True
    _flat: FlatUpdates | None = None  # element-wise classes: each bucket stepped as one flat tensor

    def __new__(cls, model: Any = None, *args: Any, shard: bool = False, **kwargs: Any) -> DistributedOptimizer:
        """``shard=True`` builds the sharded optimizer (:class:`~.sharded.ShardedDistributedOptimizer`, an
        instance of this class). Every rank's settings are compared first, before any process group is made
        (the sharded optimizer makes some): a difference raises on every rank, naming it."""
        if isinstance(model, DistributedDataParallel):
            check_settings_agree(model, args, shard or cls.shards, kwargs)
        if shard and not cls.shards:
            if cls is not DistributedOptimizer:
                raise TypeError(
                    f"{cls.__name__}(..., shard=True): shard=True builds a ShardedDistributedOptimizer, which is not "
                    f"a {cls.__name__}; subclass collective_ops.torch.ShardedDistributedOptimizer for a sharded one"
                )
            # the sharded subclass (sharded.py, which this module does not import: the package's __init__ does)
            cls = next(subclass for subclass in cls.__subclasses__() if subclass.shards)
        return super().__new__(cls)

    def __init__(
        self,
        model: DistributedDataParallel,
        optimizer_class: type[torch.optim.Optimizer],
        *args: Any,
        params: Any = None,
        overlap: bool = True,
        shard: bool = False,
        schedule: str | None = None,
        grad_dtype: Any = None,
        master_weights: bool | None = None,
        **kwargs: Any,
    ) -> None:
        refuse_unwrapped(model, DistributedDataParallel, shard and not self.shards)
        custom_hook = model.manager.comm_hook is not allreduce_hook and not model.compression
        schedule = schedule or ("plan" if custom_hook else "auto")
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
        self._given = given_optimizers(optimizer_class)  # optimizers built by the user, or None for a class
        refuse_unusable(optimizer_class, self._given, args, kwargs, params)
        refuse_shard_options(kwargs)
        self.precision = resolve_precision(model.param_list, self.shards, grad_dtype, master_weights)
        if self.precision.master_weights and not self.shards:
            refuse_unflat_masters(optimizer_class, self._given, kwargs)
        model.refuse_second_optimizer(self)
        model.check_grad_dtype(self.precision.grad_dtype)
        self.model = model
        self.overlap = overlap
        self.schedule = schedule
        self._planner = LaunchOrderPlanner()  # schedule="auto": the launch order planned, tried and kept
        self._forward_start: float | None = None
        self._forward_compiled = False  # the last forward ran under torch.compile (no per-module timeline)
        self._step_seconds = 0.0  # the last step()'s own time
        runtime.finish_in_flight_before_leaving(self._finish_before_leaving)
        if self._given is not None:
            groups = [group for optimizer in self._given for group in optimizer.param_groups]
        else:
            groups = as_groups(model.module.parameters() if params is None else params)
        refuse_foreign_params(model, groups)
        self._index = {id(p): i for i, p in enumerate(model.param_list)}
        self._join_config = _compat.disabled_join_config()  # Joinable (Optimizer's init skips its)
        self._stepping = False  # True while this optimizer calls the wrapped class's step()
        self._scaler_ref: weakref.ref | None = None  # the GradScaler that last stepped it (scaler.step(opt))
        self._optimizer = self._make_optimizer(optimizer_class, groups, args, kwargs)
        super().__init__(self._optimizer.param_groups, self._optimizer.defaults)
        self._rebind()  # one list of groups and one state, shared with the class's own optimizer
        if not self.shards and self._given is None and steps_flat(optimizer_class, kwargs):
            # one step per bucket, on its flat buffers (and fp32 masters)
            self._flat = FlatUpdates(optimizer_class, args, kwargs, self.precision.master_weights)
            self._lay_out_flat()
        self._built = True  # add_param_group from now on is the user's (torch's __init__ called it above)
        self._pending: PendingUpdates | None = None
        # Parameters this step still writes (their update, sharded their all-gather, lands at the next forward),
        # against in-place changes by the loop in between, which the owed write would lose or build on.
        self._params_guard = InPlaceGuard()
        self.update_seconds = 0.0  # time spent in per-bucket updates (the last step)
        model.set_grad_dtype(self.precision.grad_dtype)  # (once nothing is left to refuse: the model unchanged else)
        model.attach_optimizer(self)
        # Which parameters each module's forward reads is learnt from the first forward: its own, plus those
        # of submodules whose forward never runs (MultiheadAttention reads out_proj.weight itself).
        self._forward_reads = ForwardReads()
        # Reads the learnt needs miss (a parent's forward reading a child's bias before the child runs, a read
        # only some forwards make) wait at the read itself: the modules in their forward, innermost last, and
        # the torch function mode that watches the owed parameters while they run.
        self._readers: list[nn.Module] = []
        self._reads = OwedReads(self)
        self._timeline = ForwardTimeline()  # the forward's use of buckets over time (schedule="auto" plans from it)
        self._hooks = hook_model(model, self, self._index)
        for optimizer in self._given or ():  # the user's own optimizers, read or loaded directly
            self._hooks += watch_given(optimizer, self)
        # after co.shutdown() the model's forwards and checkpoints run as without the library
        runtime.release_at_shutdown(functools.partial(remove_all, self._hooks))

    def _make_optimizer(
        self, optimizer_class: type[torch.optim.Optimizer], groups: list[dict], args: tuple, kwargs: dict
    ) -> torch.optim.Optimizer:
        """The wrapped class's optimizer (over the model's parameters here; over shards when sharded), or the
        optimizers given in its place."""
        if self._given is not None:
            return self._given[0] if len(self._given) == 1 else OptimizerSet(self._given)
        return optimizer_class(groups, *args, **kwargs)

    def _follow_given_groups(self) -> None:
        """A group added to a given optimizer directly (its own ``add_param_group``, as when unfreezing layers)
        joins this one: trained and cleared from then on, as by the plain optimizer. Owed updates land first."""
        if self._given is None:
            return
        groups = self._optimizer.param_groups
        known = self._known_groups
        if len(groups) == len(known) and all(a is b for a, b in zip(groups, known)):
            return
        if self.in_flight:
            self.synchronize()
        refuse_foreign_params(self.model, groups)
        refuse_shared_params(self._given)
        self._rebind()

    def _rebind(self) -> None:
        """The wrapped optimizer's groups and state as this one's (a load_state_dict replaces both)."""
        self.param_groups = self._optimizer.param_groups
        self.state = self._optimizer.state
        self._trained = {id(p) for p in self._model_params()}
        self._known_groups = list(self._groups)  # (a given optimizer's own add_param_group appends to it)
        if self._flat is not None:  # a new state (load_state_dict) or group: packed again at the next flat step
            self._flat.unpack()

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The wrapped class's parameter groups. Read between backward() and step() (``scaler.unscale_(opt)``
        before clipping, a gradient norm over them), the last backward's reductions are finished first, as the
        wrapped model's ``parameters()`` finish them, so what is read there is averaged; that step loses its
        overlap with the next forward. (GradScaler's in-place unscaling moves no version counter: the gradient
        guard cannot see it race a reduction.) Read after step(), as an LR scheduler does, they finish nothing."""
        if getattr(self, "_built", False) and not self._stepping and self._gradients_unstepped():
            self.finish_reductions()
        return self._groups

    @param_groups.setter
    def param_groups(self, groups: list[dict[str, Any]]) -> None:
        self._groups = groups

    @property
    def state(self) -> Any:
        """The wrapped class's state. Read while a step's updates are owed (right after ``step()``: a logged
        moment, a checkpoint taken by hand), they are applied first, as ``state_dict()`` applies them; the
        state read is the step's, not the one before (that step loses its overlap with the next forward)."""
        if getattr(self, "_built", False) and not self._stepping and self._pending is not None:
            self.synchronize()
        return self._state

    @state.setter
    def state(self, state: Any) -> None:
        self._state = state

    def _gradients_unstepped(self) -> bool:
        """True between a backward whose reductions run on past it and the step() that consumes them."""
        return self.model.manager.deferred_pending and self._pending is None

    def _model_params(self) -> list[torch.Tensor]:
        """The model parameters this optimizer trains."""
        return [p for group in self._groups for p in group["params"]]

    @property
    def defers(self) -> bool:
        """True if backward returns once buckets are launched (their reductions finished later, as needed)."""
        return self.overlap and self._planner.defers_now

    @property
    def settling(self) -> bool:
        """True until the launch order is chosen (schedule="auto": planned after step 3, then the shortlist's
        trial); steps until then run orders that may not be kept."""
        if self._planner.trial is not None:
            return True
        return self._plans_schedule() and self.model.manager.steps_synced <= SCHEDULE_AFTER_STEPS

    @property
    def chunk_candidates_mib(self) -> tuple[float, ...]:
        """The chunk sizes (MiB) ``schedule="auto"`` weighs for buckets larger than them; ``()``: whole buckets only.
        Set before the schedule is planned (the 4th forward). Weighed at 2 ranks only (beyond, the chunks would
        change the sums, so the weights would depend on which order the timed trial keeps)."""
        return self._chunk_candidates_mib

    @chunk_candidates_mib.setter
    def chunk_candidates_mib(self, sizes: Any) -> None:
        self._chunk_candidates_mib = chunk_sizes_mib(sizes)

    @property
    def in_flight(self) -> bool:
        """True while a step's reductions or updates are not all finished (synchronize() finishes them)."""
        return self.model.manager.deferred_pending or self._pending is not None

    def gather_gradients(self) -> None:
        """Every gradient averaged on every rank, as DDP's after backward (for code that reads or changes them
        between backward() and step()): here the reductions finished (``finish_reductions()``); with
        ``shard=True``, where each rank holds its shard of them only, an all-gather of them."""
        self.finish_reductions()

    # -- torch.optim.Optimizer ------------------------------------------------------------------
    def step(self, closure: Any = None, grad_scaler: Any = None) -> Any:  # type: ignore[override]
        """Update every bucket whose reduction has landed; the rest as the next forward needs them.

        ``closure``, as torch's optimizers take it (Lightning's automatic optimization passes one): called
        once, with gradients enabled, to run the forward and backward; its loss is returned."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._step(grad_scaler)
        return loss

    @torch.no_grad()
    def _step(self, grad_scaler: Any) -> None:
        if grad_scaler is not None:
            self._scaled_step(grad_scaler)
            return
        if getattr(self, "found_inf", None) is not None:
            self._step_by_scaler_attributes(self.found_inf, getattr(self, "grad_scale", None))
            return
        if self.model.manager.has_unreduced_accumulation:
            raise RuntimeError(UNREDUCED_ACCUMULATION)
        start = time.perf_counter()
        self._follow_given_groups()
        for optimizer in self._given or ():  # an LR scheduler over one given: its step is taken (bucket by bucket)
            _compat.mark_stepped(optimizer)
        # every bucket before any update: a step that would be wrong is refused whole
        self.model.owned_gradients.check_untouched(self._buckets(), sharded=self.shards)
        if self.model.check_finite:
            self._refuse_nonfinite_gradients()
        self._start_step()
        for bucket in self._owed_buckets():
            self._params_guard.note(bucket, self._bucket_params(bucket))
        self._step_seconds = time.perf_counter() - start

    def _refuse_nonfinite_gradients(self) -> None:
        """``wrap(..., check_finite=True)``: a step whose averaged gradients are not all finite is not applied.

        Every reduction is finished first (this step loses its overlap with the next forward), so no
        bucket is updated before the check; every rank then raises, the parameters and the optimizer
        state left as before the step (catch it, ``zero_grad()``, and the loop may go on).
        """
        self.finish_reductions()
        origin = self.model.take_nonfinite_origin()
        bad = self._nonfinite_gradient_names()
        if not bad:
            return
        self._skip_step()
        raise nonfinite_gradients(bad, origin)

    def _nonfinite_gradient_names(self) -> list[str]:
        """The parameters whose averaged gradient holds a NaN or Inf, the same on every rank."""
        return self.model.nonfinite_gradient_names()

    def _start_step(self) -> None:
        """Apply what has landed of the last backward's reductions; owe the rest."""
        if self._pending is not None:
            self.synchronize()  # a previous step() whose updates were never needed: owed first
        self.update_seconds = 0.0
        manager = self.model.manager
        if not manager.deferred_pending:  # every bucket already finished (or nothing was reduced)
            if self._flat is None:
                self._timed_step(None, None)
            else:
                self._apply_updates(list(self._buckets()), None)
            return
        self._pending = PendingUpdates.start(len(manager.plan.buckets), self._groups, frozen_setting)
        self._finish([bucket for bucket in self._pending.buckets if manager.bucket_ready(bucket)])

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As the class's zero_grad; gradients of buckets whose update is still owed are cleared after it."""
        self._follow_given_groups()  # (a group added to a given optimizer is cleared too, as by it)
        self.model.zero_main_grads()
        pending = self._pending
        if pending is None and self.model.manager.deferred_pending:
            self.synchronize()  # reductions in flight into the gradients: never cleared under them
        if pending is None and set_to_none:
            for p in self._model_params():  # (as torch's own zero_grad: the loop's per-step cost)
                p.grad = None
            return
        owed = set()
        if pending is not None:
            pending.clear_after = set_to_none
            owed = self._params_of(pending.buckets)
        for p in self._model_params():
            if id(p) not in owed:
                clear_grad(p, set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """As torch's (unfreezing layers as training goes on): a group of the model's parameters, with settings
        of its own; every owed update is applied first. Every rank calls it at the same point."""
        if not getattr(self, "_built", False):  # torch's __init__ registering the class's own groups
            super().add_param_group(param_group)
            return
        groups = as_groups([param_group])
        refuse_foreign_params(self.model, groups)
        self.synchronize()
        self._add_group(groups[0])

    def _add_group(self, group: dict[str, Any]) -> None:
        self._optimizer.add_param_group(group)  # param_groups is the class's own list: the group shows there
        self._rebind()

    def state_dict(self) -> dict[str, Any]:
        """The class's own state_dict (loadable into a plain optimizer of the same class), every update applied."""
        self.synchronize()
        return self._optimizer.state_dict()

    def consolidate_state_dict(self, to: int = 0) -> None:
        """torch's ``ZeroRedundancyOptimizer`` checkpoint idiom (``opt.consolidate_state_dict(to=0)``, then
        ``opt.state_dict()`` on rank 0): unsharded, every rank already holds the whole state, so nothing moves."""
        world = self.model.engine.world_size
        if isinstance(to, bool) or not isinstance(to, int) or not 0 <= to < world:
            raise ValueError(f"consolidate_state_dict(to={to!r}): to must be a rank, an int from 0 to {world - 1}")

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.synchronize()
        self._optimizer.load_state_dict(state_dict)
        if self.precision.master_weights:  # torch's load casts the state to the bf16 parameters' dtype
            params = [p for group in self._optimizer.param_groups for p in group["params"]]
            keep_saved_dtypes(self._optimizer.state, params, state_dict["state"])
        self._rebind()

    # -- what the rest of the loop may call --------------------------------------------------------
    def synchronize(self) -> None:
        """Finish every bucket in flight and apply every owed update (blocking)."""
        manager = self.model.manager
        if manager.deferred_pending or self._pending is not None:
            self._finish(list(range(len(manager.plan.buckets))))

    def _finish_before_leaving(self) -> None:
        """co.shutdown(): the last step's reductions (and all-gathers) finished before the groups go, and the
        groups of its own let go of, so that destroying them joins their worker threads while Python is alive."""
        if self.in_flight:
            self.synchronize()
        if not self.model.manager.in_progress:
            self.model.manager.set_launch_order(None)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` on the averaged gradients (call between backward and step).

        The norm needs every gradient, so this step's buckets are all finished here: the
        step loses its overlap with the next forward.
        """
        if self._pending is not None:
            raise RuntimeError("clip_grad_norm_ after step(): clip between backward() and step(), as with torch")
        self.finish_reductions()
        if self.model.manager.grad_dtype is not None:  # main gradients: the buffers, not p.grad
            index = self._index
            grads = [self.model.main_grad(index[id(p)]) for p in self._model_params()]
            return clip_norm_(grads, max_norm, norm_type)
        return nn.utils.clip_grad_norm_(self._model_params(), max_norm, norm_type)

    def finish_reductions(self) -> None:
        """Wait for every reduction of the last backward (no update applied): the gradients are final.

        For code that reads gradients between backward and step (``scaler.unscale_(opt)`` before
        clipping, logging a gradient norm); this step then loses its overlap with the next forward.
        """
        manager = self.model.manager
        for bucket in range(len(manager.plan.buckets)):
            if manager.deferred_pending:
                self.model.finish_bucket(bucket)

    @property
    def stepping(self) -> bool:
        """True while this optimizer runs the wrapped class's (or the given optimizers') step, bucket by bucket."""
        return self._stepping

    def before_optimizer_beside(self, optimizer: torch.optim.Optimizer) -> None:
        """Another optimizer is about to step parameters of this model (a plain AdamW over those this one was not
        given): the buckets holding its parameters are finished first (with this step's updates owed there), so
        that it steps on averaged gradients as under DDP. Unless it shares parameters with this optimizer, they were
        finished at the end of backward already (:meth:`backward_ended`); the other buckets keep their overlap."""
        if optimizer in (self._given or ()):
            raise given_stepped_directly(optimizer)
        self._finish(self._buckets_holding({id(p) for group in optimizer.param_groups for p in group["params"]}))

    def backward_ended(self) -> None:
        """At the end of a backward whose reductions run on past it (deferred): the buckets holding gradients of
        parameters this optimizer does not train are finished now, as DDP finishes every bucket in backward. So
        whatever reads those gradients next, by any route (a plain optimizer beside this one, ``scaler.unscale_``
        of it, a norm over them), reads them averaged; this optimizer's own buckets keep their overlap."""
        others = {id(p) for p in self.model.param_list} - self._trained
        for bucket in self._buckets_holding(others):
            if self.model.manager.deferred_pending:
                self.model.finish_bucket(bucket)

    def _buckets_holding(self, param_ids: set[int]) -> list[int]:
        """The buckets (in plan order) that hold any of these parameters."""
        buckets = self._buckets()
        return [b for b in buckets if any(id(p) in param_ids for p in self._bucket_members(b))]

    def _refuse_scaler_on_main_grads(self) -> None:
        """A GradScaler unscales and checks ``p.grad``, which main gradients leave None: it would step on scaled
        gradients."""
        if self.model.manager.grad_dtype is not None:
            raise RuntimeError(
                "GradScaler with main gradients (master_weights / grad_dtype): the scaler reads p.grad, which main "
                "gradients leave None, so it would step on scaled gradients. Train the bf16 model without a "
                "GradScaler (bf16 needs no loss scaling), or leave master_weights off for an fp16 model with one"
            )

    def _scaled_step(self, scaler: Any) -> None:
        """``GradScaler.step(opt)``: every reduction finished (the inf check needs all gradients), the
        gradients unscaled and checked, the step skipped where one is not finite, as torch does."""
        self._refuse_scaler_on_main_grads()
        self._scaler_ref = weakref.ref(scaler)  # (sharded, a rank that joins keeps stepping through it)
        self.finish_reductions()
        if self._found_inf_anywhere(scaler_record(scaler, self)):
            self._skip_step()
        else:
            self.step()

    def _step_by_scaler_attributes(self, found_inf: torch.Tensor, grad_scale: torch.Tensor | None) -> None:
        """``GradScaler.step(opt)`` by torch's announced protocol (it warns of it since 2.1; 2.13 still hands
        itself to ``step(grad_scaler=...)``): it sets ``found_inf`` and ``grad_scale`` (None where ``unscale_``
        ran) on the optimizer and calls ``step()``. Its inf check read ``param_groups``, which finished the
        reductions first, so every rank judged the same averaged gradients. Skipped where one was not finite;
        else the gradients unscaled as ``GradScaler.unscale_`` does (the same reciprocal, the same kernel), then
        the step. Ignored, the step would apply the scaled gradients."""
        self._refuse_scaler_on_main_grads()
        self.found_inf = self.grad_scale = None  # (GradScaler deletes both afterwards) the step below is plain
        if float(found_inf.item()):
            self._skip_step()
            return
        if grad_scale is not None:
            unscale_(self._model_params(), grad_scale)
        self.step()

    def _found_inf_anywhere(self, found_inf_per_device: dict[Any, torch.Tensor]) -> bool:
        """GradScaler's verdict on this step (``unscale_`` recorded it per device). Unsharded every rank checked
        the same averaged gradients: the same verdict everywhere, no collective needed."""
        return found_inf_here(found_inf_per_device)

    def _skip_step(self) -> None:
        """The last backward's gradients are not applied (GradScaler found them not finite)."""

    # -- internals ---------------------------------------------------------------------------------
    def _before_forward_of(self, module: nn.Module, args: Any) -> None:
        """Forward pre-hook: the buckets holding the parameters this module reads are finished (and updated) first."""
        if torch.compiler.is_compiling():
            return  # inside a compiled graph: every owed update was applied before it (compiled_forward_starts)
        timed = self._times_forward()
        if not timed and not self.in_flight and self._forward_reads.ran is None:
            # nothing owed (sharded: no all-gather unwaited), learnt or timed: the usual forward after a step
            # that finished its buckets
            if self._readers:
                self._readers.append(module)  # inside a watched forward: the innermost reader (its hook pops it)
            return
        self._forward_reads.module_runs(module)
        timeline = self._timeline if timed else None
        if timeline is not None and module is self.model.module:
            timeline.forward_started(follows_backward=self.in_flight)
        if self.in_flight or timeline is not None:
            indices = self._reads_of(module)
            if timeline is not None:
                timeline.needed(indices)
            if self.in_flight and _compat.is_compiled(module) and module is not self.model.module:
                # A compiled submodule in an eager forward: no wait can sit inside its graph (and no torch function
                # mode sees its reads), so every owed write lands first, as before a compiled model's forward.
                indices = list(range(len(self._index)))
            if self.in_flight:
                self._finish_reads(indices, type(module).__name__)
        self._enter_reads(module)

    def _reads_of(self, module: nn.Module) -> list[int]:
        """The parameters (indices into the model's list) ``module``'s forward reads: learnt in the first forward
        and from reads caught since; a module not seen then reads at least its own."""
        return self._forward_reads.reads_of(module, lambda: self._own_params(module))

    def _own_params(self, module: nn.Module) -> list[int]:
        """``module``'s own trained parameters (not its submodules'), as indices into the model's list."""
        return [self._index[id(p)] for p in module.parameters(recurse=False) if id(p) in self._index]

    def _finish_reads(self, indices: list[int], module: str) -> None:
        """Before a forward reads these parameters: their buckets finished, their owed updates applied."""
        self._finish(buckets_read(indices, self.model.manager.plan.location), module)  # plan order, as every rank

    # -- reads the learnt needs miss ------------------------------------------------------------------
    def _owed_writes(self) -> list[int]:
        """The buckets whose parameters this step still writes (sharded: also those whose all-gather is not
        waited for): a forward reading them now would read the step's old values."""
        return self._owed_buckets()

    def _write_owed(self, bucket: int) -> bool:
        """``bucket`` is among :meth:`_owed_writes` (without listing them: asked once per parameter read)."""
        return self._update_owed(bucket)

    def _update_owed(self, bucket: int) -> bool:
        """This step still owes ``bucket``'s update (its class step over the bucket's parameters)."""
        return self._pending is not None and bucket in self._pending.buckets

    def _enter_reads(self, module: nn.Module) -> None:
        """``module``'s forward starts (its own reads finished): the innermost reader from now on. The outermost
        forward that starts while writes are still owed watches every torch function until it returns
        (:class:`OwedReads`)."""
        if self._readers:
            self._readers.append(module)
            return
        owed = self._owed_writes() if self.in_flight else None
        if not owed:
            # Nothing owed (overlap=False, after synchronize(), a model compiled inside the wrapper, whose
            # pre-hook finished every bucket): no mode, nor any cost per torch function. Writes never become
            # owed during a forward, so none of its modules' forwards needs watching either.
            return
        self._readers.append(module)
        self._reads.watch({id(p): self._index[id(p)] for b in owed for p in self._bucket_members(b)})

    def _after_forward_of(self, module: nn.Module, args: Any, output: Any) -> None:
        """Every module's forward hook (always called, also where the forward raised): the reader left."""
        if torch.compiler.is_compiling() or not self._readers:
            return
        while self._readers:
            if self._readers.pop() is module:
                break
        if not self._readers:
            self._reads.unwatch()

    def read_owed(self, param: torch.Tensor) -> None:
        """A torch function is about to read ``param`` while its bucket's write may be owed (:class:`OwedReads`):
        finished first, where still owed, and the innermost module in its forward noted as reading it, so that
        its pre-hook finishes that bucket from the next forward on."""
        index = self._index[id(param)]
        bucket = self.model.manager.plan.location[index][0]
        if not self._write_owed(bucket):
            return
        reader = self._readers[-1] if self._readers else None
        self._finish_reads([index], type(reader).__name__ if reader is not None else "")
        if reader is not None:
            self._forward_reads.caught(reader, index, lambda: self._own_params(reader))

    def _forward_starts(self, model: nn.Module, args: Any) -> None:
        if torch.compiler.is_compiling():
            return  # compiled_forward_starts, from the wrapper's forward
        self._forward_start = time.perf_counter()
        self._forward_compiled = False

    awaits_first_gradient = False  # sharded: True after a step, until a gradient arrives or zero_grad() clears

    def first_gradient_after_step(self, param: torch.Tensor) -> None:
        """The first gradient to arrive after a step (``awaits_first_gradient``), ``param``'s."""

    def backward_reaches_outputs(self) -> None:
        """A backward reached the model's outputs, before any parameter's gradient (every rank at the same point).
        Where the last backward's reductions are still in flight with no step() since (its forward ran before
        that backward: two losses computed, then each backpropagated), they are finished first, so that this one
        adds onto averaged gradients, as under DDP's semantics (a forward in between finishes them itself)."""
        if self._pending is None and self.model.manager.deferred_pending:
            self.finish_reductions()

    def backward_starts(self, param: torch.Tensor | None = None) -> None:
        """At the first gradient of a backward that reduces (``param``'s; every rank at the same point). Unsharded,
        a second backward before step() accumulates onto averaged gradients, as under DDP: nothing to do."""

    def compiled_forward_starts(self) -> None:
        """Before the forward of a model under ``torch.compile`` (run as Python, outside the graph).

        A compiled forward is one graph: the per-module waits cannot sit inside it, so every owed
        update (and, sharded, every all-gather) is finished first. The step keeps the overlap of
        per-bucket updates with the reductions still in flight during ``step()``, not the one with
        the next forward. The launch-order planner, which times the forward module by module, then
        keeps plan order.
        """
        self._forward_start = time.perf_counter()
        self._forward_compiled = True
        if self.in_flight:
            self.synchronize()

    def _plans_schedule(self) -> bool:
        """True while the forward's use of buckets is being timed: schedule="auto", not yet planned for this plan."""
        return self.schedule == "auto" and self.overlap and self._planner.plans(self.model.manager.plan)

    def _times_forward(self) -> bool:
        """True while the forward's use of buckets is timed: the input of the launch-order planner (and, here
        the same, of the online bucket-size tune's simulated overlapped step)."""
        return self._plans_schedule()

    def _before_state_dict(self, module: nn.Module, prefix: str, keep_vars: bool) -> None:
        if self.in_flight:
            self.synchronize()

    def _before_load(self, module: nn.Module, *args: Any) -> None:
        if self.in_flight:
            self.synchronize()

    def _after_load(self, module: nn.Module, incompatible_keys: Any) -> None:
        """After weights were loaded into ``module`` (torch calls it for each module of the loaded tree, once its
        own parameters and its children's are loaded; sharded: the fp32 masters of its own parameters follow)."""

    def _owed_buckets(self) -> list[int]:
        """The buckets whose parameters this step still writes (at the next forward that reads them)."""
        return list(self._pending.buckets) if self._pending is not None else []

    def _buckets(self) -> range:
        """The buckets of the model's current plan, in plan order."""
        return range(len(self.model.manager.plan.buckets))

    def _bucket_members(self, bucket: int) -> list[torch.Tensor]:
        """Every parameter of this bucket."""
        params = self.model.param_list  # (a property: read once, not per parameter)
        return [params[i] for i in self.model.manager.plan.buckets[bucket].param_indices]

    def _bucket_params(self, bucket: int) -> list[torch.Tensor]:
        """The parameters of this bucket that this optimizer writes (not those of an optimizer beside it)."""
        return [p for p in self._bucket_members(bucket) if id(p) in self._trained]

    def _check_params_untouched(self, buckets: list[int], release: bool = True) -> None:
        """Raise where the loop changed these buckets' parameters in place while this step still owed them a
        write: the update would build on the change (or, sharded, the all-gather overwrite it), not follow it."""
        for bucket in buckets:
            params = self._bucket_params(bucket)
            changed = self._params_guard.changed(bucket, params, release)
            if not changed:
                continue
            names = [self.model.param_names[self._index[id(params[position])]] for position in changed]
            raise params_changed_while_owed(names)

    def _after_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        if torch.compiler.is_compiling():
            return
        if self._times_forward():
            self._timeline.forward_ended()
        self._forward_reads.first_forward_ended(self._own_params, lambda module: module.children())

    @torch.no_grad()
    def _finish(self, buckets: list[int], module: str = "") -> None:
        """Finish these buckets' reductions (where not yet) and apply their owed updates in one call of the
        class's step (its per-call cost paid once, not per bucket); traced when tracing is on.

        Often called from a forward pre-hook, so inside the forward's contexts, which a plain step after
        backward never sees: out of inference mode (an evaluation under ``torch.inference_mode()``, as
        Lightning validates, made the state a first update creates, a momentum buffer, an inference tensor
        that the next training step could not update in place) and out of autocast (an update through a
        matmul, as Shampoo-like preconditioners compute, ran in bf16 under a bf16 forward: silently off DDP's)."""
        # (unwatched: the update's own reads of the parameters are not a forward's)
        with torch.inference_mode(False), without_autocast(self.model.engine.device.type), self._reads.paused():
            self._finish_buckets(buckets, module)
        if self._reads.owed and not self._owed_writes():
            self._reads.owed = {}  # nothing owed any more: the rest of this forward's functions pay one falsy test

    def _finish_buckets(self, buckets: list[int], module: str) -> None:
        manager = self.model.manager
        tracer = getattr(manager.observer, "bucket_update", None)
        step = manager.steps_synced
        for bucket in buckets:
            if manager.deferred_pending and not manager.bucket_finished(bucket):
                start = time.perf_counter()
                try:
                    self.model.finish_bucket(bucket)
                except StepMisalignedError:  # raised before the step's first bucket finished: none of it applies
                    self._pending = None
                    self._skip_step()
                    raise
                end = time.perf_counter()
                self._timeline.waited(end - start)
                if tracer is not None and module:
                    tracer("forward wait", bucket, step, start, end, module)
        pending = self._pending
        owed = [bucket for bucket in buckets if pending is not None and pending.take(bucket)]
        if not owed:
            return
        # sharded, the parameters are the step's until their all-gather is waited for, after this
        self._check_params_untouched(owed, release=not self.shards)
        start = time.perf_counter()
        self._apply_updates(owed, pending)
        end = time.perf_counter()
        for bucket in owed:
            if tracer is not None:
                tracer("update", bucket, step, start, end, module)
            if pending.clear_after is not None:
                for p in self._bucket_params(bucket):
                    clear_grad(p, pending.clear_after)
        if pending.finished:
            self._pending = None

    def _apply_updates(self, buckets: list[int], frozen: PendingUpdates | None) -> None:
        """The class's step over these buckets' parameters: one call per bucket on its flat buffers where the class
        is element-wise (:mod:`.flat_update`), else one call over their parameters."""
        if self._flat is not None:
            buckets = self._flat_step(buckets, frozen)
            if not buckets:
                return
        self._timed_step(self._params_of(buckets), frozen)

    def _flat_step(self, buckets: list[int], frozen: PendingUpdates | None) -> list[int]:
        """The flat steps of these buckets; those left to step per parameter."""
        start = time.perf_counter()
        self._stepping = True  # (torch's global step hooks: this optimizer's own steps)
        try:
            left = self._flat.step(buckets, self.model.manager.buffers, self._optimizer.state, frozen)
        finally:
            self._stepping = False
        self.update_seconds += time.perf_counter() - start
        return left

    def _timed_step(self, only: set[int] | None, frozen: PendingUpdates | None) -> None:
        """The class's step over ``only`` (parameter ids; None: all) with the groups' settings at ``frozen``'s
        step() (None: current)."""
        start = time.perf_counter()
        try:
            with groups_narrowed(self._optimizer.param_groups, only, frozen):
                given = [dict(group) for group in self._optimizer.param_groups]
                self._stepping = True
                self._optimizer.step()
                changed = changed_settings(given, self._optimizer.param_groups)
        finally:
            self._stepping = False
        self.update_seconds += time.perf_counter() - start
        if changed:
            refuse_group_mutation(type(self._optimizer).__name__, changed)

    def _params_of(self, buckets: list[int]) -> set[int]:
        return {id(p) for bucket in buckets for p in self._bucket_params(bucket)}

    # -- torch.distributed.algorithms.Join: Join([model, opt]) as with DDP-style code ---------------
    def join_hook(self, **kwargs: Any) -> JoinHook:
        """Nothing to shadow: the model's hook issues every collective; a rank that joined skips its updates,
        as a plain optimizer does under DDP's join, and takes the last joiner's parameters at the end. With
        ``shard=True`` the model's shadow steps also update the joined rank's shards (``step_while_joined``)."""
        return JoinHook()

    def step_while_joined(self) -> None:
        """A step a joined rank shadows (``model.join()``): unsharded, nothing; the rank skips its updates, as a
        plain optimizer does under DDP's join, and takes the last joiner's parameters at the end."""

    def settings_while_joined(self, active: bool) -> None:
        """Unsharded, nothing: a joined rank makes no updates (sharded, it takes its active peers' settings)."""

    @property
    def join_device(self) -> torch.device:
        return self.model.engine.device

    @property
    def join_process_group(self) -> Any:
        return torch.distributed.group.WORLD

    def on_settle(self, forward_ended: bool = True) -> None:
        """At the end of a forward, every rank at the same point: plan the launch order once per bucket plan.

        With ``schedule="auto"``, from the last backward's bucket ready times, this forward's use
        of the buckets and the fitted α/β, rank 0 simulates every candidate order
        (:mod:`collective_ops.bucketing.update.schedule`) and every rank adopts its choice: buckets the
        next forward needs first stop queueing behind the rest.
        """
        manager = self.model.manager
        stats = manager.last_stats
        if not forward_ended:  # a backward that finished every bucket: what is settled here is at forward ends
            return
        if self._planner.trial is not None and not self.model.joined:
            # this model's own time (its forward, backward and step()): other work between steps does not count
            self._planner.advance_timed(
                manager, self.model.engine, stats, self.model.backward_began, self._forward_start, self._step_seconds
            )
            return
        if self._times_forward():
            if self.model.module.training and torch.is_grad_enabled():  # a training step's forward, not an evaluation
                self._timeline.remember(stats, manager.steps_synced)
            self._timeline.settled()
        if not (self._plans_schedule() and planning_due(manager, self.model.joined)):
            return
        self._planner.plan(
            manager,
            self.model.engine,
            self._timeline,
            self._forward_compiled,
            self._chunk_candidates_mib,
            _measure_cost,
            self._sharded_orders(),
        )

    def _sharded_orders(self) -> Any:
        """Sharded: the step's reduce-scatter orders simulated for a fitted cost (None: allreduce orders)."""
        return None

    @property
    def schedule_report(self) -> list[OrderPrediction] | None:
        """Every launch order ``schedule="auto"`` simulated, best first (None until planned)."""
        return self._planner.report

    @property
    def schedule_bound_s(self) -> float | None:
        """The step no launch order beats, from the profile and cost the planner used (schedule.step_bound)."""
        return self._planner.bound_s

    @property
    def schedule_trial(self) -> dict[str, Any] | None:
        """What the last order trial measured and kept (orders, overlapped, median_s, kept)."""
        return self._planner.kept

    def predict_overlapped(self, plan: Any, cost: Any) -> OrderPrediction | None:
        """For ``bucket_size_mb="auto"``: the best launch order's simulated step were the model bucketed as
        ``plan``, from the last backward and the forward after it; None where that profile is not at hand."""
        manager = self.model.manager
        stats = manager.last_stats
        if not (self.schedule == "auto" and self.overlap and stats.backward_start is not None):
            return None
        if not self._timeline.complete(stats.backward_start):
            return None
        inputs = planner_inputs(self._timeline, manager, stats, plan, cost)
        return ranked_orders(inputs, manager, plan, self.model.engine.world_size, self._chunk_candidates_mib)[0]

    def on_plan_change(self, plan: Any) -> None:
        """The model's buckets were replanned (first-step rebuild, auto-tune): a trial of the old plan's orders ends."""
        self._planner.on_plan_change()
        if self._flat is not None:
            self._lay_out_flat()

    def _lay_out_flat(self) -> None:
        """The flat steps on the wrapper's parameter buffers of its current plan."""
        model = self.model
        buffers = model.param_buffers()
        self._flat.lay_out(model.manager.plan, buffers, self._optimizer.param_groups, model.param_list)

    def remove_hooks(self) -> None:
        """Detach the forward pre-hooks (after a final synchronize)."""
        self.synchronize()
        remove_all(self._hooks)


def _measure_cost() -> Any:
    """The fitted alpha/beta of the model's channel, measured live (a collective: every rank calls it)."""
    from ...tuning import measure_alpha_beta

    return measure_alpha_beta()


__all__ = ["DistributedOptimizer"]
