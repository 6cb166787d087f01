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
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from .bucketing import BucketPlan, ParamSpec, plan_buckets
from .bucketing.row_sparse import wire_nbytes

logger = logging.getLogger("collective_ops")

CANDIDATES_MB = (1.0, 2.0, 5.0, 10.0, 25.0, 50.0, 100.0)
# first_bucket_mb candidates (besides "as large as the others"): a small first bucket starts communication
# as soon as backward produces its first gradients; on a slow link that start is the whole head start.
FIRST_BUCKET_CANDIDATES_MB = (0.25, 1.0)


@dataclass(frozen=True)
class CostModel:
    """Seconds for one allreduce of ``nbytes``: ``alpha + beta * nbytes``.

    ``alpha_queued``: the latency of a collective launched while the previous one is still in
    flight, as the bucket manager launches them. Backends that progress several collectives at
    once (Gloo's process group runs two worker threads) overlap most of it with the previous
    transfer; None means no overlap (``alpha``).

    ``cpu_share``: CPU seconds this process spent per second of those back-to-back collectives
    (the transport's own threads: on CPU tensors they run on the cores compute uses); None
    where not measured. :func:`estimated_contention` turns it into the simulator's contention.
    """

    alpha: float
    beta: float
    label: str = "measured"
    alpha_queued: float | None = None
    cpu_share: float | None = None

    def __post_init__(self) -> None:
        values = (self.alpha, self.beta, self.alpha if self.alpha_queued is None else self.alpha_queued)
        if not all(np.isfinite(v) and v >= 0 for v in values):
            raise ValueError(f"cost model needs finite alpha, beta and alpha_queued >= 0, got {values}")

    def cost(self, nbytes: int, queued: bool = False) -> float:
        alpha = self.alpha_queued if queued and self.alpha_queued is not None else self.alpha
        return alpha + self.beta * nbytes

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
    # parameter index -> share of its bytes its bucket sends (row-sparse tables, bucketing/row_sparse.py)
    wire_share: dict[int, float] = field(default_factory=dict)
    wire_itemsize: int | None = None  # a compressing hook's element size on the wire (None: each bucket's own)

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
        nbytes = wire_nbytes(bucket, profile.wire_share, profile.wire_itemsize)
        duration = cost.cost(nbytes, queued=bool(finishes) and ready < channel_free)
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
    first_bucket_mb: float | Sequence[float] | None = 1.0,
    order: Sequence[int] | None = None,
    contention: float = 0.0,
) -> list[Prediction]:
    """Predictions for each candidate size, best first. ``order``: the observed ready order.

    ``first_bucket_mb``: one size (capped at each candidate), None (as large as the others), or
    a sequence of sizes to choose from too (each below the candidate, plus the candidate itself).
    """
    if order is None:
        order = sorted(profile.ready_s, key=profile.ready_s.get)
    out = []
    for mb in candidates_mb:
        if first_bucket_mb is None:
            firsts = [mb]
        elif isinstance(first_bucket_mb, (int, float)):
            firsts = [min(first_bucket_mb, mb)]
        else:
            firsts = sorted({min(f, mb) for f in first_bucket_mb} | {mb})
        for first in firsts:
            out.append(simulate(plan_buckets(specs, mb, first, order=order), profile, cost, contention))
    return sorted(out, key=lambda p: (p.step_s, p.collectives))


def choose(
    predictions: Sequence[Prediction], overlapped_s: dict[tuple[float, float], float] | None = None
) -> Prediction:
    """The candidate to set: the first of ``predictions`` (best first), or, where updates overlap the next
    forward, the one whose simulated overlapped step (``overlapped_s``, by (size, first bucket)) is shortest."""
    if not overlapped_s:
        return predictions[0]
    return min(predictions, key=lambda p: overlapped_s[(p.bucket_size_mb, p.first_bucket_mb)])


def measure_alpha_beta(
    sizes: Sequence[int] = (1 << 12, 1 << 16, 1 << 20, 1 << 22, 1 << 24), iters: int = 10
) -> CostModel:
    """Fit alpha/beta of allreduce on the live torch group (every rank calls it; same result everywhere).

    Then ``alpha_queued`` from 8 async allreduces of 1 MiB launched back to back (as buckets
    are): their total time beyond ``alpha + 8 * beta * 1 MiB``, per queued collective.
    """
    from .tools.bench import run_sweep

    rows = run_sweep(
        "allreduce", list(sizes), warmup=2, iters=iters, impls=("raw",), progress=False, rounds=1, check=False
    )
    fitted = CostModel.fit([r.bytes for r in rows], [r.time_us * 1e-6 for r in rows])
    queued, cpu_share = _back_to_back_seconds(count=8, nbytes=1 << 20)
    alpha_queued = (queued - fitted.alpha - 8 * fitted.beta * (1 << 20)) / 7
    alpha_queued = float(min(max(alpha_queued, 0.0), fitted.alpha))
    return CostModel(fitted.alpha, fitted.beta, fitted.label, alpha_queued, cpu_share)


def estimated_contention(cost: CostModel, device_type: str) -> float:
    """The simulator's ``contention`` without profiling steps (the online ``bucket_size_mb="auto"``).

    On the CPU, compute uses every core it is given (torch's intra-op threads), so whatever CPU the
    transport takes while a bucket is on the wire (``cost.cpu_share``) is taken from backward:
    about 1 on loopback Gloo, which moves bytes as fast as a core copies them, little on a slow
    link. Elsewhere the transport runs beside the device's compute: 0. :func:`profile_with_contention`
    measures it instead, from steps (``co.tune``).
    """
    if device_type != "cpu" or cost.cpu_share is None:
        return 0.0
    return float(min(max(cost.cpu_share, 0.0), 1.0))


def _back_to_back_seconds(count: int, nbytes: int, repeats: int = 3) -> tuple[float, float]:
    """(time, CPU share): the slowest rank's median time for ``count`` async allreduces launched back to back,
    and the largest over ranks of this process's CPU time per second of them."""
    import torch

    from .runtime import get_engine
    from .tools.bench import _sync

    engine = get_engine("torch")
    buffers = [torch.zeros(nbytes // 4, dtype=torch.float32, device=engine.device) for _ in range(count)]
    times, shares = [], []
    for _ in range(repeats + 1):  # the first round warms up
        engine.barrier()
        start, cpu_start = time.perf_counter(), time.process_time()
        for handle in [engine.allreduce(b, "sum", async_op=True) for b in buffers]:
            handle.wait()
        _sync(engine.device)
        times.append(time.perf_counter() - start)
        shares.append((time.process_time() - cpu_start) / max(times[-1], 1e-9))
    seconds, share = engine.reduce_floats([float(np.median(times[1:])), float(np.median(shares[1:]))], "max")
    return seconds, share


def profile_from_stats(
    stats,
    step_start: float,
    step_end: float,
    wire_share: dict[int, float] | None = None,
    wire_itemsize: int | None = None,
) -> BackwardProfile:
    """A :class:`BackwardProfile` from the bucket manager's stats of one step."""
    backward_end = stats.finalize_start if stats.finalize_start is not None else step_end
    ready = {i: t - step_start for i, t in stats.ready_times.items()}
    compute = (step_end - step_start) - stats.exposed_comm_s
    return BackwardProfile(ready, backward_end - step_start, max(compute, 0.0), dict(wire_share or {}), wire_itemsize)


def _median_profile(model, step_fn: Callable[[], None], steps: int) -> BackwardProfile:
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


def profile_with_contention(
    model, step_fn: Callable[[], None], cost: CostModel, steps: int = 3
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
    model,
    step_fn: Callable[[], None],
    candidates_mb: Sequence[float] = CANDIDATES_MB,
    confirm_top: int = 2,
    confirm_steps: int = 3,
    cost: CostModel | None = None,
    profile_steps: int = 2,
    keep_current: bool = True,
) -> TuneResult:
    """Choose ``bucket_size_mb`` and ``first_bucket_mb`` for a wrapped torch model and set them.

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
    cost = cost or measure_alpha_beta()
    profile, contention = profile_with_contention(model, step_fn, cost, profile_steps)
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


def save_profile(
    model,
    step_fn: Callable[[], None],
    path: str,
    cost: CostModel | None = None,
    profile: BackwardProfile | None = None,
    contention: float = 0.0,
    where: str = "",
) -> BackwardProfile:
    """Save a wrapped model's step profile (shapes, ready times) for ``collective-ops tune`` (rank 0 writes).

    ``profile`` (e.g. from :func:`profile_with_contention`) is profiled from one step when not
    given. With ``cost`` (fitted on the live group: alpha, beta, the world size) and ``where``
    (e.g. "emulated link, 1gbit"), ``collective-ops tune --project`` projects that link to
    other world sizes.
    """
    import json

    manager = model.manager
    if profile is None:
        step_fn()
        start = time.perf_counter()
        step_fn()
        end = time.perf_counter()
        profile = profile_from_stats(manager.last_stats, start, end, manager.wire_shares(), manager.wire_itemsize)
    if manager.engine.rank == 0:
        payload = {
            "params": [[p.name, p.numel, p.dtype, p.device, p.itemsize, p.rows] for p in manager.plan.params],
            "order": list(manager.plan.order),
            "ready_s": {str(k): v for k, v in profile.ready_s.items()},
            "backward_end_s": profile.backward_end_s,
            "step_compute_s": profile.step_compute_s,
            "wire_share": {str(k): v for k, v in profile.wire_share.items()},
            "wire_itemsize": profile.wire_itemsize,
            "first_bucket_mb": manager.plan.first_bucket_mb,
            "contention": contention,
            "where": where,
        }
        if cost is not None:
            payload["cost"] = {
                "alpha": cost.alpha,
                "beta": cost.beta,
                "alpha_queued": cost.alpha_queued,
                "world_size": manager.engine.world_size,
            }
        with open(path, "w") as f:
            json.dump(payload, f)
    return profile


@dataclass(frozen=True)
class SavedProfile:
    specs: list[ParamSpec]
    order: list[int]
    profile: BackwardProfile
    first_bucket_mb: float
    contention: float = 0.0
    where: str = ""
    cost: CostModel | None = None  # fitted where the profile was taken
    cost_world_size: int = 0


def load_profile(path: str) -> SavedProfile:
    import json

    try:
        with open(path) as f:
            data = json.load(f)
        specs = [ParamSpec(*row) for row in data["params"]]
        profile = BackwardProfile(
            {int(k): float(v) for k, v in data["ready_s"].items()},
            float(data["backward_end_s"]),
            float(data["step_compute_s"]),
            {int(k): float(v) for k, v in data.get("wire_share", {}).items()},  # absent in older profiles
            data.get("wire_itemsize"),
        )
        fitted = data.get("cost")
        cost = None
        if fitted is not None:
            cost = CostModel(float(fitted["alpha"]), float(fitted["beta"]), "fitted", fitted.get("alpha_queued"))
        return SavedProfile(
            specs,
            [int(i) for i in data["order"]],
            profile,
            float(data.get("first_bucket_mb", 1.0)),
            float(data.get("contention", 0.0)),
            str(data.get("where", "")),
            cost,
            int(fitted["world_size"]) if fitted else 0,
        )
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{path}: not a profile written by collective_ops.tuning.save_profile ({exc})") from None


def link_from_fit(cost: CostModel, world_size: int) -> tuple[float, float]:
    """(per-hop latency s, link bandwidth B/s) of the ring whose allreduce at ``world_size`` costs ``cost``."""
    if world_size < 2:
        raise ValueError("a link can only be derived from a fit at 2 or more ranks")
    hops = 2 * (world_size - 1)
    bandwidth = 2 * (world_size - 1) / world_size / cost.beta if cost.beta > 0 else float("inf")
    return cost.alpha / hops, bandwidth


def add_arguments(parser) -> None:
    parser.add_argument("--profile", required=True, help="a profile from collective_ops.tuning.save_profile")
    parser.add_argument("--world", type=int, nargs="+", default=[8, 64, 512, 4096], help="world sizes to project to")
    parser.add_argument(
        "--project",
        action="store_true",
        help="project the link the profile's cost was fitted on (saved with it) instead of --latency-us/--bandwidth-gbs",
    )
    parser.add_argument("--latency-us", type=float, default=5.0, help="per-hop link latency (alpha), microseconds")
    parser.add_argument("--bandwidth-gbs", type=float, default=25.0, help="per-link bandwidth, GB/s")
    parser.add_argument(
        "--candidates",
        type=float,
        nargs="+",
        default=list(CANDIDATES_MB),
        help="bucket sizes to try, MiB (default: %(default)s)",
    )


def run(args) -> int:
    if args.latency_us < 0 or args.bandwidth_gbs <= 0 or any(w < 1 for w in args.world):
        print("collective-ops tune: need --latency-us >= 0, --bandwidth-gbs > 0 and world sizes >= 1", file=sys.stderr)
        return 2
    if not all(0 < mb <= 1 << 20 for mb in args.candidates):
        print(
            f"collective-ops tune: --candidates are bucket sizes in MiB, > 0 (got {args.candidates})", file=sys.stderr
        )
        return 2
    try:
        saved = load_profile(args.profile)
    except ValueError as exc:
        print(f"collective-ops tune: {exc}", file=sys.stderr)
        return 2
    profile, contention, queued_share = saved.profile, 0.0, 1.0
    if args.project:
        if saved.cost is None or saved.cost_world_size < 2:
            print(
                "collective-ops tune: --project needs a profile saved with its fitted cost (save_profile(cost=...))",
                file=sys.stderr,
            )
            return 2
        latency, bandwidth = link_from_fit(saved.cost, saved.cost_world_size)
        contention = saved.contention
        if saved.cost.alpha > 0 and saved.cost.alpha_queued is not None:
            queued_share = saved.cost.alpha_queued / saved.cost.alpha
        print(
            f"SIMULATION: projection of the link measured {saved.where or 'where the profile was taken'} "
            f"({saved.cost_world_size} ranks: alpha {saved.cost.alpha * 1e6:.0f} us, queued "
            f"{queued_share * saved.cost.alpha * 1e6:.0f} us, beta {saved.cost.beta * 1e9:.3f} ns/B)\n"
            "Assumptions:\n"
            f"  - ring allreduce over N ranks, every hop a link like the measured one: {latency * 1e6:.0f} us "
            f"latency per hop, {bandwidth / 1e6:.1f} MB/s (alpha = 2(N-1) x latency, beta = 2(N-1)/N / bandwidth)\n"
            f"  - a collective queued behind another pays {queued_share:.0%} of alpha, as measured\n"
            f"  - per-rank compute and backward unchanged (weak scaling: same batch per rank): compute "
            f"{profile.step_compute_s * 1e3:.1f} ms, backward ends at {profile.backward_end_s * 1e3:.1f} ms\n"
            f"  - contention (overlapped communication slowing backward) {contention:.2f}, as measured\n"
            "  - no hierarchy (no faster intra-node links), no stragglers, no congestion beyond the ring"
        )
    else:
        latency, bandwidth = args.latency_us * 1e-6, args.bandwidth_gbs * 1e9
        print(
            f"SIMULATION (ring allreduce, alpha {args.latency_us:g} us per hop, {args.bandwidth_gbs:g} GB/s links), "
            f"profile {args.profile}: {len(saved.specs)} parameters, backward {profile.backward_end_s * 1e3:.1f} ms, "
            f"compute {profile.step_compute_s * 1e3:.1f} ms"
        )
    for world in args.world:
        ring = CostModel.ring(world, latency, bandwidth)
        cost = CostModel(ring.alpha, ring.beta, ring.label, ring.alpha * queued_share)
        ranked = predict(saved.specs, profile, cost, args.candidates, saved.first_bucket_mb, saved.order, contention)
        best = ranked[0]
        print(
            f"  N={world:<5} best bucket_size_mb={best.bucket_size_mb:g}: step {best.step_s * 1e3:.1f} ms, "
            f"exposed {best.exposed_comm_s * 1e3:.1f} ms, {best.collectives} collectives; "
            + ", ".join(
                f"{p.bucket_size_mb:g}: {p.step_s * 1e3:.1f}" for p in sorted(ranked, key=lambda p: p.bucket_size_mb)
            )
        )
    return 0
