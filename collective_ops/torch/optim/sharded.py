"""Sharded data parallel on the same buckets: ``DistributedOptimizer(..., shard=True)`` (ZeRO-1).

Each bucket is padded to a multiple of the world size and cut into equal contiguous shards
(:class:`collective_ops.bucketing.shard.ShardLayout`). Gradients are reduce-scattered per
bucket during backward, in the plan's launch order on every rank; each rank runs the wrapped
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

import logging
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ...bucketing.hooks import allreduce_hook, reduce_scatter_hook
from ...bucketing.interfaces import Handle, wait_with_timeout
from ...bucketing.manager import StallError
from ...bucketing.plan import BucketPlan
from ...bucketing.schedule import OrderPrediction, simulate_sharded
from ...bucketing.shard import ShardLayout, ShardPiece
from ...bucketing.updates import PendingUpdates
from ...options import names_text
from ..ddp import DistributedDataParallel, called_by_torch_dcp, view_like
from ..inplace import InPlaceGuard
from . import state_json as _state_json
from .dcp import dcp_asks_sharded_state, is_sharded, piece_values, sharded_state_tensor
from .optimizer import DistributedOptimizer, frozen_setting
from .optimizer_set import given_optimizers

_log = logging.getLogger(__name__)
_GATHER_NAMED = "the all-gather of updated parameters"  # how a failed all-gather is named in its error

LOW_PRECISION = (torch.float16, torch.bfloat16)
# torch.optim classes whose update of an element reads only that element's gradient and state (and the
# group's hyperparameters): run on flat pieces of parameters, their arithmetic is unchanged.
ELEMENTWISE_OPTIMIZERS = tuple(
    getattr(torch.optim, name)
    for name in ("SGD", "Adam", "AdamW", "Adamax", "Adagrad", "Adadelta", "ASGD", "NAdam", "RAdam", "RMSprop", "Rprop")
)
MASTER_KEY = "master_param"  # fp32 master values of a low-precision parameter, in state_dict()
GRAD_REDUCE_DTYPES = (None, "float32")


class _ModelParamsGroup(dict):
    """One of the sharded optimizer's groups with the model's parameters as ``"params"``, for
    torch.distributed.checkpoint; its other keys are written through to the group."""

    def __init__(self, group: dict[str, Any], params: list[torch.Tensor]) -> None:
        super().__init__(group)
        super().__setitem__("params", list(params))
        self._group = group

    def __setitem__(self, key: str, value: Any) -> None:
        super().__setitem__(key, value)
        if key != "params":
            self._group[key] = value


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
        if not called_by_torch_dcp():
            return groups
        return [_ModelParamsGroup(group, params) for group, params in zip(groups, self._model_groups)]

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
        grad_reduce_dtype: str | None = None,
        assume_elementwise: bool = False,
        **kwargs: Any,
    ) -> None:
        if given_optimizers(optimizer_class) is not None:
            raise TypeError(
                "shard=True takes an optimizer class and its settings (DistributedOptimizer(model, torch.optim.AdamW, "
                "shard=True, lr=...)): it builds the class over this rank's shards. Optimizers built over whole "
                "parameters (several classes, e.g. Muon + AdamW) run with shard=False"
            )
        _refuse_non_elementwise(optimizer_class, assume_elementwise)
        if schedule not in (None, "plan"):
            raise ValueError(
                f"shard=True launches in plan order (schedule='plan'), got schedule={schedule!r}: a planned order "
                "is not supported with shard=True yet (its all-gathers have an order of their own)"
            )
        if grad_reduce_dtype not in GRAD_REDUCE_DTYPES:
            raise ValueError(
                f"grad_reduce_dtype must be None (the parameters' dtype) or 'float32', got {grad_reduce_dtype!r}"
            )
        if isinstance(model, DistributedDataParallel):
            _refuse_unsupported(model, grad_reduce_dtype)
        self.grad_reduce_dtype = grad_reduce_dtype
        self._inner_args = (args, kwargs)
        self._kept: dict[int, torch.Tensor] = {}  # bucket -> reduced shard in another dtype (fp32, fp16)
        self._gathers: dict[int, Handle] = {}  # bucket -> all-gather in flight
        self._next_gather = 0  # position in the gather order
        self._steps_applied = 0  # the model's synchronised step whose gradients were last applied
        self._warned_joined = False  # step_while_joined's warning: once
        self._stepped_grads: list[tuple[torch.Tensor, torch.Tensor]] = []  # (parameter, the gradient step() used)
        # The reduction of a backward that added onto gradients a step had consumed (a GAN's generator step
        # through this discriminator before its zero_grad()), with those gradients' names: never stepped on,
        # dropped by a zero_grad() (the optimizer's, or the module's before the next backward).
        self._tainted: tuple[int, list[str]] | None = None
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
        # Only for "has every rank come to gather the full state?": a rank that never comes (state_dict() called
        # on rank 0 alone, as a DDP loop saves) cannot pair it with its training collectives, as it would there.
        self._arrival_group = dist.new_group(backend=dist.get_backend()) if dist.get_world_size() > 1 else None
        self._arrival: Any = None  # this rank's arrival, posted and not yet matched by every rank
        super().__init__(
            model, optimizer_class, *args, params=params, overlap=overlap, shard=True, schedule=schedule, **kwargs
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
        return self.grad_reduce_dtype

    def _lay_out(self, plan: BucketPlan) -> None:
        """Parameters as views of padded per-bucket buffers; this rank's pieces (views, or fp32 masters)."""
        engine = self.model.engine
        self._bound_guard.clear()  # (noted per bucket of the old layout)
        self._layout = ShardLayout(plan, engine.world_size)
        self._param_buffers = []
        self._param_addresses = {}  # model index -> where its view of the buffers starts (see _refuse_params_moved)
        for spec, shards in zip(plan.buckets, self._layout.buckets):
            buffer = torch.zeros(shards.padded_numel, dtype=getattr(torch, spec.dtype), device=spec.device)
            with torch.no_grad():
                for index, offset in zip(spec.param_indices, spec.offsets):
                    p = self.model._params[index]
                    view = view_like(p, buffer, offset)
                    view.copy_(p.detach())
                    p.data = view
                    self._param_addresses[index] = view.data_ptr()
            self._param_buffers.append(buffer)
        self._pieces: list[tuple[ShardPiece, torch.Tensor]] = []
        for piece in self._layout.pieces(engine.rank):
            source = self._param_shard(piece.bucket).narrow(0, piece.shard_offset, piece.numel)
            master = source.detach().float().clone() if source.dtype in LOW_PRECISION else source
            self._pieces.append((piece, master))
        self._bucket_pieces = [[] for _ in plan.buckets]
        for piece, tensor in self._pieces:
            self._bucket_pieces[piece.bucket].append((piece, tensor))
        self._gather_order = list(reversed(range(len(plan.buckets))))  # the forward needs the last buckets first
        self._written_versions.clear()
        for bucket in range(len(plan.buckets)):
            self._note_written(bucket)

    def _note_written(self, bucket: int) -> None:
        """The optimizer wrote this bucket's parameters (laid out, all-gathered): their version counters, where
        this rank holds fp32 masters of them."""
        if any(_is_master(piece, tensor, self._param_buffers) for piece, tensor in self._bucket_pieces[bucket]):
            self._written_versions[bucket] = [p._version for p in self._bucket_params(bucket)]

    def _masters_follow_edits(self) -> None:
        """Before a step's updates: low-precision parameters changed in place since the optimizer last wrote them
        (``p.clamp_()`` as WGAN clips weights, ``torch.nn.init`` on a layer, under no_grad) have their fp32 masters
        take the change, as a plain optimizer steps from the changed weights; else the step would write the old
        masters back over it. Seen by the version counters: a change through ``p.data`` is not."""
        edited = [
            bucket
            for bucket, versions in self._written_versions.items()
            if [p._version for p in self._bucket_params(bucket)] != versions
        ]
        if edited:
            self._take_params_into_masters(only_changed=True, buckets=edited)

    def _refuse_params_moved(self) -> None:
        """A parameter whose storage was replaced after the shards were laid out (``p.data = tensor``,
        ``p.set_()``, a conversion of the inner module) no longer views the buffer its all-gather writes: it would
        keep its values while the optimizer trains the shard, silently. Refused at the first gradient of a
        backward, before any collective."""
        params = self.model._params
        moved = [index for index, address in self._param_addresses.items() if params[index].data_ptr() != address]
        if not moved:
            return
        raise RuntimeError(
            f"shard=True: the storage of {names_text([self.model._param_names[i] for i in moved], 3)} was replaced "
            "after DistributedOptimizer was built (p.data = tensor, p.set_(), or a cast or move of the inner "
            "module): the optimizer updates each parameter through its view of the shard buffers, so this one "
            "would keep its values while its shard trains. Change parameters' values in place (with "
            "torch.no_grad(): p.copy_(value)), load weights with model.load_state_dict(), and convert the model "
            "before wrap()"
        )

    def _param_shard(self, bucket: int) -> torch.Tensor:
        return self.model.engine.shard_of(self._param_buffers[bucket])

    def _inner_optimizer(self, settings: list[dict[str, Any]]) -> torch.optim.Optimizer:
        """The wrapped class over this rank's pieces, grouped as the model's parameters were."""
        group_of = {id(p): g for g, params in enumerate(self._model_groups) for p in params}
        pieces: list[list[torch.Tensor]] = [[] for _ in self._model_groups]
        for piece, tensor in self._pieces:
            group = group_of.get(id(self.model._params[piece.param_index]))
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
        raise RuntimeError(
            f"{type(optimizer).__name__}.step() over parameters of a model whose DistributedOptimizer has "
            "shard=True: each rank holds averaged gradients only for its shard of every bucket, and the all-gather "
            "writes every parameter of a bucket, so that optimizer would train on gradients not averaged and its "
            "updates be overwritten. Give every trained parameter to the DistributedOptimizer (parameter groups "
            "for different settings), or use shard=False"
        )

    def _gradients_unstepped(self) -> bool:
        """True between a backward that reduced and the step() that consumes it: each piece's ``.grad`` is bound
        to its averaged shard only by finish_reductions() (what ``scaler.unscale_(opt)`` must read)."""
        return self._reduction() != self._steps_applied

    def backward_ended(self) -> None:
        """Nothing is finished early: outside this rank's shard no gradient is ever averaged, and an optimizer
        beside this one is refused (:meth:`before_optimizer_beside`)."""

    # -- the step ------------------------------------------------------------------------------
    @property
    def in_flight(self) -> bool:
        return super().in_flight or bool(self._gathers)

    def _start_step(self) -> None:
        """Update each bucket's shard once its reduce-scatter lands and all-gather it; the rest as needed."""
        if self._pending is not None or self._gathers:
            self.synchronize()  # a previous step's updates were never needed: owed first
        self._masters_follow_edits()
        self.update_seconds = 0.0
        self._masters_loaded = False
        self._consolidated = None  # the state moves on
        reduction = self._reduction()
        if reduction == self._steps_applied:
            self._refuse_gradients_kept("step() again after step() with no backward in between, while")
            self._step_on_cleared_gradients()
            return
        self._refuse_tainted("step()")
        self._refuse_bound_gradients_changed()
        self._gradients_gathered = self._bound_after_gather = False
        if self._allreduce_first_step:
            self._start_sharding()  # the gradients of this step are complete: every shard of them is valid
        self._steps_applied = reduction
        # what a backward before the next zero_grad() would add onto (_refuse_gradients_kept_after_step)
        self._stepped_grads = [(p, p.grad) for p in self._model_params() if p.grad is not None]
        self._pending = PendingUpdates.start(len(self.model.manager.plan.buckets), self._groups, frozen_setting)
        self._next_gather = 0
        if self.overlap:
            # Every reduce-scatter waited for and every all-gather launched before step() returns, so code that
            # runs on some ranks only next (rank 0 saving model.module.state_dict()) waits only for collectives
            # every rank has issued; launched later, at each rank's own next forward, they hung there.
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
        zeroed = [(piece, t) for piece, t in self._pieces if self.model._params[piece.param_index].grad is not None]
        for _, tensor in zeroed:
            tensor.grad = torch.zeros_like(tensor)
        self._step_pieces(zeroed, None)
        self._next_gather = 0
        self.synchronize()  # (no step owed: it launches every all-gather, in order, and waits for them)

    def step_while_joined(self) -> None:
        """In a step a joined rank shadows (``model.join()``): its shards' update from the reduced gradients and
        their all-gathers, which its peers' forwards wait for, as torch's ZeroRedundancyOptimizer steps under
        Join. With its own ``param_groups``: a learning-rate scheduler stepped on the other ranks after this
        one joined does not reach its shards (warned once)."""
        if not self._warned_joined:
            self._warned_joined = True
            _log.warning(
                "rank %d joined: it keeps updating its shards with its own optimizer settings (lr %s); changes "
                "that the other ranks' schedulers make from now on do not reach them",
                self.model.engine.rank,
                [group["lr"] for group in self._groups],
            )
        scaler = self._scaler_ref() if self._scaler_ref is not None else None
        if scaler is None or not scaler.is_enabled():
            self.step()
            return
        # Its own steps went through a GradScaler, so its peers' still do: the gradients reduced into its shards
        # are scaled by the same scale, and each peer's step agrees on overflow (a collective). It steps through
        # the scaler too, unscaling by that scale, taking part in the agreement and backing off alike.
        scaler.step(self)
        scaler.update()

    def _reduction(self) -> int:
        """The number of the model's synchronised step whose gradients are (being) reduced."""
        manager = self.model.manager
        return manager.steps_synced + (1 if manager.deferred_pending else 0)

    def _finish_before_leaving(self) -> None:
        super()._finish_before_leaving()
        self._gather_group = self._arrival_group = self._arrival = None

    def synchronize(self) -> None:
        """Finish every reduction, apply every owed update, finish every all-gather (blocking)."""
        self._advance(block=True)
        for bucket in list(self._gathers):
            self._wait_gather(bucket)

    def _advance(self, block: bool, until: int | None = None, module: str = "") -> None:
        """Apply the updates of the buckets whose reduction landed (local work, in any order), and with
        ``block`` of every bucket up to ``until`` in the gather order (all: None), waiting for their
        reductions; then launch the all-gathers of the gather order's updated prefix. Only how far
        the all-gathers get depends on timing, never their order."""
        manager = self.model.manager
        stop = len(self._gather_order) if until is None else self._gather_order.index(until) + 1
        self._finish(
            [
                bucket
                for position, bucket in enumerate(self._gather_order)
                if (block and position < stop) or not manager.deferred_pending or manager.bucket_ready(bucket)
            ],
            module,
        )
        if self._steps_applied != self._reduction():
            return  # no step() for these gradients: parameters unchanged, nothing to gather
        while self._next_gather < len(self._gather_order):
            bucket = self._gather_order[self._next_gather]
            if self._pending is not None and bucket in self._pending.buckets:
                return
            try:
                self._gathers[bucket] = self.model.engine.all_gather_shard(
                    self._param_buffers[bucket], async_op=True, group=self._gather_group
                )
            except Exception as exc:  # refused at once (Gloo's point-to-point to a peer already gone)
                if manager.is_transport_error(exc):
                    raise manager.explain_failure(bucket, exc, _GATHER_NAMED) from exc
                raise
            self._next_gather += 1

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
            if _is_master(piece, tensor, self._param_buffers):
                self._param_shard(piece.bucket).narrow(0, piece.shard_offset, piece.numel).copy_(tensor)

    def _bind_grads(self, bucket: int, note: bool = False) -> None:
        """Each piece's ``.grad``: its part of the reduced shard (cast to the piece's dtype where it differs).
        ``note``: bound before step() (where other code may change them): their version counters are noted."""
        manager = self.model.manager
        self.model.check_gradients_untouched([bucket])  # p.grad averaged only in this shard: not for other code
        source = self._kept.pop(bucket, None)
        if source is None:
            source = self.model.engine.shard_of(manager.buffers[bucket])
        bound = False
        for piece, tensor in self._bucket_pieces[bucket]:
            if tensor.grad is not None:
                continue  # bound already this step (clip_grad_norm_ scaled it)
            if piece.param_index in manager.globally_unused and self.model._params[piece.param_index].grad is None:
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
        return pieces + self.model._gradient_tensors(bucket)

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
        raise RuntimeError(
            f"shard=True: the gradients of bucket {changed[0]} ({self.model.bucket_members_text(changed[0])}) were "
            "changed in place between backward() and step(), after opt.param_groups or opt.finish_reductions() "
            "bound them to this rank's shard. Each rank holds the averaged gradient only in its own shard, so what "
            "code outside the optimizer computes from them differs per rank: torch.nn.utils.clip_grad_norm_ over "
            "opt.param_groups (or over the parameters) takes this rank's norm only, and the ranks' weights would "
            "part. Clip with opt.clip_grad_norm_(max_norm) (the global norm, from the shards), or call "
            "opt.gather_gradients() on every rank first: it all-gathers the averaged gradients, after which "
            f"torch's clip_grad_norm_/clip_grad_value_ over model.parameters() work as under DDP{order}"
        )

    def _wait_gather(self, bucket: int, module: str = "") -> None:
        with self._reads.paused():  # (its own reads of the parameters are not a forward's)
            self._wait_gather_unwatched(bucket, module)

    def _wait_gather_unwatched(self, bucket: int, module: str) -> None:
        self._check_params_untouched([bucket])
        handle = self._gathers.pop(bucket, None)
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
        location = manager.plan.location
        for bucket in sorted({location[i][0] for i in indices}, key=self._gather_order.index):
            if bucket in self._gather_order[self._next_gather :] or manager.deferred_pending:
                self._advance(block=True, until=bucket, module=module)
            self._wait_gather(bucket, module)

    def _times_forward(self) -> bool:
        """Until the online bucket-size tune (bucket_size_mb="auto") has run: its simulated sharded step's input."""
        return self.overlap and self.model.tune_pending

    def predict_overlapped(self, plan: BucketPlan, cost: Any) -> OrderPrediction | None:
        """For ``bucket_size_mb="auto"``: the sharded step simulated were the model bucketed as ``plan``
        (:func:`simulate_sharded`), from the last backward and the forward after it; None without that profile.

        A reduce-scatter or all-gather of a bucket of X bytes sends (N-1)/N of X per rank, what an allreduce
        of X/2 sends: each costs the fitted allreduce cost of X/2 (a row-sparse table's rows are allreduced),
        with the queued latency for all but the first of each kind: the all-gathers go back to back at
        ``step()``, and the reduce-scatters of a communication-bound step queue behind each other.
        """
        stats = self.model.manager.last_stats
        if not (self.overlap and stats.backward_start is not None and self._timeline.complete(stats.backward_start)):
            return None
        shares = self.model.manager.wire_shares(plan)
        profile = self._timeline.profile(stats, plan, shares)
        wire = self._wire_dtype()
        reduce_s, gather_s = [], []
        first_gathered = profile.needs()[0]
        for index, (bucket, sent) in enumerate(zip(plan.buckets, profile.nbytes)):
            ratio = _itemsize(wire or bucket.dtype) / _itemsize(bucket.dtype)  # bytes on the wire per byte
            by_rows = len(bucket.param_indices) == 1 and bucket.param_indices[0] in shares
            reduced = int(sent * ratio) if by_rows else int(bucket.nbytes * ratio / 2)
            reduce_s.append(cost.cost(reduced, queued=index > 0))
            gather_s.append(cost.cost(bucket.nbytes // 2, queued=index != first_gathered))
        return simulate_sharded(profile, reduce_s, gather_s)

    # -- what the rest of the loop may call --------------------------------------------------------
    def zero_grad(self, set_to_none: bool = True) -> None:
        """As the class's zero_grad, over the model's parameters (their owed buckets cleared after the update);
        gradients reduced but never stepped on are dropped with them."""
        self._stepped_grads = []
        self._tainted = None
        self._bound_guard.clear()
        self._gradients_gathered = self._bound_after_gather = False
        super().zero_grad(set_to_none)
        if self._steps_applied != self._reduction():
            self._skip_step()

    def backward_reaches_outputs(self) -> None:
        """A backward about to add onto reduced gradients no step() used yet (a second backward per step without
        no_sync(): the DCGAN tutorial's discriminator, its real and fake losses apart). Under DDP it adds onto the
        averaged gradients; each rank holds them averaged in its own shard only, so they are all-gathered here
        first (as by :meth:`gather_gradients`: one all-gather of the gradients), before the backward's first gradient
        adds onto them. Not where they were reduced in another dtype than the buffers', marked (never stepped
        on) or cleared by the module since: :meth:`backward_starts` decides those."""
        if self._steps_applied == self._reduction() or self._gradients_gathered or self._reduced_off_buffers():
            return
        if self._tainted_names() is not None or self._cleared_but(None):
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
        if self._steps_applied == self._reduction():
            return
        if self._gradients_gathered:  # whole on every rank (backward_reaches_outputs): added onto, as under DDP
            self._gradients_gathered = False
            return
        tainted = self._tainted_names()
        cleared = self._cleared_but(param)
        if tainted is not None or cleared:
            # Cleared through the module since (model.zero_grad()): dropped, as under DDP. Or never to be stepped
            # on (marked): dropped too, this backward's reduction marked in its place (a PGD loop's adversarial
            # backwards after step(), before its zero_grad()).
            self.synchronize()  # its reduce-scatters finished before this backward's gradients reach the buffers
            self._skip_step()
            self._tainted = None if cleared else (self._steps_applied + 1, tainted)
            return
        raise RuntimeError(
            "shard=True: backward() ran again before step() used the gradients it reduced last time. Each "
            "backward reduce-scatters, so this rank holds the averaged gradient only in its own shard, and a "
            "second backward would add local gradients to it and mix the two (not DDP's accumulation). They are "
            "all-gathered first where the backward passes through the model's outputs, but not where gradients "
            "are reduced in another dtype than their buffers' (grad_reduce_dtype, compression), nor for a "
            "backward that does not. Accumulate micro-batches under `with model.no_sync():` (every one but the "
            "last), or call opt.step() (or opt.zero_grad() to drop them) between backward() calls"
        )

    @property
    def awaits_first_gradient(self) -> bool:
        return bool(self._stepped_grads)

    def first_gradient_after_step(self, param: torch.Tensor) -> None:
        """Under DDP a backward after step() without zero_grad() adds onto the averaged gradients the step used
        (accumulating across steps). Sharded, only this rank's shard of them was averaged (the rest holds its
        local gradients), so the next reduce-scatter sums something else: that reduction is marked
        (:attr:`_tainted`) and refused where it would be used (step(), clipping, gathering), on every rank
        alike; a zero_grad() drops it, as a GAN's discriminator drops the gradients its generator's step left.
        Checked once per step, and only where no opt.zero_grad() came in between: model.zero_grad() or setting
        p.grad to None clears them too, so what counts is a gradient object kept from the step and not all
        zeros, other than ``param``'s, which just had this backward's gradient added."""
        kept = self._kept_gradient_names(but=param)
        if kept:
            self._tainted = (self._steps_applied + 1, kept)

    def _kept_gradient_names(self, but: torch.Tensor | None = None) -> list[str]:
        """The parameters whose gradient the last step used is still there and not all zeros (``but``'s aside).
        Asked once per step: where none is kept they were cleared, and those cleared in place stay all zeros
        until a backward."""
        stepped, self._stepped_grads = self._stepped_grads, []
        return [
            self.model._param_names[self._index[id(p)]]
            for p, grad in stepped
            if p is not but and p.grad is grad and bool(grad.any())
        ]

    def _cleared_but(self, param: torch.Tensor | None) -> bool:
        """Whether every model parameter's gradient is None or all zeros, ``param``'s aside (its gradient just
        arrived)."""
        return all(p.grad is None or not bool(p.grad.any()) for p in self._model_params() if p is not param)

    def _tainted_names(self) -> list[str] | None:
        """Where the last backward's reduction is marked (it added onto a consumed step's gradients): the names
        of the gradients that step left; else None."""
        if self._tainted is not None and self._tainted[0] == self._reduction():
            return self._tainted[1]
        return None

    def _refuse_tainted(self, call: str) -> None:
        """Raise where ``call`` would use the gradients of a backward that added onto a consumed step's."""
        kept = self._tainted_names()
        if kept is not None:
            self._refuse_kept(f"{call} on gradients a backward added after the last step(), while", kept)

    def _refuse_gradients_kept(self, what: str, but: torch.Tensor | None = None) -> None:
        """Raise where gradients the last step used are still there and not all zeros (``but``'s aside)."""
        kept = self._kept_gradient_names(but)
        if kept:
            self._refuse_kept(what, kept)

    def _refuse_kept(self, what: str, kept: list[str]) -> None:
        raise RuntimeError(
            f"shard=True: {what} the gradients that step used were never cleared "
            f"({names_text(kept, limit=3)}). Under DDP a plain optimizer "
            "would use them again (a second step() applies them twice; a backward adds onto them, accumulating "
            "across steps); sharded, the step consumed this rank's averaged shard of them and the rest holds its "
            "local gradients, so the result would differ from DDP's. Call opt.zero_grad() after step() or before "
            "the next backward (a backward whose gradients are then dropped by a zero_grad() is fine: a GAN's "
            "generator step through this model); to accumulate micro-batches, run all but the last backward of a "
            "step under `with model.no_sync():`"
        )

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
        norm_type = float(norm_type)
        device = self.model.engine.device
        if grads:
            norms = torch.stack([torch.linalg.vector_norm(g, norm_type) for g in grads])
            local = norms.max() if norm_type == float("inf") else norms.pow(norm_type).sum()
        else:
            local = torch.zeros((), device=device)
        total = local.to(torch.float32).reshape(1).clone()
        op = dist.ReduceOp.MAX if norm_type == float("inf") else dist.ReduceOp.SUM
        dist.all_reduce(total, op=op)
        total = total[0] if norm_type == float("inf") else total[0].pow(1.0 / norm_type)
        coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for g in grads:
            g.mul_(coefficient.to(g.dtype))
        for bucket in range(len(self.model.manager.plan.buckets)):
            self._note_bound(bucket)  # the optimizer's own change: not refused at step()
        return total

    def finish_reductions(self) -> None:
        """Wait for every reduce-scatter of the last backward; each piece's ``.grad`` then holds its
        averaged gradient (``param_groups`` holds the pieces: what ``scaler.unscale_(opt)`` reads). The
        gradients are the pieces' again: a later ``model.parameters()`` all-gathers what they hold then."""
        if self._allreduce_first_step and self._reduction() != self._steps_applied:
            self._start_sharding()  # the first step's gradients are complete: every shard of them is valid
        self._bound_after_gather = self._bound_after_gather or self._gradients_gathered  # (named in its error)
        self._gradients_gathered = False
        super().finish_reductions()
        for bucket in range(len(self.model.manager.plan.buckets)):
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
        if self._reduced_off_buffers():
            raise ValueError(
                f"gather_gradients() with gradients reduced in {self._wire_dtype()} (grad_reduce_dtype or "
                "compression): the reduced shards are not in the gradient buffers. Clip with "
                "opt.clip_grad_norm_(max_norm), which takes the global norm from the shards"
            )
        if self._reduction() == self._steps_applied or self._gradients_gathered:
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
        self.model.forget_gradients_owned()
        self._gradients_gathered = True

    def _reduced_off_buffers(self) -> bool:
        """Whether gradients are reduced in another dtype than their buffers' (the shards kept apart)."""
        wire = self._wire_dtype()
        return wire is not None and any(spec.dtype != wire for spec in self.model.manager.plan.buckets)

    def _gather_gradients(self) -> None:
        """Gradients bound to the pieces (``param_groups`` read, GradScaler's unscale in place) written back into
        this rank's shard of the buffers and unbound (step() binds them again, with any change made meanwhile);
        then every bucket's shard all-gathered, on the all-gathers' own group."""
        manager = self.model.manager
        handles = []
        for bucket, buffer in enumerate(manager.buffers):
            source = self.model.engine.shard_of(buffer)
            for piece, tensor in self._bucket_pieces[bucket]:
                if tensor.grad is not None:
                    source.narrow(0, piece.shard_offset, piece.numel).copy_(tensor.grad)
                    tensor.grad = None
            handles.append(self.model.engine.all_gather_shard(buffer, async_op=True, group=self._gather_group))
        for bucket, handle in enumerate(handles):
            try:
                wait_with_timeout(handle, manager.stall_timeout_s)
            except Exception as exc:
                raise manager.explain_failure(bucket, exc, "the all-gather of averaged gradients") from exc

    def _nonfinite_gradient_names(self) -> list[str]:
        """From the shards: each rank flags the parameters its pieces found not finite (one small allreduce)."""
        flags = torch.zeros(len(self.model._params), dtype=torch.int32, device=self.model.engine.device)
        for piece, tensor in self._pieces:
            if tensor.grad is not None and not bool(torch.isfinite(tensor.grad).all()):
                flags[piece.param_index] = 1
        if dist.get_world_size() > 1:
            dist.all_reduce(flags)
        return [self.model._param_names[i] for i in flags.nonzero().flatten().tolist()]

    def _step_by_scaler_attributes(self, found_inf: torch.Tensor, grad_scale: torch.Tensor | None) -> None:
        raise RuntimeError(
            "shard=True under a GradScaler that sets grad_scale and found_inf on the optimizer instead of handing "
            "itself to step() (torch's newer protocol): each rank's inf check saw only its own shards, and the "
            "scaler keeps that per-rank verdict for update(), so an overflow in one shard would part the ranks' "
            "scales and their training. Not supported: use shard=False with a GradScaler, or bf16 autocast, "
            "which needs no loss scaling"
        )

    def _found_inf_anywhere(self, found_inf_per_device: dict[Any, torch.Tensor]) -> bool:
        """Each rank checked only its shards, so an overflow is seen where its element lives: the verdict is
        agreed over the ranks (one small allreduce, as Megatron's distributed optimizer does) and written back
        into the scaler's record, so that every rank skips the step and ``scaler.update()`` backs off alike.
        Otherwise the rank that saw it skipped its all-gathers while its peers waited in theirs."""
        device = self.model.engine.device
        agreed = torch.tensor([float(super()._found_inf_anywhere(found_inf_per_device))], device=device)
        if dist.get_world_size() > 1:
            dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
        verdict = agreed.item()
        for value in found_inf_per_device.values():
            value.fill_(verdict)
        if not found_inf_per_device:  # no piece of this rank had a gradient: scaler.update() still needs a record
            found_inf_per_device[device] = agreed[0].clone()
        return bool(verdict)

    def _skip_step(self) -> None:
        self._steps_applied = self._reduction()
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
        if self._consolidated is not None and not called_by_torch_dcp():
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
        if dcp_asks_sharded_state():
            return self._in_plain_format(self._sharded_state())
        return self._in_plain_format(self._full_state())

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gather the full state onto rank ``to`` only, in host memory, as torch's ``ZeroRedundancyOptimizer``:
        every rank calls it, the others keep nothing (``state_dict()`` on every rank gives each the whole state,
        on the device). Then ``state_dict()`` on rank ``to`` alone returns it, with no collective, until the next
        step or load: ``opt.consolidate_state_dict(to=0)``, then ``if rank == 0: torch.save(opt.state_dict(), path)``."""
        super().consolidate_state_dict(to)  # checks ``to``
        self._wait_for_every_rank(f"consolidate_state_dict(to={to})")
        self.synchronize()
        mine = self.model.engine.rank == to
        full = self._full_state(keep=mine, device=torch.device("cpu"))
        self._consolidated = (to, full if mine else None)

    def _in_plain_format(self, full: dict[int, dict[str, Any]]) -> dict[str, Any]:
        """Every parameter's state (model index -> {key: value}) as the plain optimizer's state_dict."""
        state, groups, number = {}, [], 0
        for inner_group, params in zip(self._optimizer.param_groups, self._model_groups):
            ids = []
            for p in params:
                index = self._index.get(id(p))  # None: frozen (requires_grad=False), never stepped, no state
                if index in full:
                    state[number] = full[index]
                ids.append(number)
                number += 1
            groups.append({**_settings(inner_group), "params": ids})
        return {"state": state, "param_groups": groups}

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
        self._install(full, [_settings(g) for g in groups])
        self._masters_loaded = any(MASTER_KEY in state for state in full.values())

    def _owed_buckets(self) -> list[int]:
        """Buckets whose update or all-gather (launched or not yet) this step still owes."""
        owed = set(super()._owed_buckets()) | set(self._gathers)
        if self._steps_applied == self._reduction():
            owed |= set(self._gather_order[self._next_gather :])
        return sorted(owed)

    def _write_owed(self, bucket: int) -> bool:
        if super()._write_owed(bucket) or bucket in self._gathers:
            return True
        return self._steps_applied == self._reduction() and bucket in self._gather_order[self._next_gather :]

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
        with torch.no_grad():
            for piece, tensor in self._pieces:
                chosen = (buckets is None or piece.bucket in buckets) and (
                    params is None or piece.param_index in params
                )
                if chosen and _is_master(piece, tensor, self._param_buffers):
                    param = self._param_shard(piece.bucket).narrow(0, piece.shard_offset, piece.numel)
                    values = param.to(tensor.dtype)
                    if only_changed:
                        values = torch.where(param != tensor.to(param.dtype), values, tensor)
                    tensor.copy_(values)

    def on_plan_change(self, plan: BucketPlan) -> None:
        """The model's buckets were replanned: lay the shards out anew, moving the state with them."""
        if plan is self._layout.plan:
            return  # the same plan with fresh gradient buffers (a failed step): pieces bind lazily
        # the gradients the last step used, now in the new buffers (the old ones, freed, are not to be held here)
        self._stepped_grads = [(p, p.grad) for p, _ in self._stepped_grads if p.grad is not None]
        settings = [_settings(g) for g in self._optimizer.param_groups]
        slices = self._state_moved_to(ShardLayout(plan, self.model.engine.world_size))
        # the old pieces (views of the old parameter buffers, fp32) let go first: each old buffer is freed as
        # soon as its last parameter moves into the new ones, rather than every old buffer beside every new one
        self._optimizer.state.clear()
        for group in self._optimizer.param_groups:
            group["params"] = []
        self._pieces, self._bucket_pieces = [], []
        self._lay_out(plan)
        self._install_slices(slices, settings)
        _return_freed_memory()

    def _add_group(self, group: dict[str, Any]) -> None:
        """The shards laid out again with the new group's pieces, the state gathered and resharded (a collective)."""
        known = {id(p) for params in self._model_groups for p in params}
        if any(id(p) in known for p in group["params"]):
            raise ValueError("some parameters appear in more than one parameter group")
        self._wait_for_every_rank("add_param_group()")
        full = self._full_state()
        settings = [_settings(g) for g in self._optimizer.param_groups]
        settings.append({**self._optimizer.defaults, **_settings(group)})
        self._model_groups.append(list(group["params"]))
        self._install(full, settings)

    def _install(self, full: dict[int, dict[str, Any]], settings: list[dict[str, Any]]) -> None:
        """A fresh inner optimizer over the current pieces, holding their slices of ``full``."""
        # sliced before the masters are refreshed from the weights: a sharded state's values may view them
        slices = {
            piece: self._slice_state(full[piece.param_index], piece)
            for piece, _ in self._pieces
            if piece.param_index in full
        }
        self._install_slices(slices, settings)

    def _install_slices(self, slices: dict[ShardPiece, dict[str, Any]], settings: list[dict[str, Any]]) -> None:
        """A fresh inner optimizer over the current pieces, each holding its ``slices`` (copies) where given."""
        self._consolidated = None
        slices = {id(tensor): slices[piece] for piece, tensor in self._pieces if piece in slices}
        self.reload_model_params()
        optimizer = self._inner_optimizer(settings)
        inner_state, number, groups = {}, 0, []
        for group in optimizer.param_groups:
            groups.append({**_settings(group), "params": list(range(number, number + len(group["params"])))})
            for tensor in group["params"]:
                sliced = slices.get(id(tensor))
                if sliced is not None:
                    master = sliced.pop(MASTER_KEY, None)
                    if master is not None:
                        tensor.detach().copy_(master)
                    inner_state[number] = sliced
                number += 1
        optimizer.load_state_dict({"state": inner_state, "param_groups": groups})
        self._optimizer = optimizer
        self._rebind()

    def _slice_state(self, state: dict[str, Any], piece: ShardPiece) -> dict[str, Any]:
        """A piece's part of a parameter's state: full values, or torch.distributed.checkpoint's sharded ones
        (taken in this layout, or filled by ``dcp.load`` for it); copies, the fp32 masters among them."""
        p = self.model._params[piece.param_index]
        sliced = {}
        for key, value in state.items():
            if is_sharded(value):
                sliced[key] = piece_values(value, p, piece).clone()
            elif key == MASTER_KEY or _elementwise(key, value, p):
                sliced[key] = _flat_like(value, p)[piece.param_start : piece.param_end].clone()
            else:  # a scalar (step): each piece its own, as the class's load_state_dict would not copy it
                sliced[key] = value.clone() if isinstance(value, torch.Tensor) else value
        return sliced

    def _state_moved_to(self, layout: ShardLayout) -> dict[ShardPiece, dict[str, Any]]:
        """This rank's pieces in ``layout`` (a replan's), each with its slice of the state (copies), gathered from
        the current layout one bucket and key at a time (collectives), each key's old values dropped once
        gathered: at most one bucket's values of one key are whole at once, against the whole state that
        :meth:`_full_state` gathers (the process's peak RSS: transformer-5m at 2 ranks, +107 MiB at the online
        tune's replan)."""
        plan, inner_state = self._layout.plan, self._optimizer.state
        scalars, keys = self._gathered_scalars()
        moved: dict[int, list[ShardPiece]] = {}
        for piece in layout.pieces(self.model.engine.rank):
            moved.setdefault(piece.param_index, []).append(piece)
        slices = {
            piece: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in scalars[index].items()}
            for index, pieces in moved.items()
            if index in scalars
            for piece in pieces
        }
        for bucket, key, flat in self._gathered_bucket_states(keys):
            for _, tensor in self._bucket_pieces[bucket]:
                inner_state.get(tensor, {}).pop(key, None)  # (a master stays: the piece is the parameter's)
            spec = plan.buckets[bucket]
            for index, offset in zip(spec.param_indices, spec.offsets):
                for piece in moved.get(index, []) if index in scalars else []:
                    slices[piece][key] = flat.narrow(0, offset + piece.param_start, piece.numel).clone()
        return slices

    def _gathered_bucket_states(self, keys: list[str]) -> Any:
        """Each bucket's whole flat value of each per-element key, gathered from every rank's shard (collectives,
        in the same order on every rank), one at a time: (bucket, key, flat)."""
        plan = self._layout.plan
        for bucket, shards in enumerate(self._layout.buckets):
            for key in keys:
                if key == MASTER_KEY and getattr(torch, plan.buckets[bucket].dtype) not in LOW_PRECISION:
                    continue  # fp32 parameters are their own masters
                yield bucket, key, self._gather_bucket_state(bucket, key, shards.shard_numel)

    def _wait_for_every_rank(self, call: str) -> None:
        """Return once every rank has come to ``call`` (which gathers the full state); raise ``StallError``
        if they do not within the stall timeout (``COLLECTIVE_OPS_STALL_TIMEOUT``), rather than block."""
        if self._arrival_group is None:
            return
        timeout = self.model.manager.stall_timeout_s
        if self._arrival is None:  # else the arrival of a call that gave up waiting, still posted: matched now
            token = torch.zeros(1, device=self.model.engine.device)
            self._arrival = dist.all_reduce(token, group=self._arrival_group, async_op=True)
        try:
            wait_with_timeout(self._arrival, timeout)
            self._arrival = None
        except TimeoutError as exc:
            raise StallError(
                f"rank {self.model.engine.rank} waited {timeout:g} s in opt.{call} for the other ranks: with "
                "shard=True it gathers the optimizer state from every rank, so every rank calls it at the same "
                "point (then save the result on one: state = opt.state_dict(); if rank == 0: torch.save(state, "
                "path)), as FSDP's and DeepSpeed's checkpoints; or, as torch's ZeroRedundancyOptimizer, "
                "opt.consolidate_state_dict(to=0) on every rank, then opt.state_dict() on rank 0 alone (only rank 0 "
                "then holds the state, in host memory). Set COLLECTIVE_OPS_STALL_TIMEOUT (seconds) to wait longer."
            ) from exc

    def _full_state(self, keep: bool = True, device: torch.device | None = None) -> dict[int, dict[str, Any]]:
        """Every parameter's state (model index -> {key: value}), gathered per bucket (collectives). ``keep``
        False: this rank takes part only (an empty result); ``device``: where the values go, bucket by bucket
        (default: where the state is)."""
        plan = self._layout.plan
        full, keys = self._gathered_scalars(device)
        for bucket, key, flat in self._gathered_bucket_states(keys):
            if not keep:
                continue
            flat = flat if device is None else flat.to(device)
            spec = plan.buckets[bucket]
            for index, offset in zip(spec.param_indices, spec.offsets):
                if index in full:
                    p = self.model._params[index]
                    full[index][key] = _unflat_like(flat.narrow(0, offset, p.numel()), p)
        return full if keep else {}

    def _gathered_scalars(self, device: torch.device | None = None) -> tuple[dict[int, dict[str, Any]], list[str]]:
        """(every stepped parameter's values that are not per element (``step``; all of a 0-d parameter's), from
        the rank holding its first element; the per-element keys any rank holds): one small all-gather."""
        inner_state = self._optimizer.state
        scalars, keys = {}, set()
        for piece, tensor in self._pieces:
            state = inner_state.get(tensor, {})
            keys |= {k for k, v in state.items() if _piecewise(v, piece)}
            if piece.param_start == 0 and state:
                scalars[piece.param_index] = self._scalar_state(piece, tensor, state)
        if any(_is_master(pc, t, self._param_buffers) for pc, t in self._pieces):
            keys.add(MASTER_KEY)
        gathered = _state_json.allgather(self.model.engine, (scalars, sorted(keys)))  # JSON: nothing unpickled
        state: dict[int, dict[str, Any]] = {}
        for rank_scalars, _ in gathered:
            state.update({index: _moved(dict(values), device) for index, values in rank_scalars.items()})
        return state, sorted({k for _, rank_keys in gathered for k in rank_keys})

    def _scalar_state(self, piece: ShardPiece, tensor: torch.Tensor, state: dict[str, Any]) -> dict[str, Any]:
        """What of a piece's state is not per element (``step``); of a 0-d parameter (one piece: CLIP's
        ``logit_scale``), all of it, shaped as the parameter, its fp32 master too."""
        if self.model._params[piece.param_index].dim() != 0:
            return {k: v for k, v in state.items() if not _piecewise(v, piece)}
        whole = {k: v.reshape(()) if _piecewise(v, piece) else v for k, v in state.items()}
        if _is_master(piece, tensor, self._param_buffers):
            whole[MASTER_KEY] = tensor.detach().reshape(())
        return whole

    def _sharded_state(self) -> dict[int, dict[str, Any]]:
        """Every parameter's state as torch.distributed.checkpoint saves sharded state (``full_state_dict=False``):
        each per-element value a ``ShardedTensor`` whose local shards view this rank's pieces of it (nothing
        gathered: 1/N of the state per rank), the rest (``step``) from :meth:`_gathered_scalars`."""
        state, keys = self._gathered_scalars()
        inner_state = self._optimizer.state
        mine: dict[int, list[tuple[ShardPiece, torch.Tensor]]] = {}
        for piece, tensor in self._pieces:
            mine.setdefault(piece.param_index, []).append((piece, tensor))
        for index, values in state.items():
            p = self.model._params[index]
            if p.dim() == 0:
                continue  # (gathered whole with the scalars)
            dtype = torch.float32 if p.dtype in LOW_PRECISION else p.dtype
            owners = self._layout.owners(index)
            for key in keys:
                if key == MASTER_KEY and p.dtype not in LOW_PRECISION:
                    continue
                local = {}
                for piece, tensor in mine.get(index, []):
                    value = tensor.detach() if key == MASTER_KEY else inner_state.get(tensor, {}).get(key)
                    local[piece] = value if value is not None else torch.zeros_like(tensor, dtype=dtype)
                values[key] = sharded_state_tensor(p, owners, local, dtype, p.device)
        return state

    def _gather_bucket_state(self, bucket: int, key: str, shard_numel: int) -> torch.Tensor:
        """Every rank's values of ``key`` in ``bucket``, flat as the bucket lies (zeros where a piece has none).

        Gathered in place (the engine's all-gather of shards: on Gloo point-to-point in 1 MiB pieces), so the
        bucket's values exist once: Gloo's own all-gather copied them once more, +68 MiB of peak RSS in a replan
        of transformer-5m at 2 ranks."""
        engine = self.model.engine
        dtype = _master_dtype(self._layout.plan.buckets[bucket].dtype)  # the layout being read (a replan: the old)
        flat = torch.zeros(shard_numel * engine.world_size, dtype=dtype, device=self._param_buffers[bucket].device)
        local = engine.shard_of(flat)
        for piece, tensor in self._bucket_pieces[bucket]:
            value = tensor.detach() if key == MASTER_KEY else self._optimizer.state.get(tensor, {}).get(key)
            if value is not None:
                local.narrow(0, piece.shard_offset, piece.numel).copy_(value.reshape(-1))
        return engine.all_gather_shard(flat)


def _return_freed_memory() -> None:
    """Hand the host memory a relayout freed back to the system (glibc's ``malloc_trim``; elsewhere nothing).

    The old buffers and the gathered state, freed, stay in the C heap's free lists, which the next backward's
    allocations, of other sizes, do not fill: transformer-5m at 2 ranks, 3 steps with ``bucket_size_mb="auto"``
    (a replan at the second), peak RSS 512 MiB untrimmed, 497 trimmed (one run each)."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    trim = getattr(ctypes.CDLL(name), "malloc_trim", None) if name else None
    if trim is not None:
        trim(0)


def _refuse_non_elementwise(optimizer_class: Any, assume_elementwise: bool) -> None:
    """Pieces of parameters change the update of any optimizer that reads across a parameter: refused unless
    known (or said) to be element-wise, rather than training differently without an error."""
    if assume_elementwise or optimizer_class in ELEMENTWISE_OPTIMIZERS or not isinstance(optimizer_class, type):
        return  # (not a class: the base class refuses it)
    name = getattr(optimizer_class, "__name__", repr(optimizer_class))
    raise ValueError(
        f"shard=True runs {name} on flat pieces of parameters (a shard boundary may cut one), and {name} is not "
        "known to update each element from its own gradient and state alone: one that reads across a parameter "
        "(Adafactor factors a matrix's second moment by rows and columns, Muon orthogonalises whole matrices, "
        "LAMB scales by a parameter's norm) would train differently on pieces, without an error. Use shard=False "
        f"(parameters whole), or pass assume_elementwise=True if {name}'s update is element-wise (known: "
        f"{', '.join(cls.__name__ for cls in ELEMENTWISE_OPTIMIZERS)}; subclasses of them too need it)"
    )


def _refuse_unsupported(model: DistributedDataParallel, grad_reduce_dtype: str | None) -> None:
    manager = model.manager
    if manager.comm_hook is not allreduce_hook and not model.compression:
        raise ValueError(
            "shard=True reduce-scatters gradients and replaces the model's comm hook; a custom comm_hook cannot be "
            "used with it (compression='fp16'/'bf16' can)"
        )
    if model.compression and not isinstance(model.compression, str):  # co.PowerSGD: whole matrices, not shards
        raise ValueError(
            f"shard=True reduce-scatters each bucket, and compression={model.compression!r} reduces whole gradient "
            "matrices: use DistributedOptimizer without shard=True, or compression='fp16'/'bf16'"
        )
    if grad_reduce_dtype is not None and model.compression:
        raise ValueError("pass either compression (on wrap) or grad_reduce_dtype, not both")


def _moved(state: dict[str, Any], device: torch.device | None) -> dict[str, Any]:
    """A state's tensor values on ``device`` (None: where they are)."""
    if device is None:
        return state
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in state.items()}


def _itemsize(dtype: str) -> int:
    return torch.empty(0, dtype=getattr(torch, dtype)).element_size()


def _settings(group: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in group.items() if k != "params"}


def _is_master(piece: ShardPiece, tensor: torch.Tensor, param_buffers: list[torch.Tensor]) -> bool:
    """True when the piece's tensor is an fp32 copy (of low-precision parameters), not a view of them."""
    return tensor.dtype != param_buffers[piece.bucket].dtype


def _master_dtype(dtype: str) -> torch.dtype:
    """The dtype the optimizer works in for a bucket of ``dtype``: fp32 for fp16/bf16, else its own."""
    torch_dtype = getattr(torch, dtype)
    return torch.float32 if torch_dtype in LOW_PRECISION else torch_dtype


def _piecewise(value: Any, piece: ShardPiece) -> bool:
    """A piece's state value with one entry per element (exp_avg), not a scalar (step)."""
    return isinstance(value, torch.Tensor) and value.dim() == 1 and value.numel() == piece.numel


def _elementwise(key: str, value: Any, p: torch.Tensor) -> bool:
    """A full state value with one entry per element of ``p``."""
    return isinstance(value, torch.Tensor) and value.shape == p.shape and not (p.dim() == 0 and key == "step")


def _flat_like(value: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """``value``'s elements in ``p``'s memory order (how ``p`` lies in its bucket), flat."""
    laid_out = torch.empty_like(p, dtype=value.dtype).copy_(value)
    return laid_out.as_strided((p.numel(),), (1,), 0)


def _unflat_like(flat: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`_flat_like`: a tensor shaped (and strided) as ``p``, where ``flat`` is."""
    out = torch.empty_like(p, dtype=flat.dtype, device=flat.device)
    out.as_strided((p.numel(),), (1,), 0).copy_(flat)
    return out


__all__ = ["ShardedDistributedOptimizer"]
