"""Optimizer settings under ``join()`` with ``shard=True``: a rank that ran out of data still owns shards and
updates them in every step it shadows, so it needs the settings its active peers step with. An LR scheduler
(or a loop setting ``lr`` by hand) runs only on the ranks still training; each step, at the point where every
rank is (an active rank's forward, a joined rank's shadowed step), the settings that schedulers change are
taken from the active ranks: two small collectives, the number of values (the same on every rank, or refused),
then a max over the active ranks' values (all the same, so exact; a joined rank gives -inf)."""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import Any

import torch

# The group settings torch's schedulers change (LR schedulers; OneCycleLR and CyclicLR also cycle momentum or
# Adam's first beta) and recipes schedule by hand (weight decay); the others stay as each rank built them.
SCHEDULED_SETTINGS = ("lr", "momentum", "betas", "weight_decay")


def _values(setting: Any) -> list[float]:
    if isinstance(setting, (tuple, list)):
        return [v for item in setting for v in _values(item)]
    if isinstance(setting, torch.Tensor) and setting.numel() == 1:
        return [float(setting)]
    if isinstance(setting, numbers.Real) and not isinstance(setting, bool):
        return [float(setting)]
    return []


def _flat(groups: Sequence[dict]) -> list[float]:
    return [v for group in groups for key in SCHEDULED_SETTINGS if key in group for v in _values(group[key])]


def _taken(setting: Any, value: float) -> Any:
    """``value`` in ``setting``'s place: a tensor filled in place (as a scheduler fills a tensor lr); an int kept
    an int only where ``value`` is whole (an int lr of 1 may become 0.5)."""
    if isinstance(setting, torch.Tensor):
        return setting.fill_(value)
    if isinstance(setting, int) and value.is_integer():
        return type(setting)(value)
    return value


def _assign(groups: Sequence[dict], values: list[float]) -> None:
    position = iter(values)
    for group in groups:
        for key in SCHEDULED_SETTINGS:
            setting = group.get(key)
            if key not in group or not _values(setting):
                continue
            if isinstance(setting, (tuple, list)):
                group[key] = type(setting)(_taken(item, next(position)) if _values(item) else item for item in setting)
            else:
                group[key] = _taken(setting, next(position))


def share_settings(engine: Any, groups: Sequence[dict], active: bool) -> None:
    """The active ranks' scheduled settings into a joined rank's ``groups`` (every rank calls it alike). Two small
    collectives: the number of values, which must be the same on every rank, then the values."""
    mine = _flat(groups)
    most, fewest = engine.reduce_floats([len(mine), -len(mine)], "max")
    if most != -fewest:
        raise ValueError(
            f"rank {engine.rank}: the optimizer's {', '.join(SCHEDULED_SETTINGS)} settings differ in number between "
            f"ranks ({len(mine)} values here; from {int(-fewest)} to {int(most)} over the ranks) inside join(): "
            "build the optimizer with the same parameter groups and settings on every rank"
        )
    if not mine:
        return
    shared = engine.reduce_floats(mine if active else [-math.inf] * len(mine), "max")
    if not active:
        _assign(groups, shared)
