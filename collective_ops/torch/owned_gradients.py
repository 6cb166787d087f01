"""The gradients a DistributedOptimizer owns between backward and its update: each bucket's gradient tensors,
noted when the optimizer takes them, so that an in-place change by other code (``clip_grad_norm_`` while the
reduction is still in flight, or sharded, where only this rank's shard is averaged) raises instead of training
silently wrong."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch

from ..options import names_text
from .inplace import InPlaceGuard


class OwnedGradients:
    """One wrapped model's owned buckets: ``manager`` holds the bucket buffers, ``params``/``names`` the planned
    parameters; with ``as_view`` (``gradient_as_bucket_view``) each ``p.grad`` is a view of its bucket."""

    def __init__(self, manager: Any, params: Sequence[torch.Tensor], names: Sequence[str], as_view: bool) -> None:
        self._manager, self._params, self._names, self._as_view = manager, params, names, as_view
        self._guard = InPlaceGuard()

    def tensors(self, bucket: int) -> list[torch.Tensor]:
        """What other code changes this bucket's gradients through: its buffer (each ``p.grad`` a view of
        it), and with ``gradient_as_bucket_view=False`` the members' own ``p.grad`` tensors."""
        tensors = [self._manager.buffers[bucket]]
        if not self._as_view:
            members = self._manager.plan.buckets[bucket].param_indices
            tensors += [self._params[i].grad for i in members if self._params[i].grad is not None]
        return tensors

    def note(self, buckets: Iterable[int]) -> None:
        for bucket in buckets:
            self._guard.note(bucket, self.tensors(bucket))

    def forget(self) -> None:
        self._guard.clear()

    def check_untouched(self, buckets: Iterable[int], sharded: bool = False) -> None:
        """Raise where other code changed a bucket's gradients in place since they were noted; ``sharded``: the
        error says what works under ``shard=True``."""
        for bucket in buckets:
            if self._guard.changed(bucket, self.tensors(bucket)):
                raise self._changed_error(bucket, sharded)

    def members_text(self, bucket: int) -> str:
        """The names of a bucket's parameters, for errors: the first five."""
        return names_text([self._names[i] for i in self._manager.plan.buckets[bucket].param_indices])

    def _changed_error(self, bucket: int, sharded: bool) -> RuntimeError:
        changed = (
            f"the gradients of bucket {bucket} ({self.members_text(bucket)}) were changed in place between "
            "backward() and the DistributedOptimizer's step, while it still owned them: "
        )
        if sharded:
            return RuntimeError(
                changed + "with shard=True p.grad is averaged only in this rank's shard. Clip with "
                "opt.clip_grad_norm_(max_norm), or call opt.gather_gradients() on every rank (after "
                "scaler.unscale_(opt) under a GradScaler) before torch's clips or other code that reads or changes "
                "gradients between backward() and step()"
            )
        return RuntimeError(
            changed + "its updates overlap the reduction with the next forward, so after backward() p.grad is not "
            "yet averaged. Take the parameters through the model (model.parameters() finishes the reductions "
            "first; so does opt.param_groups, which scaler.unscale_(opt) reads), or call opt.finish_reductions() "
            "before code that reads or changes gradients between backward() and step()"
        )
