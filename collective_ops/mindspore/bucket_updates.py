"""MindSpore: a ``DistributedOptimizer``'s per-bucket updates, owed to the next forward (PyNative, ``shard=False``).

Where the wrapper reduces bucket by bucket (``overlap=True``: its hooks launch each bucket during
backward; or ``compile_reduction=False``), a step (``opt(grads)``, or inside ``TrainOneStepCell`` /
``Model``) launches what is left and owes every bucket's update whose reduction has not landed
(the core's :class:`~collective_ops.bucketing.update.pending.PendingUpdates`). MindSpore's
``CommHandle`` cannot be polled, so on MindSpore every bucket is owed at the step. The next
forward applies each owed bucket just before the first cell that reads one of its parameters (a
forward pre-hook on every cell of the network; which parameters a cell reads is learnt from the
first forward, :class:`~collective_ops.bucketing.update.overlap.ForwardReads`), in plan order on
every rank; the forward's end applies the rest (parameters it did not read). Anything that reads
the parameters through ``Cell.parameters_and_names`` (``ms.save_checkpoint(net)``,
``net.parameters_dict()``, ``net.trainable_params()``, ``ms.load_param_into_net``) applies every
owed update first, as do a reduction, ``set_bucket_size``, ``join()`` and the optimizer's own
state reads; a direct read of one Parameter (``p.asnumpy()``) is not seen: ``opt.synchronize()``
first.

The update of one bucket is an optimizer of the wrapped class built over that bucket's parameters
whose state Parameters *are* the whole optimizer's (``moment1.fc.weight``, ``global_step``): the
state stays one, named as a plain optimizer's. Its step counters (``global_step``, Adam's
``beta1_power``) advance once a step, not once a bucket: each bucket's update starts from their
values at the step (``PendingUpdates``' frozen settings), so every bucket's arithmetic is the
plain optimizer's, element for element. Where the wrapper's compiled reduction ran (one graph:
every bucket lands at once) the whole optimizer updates everything at the step, as without
overlap; so it does for parameter groups with learning rates of their own (MindSpore names them by
the group's position, which an optimizer over one bucket's groups does not keep).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import mindspore as ms
import numpy as np
from mindspore import Parameter, ParameterTuple, nn

from ..bucketing.update.overlap import ForwardReads, buckets_read
from ..bucketing.update.pending import PendingUpdates
from ..comm.mindspore_engine import fresh_copy
from ._compat import TRAINING_PATCHES, no_grad, optimizer_parameter_table, own_parameters

_OWING: set[BucketUpdates] = set()  # the optimizers with updates owed: every parameter read applies them first
_parameters_and_names = nn.Cell.parameters_and_names  # MindSpore's own (the wrappers replace it: below)


def _settling_parameters_and_names(self: nn.Cell, *args: Any, **kwargs: Any) -> Any:
    """``Cell.parameters_and_names`` (every parameter read of MindSpore's checkpoint, load and listing functions
    passes through it), after applying every owed update: a checkpoint saved between a step and the next
    forward holds the step's weights."""
    if _OWING:  # (empty unless a step's updates are owed: MindSpore lists parameters often)
        for owing in list(_OWING):
            owing.synchronize()
    return _parameters_and_names(self, *args, **kwargs)


TRAINING_PATCHES.add(nn.Cell, "parameters_and_names", lambda original: _settling_parameters_and_names)


class BucketUpdates:
    """The per-bucket steps of one ``DistributedOptimizer`` over a wrapped network (see the module's text)."""

    def __init__(self, network: Any, optimizer: nn.Optimizer, build: Callable[[set[int]], nn.Optimizer]) -> None:
        self.network = network
        self.optimizer = optimizer  # the whole: it owns the state, which every bucket's optimizer shares
        self._build = build  # ids of a bucket's parameters -> an optimizer of the class over them
        self._own = {id(p) for p in optimizer.parameters}
        # learning rates of their own in some parameter groups: MindSpore names them by group position, which an
        # optimizer over one bucket's groups would not keep: updated after the whole reduction, at the step
        self._per_group_lr = bool(getattr(optimizer, "is_group_lr", False))
        state = [p for _, p in _parameters_and_names(optimizer) if id(p) not in self._own]
        self._state = {p.name: p for p in state}
        trained = {p.name for p in optimizer.parameters}
        # what every bucket's update reads and writes alike (step counters, powers, learning rates), frozen at a step
        self._counters = {name: p for name, p in self._state.items() if name.partition(".")[2] not in trained}
        self._advancing: dict[str, Parameter] | None = None  # those a step changes (global_step, beta1_power, ...)
        self._step_counters = self._counters  # what the step in flight froze
        self._first_update = False
        self._index = {id(p): i for i, p in enumerate(network._grad_params)}
        self._bucket_optimizers: list[nn.Optimizer | None] = []
        self._built_for: str | None = None
        self._pending: PendingUpdates | None = None
        self._reads = ForwardReads()
        self._own_of: dict[int, list[int]] = {}
        self._hooks: list[Any] = []
        self._settling = False
        # buckets applied at the step, by the forward's cells (and how many cells applied some), at its end, and by a
        # parameter read or synchronize()
        self.applied = {"step": 0, "forward": 0, "forward cells": 0, "forward end": 0, "read": 0}

    # -- the step ------------------------------------------------------------------
    @property
    def in_flight(self) -> bool:
        """True while a step's updates are owed."""
        return self._pending is not None

    def step(self, grads: Sequence[ms.Tensor], params: Sequence[Parameter]) -> Any:
        """Reduce; apply the buckets whose reductions landed, owe the others."""
        self.synchronize()
        if self._per_group_lr:
            return self.optimizer(self.network.reduce(grads, params))
        reduced = self.network.reduce_deferred(grads, params)
        if reduced is not None:  # reduced at once (compiled, first step, join): every bucket landed
            self.applied["step"] += len(self.network.manager.plan.buckets)
            return self.optimizer(reduced)
        self._build_for_plan()
        manager = self.network.manager
        # only the counters a step advances are put back before each bucket's update: an assign costs ~ms in PyNative
        self._step_counters = self._counters if self._advancing is None else self._advancing
        self._pending = PendingUpdates.start(len(manager.plan.buckets), [self._step_counters], _copy)
        self._first_update = True  # the counters are at their values at the step until a bucket's update
        _OWING.add(self)
        self._hook_forward()
        self._finish([b for b in self._pending.buckets if manager.bucket_ready(b)], "step")
        return ms.Tensor(True)  # (a training cell's step depends on the optimizer's result)

    def synchronize(self, by: str = "read") -> None:
        """Apply every owed update (every rank's order: plan order)."""
        if self._pending is not None and not self._settling:
            self._finish(list(self._pending.buckets), by)

    def _finish(self, buckets: list[int], by: str) -> None:
        """Finish these buckets' reductions and apply their owed updates, in the order given."""
        pending = self._pending
        if pending is None or self._settling:
            return
        manager = self.network.manager
        tracer = getattr(manager.observer, "bucket_update", None)
        self._settling = True  # (an update's own parameter reads, a graph compiled for it, apply nothing)
        try:
            for bucket in buckets:
                if not pending.take(bucket):
                    continue
                start = time.perf_counter()
                grads = self.network.finish_bucket(bucket)
                self._apply(bucket, grads, pending)
                self.applied[by] += 1
                if tracer is not None:
                    tracer("update", bucket, manager.steps_synced, start, time.perf_counter(), by)
        finally:
            self._settling = False
            if pending.finished:
                self._pending = None
                _OWING.discard(self)

    def _apply(self, bucket: int, grads: dict[int, ms.Tensor], pending: PendingUpdates) -> None:
        """One bucket's update, with the step counters as they were at the step."""
        optimizer = self._bucket_optimizers[bucket]
        if optimizer is None:  # none of the bucket's parameters is this optimizer's
            return
        frozen = pending.settings_for(self._step_counters) or {}
        first, self._first_update = self._first_update, False
        if not first:  # (the step's first update starts from them as they are)
            for name, value in frozen.items():
                ms.ops.assign(self._step_counters[name], value)
        order = [self._index[id(p)] for p in optimizer.parameters]
        with no_grad():  # inside a forward being differentiated: the update is no part of it
            optimizer(tuple(grads[i] for i in order))
        if first and self._advancing is None:  # learnt once: which counters the class's step advances
            self._advancing = {
                name: param
                for name, param in self._counters.items()
                if not np.array_equal(param.asnumpy(), frozen[name].asnumpy())
            }

    # -- one optimizer a bucket, sharing the whole's state -----------------------------------
    def _build_for_plan(self) -> None:
        plan = self.network.manager.plan
        if self._built_for == plan.fingerprint():
            return
        params = self.network._grad_params
        self._bucket_optimizers = []
        for bucket in plan.buckets:
            members = {id(params[i]) for i in bucket.param_indices} & self._own
            self._bucket_optimizers.append(self._sharing(self._build(members)) if members else None)
        self._built_for = plan.fingerprint()

    def _sharing(self, optimizer: nn.Optimizer) -> nn.Optimizer:
        """``optimizer`` (of the class, over one bucket's parameters) with the whole's state Parameters in place of
        its own, by name; refused where one of its own has no counterpart (it would keep state of its own)."""
        for key, value in list(optimizer.__dict__.items()):
            if isinstance(value, ParameterTuple) and not all(id(p) in self._own for p in value):
                setattr(optimizer, key, ParameterTuple([self._shared(optimizer, p) for p in value]))
        table = optimizer_parameter_table(optimizer)
        for key, param in list(table.items()):
            if id(param) not in self._own:
                table[key] = self._shared(optimizer, param)
        return optimizer

    def _shared(self, optimizer: nn.Optimizer, param: Parameter) -> Parameter:
        shared = self._state.get(param.name)
        if shared is None or tuple(shared.shape) != tuple(param.shape):
            raise ValueError(
                f"{type(optimizer).__name__} over one bucket's parameters keeps {param.name!r}, which the optimizer "
                "over all of them does not have, so its per-bucket updates cannot share one state (parameter "
                "groups with learning rates of their own?). Wrap the network with overlap=False (its compiled "
                "reduction lands every bucket at once and the optimizer updates all of them in one call)"
            )
        return shared

    # -- the next forward ------------------------------------------------------------
    def _hook_forward(self) -> None:
        """A forward pre-hook on every cell of the network (owed buckets applied before a cell reads them) and a
        forward hook on the network (the rest applied at its end); registered once."""
        if self._hooks:
            return
        net = self.network.network
        for _, cell in net.cells_and_names():
            self._hooks.append(cell.register_forward_pre_hook(self._before_forward_of))
        self._hooks.append(net.register_forward_hook(self._after_forward))

    def _before_forward_of(self, cell: nn.Cell, inputs: Any) -> None:
        self._reads.module_runs(cell)
        if self._pending is None or self._settling:
            return
        if self._reads.ran is not None:
            # the forward that learns the reads: a cell may read a sub-cell's parameters before (or without) its
            # sub-cell running, and MindSpore has no way to catch the read: everything below it, first
            indices = [self._index[id(p)] for _, p in _parameters_and_names(cell) if id(p) in self._index]
        else:
            indices = self._reads.reads_of(cell, lambda: self._own_params(cell))
        owed = [b for b in buckets_read(indices, self.network.manager.plan.location) if b in self._pending.buckets]
        if owed:
            self.applied["forward cells"] += 1
            self._finish(owed, "forward")

    def _after_forward(self, cell: nn.Cell, inputs: Any, output: Any) -> None:
        self._reads.first_forward_ended(self._own_params, lambda c: c.name_cells().values())
        # the parameters this forward did not read: applied now, before a backward reuses the buckets
        self.synchronize("forward end")

    def _own_params(self, cell: nn.Cell) -> list[int]:
        """``cell``'s own parameters (not its sub-cells'), as indices into the network's trainable parameters."""
        found = self._own_of.get(id(cell))
        if found is None:
            found = [
                self._index[id(p)] for p in own_parameters(cell).values() if p is not None and id(p) in self._index
            ]
            self._own_of[id(cell)] = found
        return found


def _copy(value: ms.Tensor) -> ms.Tensor:
    """``value``'s values in memory of their own (a 0-d one too: concatenation needs an axis)."""
    return fresh_copy(value.reshape(-1)).reshape(tuple(value.shape))


__all__ = ["BucketUpdates"]
