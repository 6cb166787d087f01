"""Several torch optimizers stepped as one: what a DistributedOptimizer wraps when given optimizers, not a class.

Modern recipes train parts of a model with different classes (Muon for the hidden matrices,
AdamW for embeddings, norms and biases). Under DDP that is two plain optimizers; given to one
``DistributedOptimizer`` as ``[muon, adamw]`` they keep its per-bucket updates overlapped with
the next forward: each bucket's update runs every optimizer over that bucket's parameters.
The optimizers stay the user's own objects: their ``param_groups`` dicts are shared (an LR
scheduler over either, or over the DistributedOptimizer, sets the same values) and their
state is theirs.
"""

from __future__ import annotations

import weakref
from collections import ChainMap
from collections.abc import Sequence
from typing import Any

import torch

STATE_DICT_KEY = "optimizers"  # OptimizerSet.state_dict(): {"optimizers": [each optimizer's own state_dict]}


class OptimizerSet:
    """``optimizers`` as one optimizer: their groups in order, their states, each stepped in turn."""

    defaults: dict[str, Any] = {}  # settings live in each optimizer's groups

    def __init__(self, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        self.optimizers = tuple(optimizers)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """Every optimizer's groups, in the order given (the same dicts: settings changed here change there)."""
        return [group for optimizer in self.optimizers for group in optimizer.param_groups]

    @property
    def state(self) -> ChainMap:
        return ChainMap(*(optimizer.state for optimizer in self.optimizers))

    def step(self) -> None:
        """Each optimizer's step, skipping one with no parameter in its groups now (a bucket it has none of)."""
        for optimizer in self.optimizers:
            if any(group["params"] for group in optimizer.param_groups):
                optimizer.step()

    def state_dict(self) -> dict[str, Any]:
        """Each optimizer's own state_dict, in order: each loads into a plain optimizer of its class."""
        return {STATE_DICT_KEY: [optimizer.state_dict() for optimizer in self.optimizers]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        states = state_dict.get(STATE_DICT_KEY) if isinstance(state_dict, dict) else None
        if not isinstance(states, list) or len(states) != len(self.optimizers):
            names = ", ".join(type(optimizer).__name__ for optimizer in self.optimizers)
            raise ValueError(
                f"this DistributedOptimizer holds {len(self.optimizers)} optimizers ({names}): load a state_dict it "
                f"saved, {{{STATE_DICT_KEY!r}: [one state_dict per optimizer, in that order]}}"
            )
        for optimizer, state in zip(self.optimizers, states):
            optimizer.load_state_dict(state)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise ValueError(
            "add_param_group on a DistributedOptimizer of several optimizers: which one should train the group is "
            "not said. Add it to that optimizer itself (e.g. adamw.add_param_group(group)): the "
            "DistributedOptimizer takes it up at its next zero_grad() or step()"
        )


def given_optimizers(optimizer: Any) -> tuple[torch.optim.Optimizer, ...] | None:
    """The optimizer instances given in place of a class (one, or a list), or None for a class."""
    if isinstance(optimizer, torch.optim.Optimizer):
        return (optimizer,)
    if isinstance(optimizer, (list, tuple)) and optimizer:
        if not all(isinstance(item, torch.optim.Optimizer) for item in optimizer):
            raise TypeError(
                "DistributedOptimizer takes an optimizer class (torch.optim.AdamW, with its settings as keywords), "
                f"or torch optimizers built over the model's parameters (e.g. [Muon(matrices), AdamW(rest)]); got "
                f"{[type(item).__name__ for item in optimizer]}"
            )
        return tuple(optimizer)
    return None


def refuse_shared_params(optimizers: Sequence[torch.optim.Optimizer]) -> None:
    """A parameter in two of the optimizers would be updated twice a step: refused."""
    seen: dict[int, str] = {}
    for optimizer in optimizers:
        name = type(optimizer).__name__
        for group in optimizer.param_groups:
            for p in group["params"]:
                if id(p) in seen:
                    raise ValueError(
                        f"a parameter of shape {tuple(p.shape)} is in both {seen[id(p)]} and {name}: it would be "
                        "updated twice each step. Give each parameter to one optimizer"
                    )
                seen[id(p)] = name


def watch_given(optimizer: torch.optim.Optimizer, owner: Any) -> list[Any]:
    """The hooks (their handles) by which an optimizer given by the user to ``owner`` (a DistributedOptimizer)
    defers to it: its own state_dict() sees every owed update; a state loaded into it directly lands after
    them, and its (new) groups become ``owner``'s."""
    me = weakref.ref(owner)

    def before(*args: Any) -> None:
        ours = me()
        if ours is not None and ours.in_flight:
            ours.synchronize()

    def after(*args: Any) -> None:
        ours = me()
        if ours is not None:
            ours._rebind()

    return [
        optimizer.register_state_dict_pre_hook(before),
        optimizer.register_load_state_dict_pre_hook(before),
        optimizer.register_load_state_dict_post_hook(after),
    ]
