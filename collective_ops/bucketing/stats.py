"""What a bucket manager records of each synchronised step: per-bucket timestamps and the step's counters (read by
the tracer, the tuner's profile, ``comm_stats()``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class BucketTiming:
    """Per-bucket timestamps of the last synchronised iteration (``time.perf_counter`` seconds)."""

    first_ready: float | None = None
    last_ready: float | None = None
    launched: float | None = None
    # when its collective was first seen complete: with an observer (the tracer) the manager looks at every
    # gradient and every bucket finished; without one, and for handles that cannot be polled, when finished
    completed: float | None = None


@dataclass
class StepStats:
    """Counters of the last synchronised iteration."""

    step: int = 0
    collectives: int = 0
    bytes_communicated: int = 0
    backward_start: float | None = None  # first gradient ready
    finalize_start: float | None = None
    finalize_end: float | None = None
    exposed_comm_s: float = 0.0  # time finalize waited on communication not hidden by backward
    buckets: list[BucketTiming] = field(default_factory=list)
    # parameter index -> when its gradient was ready; insertion order is the observed ready order
    ready_times: dict[int, float] = field(default_factory=dict)


def stats_summary(stats: StepStats, plan: Any, totals: dict[str, Any], world_size: int) -> dict[str, Any]:
    """Buckets, collectives and bytes per step, and communication not hidden behind backward."""
    return {
        "world_size": world_size,
        "buckets": len(plan.buckets),
        "bucket_bytes": [b.nbytes for b in plan.buckets],
        "bucket_params": [len(b.param_indices) for b in plan.buckets],
        "bucket_size_mb": plan.bucket_size_mb,
        "plan_fingerprint": plan.fingerprint(),
        "steps": totals["steps"],
        "collectives_per_step": stats.collectives,
        "bytes_per_step": stats.bytes_communicated,
        "exposed_comm_s": stats.exposed_comm_s,
        "mean_exposed_comm_s": totals["exposed_comm_s"] / max(totals["steps"], 1),
    }


def compiled_step_stats(
    step: int,
    plan: Any,
    start: float,
    end: float,
    wire_nbytes: Callable[[Any], int],
    collectives: int | None = None,
) -> StepStats:
    """A step whose buckets one compiled call reduced (all of them, in plan order, between ``start`` and ``end``):
    every gradient ready, every bucket launched, at ``start``; every bucket complete at ``end``. ``collectives``:
    the call's collectives where it is not one a bucket."""
    buckets = plan.buckets
    return StepStats(
        step=step,
        collectives=len(buckets) if collectives is None else collectives,
        bytes_communicated=sum(wire_nbytes(b) for b in buckets),
        backward_start=start,
        finalize_start=start,
        finalize_end=end,
        buckets=[BucketTiming(start, start, start, end) for _ in buckets],
        ready_times=dict.fromkeys(plan.order, start),
    )
