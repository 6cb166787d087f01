"""``GradientBucket``: manual fusion of many small tensors into few collectives."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..ops import parse_reduce_op
from .fusion import fused_collective
from .interfaces import BucketEngine, Handle
from .plan import DEFAULT_BUCKET_MB, validate_bucket_mb

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
        bucket_size_mb: float = DEFAULT_BUCKET_MB,
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
        self._device: str | None = None
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
        _numel, _dtype, device = engine.describe(tensor)
        if self._device is not None and device != self._device:
            raise ValueError(
                f"GradientBucket holds tensors on {self._device}; this one is on {device}. "
                "Use one GradientBucket per device."
            )
        self._device = device
        self._tensors.append(tensor)

    def clear(self) -> None:
        self._tensors.clear()
        self._device = None

    def allreduce(self, async_op: bool = False) -> Handle | None:
        """Reduce every added tensor in place; with ``async_op`` return a handle to wait on."""
        if not self._tensors:
            self.num_collectives = 0
            return None
        engine = self._engine
        assert engine is not None
        # Fuse in add order, each buffer capped at bucket_size_mb (no smaller first bucket).
        handle, self.num_collectives = fused_collective(
            engine,
            self._tensors,
            self.bucket_size_mb,
            lambda buffer: engine.allreduce(buffer, self.reduce_op, async_op=True),
        )
        if async_op:
            return handle
        handle.wait()
        return None
