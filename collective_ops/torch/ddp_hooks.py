"""torch DDP's communication-hook API on our buckets: ``model.register_comm_hook(state, hook)``.

A DDP hook is ``hook(state, bucket) -> torch.futures.Future[torch.Tensor]``: it reduces the
bucket's flat gradient buffer (averaging is its own business, as in DDP) and the future's value
is the reduced buffer. torch's own hooks (``torch.distributed.algorithms.ddp_comm_hooks``: fp16
and bf16 compression, PowerSGD) and hooks written for DDP then reduce our buckets unchanged.
``torch.distributed.GradBucket`` cannot be built from Python, so the bucket handed over is a
stand-in with the methods those hooks call.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..bucketing.hooks import BucketContext, CommHook

DDPCommHook = Callable[[Any, Any], torch.futures.Future]


class GradBucketView:
    """One bucket as DDP hooks see a ``torch.distributed.GradBucket``."""

    def __init__(
        self, ctx: BucketContext, buffer: torch.Tensor, params: Sequence[torch.Tensor], bucket_count: int
    ) -> None:
        self._ctx = ctx
        self._buffer = buffer
        self._params = list(params)
        self._count = bucket_count

    def index(self) -> int:
        return self._ctx.bucket.index

    def is_last(self) -> bool:
        return self._ctx.bucket.index == self._count - 1

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def set_buffer(self, tensor: torch.Tensor) -> None:
        self._buffer.copy_(tensor)

    def parameters(self) -> list[torch.Tensor]:
        return list(self._params)

    def gradients(self) -> list[torch.Tensor]:
        """Each parameter's gradient as a view of the buffer, shaped as the parameter."""
        buffer = self._buffer
        return [
            buffer.narrow(0, offset, p.numel()).view_as(p) for p, offset in zip(self._params, self._ctx.bucket.offsets)
        ]


class FutureHandle:
    """A DDP hook's future as the bucket manager's handle: waiting leaves the reduced values in the buffer."""

    def __init__(self, future: torch.futures.Future, buffer: torch.Tensor) -> None:
        if not (callable(getattr(future, "wait", None)) and callable(getattr(future, "done", None))):
            raise TypeError(
                f"a DDP comm hook must return a torch.futures.Future of the reduced bucket, got {type(future).__name__}"
            )
        self._future = future
        self._buffer = buffer

    def wait(self, timeout: Any = None) -> torch.Tensor:
        value = self._future.wait()
        reduced = value[0] if isinstance(value, (list, tuple)) else value
        if reduced is not self._buffer:
            self._buffer.copy_(reduced.view_as(self._buffer))
        return self._buffer

    def is_completed(self) -> bool:
        return self._future.done()


def ddp_comm_hook(
    state: Any,
    hook: DDPCommHook,
    params_of: Callable[[Sequence[int]], list[torch.Tensor]],
    bucket_count: Callable[[], int],
) -> CommHook:
    """Our comm hook calling the DDP hook ``hook(state, bucket)`` on each bucket."""

    def comm_hook(ctx: BucketContext) -> FutureHandle:
        # The same memory under a version counter of its own: the hook writes the reduced values back in place
        # from a completion callback, at any time, and those writes are the reduction's, not the in-place
        # changes by other code that the gradient guard looks for (model.owned_gradients.check_untouched).
        buffer = ctx.buffer.data
        bucket = GradBucketView(ctx, buffer, params_of(ctx.bucket.param_indices), bucket_count())
        return FutureHandle(hook(state, bucket), buffer)

    comm_hook.ddp_hook = hook  # type: ignore[attr-defined]
    return comm_hook
