"""Every rank reduces the gradients of the same iteration: a per-step check of the forward passes behind them.

Collectives are matched by the order they are issued in. A rank that skips a backward (a loss found non-finite
on that rank alone, an exception its loop caught) therefore pairs its next step's buckets with its peers'
current ones: the averages mix iterations, silently, until the step counts part far enough for a stall. Each
rank counts its forward passes (the adapter decides which count: gradients enabled, training mode) and, at the
first gradient of each backward, takes the number run since its previous backward. A synchronised step's number
travels in one small integer all-reduce issued before the step's first bucket; every rank reads the same table
of all ranks' numbers, so where they differ every rank raises, at the same step, before anything is updated.
A rank counted once per backward accepts loops that differ only in how many micro-batches a rank accumulates
under ``no_sync()``: those forwards each have their backward.
"""

from __future__ import annotations

from typing import Any

from .interfaces import BucketEngine, Handle, wait_with_timeout


class StepMisalignedError(RuntimeError):
    """The ranks' gradients of one reduced step came from different iterations (a rank skipped a backward)."""


class StepAlignment:
    """The forward passes behind each rank's backward, compared across ranks once per synchronised step."""

    def __init__(self, group: Any = None, device: str = "cpu") -> None:
        self.group, self.device = group, device  # where the tables go (the engine's host group, if it has one)
        self._forwards = 0  # counted since the last backward started
        self._behind_backward = 0  # behind the latest backward
        self._in_flight: tuple[Any, Handle, int] | None = None  # (table, handle, step)

    def count_forward(self) -> None:
        self._forwards += 1

    def backward_started(self) -> None:
        """A gradient arrived: the forwards counted so far are this backward's (a no-op for its later gradients)."""
        if self._forwards:
            self._behind_backward, self._forwards = self._forwards, 0

    def launch(self, engine: BucketEngine, step: int, taking_part: bool) -> None:
        """Issue the step's table (rank r's count at r, whether it takes part at world + r) as an async sum.

        A rank that shadows the step (it joined: no data of its own) takes no part in the comparison.
        """
        world, rank = engine.world_size, engine.rank
        table = [0] * (2 * world)
        if taking_part:
            table[rank], table[world + rank] = self._behind_backward, 1
        tensor = engine.int_tensor(table, self.device)
        handle = engine.allreduce(tensor, "sum", async_op=True, group=self.group)
        self._in_flight = (tensor, handle, step)

    @property
    def pending(self) -> bool:
        return self._in_flight is not None

    def drop(self) -> None:
        """The step was abandoned: its table is not read."""
        self._in_flight = None

    def settle(self, engine: BucketEngine, timeout_s: float | None) -> StepMisalignedError | None:
        """Wait for the step's table (TimeoutError past ``timeout_s``); the error every rank raises, if misaligned."""
        if self._in_flight is None:
            return None
        tensor, handle, step = self._in_flight
        wait_with_timeout(handle, timeout_s)
        self._in_flight = None
        world = engine.world_size
        table = engine.to_list(tensor)
        counts = {rank: table[rank] for rank in range(world) if table[world + rank]}
        if len(set(counts.values())) <= 1:
            return None
        return StepMisalignedError(
            f"reduced step {step} averages gradients of different iterations: forward passes (with gradients "
            f"enabled, in training mode) since each rank's previous backward: "
            + ", ".join(f"rank {rank}: {count}" for rank, count in sorted(counts.items()))
            + ". A rank that ran more skipped a backward (a loss judged non-finite on that rank alone, an error "
            "its loop caught), so its gradients were about to be averaged with another iteration's: nothing of this "
            "step is applied. Skip steps on every rank alike (decide together: an all-reduce of a flag), run "
            "forwards that have no backward under torch.no_grad() or in eval mode, or pass "
            "check_step_alignment=False to wrap() if the ranks' forward counts differ by design."
        )
