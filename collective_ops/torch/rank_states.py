"""The compression's per-rank state in checkpoints that one rank writes (Lightning's, Accelerate's ``save_state``).

PowerSGD's error-feedback memory differs on every rank (each holds what compressing its own gradients lost), so a
checkpoint written by rank 0 alone must carry every rank's. :class:`RankCompressionStates` is that state as one
object with ``state_dict()`` / ``load_state_dict()``, the shape both frameworks' checkpoint hooks take: saving
gathers every rank's state (a collective, as JSON: nothing is unpickled), loading takes this rank's back.
"""

from __future__ import annotations

from typing import Any

import torch

from .optim import state_json


class RankCompressionStates:
    """Every rank's :meth:`compression_state_dict` of a wrapped ``model``, for a checkpoint one rank writes."""

    def __init__(self, model: Any) -> None:
        self.model = model

    @staticmethod
    def needed(model: Any) -> bool:
        """Whether ``model``'s compression keeps state between steps (PowerSGD; fp16/bf16 keep none)."""
        return hasattr(getattr(getattr(model, "manager", None), "comm_hook", None), "state_dict")

    def state_dict(self) -> dict[str, Any]:
        """Every rank's compression state, by rank, on the host (a collective: every rank calls it, as both
        frameworks' saving does). Each rank holds them all while saving: the error-feedback memory is gradient-sized
        per rank. Where a rank cannot give its state (a step in flight after a failure), every rank raises, naming it,
        rather than its peers waiting in the gather."""
        engine = self.model.engine
        try:
            local = {"state": self.model.compression_state_dict(), "error": None}
        except Exception as exc:  # told to every rank: the peers are already on their way into the gather
            local = {"state": None, "error": f"rank {engine.rank}: {type(exc).__name__}: {exc}"}
        gathered = state_json.allgather(engine, local, device=torch.device("cpu"))
        errors = [entry["error"] for entry in gathered if entry["error"]]
        if errors:
            raise RuntimeError(f"the compression state could not be saved on every rank: {'; '.join(errors)}")
        return {"world_size": len(gathered), "ranks": [entry["state"] for entry in gathered]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """This rank's compression state from :meth:`state_dict`'s, saved at the same world size."""
        engine = self.model.engine
        if state["world_size"] != engine.world_size:
            raise ValueError(
                f"the checkpoint holds the compression state of {state['world_size']} ranks, this run has "
                f"{engine.world_size}: PowerSGD's error-feedback memory belongs to each rank. Resume at "
                f"{state['world_size']} ranks, or drop the checkpoint's compression state (Lightning: its "
                "'collective_ops_compression' entry; Accelerate: its custom_checkpoint file) to restart it"
            )
        self.model.load_compression_state_dict(state["ranks"][engine.rank])


__all__ = ["RankCompressionStates"]
