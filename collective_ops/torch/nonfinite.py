"""``check_finite``: non-finite reduced gradients, judged at the next forward (an optimizer may skip a step on
purpose, as ``torch.amp.GradScaler`` does on an overflow: only parameters that became non-finite mean training
went wrong), with the rank and parameters where a NaN began."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

logger = logging.getLogger("collective_ops")


class NonfiniteWatch:
    """One wrapped model's non-finite gradients: ``names``/``params`` the planned parameters, ``rank`` this one."""

    def __init__(self, names: Sequence[str], params: Sequence[torch.Tensor], rank: int) -> None:
        self._names, self._params, self._rank = names, params, rank
        self._local: list[str] = []  # not finite on this rank before the reduction
        self._pending: tuple[list[str], str] | None = None  # (reduced not finite, origin clause): judged later

    def note_local(self, index: int) -> None:
        """Parameter ``index``'s gradient was not finite on this rank before the reduction."""
        self._local.append(self._names[index])

    def names(self) -> list[str]:
        """The parameters whose gradient holds a NaN or Inf (after the reduction: the same on every rank)."""
        return [
            name
            for name, p in zip(self._names, self._params)
            if p.grad is not None and not bool(torch.isfinite(p.grad).all())
        ]

    def take_origin(self) -> str:
        """The parameters not finite on this rank before the reduction (where a NaN came from), as a clause of an
        error message, "" where none; forgotten once taken."""
        local, self._local = self._local, []
        return f"; on rank {self._rank} before reduction: {local}" if local else ""

    def note_step(self) -> None:
        """After a step's reduction: the parameters whose reduced gradient is not finite, judged at the next
        forward (:meth:`raise_if_applied`)."""
        origin = self.take_origin()
        bad = self.names()
        self._pending = (bad, origin) if bad else None

    def raise_if_applied(self) -> None:
        """Raise ``FloatingPointError`` where the optimizer applied the non-finite gradients noted last step."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        bad, origin = pending
        by_name = dict(zip(self._names, self._params))
        if all(bool(torch.isfinite(by_name[name]).all()) for name in bad):
            logger.debug("non-finite gradients in %s were not applied (the optimizer skipped the step)", bad[:10])
            return
        raise FloatingPointError(
            f"non-finite gradients (NaN or Inf) after reduction in {len(bad)} parameter(s): {bad[:10]}{origin}; "
            "the optimizer applied them and the parameters are no longer finite. Lower the learning rate, use "
            "gradient clipping or loss scaling (torch.amp.GradScaler skips such steps), or check the data of that step."
        )
