"""Optimizer settings under ``join()`` with ``shard=True``: a rank that ran out of data still owns shards and
updates them in every step it shadows, so it needs the settings its active peers step with. An LR scheduler
(or a loop setting ``lr`` by hand) runs only on the ranks still training; each step, at the point where every
rank is (an active rank's forward, a joined rank's shadowed step), the settings that schedulers change are
taken from the active ranks: one small collective, a max over the active ranks' values (all the same, so exact;
a joined rank gives -inf)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

# The group settings torch's schedulers change (LR schedulers; OneCycleLR and CyclicLR also cycle momentum or
# Adam's first beta) and recipes schedule by hand (weight decay); the others stay as each rank built them.
SCHEDULED_SETTINGS = ("lr", "momentum", "betas", "weight_decay")


def _values(setting: Any) -> list[float]:
    if isinstance(setting, (tuple, list)):
        return [float(v) for v in setting]
    if isinstance(setting, torch.Tensor) or (isinstance(setting, (int, float)) and not isinstance(setting, bool)):
        return [float(setting)]
    return []


def _flat(groups: Sequence[dict]) -> list[float]:
    return [v for group in groups for key in SCHEDULED_SETTINGS if key in group for v in _values(group[key])]


def _assign(groups: Sequence[dict], values: list[float]) -> None:
    position = iter(values)
    for group in groups:
        for key in SCHEDULED_SETTINGS:
            setting = group.get(key)
            count = len(_values(setting)) if key in group else 0
            taken = [next(position) for _ in range(count)]
            if not count:
                continue
            if isinstance(setting, torch.Tensor):
                setting.fill_(taken[0])  # in place, as a scheduler fills a tensor lr
            elif isinstance(setting, (tuple, list)):
                group[key] = type(setting)(type(old)(new) for old, new in zip(setting, taken))
            else:
                group[key] = type(setting)(taken[0])


def share_settings(engine: Any, groups: Sequence[dict], active: bool) -> None:
    """The active ranks' scheduled settings into a joined rank's ``groups`` (every rank calls it alike; the
    optimizer class, hence the number of values, is the same on every rank)."""
    mine = _flat(groups)
    if not mine:
        return
    shared = engine.reduce_floats(mine if active else [-math.inf] * len(mine), "max")
    if not active:
        _assign(groups, shared)
