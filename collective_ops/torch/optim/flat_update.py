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
from ..autograd_hooks import view_like

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
    param: torch.Tensor  # the flat parameter buffer the parameters are views of
    group: dict[str, Any]  # the parameter group every one of them belongs to
    grad_addresses: list[int] = field(default_factory=list)  # where each p.grad is when it is its bucket view
    grad_buffer_address: int | None = None  # the gradient buffer grad_addresses are in
    optimizer: torch.optim.Optimizer | None = None  # the class over [param], made at the first flat step
    steps: torch.Tensor | None = None  # the per-parameter step counts, one tensor (their state's "step" views)
    packed: bool = False  # each parameter's state is views of this bucket's flat state

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
    of the flat state.
    """

    def __init__(self, optimizer_class: type[torch.optim.Optimizer], args: tuple, kwargs: dict[str, Any]) -> None:
        self._class = optimizer_class
        self._args = args
        self._kwargs = {k: v for k, v in kwargs.items() if k != "params"}
        self._buckets: dict[int, FlatBucket] = {}
        self._plan: BucketPlan | None = None

    def lay_out(self, plan: BucketPlan, params: Sequence[torch.Tensor], groups: Sequence[dict[str, Any]]) -> None:
        """Parameters of each bucket whose parameters share one group made views of a flat buffer (values kept)."""
        if plan is self._plan:
            return  # (the same plan with fresh gradient buffers: the parameters' views stand)
        self._plan = plan
        group_of = {id(p): group for group in groups for p in group["params"]}
        self._buckets = {}
        for spec in plan.buckets:
            members = [params[i] for i in spec.param_indices]
            owners = {id(group_of.get(id(p))) for p in members}
            group = group_of.get(id(members[0]))
            if group is None or len(owners) != 1 or any(p.layout != torch.strided for p in members):
                continue
            buffer = torch.zeros(spec.numel, dtype=getattr(torch, spec.dtype), device=spec.device)
            with torch.no_grad():
                for p, offset in zip(members, spec.offsets):
                    view = view_like(p, buffer, offset)
                    view.copy_(p.detach())
                    p.data = view
            self._buckets[spec.index] = FlatBucket(members, list(spec.offsets), buffer, group)

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
        optimizer.state[bucket.param] = flat
        self._install_views(bucket, entries)
        return True

    def _optimizer_for(self, bucket: FlatBucket) -> torch.optim.Optimizer:
        if bucket.optimizer is None:
            settings = {k: v for k, v in bucket.group.items() if k != "params"}
            bucket.optimizer = self._class([{**settings, "params": [bucket.param]}], *self._args, **self._kwargs)
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
        bucket.param.grad = grad_buffer
        try:
            optimizer.step()
        finally:
            bucket.param.grad = None  # (the buffer is the wrapper's: not kept alive by this)
        if not bucket.packed:
            self._install_views(bucket, [state[p] for p in bucket.params])
        elif bucket.steps is not None:
            bucket.steps.fill_(optimizer.state[bucket.param][STEP_KEY])

    def _install_views(self, bucket: FlatBucket, entries: list[dict[str, Any]]) -> None:
        """Each parameter's state (``entries``, in bucket order) made views of the flat state."""
        flat = bucket.optimizer.state[bucket.param]
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
        bucket.packed = True
