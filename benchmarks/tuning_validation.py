"""Does the simulator predict step time? Does the tuner find the best bucket size, and beat DDP's default?

    python benchmarks/tuning_validation.py --world 2 --model transformer --steps 8

1. Fit alpha/beta on the live group; profile the wrapped model (ready times, compute alone and
   the contention between overlapped communication and compute: tuning.profile_with_contention).
2. For every candidate bucket size: predicted step time against measured (median of --steps).
3. collective_ops.tune's choice and its trial steps, against the best of that exhaustive sweep.
4. wrap with the tuned size against torch DDP with its defaults (alternating blocks).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from benchmarks.common import run_benchmark, where  # noqa: E402
from benchmarks.ddp_compare import MODELS, alternate_steps, build_model, one_step, training_setup  # noqa: E402

DDP_SWEEP_MB = (1, 2, 5, 10, 25, 50)  # the hand sweep of DDP's bucket_cap_mb the tuner must match


def timed_steps(model, optimizer, batches, steps: int) -> float:
    times = []
    for i in range(steps):
        times.append(one_step(model, optimizer, batches[i % len(batches)]))
    from collective_ops.runtime import get_engine

    return get_engine("torch").reduce_floats([statistics.median(times)], "max")[0]  # the slowest rank's


def rank_main(rank: int, world: int, port: int, args, queue) -> None:
    import collective_ops as co
    from collective_ops.tuning import CANDIDATES_MB, measure_alpha_beta, predict, profile_with_contention

    torch.set_num_threads(1)
    co.init("gloo", rank=rank, world_size=world, master_port=port)
    model, batch = build_model(args.model)
    gen = torch.Generator().manual_seed(rank)
    batches = [batch(gen) for _ in range(4)]
    wrapped = co.wrap(model, bucket_size_mb=25)
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=1e-3)
    for i in range(3):
        one_step(wrapped, optimizer, batches[i % 4])
    counter = {"i": 0}

    def next_step() -> None:
        counter["i"] += 1
        one_step(wrapped, optimizer, batches[counter["i"] % 4])

    cost = measure_alpha_beta()
    profile, contention = profile_with_contention(wrapped, next_step, cost, steps=args.profile_steps)
    if args.save_profile:  # for `collective-ops tune --profile ... --project`
        from collective_ops.tools.tune import save_profile

        save_profile(wrapped, next_step, args.save_profile, cost, profile, contention, where())
    plan = wrapped.manager.plan
    predictions = {
        p.bucket_size_mb: p for p in predict(plan.params, profile, cost, CANDIDATES_MB, 1.0, plan.order, contention)
    }
    # The exhaustive sweep, in rounds over every size (order reversed every round) so that the
    # machine's drift hits every size alike; each visit: one settling step, then timed steps.
    per_visit = max(args.steps // args.sweep_rounds, 1)
    visits: dict[float, list[float]] = {mb: [] for mb in CANDIDATES_MB}
    for round_ in range(args.sweep_rounds):
        for mb in CANDIDATES_MB if round_ % 2 == 0 else CANDIDATES_MB[::-1]:
            wrapped.set_bucket_size(mb, 1.0)
            one_step(wrapped, optimizer, batches[0])
            visits[mb].append(timed_steps(wrapped, optimizer, batches, per_visit))
    sweep = {mb: statistics.median(v) for mb, v in visits.items()}
    # the tuner, from a fresh wrapper
    model2, _ = build_model(args.model)
    tuned = co.wrap(model2, bucket_size_mb=25)
    opt2 = torch.optim.SGD(tuned.parameters(), lr=1e-3)
    counter2 = {"i": 0}

    def step() -> None:
        counter2["i"] += 1
        one_step(tuned, opt2, batches[counter2["i"] % 4])

    result = co.tune(tuned, step, confirm_top=2, confirm_steps=3)
    # wrap(bucket_size_mb="auto"), settled at its second step
    model3, _ = build_model(args.model)
    auto = co.wrap(model3, bucket_size_mb="auto")
    opt3 = torch.optim.SGD(auto.parameters(), lr=1e-3)
    for i in range(3):
        one_step(auto, opt3, batches[i % 4])
    # the race, alternating blocks: DDP at every bucket_cap_mb of the hand sweep, the tuned and the auto wrap
    setups = {f"ddp {mb:g}": training_setup(args.model, "ddp", mb, rank) for mb in DDP_SWEEP_MB}
    setups["tune"] = (tuned, opt2, batches)
    setups["auto"] = (auto, opt3, batches)
    race = {key: statistics.median(v) * 1e3 for key, v in alternate_steps(setups, args.rounds, args.block).items()}
    co.barrier()
    co.shutdown()
    if rank == 0:
        queue.put(
            {
                "alpha_us": cost.alpha * 1e6,
                "alpha_queued_us": cost.alpha_queued * 1e6,
                "beta_ns_per_byte": cost.beta * 1e9,
                "profile_compute_ms": profile.step_compute_s * 1e3,
                "contention": contention,
                "backward_end_ms": profile.backward_end_s * 1e3,
                "rows": [
                    {
                        "mb": mb,
                        "predicted_ms": predictions[mb].step_s * 1e3,
                        "measured_ms": sweep[mb] * 1e3,
                        "collectives": predictions[mb].collectives,
                    }
                    for mb in CANDIDATES_MB
                ],
                "tuned_mb": result.bucket_size_mb,
                "tuned_first_mb": result.first_bucket_mb,
                "auto_mb": auto.manager.plan.bucket_size_mb,
                "auto_first_mb": auto.manager.plan.first_bucket_mb,
                "tune_trial_steps": result.trial_steps,
                "sweep_steps": len(CANDIDATES_MB) * args.sweep_rounds * (per_visit + 1),
                "race_ms": race,
            }
        )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--model", choices=list(MODELS), default="transformer")
    parser.add_argument("--steps", type=int, default=8, help="timed steps per measurement")
    parser.add_argument("--sweep-rounds", type=int, default=3, help="rounds over every size in the exhaustive sweep")
    parser.add_argument("--rounds", type=int, default=4, help="alternation rounds of the race (DDP sweep, tune, auto)")
    parser.add_argument("--block", type=int, default=3, help="steps per configuration per round of the race")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json")
    parser.add_argument(
        "--profile-steps", type=int, default=5, help="steps per profiled plan (compute alone, overlapped)"
    )
    parser.add_argument("--save-profile", help="write the profile and fitted cost here (collective-ops tune --project)")
    outcome = run_benchmark(parser, argv, rank_main)
    if isinstance(outcome, int):
        return outcome
    args, r = outcome
    r["where"] = where()
    print(
        f"# tuning_validation: {args.model}, {args.world} Gloo ranks, {where()}; alpha {r['alpha_us']:.0f} us (queued {r['alpha_queued_us']:.0f} us), "
        f"beta {r['beta_ns_per_byte']:.3f} ns/B; compute alone {r['profile_compute_ms']:.0f} ms, "
        f"contention {r['contention']:.2f}, "
        f"backward ends at {r['backward_end_ms']:.0f} ms"
    )
    print(f"  {'bucket MiB':>10} {'collectives':>11} {'predicted ms':>13} {'measured ms':>12} {'error':>7}")
    for row in r["rows"]:
        error = (row["predicted_ms"] - row["measured_ms"]) / row["measured_ms"] * 100
        print(
            f"  {row['mb']:>10g} {row['collectives']:>11} {row['predicted_ms']:>13.1f} {row['measured_ms']:>12.1f} {error:>+6.1f}%"
        )
    best = min(r["rows"], key=lambda row: row["measured_ms"])
    tuned_row = next((row for row in r["rows"] if row["mb"] == r["tuned_mb"]), None)
    print(
        f"  tuner chose {r['tuned_mb']:g} MiB (first bucket {r['tuned_first_mb']:g}) in {r['tune_trial_steps']} trial "
        f"steps (the sweep took {r['sweep_steps']})"
        + (
            f"; at that size the sweep measured {tuned_row['measured_ms'] / best['measured_ms']:.3f}x its best "
            f"({best['mb']:g} MiB)"
            if tuned_row
            else ""
        )
    )
    race = r["race_ms"]
    ddp_default = race["ddp 25"]
    ddp_best_key = min((k for k in race if k.startswith("ddp")), key=race.get)
    print(f"# race ({args.rounds} rounds x {args.block} steps, alternating; median step, {where()}):")
    for key, ms in sorted(race.items(), key=lambda kv: kv[1]):
        label = {
            "tune": f"co.tune ({r['tuned_mb']:g}/{r['tuned_first_mb']:g} MiB)",
            "auto": f"auto ({r['auto_mb']:g}/{r['auto_first_mb']:g} MiB)",
        }.get(key, key.replace("ddp", "DDP bucket_cap_mb"))
        print(
            f"  {label:<28} {ms:>7.1f} ms  {ms / ddp_default:.3f}x DDP default  {ms / race[ddp_best_key]:.3f}x best DDP ({ddp_best_key})"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(r, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
