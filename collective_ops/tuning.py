"""``co.tune(model, step_fn)``: choose ``bucket_size_mb`` for a wrapped model (torch, or MindSpore in PyNative) from profiled steps and a short
trial of the best candidates.

The cost model and simulator are :mod:`collective_ops.bucketing.cost`; the live alpha/beta fit is
:mod:`collective_ops.comm.measure`; the ``collective-ops tune`` CLI and the profile file are
:mod:`collective_ops.tools.tune`. :func:`profile_with_contention` measures the simulator's ``contention``:
compute with every bucket after backward (nothing overlaps) against compute at a plan of small buckets.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .bucketing.cost import (  # noqa: F401  (re-exported: the names the tuner was used through)
    CANDIDATES_MB,
    COMPRESSION_FLOPS_PER_S,
    DEFAULT_COMPRESSION_FLOPS_PER_S,
    FIRST_BUCKET_CANDIDATES_MB,
    BackwardProfile,
    CostModel,
    Prediction,
    choose,
    link_from_fit,
    predict,
    profile_from_stats,
    simulate,
)
from .bucketing.plan import device_type
from .comm import measure
from .comm.measure import estimated_contention  # noqa: F401  (re-exported)

logger = logging.getLogger("collective_ops")


def measure_alpha_beta(sizes: Sequence[int] = measure.SWEEP_BYTES, iters: int = 10) -> CostModel:
    """:func:`collective_ops.comm.measure.measure_alpha_beta` on the torch engine (every rank calls it)."""
    from .runtime import get_engine

    return measure.measure_alpha_beta(get_engine("torch"), sizes, iters)


def _median_profile(model: Any, step_fn: Callable[[], None], steps: int) -> BackwardProfile:
    profiles = []
    for _ in range(steps):
        start = time.perf_counter()
        step_fn()
        manager = model.manager
        end = time.perf_counter()
        profiles.append(
            profile_from_stats(manager.last_stats, start, end, manager.wire_shares(), manager.wire_itemsize)
        )
    return sorted(profiles, key=lambda p: p.step_compute_s)[len(profiles) // 2]


def with_compression_priced(profile: BackwardProfile, hook: Any, device: str) -> BackwardProfile:
    """``profile`` with a compressing hook's own price of each candidate's buckets (PowerSGD's ``planned_wire``:
    two allreduces of the compressed bytes each). Its compute is in the profiled steps' measured compute once
    compression has started; before ``start_iter`` it is added at the device's fixed rate, as the online tune does."""
    planned = getattr(hook, "planned_wire", None)
    if planned is None:
        return profile
    measured = getattr(hook, "compressing", False)
    rate = math.inf if measured else COMPRESSION_FLOPS_PER_S.get(device, DEFAULT_COMPRESSION_FLOPS_PER_S)
    return dataclasses.replace(profile, bucket_wire=planned, flops_per_s=rate)


def profile_with_contention(
    model: Any, step_fn: Callable[[], None], cost: CostModel, steps: int = 3
) -> tuple[BackwardProfile, float]:
    """(profile whose compute is free of communication, contention) for a wrapped model.

    ``steps`` steps with the whole model in one bucket (launched after backward: nothing
    overlaps) give the gradients' own ready times and the compute alone; ``steps`` more at a
    probe plan of small buckets (an eighth of the model each) give the compute while
    communication overlaps backward. The difference, over the communication the simulator
    overlaps at the probe plan, is the contention. (Probing at the model's current plan would
    divide by almost nothing when that plan overlaps little, as the 25 MiB default does.)
    Leaves the model on its current plan; costs ``2 * steps + 3`` steps.
    """
    plan = model.manager.plan
    current = (plan.bucket_size_mb, plan.first_bucket_mb)
    total_mb = sum(b.nbytes for b in plan.buckets) / 2**20
    whole_mb = max(total_mb * 2, 1.0)  # twice the model: one bucket per dtype
    probe_mb = max(total_mb / 8, 0.05)
    try:
        model.set_bucket_size(whole_mb, whole_mb)
        step_fn()  # settle on the new buffers
        profile = _median_profile(model, step_fn, steps)
        model.set_bucket_size(probe_mb, probe_mb)
        step_fn()
        overlapped = _median_profile(model, step_fn, steps).step_compute_s
        probe_plan = model.manager.plan
    finally:
        model.set_bucket_size(*current)
    step_fn()
    hidden = simulate(probe_plan, profile, cost).hidden_comm_s
    contention = (overlapped - profile.step_compute_s) / hidden if hidden > 0 else 0.0
    return profile, float(min(max(contention, 0.0), 1.0))


@dataclass
class TuneResult:
    bucket_size_mb: float
    first_bucket_mb: float
    predictions: list[Prediction]
    measured_s: dict[tuple[float, float], float]  # (bucket_size_mb, first_bucket_mb) -> seconds per step
    cost: CostModel
    trial_steps: int
    contention: float = 0.0

    def describe(self) -> str:
        lines = [
            f"cost model: alpha={self.cost.alpha * 1e6:.1f} us, beta={self.cost.beta * 1e9:.3f} ns/B ({self.cost.label}); "
            f"contention {self.contention:.2f}"
        ]
        for p in self.predictions:
            measured = self.measured_s.get((p.bucket_size_mb, p.first_bucket_mb))
            lines.append(
                f"  {p.bucket_size_mb:>6g} MiB (first {p.first_bucket_mb:g}): predicted {p.step_s * 1e3:8.1f} ms "
                f"(exposed {p.exposed_comm_s * 1e3:6.1f} ms, {p.collectives} collectives)"
                + (f", measured {measured * 1e3:8.1f} ms" if measured else "")
            )
        lines.append(
            f"chosen: bucket_size_mb={self.bucket_size_mb:g}, first_bucket_mb={self.first_bucket_mb:g} "
            f"after {self.trial_steps} trial steps"
        )
        return "\n".join(lines)


def tune(
    model: Any,
    step_fn: Callable[[], None],
    candidates_mb: Sequence[float] = CANDIDATES_MB,
    confirm_top: int = 2,
    confirm_steps: int = 3,
    cost: CostModel | None = None,
    profile_steps: int = 2,
    keep_current: bool = True,
) -> TuneResult:
    """Choose ``bucket_size_mb`` and ``first_bucket_mb`` for a wrapped model (torch, or MindSpore in PyNative) and set them.

    ``step_fn()`` runs one training step (forward, backward, optimizer) on the wrapped
    model. Profiled steps (:func:`profile_with_contention`) and a short allreduce sweep
    feed the simulator, which ranks every (size, first bucket) pair; the best ``confirm_top``
    (and, with ``keep_current``, the current pair) are then timed for ``confirm_steps``
    real steps each and the fastest wins. Rank 0 decides and broadcasts, so every rank
    ends with the same plan.
    """
    for mb in candidates_mb:
        if not mb > 0:
            raise ValueError(f"candidate bucket sizes must be positive MiB, got {mb!r}")
    if confirm_top < 1 or confirm_steps < 1 or profile_steps < 1:
        raise ValueError("confirm_top, confirm_steps and profile_steps must be at least 1")
    engine = model.engine
    manager = model.manager
    step_fn()  # warm-up (and the first-step rebuild)
    cost = cost or measure.measure_alpha_beta(engine)  # the model's own engine: torch's or MindSpore's
    profile, contention = profile_with_contention(model, step_fn, cost, profile_steps)
    profile = with_compression_priced(profile, manager.comm_hook, device_type(str(engine.device)).lower())
    specs = list(manager.plan.params)
    predictions = predict(
        specs, profile, cost, candidates_mb, FIRST_BUCKET_CANDIDATES_MB, manager.plan.order, contention
    )
    # Each rank ranks the candidates from its own profile; rank 0's shortlist is everyone's, or
    # ranks would try different plans and their collectives would no longer match.
    local = [v for p in predictions[:confirm_top] for v in _encode((p.bucket_size_mb, p.first_bucket_mb))]
    local += [-1] * (2 * confirm_top - len(local))
    shared = engine.broadcast_ints(local, src=0)
    shortlist = [_decode(shared[i : i + 2]) for i in range(0, len(shared), 2) if shared[i] >= 0]
    current = (manager.plan.bucket_size_mb, manager.plan.first_bucket_mb)
    if keep_current and current not in shortlist:
        # The incumbent is timed too: a mispredicted shortlist cannot move the model to a slower plan.
        shortlist.append(current)
    measured: dict[tuple[float, float], float] = {}
    trial_steps = 1 + 2 * profile_steps + 3
    for pair in shortlist:
        model.set_bucket_size(*pair)
        step_fn()  # settle buffers
        times = []
        for _ in range(confirm_steps):
            t0 = time.perf_counter()
            step_fn()
            times.append(time.perf_counter() - t0)
        trial_steps += confirm_steps + 1
        measured[pair] = engine.reduce_floats([float(np.median(times))], "max")[0]  # the slowest rank's
    best_local = min(measured, key=measured.get)
    choice = _decode(engine.broadcast_ints(_encode(best_local), src=0))  # rank 0 decides
    model.set_bucket_size(*choice)
    result = TuneResult(*choice, predictions, measured, cost, trial_steps, contention)
    logger.info("collective_ops.tune:\n%s", result.describe())
    return result


def _encode(pair: tuple[float, float]) -> list[int]:
    """(size, first) in MiB as integers of KiB/1000 precision, for broadcast_ints."""
    return [round(pair[0] * 1000), round(pair[1] * 1000)]


def _decode(values: Sequence[int]) -> tuple[float, float]:
    return values[0] / 1000, values[1] / 1000
