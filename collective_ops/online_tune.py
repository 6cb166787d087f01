"""``bucket_size_mb="auto"``: the online choice after the profiled step (framework-free, for every wrapper).

At the end of the profiled step every rank fits alpha/beta on the live group
(:func:`collective_ops.comm.measure.measure_alpha_beta`), simulates every candidate bucket size on the backward
just seen (:mod:`collective_ops.bucketing.cost`) and takes rank 0's choice, so every rank replans alike.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .bucketing import DEFAULT_BUCKET_MB, plan_buckets
from .bucketing.cost import (
    CANDIDATES_MB,
    COMPRESSION_FLOPS_PER_S,
    DEFAULT_COMPRESSION_FLOPS_PER_S,
    FIRST_BUCKET_CANDIDATES_MB,
    BackwardProfile,
    CostModel,
    Prediction,
    choose,
    predict,
)
from .bucketing.diagnosis import agreeing
from .comm import measure

logger = logging.getLogger("collective_ops")

# (predictions, cost, contention) -> simulated overlapped step by (bucket_size_mb, first_bucket_mb); {}: none
OverlappedSteps = Callable[[list[Prediction], CostModel, float], dict[tuple[float, float], float]]


@dataclass(frozen=True)
class OnlineChoice:
    bucket_size_mb: float  # rank 0's choice, on every rank
    first_bucket_mb: float
    predictions: list[Prediction]  # best first
    overlapped: dict[tuple[float, float], float]  # with updates overlapping the next forward: each candidate's step
    contention: float  # what the simulator charged communication that overlapped compute


def auto_tune_start(bucket_size_mb: float | str, auto_tune_step: int) -> tuple[int | None, float | str]:
    """(the step the online tune profiles, the size to start at): ``"auto"`` starts at the default size, profiles
    step ``auto_tune_step``, then settles on the simulator's choice; a number is kept (no tune)."""
    if not isinstance(bucket_size_mb, str):
        return None, bucket_size_mb
    if bucket_size_mb != "auto":
        raise ValueError(f"bucket_size_mb must be a number of MiB or 'auto', got {bucket_size_mb!r}")
    if auto_tune_step < 1:
        raise ValueError(f"auto_tune_step must be >= 1, got {auto_tune_step}")
    return auto_tune_step, DEFAULT_BUCKET_MB


def last_backward_profile(manager: Any, device_type: str = "cpu") -> BackwardProfile:
    """The bucket manager's last step as the simulator's input: each gradient's ready time from backward's start;
    a hook that prices buckets itself (PowerSGD's ``planned_wire``) prices each candidate's, its compute at
    :data:`~collective_ops.bucketing.cost.COMPRESSION_FLOPS_PER_S` for ``device_type``."""
    stats = manager.last_stats
    start = stats.backward_start or 0.0
    return BackwardProfile(
        {i: t - start for i, t in stats.ready_times.items()},
        (stats.finalize_start or start) - start,
        0.0,
        manager.wire_shares(),
        manager.wire_itemsize,
        getattr(manager.comm_hook, "planned_wire", None),
        COMPRESSION_FLOPS_PER_S.get(device_type, DEFAULT_COMPRESSION_FLOPS_PER_S),
    )


def choose_online(manager: Any, engine: Any, device_type: str, overlapped_steps: OverlappedSteps) -> OnlineChoice:
    """Every candidate simulated on the step just profiled; rank 0's choice for all (every rank calls it, at the
    end of the same step: it issues collectives). ``overlapped_steps``: the optimizer's simulated steps, if any."""
    with agreeing(manager, "bucket_size_mb='auto' (the fitted cost and rank 0's choice, shared)"):
        profile = last_backward_profile(manager, device_type)
        cost = measure.measure_alpha_beta(engine)
        contention = measure.estimated_contention(cost, device_type)
        plan = manager.plan
        predictions = predict(
            plan.params, profile, cost, CANDIDATES_MB, FIRST_BUCKET_CANDIDATES_MB, plan.order, contention
        )
        overlapped = overlapped_steps(predictions, cost, contention)
        best = choose(predictions, overlapped)  # with updates overlapping the forward: that step
        chosen = engine.broadcast_ints([round(best.bucket_size_mb * 1000), round(best.first_bucket_mb * 1000)])
    choice = OnlineChoice(chosen[0] / 1000, chosen[1] / 1000, predictions, overlapped, contention)
    _log(choice, cost)
    return choice


def overlapped_steps(
    optimizer: Any, plan: Any, predictions: list[Prediction], cost: CostModel, contention: float
) -> dict[tuple[float, float], float]:
    """With an optimizer that plans its launch order (an :class:`UpdateParticipant`): each candidate's simulated
    step with its best order, keyed by (bucket_size_mb, first_bucket_mb); empty where there is no optimizer or it
    has no profile (local work). Communication that overlaps compute (all but the forward's waits) slows it by
    ``contention``."""
    if optimizer is None:
        return {}
    steps = {}
    for p in predictions:
        candidate = plan_buckets(plan.params, p.bucket_size_mb, p.first_bucket_mb, order=plan.order)
        result = optimizer.predict_overlapped(candidate, cost)
        if result is None:
            return {}
        hidden = max(p.comm_s - result.forward_wait_s, 0.0)
        steps[(p.bucket_size_mb, p.first_bucket_mb)] = result.step_s + contention * hidden
    return steps


def _log(choice: OnlineChoice, cost: CostModel) -> None:
    predictions = choice.predictions
    logger.info(
        "collective_ops: bucket_size_mb='auto' settled on %g MiB, first bucket %g MiB (predicted exposed "
        "communication %.1f ms, %d collectives; alpha=%.1f us, beta=%.3f ns/B, contention %.2f); candidates: %s",
        choice.bucket_size_mb,
        choice.first_bucket_mb,
        predictions[0].exposed_comm_s * 1e3,
        predictions[0].collectives,
        cost.alpha * 1e6,
        cost.beta * 1e9,
        choice.contention,
        ", ".join(f"{p.bucket_size_mb:g}/{p.first_bucket_mb:g}: {p.exposed_comm_s * 1e3:.1f} ms" for p in predictions),
    )
    if choice.overlapped:
        logger.info(
            "collective_ops: chosen by the step simulated with updates overlapping the next forward: %s",
            ", ".join(f"{mb:g}/{first:g}: {s * 1e3:.1f} ms" for (mb, first), s in choice.overlapped.items()),
        )
