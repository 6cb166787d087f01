"""The compression's per-rank state in checkpoints that one rank writes (Lightning's, Accelerate's ``save_state``).

PowerSGD's error-feedback memory differs on every rank (each holds what compressing its own gradients lost), so a
checkpoint written by rank 0 alone must carry every rank's. :class:`RankCompressionStates` is that state as one
object with ``state_dict()`` / ``load_state_dict()``, the shape both frameworks' checkpoint hooks take: saving
gathers every rank's state onto the rank that writes (a collective, as JSON: nothing is unpickled), loading takes
this rank's back.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .optim import state_json


class RankCompressionStates:
    """Every rank's :meth:`compression_state_dict` of a wrapped ``model``, for a checkpoint one rank writes.

    ``writer()``: the rank that writes the checkpoint, which alone receives every rank's state (the others hold
    only their own while saving), or None where several ranks write (each then receives them all)."""

    def __init__(self, model: Any, writer: Callable[[], int | None] = lambda: 0) -> None:
        self.model = model
        self.writer = writer

    @staticmethod
    def needed(model: Any) -> bool:
        """Whether ``model``'s compression keeps state between steps (PowerSGD; fp16/bf16 keep none)."""
        return hasattr(getattr(getattr(model, "manager", None), "comm_hook", None), "state_dict")

    def state_dict(self) -> dict[str, Any]:
        """Every rank's compression state, by rank, on the host, on the writing rank (``ranks`` is None on the
        others). A collective: every rank calls it, as both frameworks' saving does. Where a rank cannot give its
        state (a step in flight after a failure), every rank raises, naming it, rather than its peers waiting."""
        engine = self.model.engine
        try:
            mine, error = state_json.to_bytes(self.model.compression_state_dict()), None
        except Exception as exc:  # told to every rank: the peers are already on their way into the gather
            mine, error = b"", f"rank {engine.rank}: {type(exc).__name__}: {exc}"
        errors = [e.decode() for e in engine.allgather_bytes((error or "").encode()) if e]
        if errors:
            raise RuntimeError(f"the compression state could not be saved on every rank: {'; '.join(errors)}")
        writer = self.writer()
        blobs = engine.allgather_bytes(mine) if writer is None else engine.gather_bytes(mine, writer)
        ranks = None if blobs is None else [state_json.from_bytes(b, torch.device("cpu")) for b in blobs]
        return {"world_size": engine.world_size, "ranks": ranks}

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
