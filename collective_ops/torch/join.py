"""Uneven inputs (``torch.distributed.algorithms.Join``): the hook a joined rank runs, shadowing its active peers'
collectives with zeros until every rank has joined, then taking the final model of the rank that joined last."""

from __future__ import annotations

from typing import Any

from torch.distributed.algorithms.join import JoinHook


class ShadowingHook(JoinHook):
    """The wrapper's join hook: each shadowed step (``main_hook``), then the final model (``post_hook``)."""

    def __init__(self, model: Any) -> None:
        self.model = model

    def main_hook(self) -> None:
        self.model._shadow_iteration()

    def post_hook(self, is_last_joiner: bool) -> None:
        self.model._sync_final_model(is_last_joiner)
