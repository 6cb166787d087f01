"""Uneven inputs (``torch.distributed.algorithms.Join``): the hook a joined rank runs, shadowing its active peers'
collectives with zeros until every rank has joined, then taking the final model of the rank that joined last."""

from __future__ import annotations

from typing import Any

from torch.distributed.algorithms.join import Join, JoinHook


class ShadowingHook(JoinHook):
    """The wrapper's join hook: each shadowed step (``main_hook``), then the final model (``post_hook``)."""

    def __init__(self, model: Any) -> None:
        self.model = model

    def main_hook(self) -> None:
        self.model._shadow_iteration()

    def post_hook(self, is_last_joiner: bool) -> None:
        self.model._sync_final_model(is_last_joiner)


def join_context(
    model: Any, divide_by_initial_world_size: bool, enable: bool, throw_on_early_termination: bool
) -> Join:
    """``with model.join():`` ranks with fewer batches shadow the others' collectives until all are done.

    As DDP's ``join()``: gradients of the steps some ranks sit out are divided by the initial
    world size (with ``divide_by_initial_world_size=False``: by the ranks still active, agreed
    on by one small collective per step); a joined rank contributes zeros; at the end every
    rank gets the parameters and buffers of a rank that joined last. ``Join([model])`` works
    the same.
    """
    return Join(
        [model],
        enable=enable,
        throw_on_early_termination=throw_on_early_termination,
        divide_by_initial_world_size=divide_by_initial_world_size,
    )
