"""Per-bucket optimizer updates: which buckets of a step still owe their update, and with what settings.

Framework-free. After backward every bucket's reduction is in flight; ``step()`` of a
per-bucket optimizer starts a :class:`PendingUpdates` for that step: the hyperparameters in
force at ``step()`` (an LR scheduler may change them before the last bucket is applied), the
buckets whose update is still owed, and whether their gradients are to be cleared after it
(a ``zero_grad`` that came first). Buckets are then applied as their reductions land, or
when the next forward needs their parameters: :meth:`take` hands each out exactly once.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass
class PendingUpdates:
    """One step's owed bucket updates."""

    buckets: list[int]  # owed, in plan order
    hyperparameters: dict[int, dict[str, Any]]  # id(parameter group) -> its settings at step()
    clear_after: bool | None = None  # None: keep gradients; True: set to None; False: zero them

    @classmethod
    def start(
        cls, bucket_count: int, groups: Sequence[dict[str, Any]], copy_value: Callable[[Any], Any] = lambda v: v
    ) -> PendingUpdates:
        """Every bucket owed; each group's settings (everything but its parameters) frozen now. ``copy_value``
        copies a value that could change in place before the owed updates are applied (a tensor learning
        rate, which schedulers fill in place: kept by reference, the owed update took the next step's)."""
        frozen = {id(group): {k: copy_value(v) for k, v in group.items() if k != "params"} for group in groups}
        return cls(list(range(bucket_count)), frozen)

    def settings_for(self, group: dict[str, Any]) -> dict[str, Any] | None:
        """The settings ``group`` had at step(), or None for a group added since (by identity, not position:
        a group added to one of several optimizers lands between the others' groups)."""
        return self.hyperparameters.get(id(group))

    def take(self, bucket: int) -> bool:
        """True (once) if ``bucket``'s update is owed: the caller applies it now."""
        if bucket not in self.buckets:
            return False
        self.buckets.remove(bucket)
        return True

    @property
    def finished(self) -> bool:
        return not self.buckets


@contextlib.contextmanager
def groups_narrowed(
    groups: Sequence[dict[str, Any]], only: set[int] | None, frozen: PendingUpdates | None
) -> Iterator[None]:
    """Parameter groups narrowed, for one step of the optimizer class over some buckets, to the parameters
    ``only`` (ids; None: all) with the settings they had at ``frozen``'s step() (None: as they are); each
    group's parameters and settings restored afterwards, also where the step raised."""
    saved = []
    try:
        for group in groups:
            saved.append((group["params"], {key: group[key] for key in group if key != "params"}))
            if only is not None:
                group["params"] = [p for p in group["params"] if id(p) in only]
            settings = None if frozen is None else frozen.settings_for(group)
            if settings is not None:
                group.update(settings)
        yield
    finally:
        for group, (params, settings) in zip(groups, saved):
            group["params"] = params
            group.update(settings)
