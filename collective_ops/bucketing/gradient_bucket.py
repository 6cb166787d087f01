"""``GradientBucket``: manual fusion of many small tensors into few collectives."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..ops import parse_reduce_op
from .interfaces import BucketEngine, Handle, ThenHandle
from .plan import ParamSpec, plan_buckets, validate_bucket_mb

EngineResolver = Callable[[Any], BucketEngine]


class GradientBucket:
    """Collect tensors with :meth:`add`, reduce them all with :meth:`allreduce`.

    Tensors are fused into flat buffers of at most ``bucket_size_mb`` MiB per dtype and
    device (a tensor larger than that travels alone, in place), reduced with one
    collective per buffer, and the results written back into the added tensors in
    place. ``num_collectives`` is the number of collectives the last call issued.
    """

    def __init__(
        self,
        bucket_size_mb: float = 25.0,
        reduce_op: Any = "sum",
        *,
        engine: BucketEngine | None = None,
        engine_for: EngineResolver | None = None,
    ) -> None:
        self.bucket_size_mb = validate_bucket_mb(bucket_size_mb, "bucket_size_mb")
        self.reduce_op = parse_reduce_op(reduce_op)
        if engine is None and engine_for is None:
            raise ValueError("GradientBucket needs an engine or an engine_for resolver")
        self._engine = engine
        self._engine_for = engine_for
        self._tensors: list[Any] = []
        self._specs: list[ParamSpec] = []
        self.num_collectives = 0

    def __len__(self) -> int:
        return len(self._tensors)

    def add(self, tensor: Any) -> None:
        if tensor is None:
            raise ValueError("GradientBucket.add() got None: this parameter has no gradient (skip it)")
        engine = self._engine_for(tensor) if self._engine_for is not None else self._engine
        if self._engine is None:
            self._engine = engine
        elif engine is not self._engine:
            raise TypeError("GradientBucket holds tensors of one framework; start another bucket for this one")
        tensor = engine.as_native(tensor)
        numel, dtype, device = engine.describe(tensor)
        if self._specs and device != self._specs[0].device:
            raise ValueError(
                f"GradientBucket holds tensors on {self._specs[0].device}; this one is on {device}. "
                "Use one GradientBucket per device."
            )
        itemsize = engine.itemsize(tensor)
        self._specs.append(ParamSpec(f"tensor{len(self._specs)}", numel, dtype, device, itemsize))
        self._tensors.append(tensor)

    def clear(self) -> None:
        self._tensors.clear()
        self._specs.clear()

    def allreduce(self, async_op: bool = False) -> Handle | None:
        """Reduce every added tensor in place; with ``async_op`` return a handle to wait on."""
        if not self._tensors:
            self.num_collectives = 0
            return None
        engine = self._engine
        assert engine is not None
        # Fuse in add order, each bucket capped at bucket_size_mb (no smaller first bucket).
        plan = plan_buckets(self._specs, self.bucket_size_mb, self.bucket_size_mb, order=range(len(self._specs)))
        launched: list[tuple[Handle | None, Any, Any]] = []
        for bucket in plan.buckets:
            members = [self._tensors[i] for i in bucket.param_indices]
            if len(members) == 1 and engine.is_contiguous(members[0]):
                # Nothing to fuse: reduce the tensor itself, no copy.
                launched.append((engine.allreduce(members[0], self.reduce_op, async_op=True), None, None))
                continue
            buffer = engine.zeros(bucket.numel, bucket.dtype, bucket.device)
            for tensor, offset in zip(members, bucket.offsets):
                engine.write(buffer, offset, tensor)
            handle = engine.allreduce(buffer, self.reduce_op, async_op=True)
            launched.append((handle, buffer, list(zip(members, bucket.offsets))))
        self.num_collectives = len(launched)

        def complete() -> None:
            for handle, buffer, members in launched:
                if handle is not None:
                    handle.wait()
                if buffer is not None:
                    for tensor, offset in members:
                        engine.write_back(tensor, buffer, offset)

        if async_op:
            return ThenHandle(_AllOf([h for h, _, _ in launched]), complete)
        complete()
        return None


class _AllOf:
    def __init__(self, handles: list[Handle | None]) -> None:
        self._handles = [h for h in handles if h is not None]

    def wait(self) -> None:
        # Waiting happens in order inside the completion callback.
        return None

    def is_completed(self) -> bool:
        return all(h.is_completed() for h in self._handles)
