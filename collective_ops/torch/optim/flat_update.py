"""Per-bucket updates on flat buffers: an element-wise optimizer class stepped once per bucket.

A bucket's gradients already live in one flat buffer (the wrapper's views); here its parameters become views of
one flat parameter buffer with the same layout, and the optimizer class steps one tensor per bucket (the flat
parameter, its ``.grad`` the flat gradient buffer) instead of one per parameter: the per-tensor host work of a
``foreach`` or single-tensor step (about 15 us a tensor for AdamW on this project's CPU) is paid once per bucket.
For SGD, Adam and AdamW the arithmetic is element-wise, so the result is bit-identical to the per-parameter
step with the same kernel (single-tensor and ``foreach``; ``fused=True`` runs its own kernel on the flat tensor).

The optimizer state a user sees stays per parameter: each parameter's ``state[p]`` holds views of the bucket's
flat state tensors (and a step count of its own, a 0-dim view of one tensor per bucket), so ``state_dict()``
and ``load_state_dict()`` keep torch's format, and a per-parameter step (below) updates the same memory.

A bucket steps per parameter instead, for that step, where the flat step would not be the same arithmetic:
some of its parameters have no gradient, a gradient is not its bucket view (``gradient_as_bucket_view=False``,
or ``p.grad`` replaced), or its parameters' state is not laid out alike (state loaded from another layout is
packed into the flat layout first, where it can be). Buckets whose parameters span several parameter groups,
and optimizer classes not listed in :data:`ELEMENTWISE`, always step per parameter.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ...bucketing.plan import BucketPlan
from ...bucketing.update.pending import PendingUpdates
from .. import _compat
from ..autograd_hooks import view_like
from .precision import MASTER_KEY

ELEMENTWISE: tuple[type[torch.optim.Optimizer], ...] = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW)
"""The classes whose update of a tensor is element by element: one call over a concatenation of tensors gives,
bit for bit, the calls over each (checked against DDP + the class in tests/test_distributed_optimizer.py)."""

STEP_KEY = "step"


def steps_flat(optimizer_class: Any, kwargs: dict[str, Any]) -> bool:
    """True where ``optimizer_class(**kwargs)`` can step a bucket as one flat tensor."""
    return optimizer_class in ELEMENTWISE and not kwargs.get("differentiable", False)


@dataclass
class FlatBucket:
    """One bucket's flat parameter buffer and the optimizer class over it."""

    params: list[torch.Tensor]  # the model's parameters in the bucket, in bucket order
    offsets: list[int]
    param: torch.Tensor  # the flat parameter buffer the parameters are views of (the wrapper's)
    group: dict[str, Any]  # the parameter group every one of them belongs to
    grad_addresses: list[int] = field(default_factory=list)  # where each p.grad is when it is its bucket view
    grad_buffer_address: int | None = None  # the gradient buffer grad_addresses are in
    optimizer: torch.optim.Optimizer | None = None  # the class over [param], made at the first flat step
    steps: torch.Tensor | None = None  # the per-parameter step counts, one tensor (their state's "step" views)
    packed: bool = False  # each parameter's state is views of this bucket's flat state
    master: torch.Tensor | None = None  # master_weights: the fp32 copy of ``param`` the optimizer updates
    # each parameter's version counter when the masters were last written into them (a parameter keeps a counter
    # of its own, apart from the buffer it is a view of): a change in place since is taken into its master
    written_versions: list[int] = field(default_factory=list)

    @property
    def stepped(self) -> torch.Tensor:
        """The flat tensor the optimizer class updates: the master where there is one, else the parameters."""
        return self.param if self.master is None else self.master

    def grads_are_views(self, grad_buffer: torch.Tensor) -> bool:
        """Every parameter's gradient is its view of ``grad_buffer``: the flat gradient is theirs."""
        if self.grad_buffer_address != grad_buffer.data_ptr():  # (a new plan or a failed step's fresh buffers)
            self.grad_buffer_address = grad_buffer.data_ptr()
            self.grad_addresses = [view_like(p, grad_buffer, o).data_ptr() for p, o in zip(self.params, self.offsets)]
        for p, address in zip(self.params, self.grad_addresses):
            grad = p.grad
            if grad is None or grad.data_ptr() != address:
                return False
        return True


class FlatUpdates:
    """The flat per-bucket steps of one unsharded DistributedOptimizer.

    ``state`` is the per-parameter state the optimizer exposes (the wrapped class's), which this keeps as views
    of the flat state. ``master_weights``: each bucket keeps an fp32 copy of its parameters (the masters) that the
    class updates, from the bucket's gradient buffer in fp32 (the main gradients), rounded into the parameters
    after each step; every bucket then steps flat (a bucket that cannot is refused at lay-out).
    """

    def __init__(
        self,
        optimizer_class: type[torch.optim.Optimizer],
        args: tuple,
        kwargs: dict[str, Any],
        master_weights: bool = False,
    ) -> None:
        self.master_weights = master_weights
        self._class = optimizer_class
        self._args = args
        self._kwargs = {k: v for k, v in kwargs.items() if k != "params"}
        self._buckets: dict[int, FlatBucket] = {}
        self._buffers: Sequence[torch.Tensor] | None = None  # the parameter buffers the buckets were laid on

    def lay_out(
        self, plan: BucketPlan, buffers: Sequence[torch.Tensor], groups: Sequence[dict[str, Any]], params: Sequence
    ) -> None:
        """Each bucket whose parameters share one group stepped on its flat parameter buffer (``buffers``, the
        wrapper's: its parameters are views of it)."""
        if buffers is self._buffers:
            return  # (the same parameter buffers, with fresh gradient buffers: the parameters' views stand)
        self._buffers = buffers
        group_of = {id(p): group for group in groups for p in group["params"]}
        self._buckets = {}
        for spec, buffer in zip(plan.buckets, buffers):
            members = [params[i] for i in spec.param_indices]
            owners = {id(group_of.get(id(p))) for p in members}
            group = group_of.get(id(members[0]))
            if group is None or len(owners) != 1 or any(p.layout != torch.strided for p in members):
                if self.master_weights:
                    raise ValueError(master_layout_error([plan.params[i].name for i in spec.param_indices]))
                continue
            bucket = FlatBucket(members, list(spec.offsets), buffer, group)
            if self.master_weights:
                bucket.master = buffer.float()
                bucket.written_versions = _compat.versions_of(members)
            self._buckets[spec.index] = bucket

    def unpack(self) -> None:
        """The per-parameter state was replaced (a load_state_dict): packed again before the next flat step."""
        for bucket in self._buckets.values():
            bucket.packed = False

    def step(
        self,
        buckets: Iterable[int],
        grad_buffers: Sequence[torch.Tensor],
        state: dict[torch.Tensor, dict[str, Any]],
        frozen: PendingUpdates | None,
    ) -> list[int]:
        """Step these buckets flat where the arithmetic is the per-parameter step's; the buckets left to step per
        parameter (their per-parameter state then moves with them: packed again before their next flat step)."""
        left = []
        for index in buckets:
            bucket = self._buckets.get(index)
            if self.master_weights:  # (main gradients: no p.grad; the buffer is the gradient)
                if not self._ready(bucket, state):
                    raise ValueError(master_state_error())
                self._step_one(bucket, grad_buffers[index], state, frozen)
                continue
            if bucket is None or not bucket.grads_are_views(grad_buffers[index]) or not self._ready(bucket, state):
                left.append(index)
                if bucket is not None:
                    bucket.packed = False
                continue
            self._step_one(bucket, grad_buffers[index], state, frozen)
        return left

    def _ready(self, bucket: FlatBucket, state: dict[torch.Tensor, dict[str, Any]]) -> bool:
        """The bucket's per-parameter state is views of its flat state, or none exists yet, or it was packed now."""
        if bucket.packed:
            return True
        entries = [state.get(p) for p in bucket.params]
        if not any(entries):
            bucket.optimizer = None  # a fresh start: the flat state is made by the first flat step
            return True
        return all(entries) and self._pack(bucket, entries)

    def _pack(self, bucket: FlatBucket, entries: list[dict[str, Any]]) -> bool:
        """Each parameter's state copied into flat state tensors; False where it cannot be (keys, shapes or step
        counts that differ between the bucket's parameters): the bucket then steps per parameter."""
        keys = set(entries[0])
        if any(set(entry) != keys for entry in entries):
            return False
        if MASTER_KEY in keys:
            keys.discard(MASTER_KEY)
            if bucket.master is None or not self._take_masters(bucket, [entry[MASTER_KEY] for entry in entries]):
                return False
        flat: dict[str, Any] = {}
        for key in keys:
            values = [entry[key] for entry in entries]
            if key == STEP_KEY:
                steps = torch.stack([torch.as_tensor(v, dtype=torch.float32).reshape(()).cpu() for v in values])
                if not bool((steps == steps[0]).all()):
                    return False
                first = values[0]
                flat[key] = first.detach().clone() if isinstance(first, torch.Tensor) else first
            elif all(v is None for v in values):
                flat[key] = None
            elif all(isinstance(v, torch.Tensor) and v.shape == p.shape for v, p in zip(values, bucket.params)):
                buffer = torch.zeros_like(bucket.param, dtype=values[0].dtype)
                for value, p, offset in zip(values, bucket.params, bucket.offsets):
                    view_like(p, buffer, offset).copy_(value)
                flat[key] = buffer
            else:
                return False
        optimizer = self._optimizer_for(bucket)
        optimizer.state[bucket.stepped] = flat
        self._install_views(bucket, entries)
        return True

    def _optimizer_for(self, bucket: FlatBucket) -> torch.optim.Optimizer:
        if bucket.optimizer is None:
            settings = {k: v for k, v in bucket.group.items() if k != "params"}
            bucket.optimizer = self._class([{**settings, "params": [bucket.stepped]}], *self._args, **self._kwargs)
        return bucket.optimizer

    def _step_one(
        self,
        bucket: FlatBucket,
        grad_buffer: torch.Tensor,
        state: dict[torch.Tensor, dict[str, Any]],
        frozen: PendingUpdates | None,
    ) -> None:
        optimizer = self._optimizer_for(bucket)
        settings = None if frozen is None else frozen.settings_for(bucket.group)
        group = optimizer.param_groups[0]
        if settings is None:
            settings = {k: v for k, v in bucket.group.items() if k != "params"}
        group.update(settings)
        stepped = bucket.stepped
        if bucket.master is not None:
            self._take_changed_params(bucket)
            grad_buffer = grad_buffer if grad_buffer.dtype == stepped.dtype else grad_buffer.to(stepped.dtype)
        stepped.grad = grad_buffer
        try:
            optimizer.step()
        finally:
            stepped.grad = None  # (the buffer is the wrapper's: not kept alive by this)
        if bucket.master is not None:
            bucket.param.copy_(bucket.master)  # (rounded to the parameters' dtype; their own counters stay)
        if not bucket.packed:
            self._install_views(bucket, [state[p] for p in bucket.params])
        elif bucket.steps is not None:
            bucket.steps.fill_(optimizer.state[stepped][STEP_KEY])

    def _take_changed_params(self, bucket: FlatBucket) -> None:
        """Parameters changed in place since the optimizer last wrote them (a loaded checkpoint, a re-initialised
        layer) become their masters' values, except where a parameter is still its master rounded (a checkpoint
        of the same run, whose saved masters hold more than the parameters can)."""
        versions = _compat.versions_of(bucket.params)
        if versions == bucket.written_versions:
            return
        changed = bucket.param != bucket.master.to(bucket.param.dtype)
        bucket.master.copy_(torch.where(changed, bucket.param.float(), bucket.master))
        bucket.written_versions = versions

    def _take_masters(self, bucket: FlatBucket, masters: list[Any]) -> bool:
        """Loaded masters (one per parameter, shaped as it) copied into the bucket's; False where they are not."""
        if not all(isinstance(m, torch.Tensor) and m.shape == p.shape for m, p in zip(masters, bucket.params)):
            return False
        for master, p, offset in zip(masters, bucket.params, bucket.offsets):
            view_like(p, bucket.master, offset).copy_(master)
        return True

    def _install_views(self, bucket: FlatBucket, entries: list[dict[str, Any]]) -> None:
        """Each parameter's state (``entries``, in bucket order) made views of the flat state (and of the bucket's
        masters)."""
        flat = bucket.optimizer.state[bucket.stepped]
        step = flat.get(STEP_KEY)
        # one tensor of step counts per bucket, each parameter's "step" a 0-dim view of it: one fill a step
        bucket.steps = step.detach().reshape(1).repeat(len(bucket.params)) if isinstance(step, torch.Tensor) else None
        for position, (entry, p, offset) in enumerate(zip(entries, bucket.params, bucket.offsets)):
            for key, value in flat.items():
                if key == STEP_KEY and bucket.steps is not None:
                    entry[key] = bucket.steps[position]
                elif isinstance(value, torch.Tensor) and value.numel() == bucket.param.numel():
                    entry[key] = view_like(p, value, offset)
                else:
                    entry[key] = value
            if bucket.master is not None:
                entry[MASTER_KEY] = view_like(p, bucket.master, offset)
        bucket.packed = True


def keep_saved_dtypes(
    state: dict[torch.Tensor, dict[str, Any]], params: list[torch.Tensor], saved: dict[int, dict[str, Any]]
) -> None:
    """The floating state of ``saved`` (a state_dict's ``"state"``, numbered as ``params``) in ``state`` in fp32,
    the masters' dtype: torch's ``load_state_dict`` casts it to each parameter's dtype (bf16), masters too; a
    state saved without masters (bf16 moments) is widened."""
    for number, entry in saved.items():
        loaded = state.get(params[number])
        for key, value in entry.items():
            if loaded is not None and isinstance(value, torch.Tensor) and value.is_floating_point():
                loaded[key] = value.to(device=params[number].device, dtype=torch.float32, copy=True)


def master_layout_error(names: list[str]) -> str:
    return (
        f"master_weights=True steps each bucket's fp32 masters as one tensor, but the bucket of {names[:3]} holds "
        "parameters of several parameter groups (or ones not given to the optimizer, or not dense): give each "
        "group parameters of whole buckets (wrap with a smaller bucket_size_mb), or leave master_weights off"
    )


def master_state_error() -> str:
    return (
        "master_weights=True: the optimizer state loaded for a bucket's parameters differs between them (keys, "
        "shapes or step counts), so its fp32 masters cannot be stepped as one tensor: load a state_dict() saved by "
        "a DistributedOptimizer or a torch optimizer of the same class over the same parameters"
    )


def refuse_unflat_masters(optimizer_class: Any, given: Any, kwargs: dict[str, Any]) -> None:
    """Unsharded fp32 masters are one tensor per bucket, updated by one call: an element-wise class is needed."""
    if given is not None or not steps_flat(optimizer_class, kwargs):
        name = getattr(optimizer_class, "__name__", "optimizers built by the user")
        raise ValueError(
            f"master_weights=True updates each bucket's fp32 masters as one tensor, which takes an element-wise "
            f"optimizer class (torch.optim.SGD, Adam or AdamW, not differentiable), not {name}: use one of those, "
            "or shard=True (its fp32 masters take any element-wise class)"
        )
