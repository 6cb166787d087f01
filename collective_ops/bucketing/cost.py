"""The cost model and schedule simulator that choose ``bucket_size_mb`` (framework-free).

Cost model: one allreduce of ``b`` bytes at the current world size costs ``alpha + beta * b``
(least squares over a short size sweep of the live backend: :mod:`collective_ops.comm.measure`). For other
world sizes and links, the ring-allreduce model: ``2(N-1) * alpha_link + 2(N-1)/N * b / bandwidth``.

Simulator: backward produces gradients at measured times (one profiled step); a bucket
can start once all its gradients are ready and the previous bucket has finished (one
communication channel, buckets in plan order, as the bucket manager launches them).
Predicted step = compute time + communication left after backward ends (exposed)
+ ``contention`` x communication that ran during backward. ``contention`` is 0 where
communication has engines of its own (GPU/NPU) and near 1 where it shares the CPU cores
with backward (Gloo on CPU).

A compressing hook that prices buckets itself (``planned_wire``: PowerSGD) is asked for each candidate
bucket's collectives (a compressed bucket takes two: each costs its own ``alpha``) and for the
floating-point operations it adds; those run on the compute device, so the step grows by them at
``flops_per_s`` (:data:`COMPRESSION_FLOPS_PER_S`). Steady state is priced: compression on, whether or
not it has started by the profiled step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .plan import BucketPlan, BucketSpec, ParamSpec, plan_buckets
from .row_sparse import wire_nbytes

CANDIDATES_MB = (1.0, 2.0, 5.0, 10.0, 25.0, 50.0, 100.0)
# first_bucket_mb candidates (besides "as large as the others"): a small first bucket starts communication
# as soon as backward produces its first gradients; on a slow link that start is the whole head start.
FIRST_BUCKET_CANDIDATES_MB = (0.25, 1.0)
# What a compressing hook's extra compute (small batched fp32 matmuls and orthogonalisations) runs at, by device
# type: documented constants, not measured (an order of magnitude each: a few CPU cores; one data-centre GPU/NPU).
COMPRESSION_FLOPS_PER_S = {"cpu": 1e10, "cuda": 1e13, "npu": 1e13}
DEFAULT_COMPRESSION_FLOPS_PER_S = 1e10

# A hook's price of one bucket of any plan: (the bytes of each collective its reduction launches, the flops it adds)
BucketWire = Callable[[BucketSpec], tuple[tuple[int, ...], float]]


@dataclass(frozen=True)
class CostModel:
    """Seconds for one allreduce of ``nbytes``: ``alpha + beta * nbytes``.

    ``alpha_queued``: the latency of a collective launched while the previous one is still in
    flight, as the bucket manager launches them. Backends that progress several collectives at
    once (Gloo's process group runs two worker threads) overlap most of it with the previous
    transfer; None means no overlap (``alpha``).

    ``cpu_share``: CPU seconds this process spent per second of those back-to-back collectives
    (the transport's own threads: on CPU tensors they run on the cores compute uses); None
    where not measured. :func:`collective_ops.comm.measure.estimated_contention` turns it into the simulator's
    contention.
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
    bucket_wire: BucketWire | None = None  # a hook that prices buckets itself (PowerSGDHook.planned_wire)
    flops_per_s: float = DEFAULT_COMPRESSION_FLOPS_PER_S  # what bucket_wire's flops run at

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
    nbytes: tuple[int, ...] = ()  # what each bucket sends, in plan order
    compression_s: float = 0.0  # compute a compressing hook adds to the step (in step_s)


def priced_wire(bucket: BucketSpec, profile: BackwardProfile) -> tuple[tuple[int, ...], float]:
    """(the bytes of each collective reducing ``bucket`` launches, the flops its hook adds): the hook's own price
    where it has one, else one collective of the bucket's bytes on the wire (row-sparse share, element size)."""
    if profile.bucket_wire is not None:
        return profile.bucket_wire(bucket)
    return (wire_nbytes(bucket, profile.wire_share, profile.wire_itemsize),), 0.0


def simulate(plan: BucketPlan, profile: BackwardProfile, cost: CostModel, contention: float = 0.0) -> Prediction:
    """Predict a step of ``plan``: buckets start when ready and the channel is free, in plan order.

    ``contention``: the share of communication overlapping backward that slows backward down
    by as much (0: free overlap; 1: overlap only time-shares the same cores).
    """
    if not 0.0 <= contention <= 1.0:
        raise ValueError(f"contention is a share between 0 and 1, got {contention!r}")
    channel_free = 0.0
    finishes, sent = [], []
    comm = flops = 0.0
    launched = 0  # collectives: a compressed bucket issues two
    for bucket in plan.buckets:
        ready = max((profile.ready_s.get(i, profile.backward_end_s) for i in bucket.param_indices), default=0.0)
        start = max(ready, channel_free)
        collectives, added = priced_wire(bucket, profile)
        # a compressed bucket's second collective waits for its first: only the first can queue
        queued = bool(finishes) and ready < channel_free
        duration = sum(cost.cost(n, queued=queued and k == 0) for k, n in enumerate(collectives))
        channel_free = start + duration
        finishes.append(channel_free)
        sent.append(sum(collectives))
        launched += len(collectives)
        comm += duration
        flops += added
    exposed = max(0.0, channel_free - profile.backward_end_s)
    hidden = max(comm - exposed, 0.0)  # one serial channel: whatever is not exposed ran during backward
    compression = flops / profile.flops_per_s
    return Prediction(
        plan.bucket_size_mb,
        plan.first_bucket_mb,
        profile.step_compute_s + compression + exposed + contention * hidden,
        exposed,
        comm,
        launched,
        tuple(finishes),
        hidden,
        tuple(sent),
        compression,
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


def link_from_fit(cost: CostModel, world_size: int) -> tuple[float, float]:
    """(per-hop latency s, link bandwidth B/s) of the ring whose allreduce at ``world_size`` costs ``cost``."""
    if world_size < 2:
        raise ValueError("a link can only be derived from a fit at 2 or more ranks")
    hops = 2 * (world_size - 1)
    bandwidth = 2 * (world_size - 1) / world_size / cost.beta if cost.beta > 0 else float("inf")
    return cost.alpha / hops, bandwidth


def profile_from_stats(
    stats: Any,
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
