"""Sharded data parallel on the same buckets: ``DistributedOptimizer(..., shard=True)`` (ZeRO-1).

Each bucket is padded to a multiple of the world size and cut into equal contiguous shards
(:class:`collective_ops.bucketing.shard.ShardLayout`). Gradients are reduce-scattered per
bucket during backward, in one launch order on every rank (``schedule="auto"``, the default: planned from
a timed step by :func:`~collective_ops.bucketing.shard.step.sharded_orders` and tried against plan order,
as unsharded; ``"plan"``: plan order); each rank runs the wrapped
optimizer on the pieces of parameters inside its shards only, so it keeps 1/N of the
optimizer state; the updated shards are all-gathered per bucket into the parameters, and the
next forward waits only for the buckets it is about to use.

Parameters become views of one padded flat buffer per bucket (as gradients already are), so
the all-gather lands in them without a copy. For fp32 parameters the optimizer's pieces are
views of those buffers too (no extra memory); for fp16/bf16 parameters each rank keeps an
fp32 master copy of its pieces only, and gradients are reduced in the parameter dtype or, with
``grad_reduce_dtype="float32"``, cast and reduced in fp32 (Megatron's ``grad_reduce_in_fp32``).

All-gathers are launched in one fixed order (the reverse of the plan: the buckets the forward
needs first), each once its bucket's update is applied, on a process group of their own: how
many are launched before the next forward depends on timing, and on the default group they
would interleave differently on each rank with the forward's buffer broadcast or a user's
``all_reduce(loss)``, mismatching collectives. On their own group the order is the same everywhere.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ...bucketing.hooks import reduce_scatter_hook
from ...bucketing.interfaces import wait_with_timeout
from ...bucketing.plan import BucketPlan
from ...bucketing.shard.layout import ShardLayout, ShardPiece
from ...bucketing.shard.step import ShardStep, reduction_of, sharded_orders, sharded_score
from ...bucketing.update.overlap import buckets_read
from ...bucketing.update.pending import PendingUpdates
from ...bucketing.update.schedule import OrderPrediction
from .. import _compat
from ..ddp import DistributedDataParallel
from ..inplace import InPlaceGuard
from .amp import SHARDED_SCALER_ATTRIBUTES, found_inf_on_any_rank
from .checks import frozen_setting
from .dcp import ModelParamsGroup
from .grads import clip_global_norm_, gather_gradients_whole, nonfinite_params
from .joined_settings import share_settings
from .optimizer import DistributedOptimizer
from .precision import renamed_grad_reduce_dtype
from .sharded_checks import (
    RankArrivals,
    SteppedGradients,
    bound_gradients_changed,
    check_sharded_arguments,
    optimizer_beside,
    params_moved,
    refuse_unsupported,
    second_backward,
)
from .sharded_state import (
    MASTER_KEY,
    ShardedState,
    in_plain_format,
    inner_state_dict,
    is_master,
    pieces_of,
    return_freed_memory,
    settings_of,
    take_params_into_masters,
)

_GATHER_NAMED = "the all-gather of updated parameters"  # how a failed all-gather is named in its error


class ShardedDistributedOptimizer(DistributedOptimizer):
    """``DistributedOptimizer(model, cls, ..., shard=True)``: optimizer state sharded across ranks.

    ``param_groups`` hold this rank's pieces (flat tensors), with the groups' settings, so LR
    schedulers work; ``state_dict()`` is the full, unsharded state in the plain optimizer's
    format (gathered on every rank: save it from one), and ``load_state_dict`` reshards a full
    state, also one saved at another world size.
    """

    shards = True

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """This rank's pieces, grouped; read by torch.distributed.checkpoint's ``get_state_dict()``/
        ``set_state_dict()``, which name the state of ``state_dict()`` (the full state, numbered as the plain
        optimizer numbers the model's parameters) through them, the model's parameters instead (settings written
        there, as its zero-lr initial step does, reach the groups)."""
        groups = DistributedOptimizer.param_groups.fget(self)
        if not _compat.called_by_torch_dcp():
            return groups
        return [ModelParamsGroup(group, params) for group, params in zip(groups, self._model_groups)]

    @param_groups.setter
    def param_groups(self, groups: list[dict[str, Any]]) -> None:
        DistributedOptimizer.param_groups.fset(self, groups)

    def __init__(
        self,
        model: DistributedDataParallel,
        optimizer_class: type[torch.optim.Optimizer],
        *args: Any,
        params: Any = None,
        overlap: bool = True,
        shard: bool = True,
        schedule: str | None = None,
        grad_dtype: Any = None,
        master_weights: bool | None = None,
        grad_reduce_dtype: str | None = None,
        assume_elementwise: bool = False,
        **kwargs: Any,
    ) -> None:
        check_sharded_arguments(optimizer_class, grad_reduce_dtype, assume_elementwise)
        grad_dtype = renamed_grad_reduce_dtype(grad_dtype, grad_reduce_dtype)
        if isinstance(model, DistributedDataParallel):
            refuse_unsupported(model, grad_dtype)
        self._inner_args = (args, kwargs)
        self._kept: dict[int, torch.Tensor] = {}  # bucket -> reduced shard in another dtype (fp32, fp16)
        # the gather order, how far it got, the all-gathers in flight, the reduction the last step consumed
        self._shard_step = ShardStep()
        # The gradients the last step used, and the reduction of a backward that added onto them (a GAN's
        # generator step through this discriminator before its zero_grad()): never stepped on, dropped by a
        # zero_grad() (the optimizer's, or the module's before the next backward).
        self._stepped = SteppedGradients()
        # bucket -> the averaged shard gradients bound to its pieces before step() (opt.param_groups read,
        # finish_reductions()): changed in place by other code from then on, they are refused at step()
        self._bound_guard = InPlaceGuard()
        self._masters_loaded = False  # load_state_dict() brought fp32 masters since the last step
        # (rank the state was consolidated on, the state there: None elsewhere), until the next step or load
        self._consolidated: tuple[int, dict[int, dict[str, Any]] | None] | None = None
        # bucket -> its parameters' version counters when the optimizer last wrote them (low precision only):
        # a change in place since (weight clipping, a re-initialised layer) is taken into the fp32 masters
        self._written_versions: dict[int, list[int]] = {}
        self._gradients_gathered = False  # this backward's averaged gradients all-gathered (gather_gradients())
        self._bound_after_gather = False  # and then bound to the pieces again (param_groups read: unscale_)
        # (every rank constructs the optimizer at the same point: creating a group is a collective)
        self._gather_group = dist.new_group(backend=dist.get_backend()) if dist.get_world_size() > 1 else None
        self._arrivals = RankArrivals()  # "has every rank come to gather the full state?", on a group of its own
        super().__init__(
            model,
            optimizer_class,
            *args,
            params=params,
            overlap=overlap,
            shard=True,
            schedule=schedule,
            grad_dtype=grad_dtype,
            master_weights=master_weights,
            **kwargs,
        )

    # -- building ------------------------------------------------------------------------------
    def _make_optimizer(
        self, optimizer_class: type[torch.optim.Optimizer], groups: list[dict], args: tuple, kwargs: dict
    ) -> torch.optim.Optimizer:
        self._optimizer_class = optimizer_class
        self._model_groups = [group["params"] for group in groups]
        manager = self.model.manager
        # The first step's bucket rebuild would move the shards under optimizer state that exists by
        # then (gathering the full state once: ~5x the model's bytes at peak). So the first step is
        # allreduced as by DDP, not deferred: its rebuild happens at the end of backward, before any
        # state exists, and the reduced gradients are complete in the new layout.
        self._allreduce_first_step = manager.rebuild_after_first_step and manager.steps_synced == 0
        if not self._allreduce_first_step:
            self._start_sharding()
        self._lay_out(manager.plan)
        settings = [{k: v for k, v in group.items() if k != "params"} for group in groups]
        return self._inner_optimizer(settings)

    def _start_sharding(self) -> None:
        """Pad the gradient buffers and reduce-scatter them from now on."""
        manager = self.model.manager
        manager.set_padding(self.model.engine.world_size)
        manager.set_comm_hook(
            reduce_scatter_hook(self._wire_dtype(), keep=self._kept.__setitem__),
            prescale_on_copy=self._wire_dtype() is None,
        )
        self._allreduce_first_step = False

    @property
    def defers(self) -> bool:
        return self.overlap and not self._allreduce_first_step

    def _wire_dtype(self) -> str | None:
        compression = self.model.compression
        if compression:
            return {"fp16": "float16", "float16": "float16", "bf16": "bfloat16", "bfloat16": "bfloat16"}[compression]
        return None  # (main gradients in another dtype than the parameters' are the buffers' own: grad_dtype)

    def _lay_out(self, plan: BucketPlan) -> None:
        """Parameters as views of padded per-bucket buffers; this rank's pieces (views, or fp32 masters)."""
        engine = self.model.engine
        self._bound_guard.clear()  # (noted per bucket of the old layout)
        self._layout = ShardLayout(plan, engine.world_size)
        # model index -> where its view of the buffers starts (see _refuse_params_moved)
        self._param_buffers = self.model.param_buffers(engine.world_size)  # (padded: cut into equal shards)
        self._param_addresses = {i: p.data_ptr() for i, p in enumerate(self.model.param_list)}
        self._pieces = pieces_of(self._layout.pieces(engine.rank), self._param_shard)
        self._bucket_pieces = [[] for _ in plan.buckets]
        for piece, tensor in self._pieces:
            self._bucket_pieces[piece.bucket].append((piece, tensor))
        self._shard_step.lay_out(len(plan.buckets))  # the forward needs the last buckets first: gathered first
        self._written_versions.clear()
        for bucket in range(len(plan.buckets)):
            self._note_written(bucket)

    def _note_written(self, bucket: int) -> None:
        """The optimizer wrote this bucket's parameters (laid out, all-gathered): their version counters, where
        this rank holds fp32 masters of them."""
        if any(is_master(piece, tensor, self._param_buffers) for piece, tensor in self._bucket_pieces[bucket]):
            self._written_versions[bucket] = _compat.versions_of(self._bucket_params(bucket))

    def _masters_follow_edits(self) -> None:
        """Before a step's updates: low-precision parameters changed in place since the optimizer last wrote them
        (``p.clamp_()`` as WGAN clips weights, ``torch.nn.init`` on a layer, under no_grad) have their fp32 masters
        take the change, as a plain optimizer steps from the changed weights; else the step would write the old
        masters back over it. Seen by the version counters: a change through ``p.data`` is not."""
        edited = [
            bucket
            for bucket, versions in self._written_versions.items()
            if _compat.versions_of(self._bucket_params(bucket)) != versions
        ]
        if edited:
            self._take_params_into_masters(only_changed=True, buckets=edited)

    def _refuse_params_moved(self) -> None:
        """A parameter whose storage was replaced after the shards were laid out (``p.data = tensor``,
        ``p.set_()``, a conversion of the inner module) no longer views the buffer its all-gather writes: it would
        keep its values while the optimizer trains the shard, silently. Refused at the first gradient of a
        backward, before any collective."""
        params = self.model.param_list
        moved = [index for index, address in self._param_addresses.items() if params[index].data_ptr() != address]
        if not moved:
            return
        raise params_moved([self.model.param_names[i] for i in moved])

    def _param_shard(self, bucket: int) -> torch.Tensor:
        return self.model.engine.shard_of(self._param_buffers[bucket])

    def _inner_optimizer(self, settings: list[dict[str, Any]]) -> torch.optim.Optimizer:
        """The wrapped class over this rank's pieces, grouped as the model's parameters were."""
        group_of = {id(p): g for g, params in enumerate(self._model_groups) for p in params}
        pieces: list[list[torch.Tensor]] = [[] for _ in self._model_groups]
        for piece, tensor in self._pieces:
            group = group_of.get(id(self.model.param_list[piece.param_index]))
            if group is not None:
                pieces[group].append(tensor)
        args, kwargs = self._inner_args
        groups = [{**setting, "params": group_pieces} for setting, group_pieces in zip(settings, pieces)]
        return self._optimizer_class(groups, *args, **kwargs)

    def _model_params(self) -> list[torch.Tensor]:
        return [p for params in self._model_groups for p in params]

    def _bucket_params(self, bucket: int) -> list[torch.Tensor]:
        """Every parameter of this bucket: its all-gather writes them all."""
        return self._bucket_members(bucket)

    def before_optimizer_beside(self, optimizer: torch.optim.Optimizer) -> None:
        raise optimizer_beside(optimizer)

    def _gradients_unstepped(self) -> bool:
        """True between a backward that reduced and the step() that consumes it: each piece's ``.grad`` is bound
        to its averaged shard only by finish_reductions() (what ``scaler.unscale_(opt)`` must read)."""
        return not self._consumed()

    def backward_ended(self) -> None:
        """Nothing is finished early: outside this rank's shard no gradient is ever averaged, and an optimizer
        beside this one is refused (:meth:`before_optimizer_beside`)."""

    # -- the step ------------------------------------------------------------------------------
    @property
    def in_flight(self) -> bool:
        return super().in_flight or bool(self._shard_step.gathers)

    def _start_step(self) -> None:
        """Update each bucket's shard once its reduce-scatter lands and all-gather it; the rest as needed."""
        if self._pending is not None or self._shard_step.gathers:
            self.synchronize()  # a previous step's updates were never needed: owed first
        self._masters_follow_edits()
        self.update_seconds = 0.0
        self._masters_loaded = False
        self._consolidated = None  # the state moves on
        reduction = self._reduction()
        if self._shard_step.consumed(reduction):
            self._stepped.refuse_kept("step() again after step() with no backward in between, while", self._name_of)
            self._step_on_cleared_gradients()
            return
        self._refuse_tainted("step()")
        self._refuse_bound_gradients_changed()
        self._gradients_gathered = self._bound_after_gather = False
        if self._allreduce_first_step:
            self._start_sharding()  # the gradients of this step are complete: every shard of them is valid
        self._shard_step.start(reduction)  # (every all-gather of this step still to launch)
        self._stepped.note_step(self._model_params())  # what a backward before the next zero_grad() adds onto
        self._pending = PendingUpdates.start(len(self._buckets()), self._groups, frozen_setting)
        if self.overlap:
            # Every reduce-scatter waited for and every all-gather launched before step() returns, so code that
            # runs on some ranks only next (rank 0 saving model.module.state_dict()) waits only for collectives
            # every rank has issued; launched later, at each rank's own next forward, they hung there.
            first = self._shard_step.first_to_gather()  # (on the wire before the others' updates)
            self._finish([] if first is None else [first])
            self._launch_gathers()
            self._advance(block=False)  # the buckets already reduced updated while the last ones are in flight
            self._advance(block=True)
        else:
            self.synchronize()

    def _step_on_cleared_gradients(self) -> None:
        """step() with no backward since the last one. A plain optimizer under DDP skips the parameters whose
        gradient is None and steps on those ``zero_grad(set_to_none=False)`` left as zeros (AdamW still decays
        them, momentum still moves them): each rank steps its pieces of the latter on zeros, then every bucket
        is all-gathered (blocking; every rank alike, as their loops clear gradients alike)."""
        if all(p.grad is None for p in self._model_params()):
            return  # cleared to None: nothing to apply, as torch skips None
        zeroed = [(piece, t) for piece, t in self._pieces if self.model.param_list[piece.param_index].grad is not None]
        for _, tensor in zeroed:
            tensor.grad = torch.zeros_like(tensor)
        self._step_pieces(zeroed, None)
        self._shard_step.regather()
        self.synchronize()  # (no step owed: it launches every all-gather, in order, and waits for them)

    def step_while_joined(self) -> None:
        """In a step a joined rank shadows (``model.join()``): its shards' update from the reduced gradients and
        their all-gathers, which its peers' forwards wait for, as torch's ZeroRedundancyOptimizer steps under
        Join; with the settings its active peers step with (:meth:`settings_while_joined`)."""
        scaler = self._scaler_ref() if self._scaler_ref is not None else None
        if scaler is None or not scaler.is_enabled():
            self.step()
            return
        # Its own steps went through a GradScaler, so its peers' still do: the gradients reduced into its shards
        # are scaled by the same scale, and each peer's step agrees on overflow (a collective). It steps through
        # the scaler too, unscaling by that scale, taking part in the agreement and backing off alike.
        scaler.step(self)
        scaler.update()

    def settings_while_joined(self, active: bool) -> None:
        share_settings(self.model.engine, self._groups, active)

    def _reduction(self) -> int:
        """The number of the model's synchronised step whose gradients are (being) reduced."""
        manager = self.model.manager
        return reduction_of(manager.steps_synced, manager.deferred_pending)

    def _consumed(self) -> bool:
        """True where a step (or a skip) consumed the gradients the last backward reduced."""
        return self._shard_step.consumed(self._reduction())

    def _finish_before_leaving(self) -> None:
        super()._finish_before_leaving()
        self._gather_group = None
        self._arrivals.release()

    def synchronize(self) -> None:
        """Finish every reduction, apply every owed update, finish every all-gather (blocking)."""
        self._advance(block=True)
        for bucket in list(self._shard_step.gathers):
            self._wait_gather(bucket)

    def _advance(self, block: bool, until: int | None = None, module: str = "") -> None:
        """Apply the updates of the buckets whose reduction landed (local work, in any order), and with
        ``block`` of every bucket up to ``until`` in the gather order (all: None), waiting for their
        reductions; then launch the all-gathers of the gather order's updated prefix. Only how far
        the all-gathers get depends on timing, never their order."""
        manager, step = self.model.manager, self._shard_step
        self._finish(step.to_update(block, until, manager.deferred_pending, manager.bucket_ready), module)
        if step.consumed(self._reduction()):  # (else no step() for these gradients: nothing to gather)
            self._launch_gathers()

    def _launch_gathers(self) -> None:
        """Launch the all-gathers of the gather order's updated prefix, in that order."""
        manager, step = self.model.manager, self._shard_step
        while (bucket := step.next_to_gather(self._update_owed)) is not None:
            try:
                handle = self.model.engine.all_gather_shard(
                    self._param_buffers[bucket], async_op=True, group=self._gather_group
                )
            except Exception as exc:  # refused at once (Gloo's point-to-point to a peer already gone)
                if manager.is_transport_error(exc):
                    raise manager.explain_failure(bucket, exc, _GATHER_NAMED) from exc
                raise
            step.launched(bucket, handle)

    def _apply_updates(self, buckets: list[int], frozen: PendingUpdates) -> None:
        """The class's step over these buckets' pieces; fp32 masters copied into the parameters' shards."""
        for bucket in buckets:
            self._bind_grads(bucket)
        self._step_pieces([pt for bucket in buckets for pt in self._bucket_pieces[bucket]], frozen)

    def _step_pieces(self, pieces: list[tuple[ShardPiece, torch.Tensor]], frozen: PendingUpdates | None) -> None:
        """The class's step over ``pieces`` (their ``.grad`` bound), then unbound; fp32 masters copied into the
        parameters' shards."""
        self._timed_step({id(tensor) for _, tensor in pieces}, frozen)
        for piece, tensor in pieces:
            tensor.grad = None
            if is_master(piece, tensor, self._param_buffers):
                self._param_shard(piece.bucket).narrow(0, piece.shard_offset, piece.numel).copy_(tensor)

    def _bind_grads(self, bucket: int, note: bool = False) -> None:
        """Each piece's ``.grad``: its part of the reduced shard (cast to the piece's dtype where it differs).
        ``note``: bound before step() (where other code may change them): their version counters are noted."""
        manager = self.model.manager
        self.model.owned_gradients.check_untouched([bucket], sharded=True)  # (averaged only in this shard)
        source = self._kept.pop(bucket, None)
        if source is None:
            source = self.model.engine.shard_of(manager.buffers[bucket])
        bound = False
        for piece, tensor in self._bucket_pieces[bucket]:
            if tensor.grad is not None:
                continue  # bound already this step (clip_grad_norm_ scaled it)
            if piece.param_index in manager.globally_unused and self.model.param_list[piece.param_index].grad is None:
                continue  # no rank used it this step (find_unused_parameters): no gradient, no update, as torch
            grad = source.narrow(0, piece.shard_offset, piece.numel)
            tensor.grad = grad if grad.dtype == tensor.dtype else grad.to(tensor.dtype)
            bound = True
        if bound and note:
            self._note_bound(bucket)

    def _bound_gradients(self, bucket: int) -> list[torch.Tensor]:
        """What other code changes a bucket's bound gradients through: its pieces' ``.grad`` (in
        ``param_groups``) and the model's gradient buffer (each ``p.grad`` a view of it)."""
        pieces = [tensor.grad for _, tensor in self._bucket_pieces[bucket] if tensor.grad is not None]
        return pieces + self.model.owned_gradients.tensors(bucket)

    def _note_bound(self, bucket: int) -> None:
        self._bound_guard.note(bucket, self._bound_gradients(bucket))

    def _refuse_bound_gradients_changed(self) -> None:
        """Before any update of a step: raise where code outside the optimizer changed gradients after they
        were bound to the pieces. Each rank holds them averaged only in its own shard, so anything computed
        from them (torch.nn.utils.clip_grad_norm_'s norm over ``opt.param_groups``, as Lightning clips, or
        over the parameters after ``opt.finish_reductions()``) differs per rank: the ranks' weights would part,
        silently. (GradScaler's unscale moves no version counter; opt.clip_grad_norm_ notes its own change.)"""
        changed = [  # (only buckets bound before step(): none in a loop that reads no param_groups there)
            bucket
            for bucket in self._bound_guard.noted()
            if self._bound_guard.changed(bucket, self._bound_gradients(bucket), release=False)
        ]
        self._bound_guard.clear()
        if not changed:
            return
        order = (
            " (here opt.gather_gradients() came before opt.param_groups was read, as scaler.unscale_(opt) reads it: "
            "the pieces were bound again and the gathered gradients went stale; call it after unscale_)"
            if self._bound_after_gather
            else ""
        )
        raise bound_gradients_changed(changed[0], self.model.owned_gradients.members_text(changed[0]), order)

    def _wait_gather(self, bucket: int, module: str = "") -> None:
        with self._reads.paused():  # (its own reads of the parameters are not a forward's)
            self._wait_gather_unwatched(bucket, module)

    def _wait_gather_unwatched(self, bucket: int, module: str) -> None:
        self._check_params_untouched([bucket])
        handle = self._shard_step.take_gather(bucket)
        if handle is None:
            return
        start = time.perf_counter()
        try:
            wait_with_timeout(handle, self.model.manager.stall_timeout_s)
        except Exception as exc:
            raise self.model.manager.explain_failure(bucket, exc, _GATHER_NAMED) from exc
        end = time.perf_counter()
        self._timeline.waited(end - start)
        self._note_written(bucket)
        tracer = getattr(self.model.manager.observer, "bucket_update", None)
        if tracer is not None and module:
            tracer("forward wait", bucket, self.model.manager.steps_synced, start, end, module)

    def _finish_reads(self, indices: list[int], module: str) -> None:
        """Before a forward reads these parameters: their buckets updated and all-gathered. Every all-gather was
        launched in step() on every rank (overlap), so this waits for this rank's own: a forward on one rank
        (an evaluation on rank 0) issues no collective here."""
        manager = self.model.manager
        for bucket in self._shard_step.read_order(buckets_read(indices, manager.plan.location)):
            if self._shard_step.ungathered(bucket) or manager.deferred_pending:
                self._advance(block=True, until=bucket, module=module)
            self._wait_gather(bucket, module)

    def _times_forward(self) -> bool:
        """Until the online bucket-size tune (bucket_size_mb="auto") has run and the launch order is planned:
        the input of their simulated sharded step."""
        return self.overlap and (self.model.tune_pending or self._plans_schedule())

    def predict_overlapped(self, plan: BucketPlan, cost: Any) -> OrderPrediction | None:
        """For ``bucket_size_mb="auto"``: the sharded step simulated were the model bucketed as ``plan``
        (:func:`~collective_ops.bucketing.shard.step.sharded_orders`: its best reduce-scatter order with
        ``schedule="auto"``, else plan order), from the last backward and the forward after it; None without
        that profile."""
        stats = self.model.manager.last_stats
        if not (self.overlap and stats.backward_start is not None and self._timeline.complete(stats.backward_start)):
            return None
        planned = self.schedule == "auto"
        return sharded_score(*self._priced(plan, cost), planned=planned, update_s=self.update_seconds)

    def _sharded_orders(self) -> Any:
        """The launch-order planner's simulator here: every reduce-scatter order of the plan, best first."""
        return lambda cost: sharded_orders(*self._priced(self.model.manager.plan, cost), update_s=self.update_seconds)

    def _priced(self, plan: BucketPlan, cost: Any) -> tuple:
        """The timed step as ``plan`` buckets it, and what prices its collectives (the sharded simulator's input)."""
        shares = self.model.manager.wire_shares(plan)
        profile = self._timeline.profile(self.model.manager.last_stats, plan, shares)
        return profile, plan, shares, self._wire_dtype(), cost.cost, lambda dtype: getattr(torch, dtype).itemsize

    # -- what the rest of the loop may call --------------------------------------------------------
    def zero_grad(self, set_to_none: bool = True) -> None:
        """As the class's zero_grad, over the model's parameters (their owed buckets cleared after the update);
        gradients reduced but never stepped on are dropped with them."""
        self._stepped.clear()
        self._bound_guard.clear()
        self._gradients_gathered = self._bound_after_gather = False
        super().zero_grad(set_to_none)
        if not self._consumed():
            self._skip_step()

    def backward_reaches_outputs(self) -> None:
        """A backward about to add onto reduced gradients no step() used yet (a second backward per step without
        no_sync(): the DCGAN tutorial's discriminator, its real and fake losses apart). Under DDP it adds onto the
        averaged gradients; each rank holds them averaged in its own shard only, so they are all-gathered here
        first (as by :meth:`gather_gradients`: one all-gather of the gradients), before the backward's first gradient
        adds onto them. Not where they were reduced in another dtype than the buffers', marked (never stepped
        on) or cleared by the module since: :meth:`backward_starts` decides those."""
        if self._consumed() or self._gradients_gathered or self._reduced_off_buffers():
            return
        if self.model.manager.grad_dtype is not None:
            return  # (main gradients: no p.grad to gather into)
        if self._stepped.marked_names(self._reduction()) is not None or self._cleared_but(None):
            return
        self._gather_whole()  # (every rank runs this backward: no meeting first, as gather_gradients() has)

    def backward_starts(self, param: torch.Tensor | None = None) -> None:
        """A backward that reduces, while the last one's reduced gradients wait for step(): refused. Its
        gradients would add to a buffer averaged in this rank's shard only (the rest holds the last local
        gradients), and the next reduce-scatter would mix the two: DDP's accumulation would not come out.
        Except where they were all-gathered whole first (:meth:`backward_reaches_outputs`): added onto, as under
        DDP; or cleared through the module since (``model.zero_grad()``): dropped, as the optimizer's zero_grad()
        drops them; or marked (never stepped on): dropped, and this backward's reduction marked instead.
        (Checked first, at every backward: a parameter moved off its shard buffer, :meth:`_refuse_params_moved`.)"""
        self._refuse_params_moved()
        if self._consumed():
            return
        if self._gradients_gathered:  # whole on every rank (backward_reaches_outputs): added onto, as under DDP
            self._gradients_gathered = False
            return
        tainted = self._stepped.marked_names(self._reduction())
        cleared = self._cleared_but(param)
        if tainted is not None or cleared:
            # Cleared through the module since (model.zero_grad()): dropped, as under DDP. Or never to be stepped
            # on (marked): dropped too, this backward's reduction marked in its place (a PGD loop's adversarial
            # backwards after step(), before its zero_grad()).
            self.synchronize()  # its reduce-scatters finished before this backward's gradients reach the buffers
            self._skip_step()
            self._stepped.marked = None if cleared else (self._shard_step.steps_applied + 1, tainted)
            return
        raise second_backward()

    @property
    def awaits_first_gradient(self) -> bool:
        return self._stepped.awaits

    def first_gradient_after_step(self, param: torch.Tensor) -> None:
        """Under DDP a backward after step() without zero_grad() adds onto the averaged gradients the step used
        (accumulating across steps). Sharded, only this rank's shard of them was averaged (the rest holds its
        local gradients), so the next reduce-scatter sums something else: that reduction is marked
        (:class:`SteppedGradients`) and refused where it would be used (step(), clipping, gathering), on every rank
        alike; a zero_grad() drops it, as a GAN's discriminator drops the gradients its generator's step left.
        Checked once per step, and only where no opt.zero_grad() came in between: model.zero_grad() or setting
        p.grad to None clears them too, so what counts is a gradient object kept from the step and not all
        zeros, other than ``param``'s, which just had this backward's gradient added."""
        kept = self._stepped.take_kept(self._name_of, but=param)
        if kept:
            self._stepped.marked = (self._shard_step.steps_applied + 1, kept)

    def _cleared_but(self, param: torch.Tensor | None) -> bool:
        """Whether every model parameter's gradient is None or all zeros, ``param``'s aside (its gradient just
        arrived). Main gradients leave every p.grad None: there, whether zero_grad() came since."""
        if self.model.manager.grad_dtype is not None:
            return self.model.main_grads_cleared
        return all(p.grad is None or not bool(p.grad.any()) for p in self._model_params() if p is not param)

    def _refuse_tainted(self, call: str) -> None:
        """Raise where ``call`` would use the gradients of a backward that added onto a consumed step's."""
        self._stepped.refuse_marked(call, self._reduction())

    def _name_of(self, param: torch.Tensor) -> str:
        return self.model.param_names[self._index[id(param)]]

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` on the averaged gradients, from the shards (one small allreduce).

        Every bucket's reduction is finished first (this step loses its overlap with the next
        forward). Equal to torch's up to summation order (each rank sums its shards first).
        """
        if self._pending is not None:
            raise RuntimeError("clip_grad_norm_ after step(): clip between backward() and step(), as with torch")
        self._refuse_tainted("clip_grad_norm_()")
        self.finish_reductions()
        grads = [t.grad for _, t in self._pieces if t.grad is not None]
        total = clip_global_norm_(grads, max_norm, norm_type, self.model.engine.device)
        for bucket in self._buckets():
            self._note_bound(bucket)  # the optimizer's own change: not refused at step()
        return total

    def finish_reductions(self) -> None:
        """Wait for every reduce-scatter of the last backward; each piece's ``.grad`` then holds its
        averaged gradient (``param_groups`` holds the pieces: what ``scaler.unscale_(opt)`` reads). The
        gradients are the pieces' again: a later ``model.parameters()`` all-gathers what they hold then."""
        if self._allreduce_first_step and not self._consumed():
            self._start_sharding()  # the first step's gradients are complete: every shard of them is valid
        self._bound_after_gather = self._bound_after_gather or self._gradients_gathered  # (named in its error)
        self._gradients_gathered = False
        super().finish_reductions()
        for bucket in self._buckets():
            self._bind_grads(bucket, note=True)

    def gather_gradients(self) -> None:
        """Between backward() and step(), on every rank (a collective): every rank's averaged gradient shards
        all-gathered into the gradient buffers, so each ``p.grad`` holds the averaged gradient, as under DDP,
        and torch's ``clip_grad_norm_``/``clip_grad_value_`` over the parameters, or any change to ``p.grad``,
        computes the same on every rank; step() takes its shard from the buffers. That step pays one all-gather
        of the gradients (and loses its overlap). Not done by ``model.parameters()`` itself: a loop may read
        those on one rank only (a gradient norm logged on rank 0), where a collective would hang. Ranks first
        meet as ``state_dict()``'s do, so a call on one rank alone raises ``StallError`` rather than pair with
        the others' next collectives. Nothing to do where no backward reduced since the last step, or already
        gathered; refused where gradients are reduced in another dtype than the buffers'."""
        if self.model.manager.grad_dtype is not None:
            raise ValueError(
                f"gather_gradients() with main gradients in {self.model.manager.grad_dtype} (grad_dtype): p.grad is "
                "not in the gradient buffers (each gradient is added into them and dropped), so torch's clips over "
                "the parameters see none. Clip with opt.clip_grad_norm_(max_norm), which takes the global norm "
                "from the shards"
            )
        if self._reduced_off_buffers():
            raise ValueError(
                f"gather_gradients() with gradients reduced in {self._wire_dtype()} (compression): the reduced "
                "shards are not in the gradient buffers. Clip with opt.clip_grad_norm_(max_norm), which takes the "
                "global norm from the shards"
            )
        if self._consumed() or self._gradients_gathered:
            return
        self._refuse_tainted("gather_gradients()")
        self._wait_for_every_rank("gather_gradients()")
        self._gather_whole()

    def _gather_whole(self) -> None:
        """The averaged gradients whole in every bucket's buffer, on every rank (every rank calls it)."""
        self.synchronize()  # this backward's reduce-scatters waited for (and anything owed before them)
        if not self._allreduce_first_step:  # (the first step is all-reduced, as by DDP: whole already)
            self._gather_gradients()
        self._bound_guard.clear()
        self.model.owned_gradients.forget()
        self._gradients_gathered = True

    def _reduced_off_buffers(self) -> bool:
        """Whether gradients are reduced in another dtype than their buffers' (the shards kept apart)."""
        wire = self._wire_dtype()
        return wire is not None and any(spec.dtype != wire for spec in self.model.manager.plan.buckets)

    def _gather_gradients(self) -> None:
        """Gradients bound to the pieces (``param_groups`` read, GradScaler's unscale in place) written back into
        this rank's shard of the buffers and unbound (step() binds them again, with any change made meanwhile);
        then every bucket's shard all-gathered, on the all-gathers' own group."""
        gather_gradients_whole(self.model.manager, self.model.engine, self._bucket_pieces, self._gather_group)

    def _nonfinite_gradient_names(self) -> list[str]:
        """From the shards: each rank flags the parameters its pieces found not finite (one small allreduce)."""
        bad = nonfinite_params(self._pieces, len(self.model.param_list), self.model.engine.device)
        return [self.model.param_names[i] for i in bad]

    def _step_by_scaler_attributes(self, found_inf: torch.Tensor, grad_scale: torch.Tensor | None) -> None:
        raise RuntimeError(SHARDED_SCALER_ATTRIBUTES)

    def _found_inf_anywhere(self, found_inf_per_device: dict[Any, torch.Tensor]) -> bool:
        """Agreed over the ranks (each checked only its shards), written back into the scaler's record.
        Otherwise the rank that saw an overflow skipped its all-gathers while its peers waited in theirs."""
        return found_inf_on_any_rank(found_inf_per_device, self.model.engine.device)

    def _skip_step(self) -> None:
        self._shard_step.skip(self._reduction())
        self._bound_guard.clear()
        self._gradients_gathered = False
        for _, tensor in self._pieces:
            tensor.grad = None

    # -- checkpoints: the full state, resharded ---------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The full, unsharded state in the plain optimizer's format, on every rank (a collective). After
        :meth:`consolidate_state_dict` (and until the next step or load): on the rank it gathered to, that
        state, with no collective; on the others a ``RuntimeError``. torch.distributed.checkpoint, which calls it
        on every rank, gets each rank's state whatever was consolidated: its sharded state dict (see
        :mod:`.dcp`) or, asking for ``full_state_dict=True``, the full state."""
        if self._consolidated is not None and not _compat.called_by_torch_dcp():
            to, full = self._consolidated
            if full is None:
                raise RuntimeError(
                    f"the optimizer state was consolidated on rank {to} (consolidate_state_dict(to={to})), not on "
                    f"rank {self.model.engine.rank}: call state_dict() on rank {to}, or call it on every rank "
                    "without consolidating first (each then gets the full state)"
                )
            return self._in_plain_format(full)
        self._wait_for_every_rank("state_dict()")
        self.synchronize()
        if _compat.dcp_asks_sharded_optimizer_state():
            return self._in_plain_format(self._state_view().sharded())
        return self._in_plain_format(self._state_view().full())

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gather the full state onto rank ``to`` only, in host memory, as torch's ``ZeroRedundancyOptimizer``:
        every rank calls it, the others keep nothing (``state_dict()`` on every rank gives each the whole state,
        on the device). Then ``state_dict()`` on rank ``to`` alone returns it, with no collective, until the next
        step or load: ``opt.consolidate_state_dict(to=0)``, then ``if rank == 0: torch.save(opt.state_dict(), path)``."""
        super().consolidate_state_dict(to)  # checks ``to``
        self._wait_for_every_rank(f"consolidate_state_dict(to={to})")
        self.synchronize()
        mine = self.model.engine.rank == to
        full = self._state_view().full(keep=mine, device=torch.device("cpu"))
        self._consolidated = (to, full if mine else None)

    def _in_plain_format(self, full: dict[int, dict[str, Any]]) -> dict[str, Any]:
        """Every parameter's state (model index -> {key: value}) as the plain optimizer's state_dict."""
        return in_plain_format(full, self._optimizer.param_groups, self._model_groups, self._index)

    def _state_view(self) -> ShardedState:
        """The state of this rank's pieces, to gather or move (collectives)."""
        return ShardedState(
            self.model.engine,
            self._layout,
            self._pieces,
            self._bucket_pieces,
            self._param_buffers,
            self._optimizer.state,
            self.model.param_list,
        )

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a full state (ours at any world size, or a plain optimizer's of the same class)."""
        self.synchronize()
        groups = state_dict["param_groups"]
        if len(groups) != len(self._model_groups) or any(
            len(g["params"]) != len(params) for g, params in zip(groups, self._model_groups)
        ):
            raise ValueError(
                "loaded state dict has a different number of parameter groups or parameters per group than this "
                "optimizer: it belongs to another model or optimizer setup"
            )
        full = {}
        for group, params in zip(groups, self._model_groups):
            for number, p in zip(group["params"], params):
                if number in state_dict["state"] and id(p) in self._index:  # a frozen one's is never used
                    full[self._index[id(p)]] = state_dict["state"][number]
        self._install(full, [settings_of(g) for g in groups])
        self._masters_loaded = any(MASTER_KEY in state for state in full.values())

    def _owed_buckets(self) -> list[int]:
        """Buckets whose update or all-gather (launched or not yet) this step still owes."""
        return self._shard_step.owed(super()._owed_buckets(), self._reduction())

    def _write_owed(self, bucket: int) -> bool:
        return self._shard_step.write_owed(bucket, self._update_owed(bucket), self._reduction())

    def _after_load(self, module: nn.Module, incompatible_keys: Any) -> None:
        """Weights were loaded into ``module``: the fp32 masters of its own parameters follow them (its
        children's follow in their own calls; a submodule loaded alone leaves the others' fp32 digits). Where the
        optimizer's state (which holds the masters) was loaded since the last step, only the elements the loaded
        weights disagree with are taken: the same checkpoint's masters keep their fp32 digits, whichever of the
        two was loaded first."""
        own = {self._index[id(p)] for p in module.parameters(recurse=False) if id(p) in self._index}
        if own:  # (nothing is in flight: the module's load pre-hook, _before_load, finished it)
            self._take_params_into_masters(only_changed=self._masters_loaded, params=own)

    def reload_model_params(self) -> None:
        """Refresh the fp32 master pieces from the (low-precision) parameters (the model's ``load_state_dict``
        does it itself)."""
        self.synchronize()
        self._take_params_into_masters(only_changed=False)

    def _take_params_into_masters(
        self, only_changed: bool, buckets: list[int] | None = None, params: set[int] | None = None
    ) -> None:
        """Each fp32 master piece (of ``buckets``, of the model's parameters ``params``: all) from its
        low-precision parameter elements; ``only_changed``: only the elements the parameters no longer round the
        master to."""
        chosen = [
            (piece, tensor)
            for piece, tensor in self._pieces
            if (buckets is None or piece.bucket in buckets) and (params is None or piece.param_index in params)
        ]
        take_params_into_masters(chosen, self._param_buffers, self._param_shard, only_changed)

    def on_plan_change(self, plan: BucketPlan) -> None:
        """The model's buckets were replanned: lay the shards out anew, moving the state with them."""
        super().on_plan_change(plan)  # (a trial of the old plan's orders ends)
        if plan is self._layout.plan:
            return  # the same plan with fresh gradient buffers (a failed step): pieces bind lazily
        # the gradients the last step used, now in the new buffers (the old ones, freed, are not to be held here)
        self._stepped.follow()
        settings = [settings_of(g) for g in self._optimizer.param_groups]
        slices = self._state_view().moved_to(ShardLayout(plan, self.model.engine.world_size))
        # the old pieces (views of the old parameter buffers, fp32) let go first: each old buffer is freed as
        # soon as its last parameter moves into the new ones, rather than every old buffer beside every new one
        self._optimizer.state.clear()
        for group in self._optimizer.param_groups:
            group["params"] = []
        self._pieces, self._bucket_pieces = [], []
        self._lay_out(plan)
        self._install_slices(slices, settings)
        return_freed_memory()

    def _add_group(self, group: dict[str, Any]) -> None:
        """The shards laid out again with the new group's pieces, the state gathered and resharded (a collective)."""
        known = {id(p) for params in self._model_groups for p in params}
        if any(id(p) in known for p in group["params"]):
            raise ValueError("some parameters appear in more than one parameter group")
        self._wait_for_every_rank("add_param_group()")
        full = self._state_view().full()
        settings = [settings_of(g) for g in self._optimizer.param_groups]
        settings.append({**self._optimizer.defaults, **settings_of(group)})
        self._model_groups.append(list(group["params"]))
        self._install(full, settings)

    def _install(self, full: dict[int, dict[str, Any]], settings: list[dict[str, Any]]) -> None:
        """A fresh inner optimizer over the current pieces, holding their slices of ``full``."""
        # sliced before the masters are refreshed from the weights: a sharded state's values may view them
        view = self._state_view()
        slices = {
            piece: view.slice(full[piece.param_index], piece) for piece, _ in self._pieces if piece.param_index in full
        }
        self._install_slices(slices, settings)

    def _install_slices(self, slices: dict[ShardPiece, dict[str, Any]], settings: list[dict[str, Any]]) -> None:
        """A fresh inner optimizer over the current pieces, each holding its ``slices`` (copies) where given."""
        self._consolidated = None
        slices = {id(tensor): slices[piece] for piece, tensor in self._pieces if piece in slices}
        self.reload_model_params()
        optimizer = self._inner_optimizer(settings)
        optimizer.load_state_dict(inner_state_dict(optimizer.param_groups, slices))
        self._optimizer = optimizer
        self._rebind()

    def _wait_for_every_rank(self, call: str) -> None:
        """Return once every rank has come to ``call`` (which gathers the full state); raise ``StallError``
        if they do not within the stall timeout (``COLLECTIVE_OPS_STALL_TIMEOUT``), rather than block."""
        self._arrivals.wait(self.model.engine, self.model.manager.stall_timeout_s, call)


__all__ = ["ShardedDistributedOptimizer"]
