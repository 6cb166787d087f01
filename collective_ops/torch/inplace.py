"""Telling whether code outside the library changed tensors in place while the library still owed work on them.

The wrapper and the DistributedOptimizer hand the loop back before their work on some tensors is
done (gradients whose reduction is in flight; parameters whose update or all-gather lands at the
next forward). An in-place change made in that window (``clip_grad_norm_`` on gradients,
``p.clamp_()`` on parameters, a submodule's ``load_state_dict``) would be silently lost or mixed
into the result. Every in-place op on a tensor moves its version counter, so noting the counters
when the window opens and comparing them before the owed work turns that into an error.
Changes through ``p.data`` (a tensor with a counter of its own) are not seen.
"""

from __future__ import annotations

import weakref
from collections.abc import Hashable, Sequence

import torch

from . import _compat


class InPlaceGuard:
    """Version counters of tensors, noted per key (a bucket) and compared later."""

    def __init__(self) -> None:
        self._noted: dict[Hashable, tuple[list[weakref.ref], list[int]]] = {}

    def note(self, key: Hashable, tensors: Sequence[torch.Tensor]) -> None:
        self._noted[key] = ([weakref.ref(t) for t in tensors], _compat.versions_of(tensors))

    def changed(self, key: Hashable, tensors: Sequence[torch.Tensor], release: bool = True) -> list[int]:
        """Positions in ``tensors`` of those changed in place since ``key`` was noted (none if it was not noted,
        or was noted for other tensors: a rebuild of the library's own replaced them). ``release``: forget
        the key. A change found forgets every key: one error, and what follows (a checkpoint, shutdown)
        finishes the work it owed."""
        noted = self._noted.pop(key, None) if release else self._noted.get(key)
        if noted is None:
            return []
        refs, versions = noted
        if len(refs) != len(tensors) or any(ref() is not t for ref, t in zip(refs, tensors)):
            return []
        now = _compat.versions_of(tensors)
        if now == versions:
            return []
        changed = [i for i, (version, noted_version) in enumerate(zip(now, versions)) if version != noted_version]
        if changed:
            self._noted.clear()
        return changed

    def noted(self) -> list[Hashable]:
        """The keys noted and not yet released, in the order noted."""
        return list(self._noted)

    def clear(self) -> None:
        self._noted.clear()
