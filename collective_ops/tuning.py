"""Choosing ``bucket_size_mb``: a cost model fitted on the live cluster, a schedule simulator, a tuner.

Cost model: one allreduce of ``b`` bytes at the current world size costs ``alpha + beta * b``
(least squares over a short size sweep of the live backend). For other world sizes and
links, the ring-allreduce model: ``2(N-1) * alpha_link + 2(N-1)/N * b / bandwidth``.

Simulator: backward produces gradients at measured times (one profiled step); a bucket
can start once all its gradients are ready and the previous bucket has finished (one
communication channel, buckets in plan order, as the bucket manager launches them).
Predicted step = compute time + communication left after backward ends (exposed)
+ ``contention`` x communication that ran during backward. ``contention`` is 0 where
communication has engines of its own (GPU/NPU) and near 1 where it shares the CPU cores
with backward (Gloo on CPU); :func:`profile_with_contention` measures it: compute with
every bucket after backward (nothing overlaps) against compute at the current plan.

Everything here is framework-free except :func:`measure_alpha_beta` (torch engine) and
:func:`tune` (a wrapped torch model).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from .bucketing import BucketPlan, ParamSpec, plan_buckets

logger = logging.getLogger("collective_ops")

CANDIDATES_MB = (1.0, 2.0, 5.0, 10.0, 25.0, 50.0, 100.0)


@dataclass(frozen=True)
class CostModel:
    """Seconds for one allreduce of ``nbytes``: ``alpha + beta * nbytes``."""

    alpha: float
    beta: float
    label: str = "measured"

    def __post_init__(self) -> None:
        if not (np.isfinite(self.alpha) and np.isfinite(self.beta)) or self.alpha < 0 or self.beta < 0:
            raise ValueError(f"cost model needs finite alpha >= 0 and beta >= 0, got {self.alpha}, {self.beta}")

    def cost(self, nbytes: int) -> float:
        return self.alpha + self.beta * nbytes

    @classmethod
    def fit(cls, nbytes: Sequence[int], seconds: Sequence[float]) -> CostModel:
        """Least-squares fit of ``seconds = alpha + beta * nbytes`` (clamped at zero)."""
        x = np.asarray(nbytes, dtype=float)
        y = np.asarray(seconds, dtype=float)
        if x.size < 2 or np.unique(x).size < 2:
            raise ValueError("fitting a cost model needs at least two different sizes")
        beta, alpha = np.polyfit(x, y, 1)
        return cls(max(float(alpha), 0.0), max(float(beta), 0.0), "fitted")

    @classmethod
    def ring(cls, world_size: int, link_latency_s: float, link_bandwidth_Bps: float) -> CostModel:
        """Ring allreduce at ``world_size`` ranks over links of the given latency and bandwidth (a projection)."""
        if world_size < 2:
            return cls(0.0, 0.0, "ring N=1")
        steps = 2 * (world_size - 1)
        return cls(
            steps * link_latency_s,
            2 * (world_size - 1) / world_size / link_bandwidth_Bps,
            f"ring N={world_size} (simulation)",
        )


@dataclass(frozen=True)
class BackwardProfile:
    """When each parameter's gradient became ready, relative to the start of the step (seconds)."""

    ready_s: dict[int, float]  # parameter index -> seconds after step start
    backward_end_s: float  # when backward (and so the last gradient) ended
    step_compute_s: float  # forward + backward + optimizer, without exposed communication

    def __post_init__(self) -> None:
        if not self.ready_s:
            raise ValueError("a backward profile needs the ready time of at least one gradient")


@dataclass(frozen=True)
class Prediction:
    bucket_size_mb: float
    first_bucket_mb: float
    step_s: float
    exposed_comm_s: float
    comm_s: float
    collectives: int
    finishes_s: tuple[float, ...]
    hidden_comm_s: float  # communication that ran while backward was still running


def simulate(plan: BucketPlan, profile: BackwardProfile, cost: CostModel, contention: float = 0.0) -> Prediction:
    """Predict a step of ``plan``: buckets start when ready and the channel is free, in plan order.

    ``contention``: the share of communication overlapping backward that slows backward down
    by as much (0: free overlap; 1: overlap only time-shares the same cores).
    """
    if not 0.0 <= contention <= 1.0:
        raise ValueError(f"contention is a share between 0 and 1, got {contention!r}")
    channel_free = 0.0
    finishes = []
    comm = 0.0
    for bucket in plan.buckets:
        ready = max((profile.ready_s.get(i, profile.backward_end_s) for i in bucket.param_indices), default=0.0)
        start = max(ready, channel_free)
        duration = cost.cost(bucket.nbytes)
        channel_free = start + duration
        finishes.append(channel_free)
        comm += duration
    exposed = max(0.0, channel_free - profile.backward_end_s)
    hidden = max(comm - exposed, 0.0)  # one serial channel: whatever is not exposed ran during backward
    return Prediction(
        plan.bucket_size_mb,
        plan.first_bucket_mb,
        profile.step_compute_s + exposed + contention * hidden,
        exposed,
        comm,
        len(plan.buckets),
        tuple(finishes),
        hidden,
    )


def predict(
    specs: Sequence[ParamSpec],
    profile: BackwardProfile,
    cost: CostModel,
    candidates_mb: Sequence[float] = CANDIDATES_MB,
    first_bucket_mb: float | None = 1.0,
    order: Sequence[int] | None = None,
    contention: float = 0.0,
) -> list[Prediction]:
    """Predictions for each candidate size, best first. ``order``: the observed ready order."""
    if order is None:
        order = sorted(profile.ready_s, key=profile.ready_s.get)
    out = []
    for mb in candidates_mb:
        first = min(first_bucket_mb, mb) if first_bucket_mb else mb
        out.append(simulate(plan_buckets(specs, mb, first, order=order), profile, cost, contention))
    return sorted(out, key=lambda p: (p.step_s, p.collectives))


def measure_alpha_beta(
    sizes: Sequence[int] = (1 << 12, 1 << 16, 1 << 20, 1 << 22, 1 << 24), iters: int = 10
) -> CostModel:
    """Fit alpha/beta of allreduce on the live torch group (every rank calls it; same result everywhere)."""
    from .bench import run_sweep

    rows = run_sweep("allreduce", list(sizes), warmup=2, iters=iters, impls=("raw",), progress=False, rounds=1)
    return CostModel.fit([r.bytes for r in rows], [r.time_us * 1e-6 for r in rows])


def profile_from_stats(stats, step_start: float, step_end: float) -> BackwardProfile:
    """A :class:`BackwardProfile` from the bucket manager's stats of one step."""
    backward_end = stats.finalize_start if stats.finalize_start is not None else step_end
    ready = {i: t - step_start for i, t in stats.ready_times.items()}
    compute = (step_end - step_start) - stats.exposed_comm_s
    return BackwardProfile(ready, backward_end - step_start, max(compute, 0.0))


def _median_profile(model, step_fn: Callable[[], None], steps: int) -> BackwardProfile:
    profiles = []
    for _ in range(steps):
        start = time.perf_counter()
        step_fn()
        profiles.append(profile_from_stats(model.manager.last_stats, start, time.perf_counter()))
    return sorted(profiles, key=lambda p: p.step_compute_s)[len(profiles) // 2]


def profile_with_contention(
    model, step_fn: Callable[[], None], cost: CostModel, steps: int = 3
) -> tuple[BackwardProfile, float]:
    """(profile whose compute is free of communication, contention) for a wrapped model.

    ``steps`` profiled steps at the current plan give the gradients' ready times and the
    compute with communication overlapping it; ``steps`` more with the whole model in one
    bucket (launched after backward: nothing overlaps) give the compute alone. The
    difference, over the communication the simulator overlaps at the current plan, is
    the contention. Leaves the model on its current plan; costs ``2 * steps + 2`` steps.
    """
    manager = model.manager
    plan = manager.plan
    current = (plan.bucket_size_mb, plan.first_bucket_mb)
    shared = _median_profile(model, step_fn, steps)
    whole_mb = max(sum(b.nbytes for b in plan.buckets) / 2**20 * 2, 1.0)  # twice the model: one bucket per dtype
    model.set_bucket_size(whole_mb, whole_mb)
    try:
        step_fn()  # settle on the new buffers
        alone = _median_profile(model, step_fn, steps).step_compute_s
    finally:
        model.set_bucket_size(*current)
    step_fn()
    profile = BackwardProfile(shared.ready_s, shared.backward_end_s, min(alone, shared.step_compute_s))
    hidden = simulate(plan, profile, cost).hidden_comm_s
    contention = (shared.step_compute_s - profile.step_compute_s) / hidden if hidden > 0 else 0.0
    return profile, float(min(max(contention, 0.0), 1.0))


@dataclass
class TuneResult:
    bucket_size_mb: float
    first_bucket_mb: float
    predictions: list[Prediction]
    measured_s: dict[float, float]
    cost: CostModel
    trial_steps: int
    contention: float = 0.0

    def describe(self) -> str:
        lines = [
            f"cost model: alpha={self.cost.alpha * 1e6:.1f} us, beta={self.cost.beta * 1e9:.3f} ns/B ({self.cost.label}); "
            f"contention {self.contention:.2f}"
        ]
        for p in self.predictions:
            measured = self.measured_s.get(p.bucket_size_mb)
            lines.append(
                f"  {p.bucket_size_mb:>6g} MiB: predicted {p.step_s * 1e3:8.1f} ms (exposed {p.exposed_comm_s * 1e3:6.1f} ms, "
                f"{p.collectives} collectives)" + (f", measured {measured * 1e3:8.1f} ms" if measured else "")
            )
        lines.append(f"chosen: bucket_size_mb={self.bucket_size_mb:g} after {self.trial_steps} trial steps")
        return "\n".join(lines)


def tune(
    model,
    step_fn: Callable[[], None],
    candidates_mb: Sequence[float] = CANDIDATES_MB,
    confirm_top: int = 2,
    confirm_steps: int = 3,
    cost: CostModel | None = None,
    profile_steps: int = 2,
    keep_current: bool = True,
) -> TuneResult:
    """Choose ``bucket_size_mb`` for a wrapped torch model and set it.

    ``step_fn()`` runs one training step (forward, backward, optimizer) on the wrapped
    model. Profiled steps (:func:`profile_with_contention`) and a short allreduce sweep
    feed the simulator; the best ``confirm_top`` predictions (and, with ``keep_current``,
    the current size) are then timed for ``confirm_steps`` real steps each and the fastest
    wins. Rank 0 decides and broadcasts, so every rank ends with the same size.
    """
    for mb in candidates_mb:
        if not mb > 0:
            raise ValueError(f"candidate bucket sizes must be positive MiB, got {mb!r}")
    if confirm_top < 1 or confirm_steps < 1 or profile_steps < 1:
        raise ValueError("confirm_top, confirm_steps and profile_steps must be at least 1")
    engine = model.engine
    manager = model.manager
    step_fn()  # warm-up (and the first-step rebuild)
    cost = cost or measure_alpha_beta()
    profile, contention = profile_with_contention(model, step_fn, cost, profile_steps)
    specs = list(manager.plan.params)
    predictions = predict(
        specs, profile, cost, candidates_mb, manager.plan.first_bucket_mb, manager.plan.order, contention
    )
    # Each rank ranks the candidates from its own profile; rank 0's shortlist is everyone's, or
    # ranks would try different plans and their collectives would no longer match.
    local = [round(p.bucket_size_mb * 1000) for p in predictions[:confirm_top]]
    local += [-1] * (confirm_top - len(local))
    shortlist = [v / 1000 for v in engine.broadcast_ints(local, src=0) if v >= 0]
    current = manager.plan.bucket_size_mb
    if keep_current and current not in shortlist:
        # The incumbent is timed too: a mispredicted shortlist cannot move the model to a slower size.
        shortlist.append(current)
    measured: dict[float, float] = {}
    trial_steps = 1 + 2 * profile_steps + 2
    for size in shortlist:
        model.set_bucket_size(size)
        step_fn()  # settle buffers
        times = []
        for _ in range(confirm_steps):
            t0 = time.perf_counter()
            step_fn()
            times.append(time.perf_counter() - t0)
        trial_steps += confirm_steps + 1
        measured[size] = engine.reduce_floats([float(np.median(times))], "max")[0]  # the slowest rank's
    best_local = min(measured, key=measured.get)
    choice = engine.broadcast_ints([round(best_local * 1000)], src=0)[0] / 1000  # rank 0 decides
    model.set_bucket_size(choice)
    result = TuneResult(
        choice, min(manager.plan.first_bucket_mb, choice), predictions, measured, cost, trial_steps, contention
    )
    logger.info("collective_ops.tune:\n%s", result.describe())
    return result


def save_profile(model, step_fn: Callable[[], None], path: str) -> BackwardProfile:
    """Profile one step of a wrapped model and save it (shapes, ready times) for ``collective-ops tune``."""
    import json

    step_fn()
    start = time.perf_counter()
    step_fn()
    manager = model.manager
    profile = profile_from_stats(manager.last_stats, start, time.perf_counter())
    if manager.engine.rank == 0:
        payload = {
            "params": [[p.name, p.numel, p.dtype, p.device, p.itemsize] for p in manager.plan.params],
            "order": list(manager.plan.order),
            "ready_s": {str(k): v for k, v in profile.ready_s.items()},
            "backward_end_s": profile.backward_end_s,
            "step_compute_s": profile.step_compute_s,
            "first_bucket_mb": manager.plan.first_bucket_mb,
        }
        with open(path, "w") as f:
            json.dump(payload, f)
    return profile


def load_profile(path: str) -> tuple[list[ParamSpec], list[int], BackwardProfile, float]:
    import json

    try:
        with open(path) as f:
            data = json.load(f)
        specs = [ParamSpec(*row) for row in data["params"]]
        profile = BackwardProfile(
            {int(k): float(v) for k, v in data["ready_s"].items()},
            float(data["backward_end_s"]),
            float(data["step_compute_s"]),
        )
        return specs, [int(i) for i in data["order"]], profile, float(data.get("first_bucket_mb", 1.0))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{path}: not a profile written by collective_ops.tuning.save_profile ({exc})") from None


def add_arguments(parser) -> None:
    parser.add_argument("--profile", required=True, help="a profile from collective_ops.tuning.save_profile")
    parser.add_argument("--world", type=int, nargs="+", default=[8, 64, 512, 4096], help="world sizes to project to")
    parser.add_argument("--latency-us", type=float, default=5.0, help="per-hop link latency (alpha), microseconds")
    parser.add_argument("--bandwidth-gbs", type=float, default=25.0, help="per-link bandwidth, GB/s")
    parser.add_argument("--candidates", type=float, nargs="+", default=list(CANDIDATES_MB))


def run(args) -> int:
    try:
        specs, order, profile, first = load_profile(args.profile)
    except ValueError as exc:
        print(f"collective-ops tune: {exc}")
        return 2
    if args.latency_us < 0 or args.bandwidth_gbs <= 0 or any(w < 1 for w in args.world):
        print("collective-ops tune: need --latency-us >= 0, --bandwidth-gbs > 0 and world sizes >= 1")
        return 2
    print(
        f"SIMULATION (ring allreduce, alpha {args.latency_us:g} us per hop, {args.bandwidth_gbs:g} GB/s links), "
        f"profile {args.profile}: {len(specs)} parameters, backward {profile.backward_end_s * 1e3:.1f} ms, "
        f"compute {profile.step_compute_s * 1e3:.1f} ms"
    )
    for world in args.world:
        cost = CostModel.ring(world, args.latency_us * 1e-6, args.bandwidth_gbs * 1e9)
        ranked = predict(specs, profile, cost, args.candidates, first, order)
        best = ranked[0]
        print(
            f"  N={world:<5} best bucket_size_mb={best.bucket_size_mb:g}: step {best.step_s * 1e3:.1f} ms, "
            f"exposed {best.exposed_comm_s * 1e3:.1f} ms, {best.collectives} collectives; "
            + ", ".join(
                f"{p.bucket_size_mb:g}: {p.step_s * 1e3:.1f}" for p in sorted(ranked, key=lambda p: p.bucket_size_mb)
            )
        )
    return 0
