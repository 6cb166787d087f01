"""``collective-ops tune``: project a saved step profile to other world sizes and links, and the profile file
(:func:`save_profile` in a training script, :func:`load_profile` here)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..bucketing import ParamSpec
from ..bucketing.cost import CANDIDATES_MB, BackwardProfile, CostModel, link_from_fit, predict, profile_from_stats


def save_profile(
    model: Any,
    step_fn: Callable[[], None],
    path: str,
    cost: CostModel | None = None,
    profile: BackwardProfile | None = None,
    contention: float = 0.0,
    where: str = "",
) -> BackwardProfile:
    """Save a wrapped model's step profile (shapes, ready times) for ``collective-ops tune`` (rank 0 writes).

    ``profile`` (e.g. from :func:`collective_ops.tuning.profile_with_contention`) is profiled from one step when not
    given. With ``cost`` (fitted on the live group: alpha, beta, the world size) and ``where``
    (e.g. "emulated link, 1gbit"), ``collective-ops tune --project`` projects that link to
    other world sizes.
    """
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
        raise ValueError(f"{path}: not a profile written by collective_ops.tools.tune.save_profile ({exc})") from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--profile", required=True, help="a profile from collective_ops.tools.tune.save_profile")
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


def run(args: argparse.Namespace) -> int:
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
