"""How much can any bucket size win? DDP and wrap at every candidate size against DDP's default.

    python benchmarks/bucket_size_headroom.py --models mlp transformer --rounds 12

A tuner can only be as good as the best bucket size. This times torch DDP with each
``bucket_cap_mb`` and collective_ops.wrap with each ``bucket_size_mb`` (CANDIDATES_MB),
all in the same processes, alternating in blocks of steps (the order reversed every
round, so machine noise hits every configuration alike), and reports each median step
as a ratio to DDP with its defaults (25 MiB). If no size gets below 0.95x here, no
tuner of bucket sizes can reach 0.95x DDP's default on this machine and workload.

On the emulated link (``--link``) it also prints compute alone (the same model and optimizer, no wrapper and no
communication, a setup of the same alternation), the wire time at the link's rate of one step's bytes (as
``comm_stats()['bytes_per_step']`` counts them, wrap's at 25 MiB) and each step as a multiple of max(compute, wire):
its distance to the physical limit (benchmarks/common.py ``physical_limit``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from benchmarks.common import COMPUTE_ALONE, link_rate, physical_limit, run_benchmark, where  # noqa: E402
from benchmarks.ddp_compare import MODELS, alternate_steps, training_setup  # noqa: E402


def rank_main(rank: int, world: int, port: int, args, queue) -> None:
    import collective_ops as co
    from collective_ops.tuning import CANDIDATES_MB

    torch.set_num_threads(args.threads)
    co.init("gloo", rank=rank, world_size=world, master_port=port)
    results, wire_bytes = {}, {}
    for name in args.models:
        setups = {
            (kind, mb): training_setup(name, kind, mb, rank)
            for kind in ("ddp", "collective_ops")
            for mb in CANDIDATES_MB
        }
        if link_rate():  # on the link: the step's physical limit
            setups[COMPUTE_ALONE, 0] = training_setup(name, COMPUTE_ALONE, 0, rank)
        times = alternate_steps(setups, args.rounds, args.block)
        results[name] = {f"{kind} {mb:g}": statistics.median(v) * 1e3 for (kind, mb), v in times.items()}
        results[name].pop(f"{COMPUTE_ALONE} 0", None)
        if link_rate():
            results[name][COMPUTE_ALONE] = statistics.median(times[COMPUTE_ALONE, 0]) * 1e3
        wire_bytes[name] = setups["collective_ops", 25][0].comm_stats()["bytes_per_step"]
        del setups
    co.barrier()
    co.shutdown()
    if rank == 0:
        queue.put((results, wire_bytes))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--models", nargs="+", choices=MODELS, default=["mlp", "cnn", "transformer"])
    parser.add_argument("--rounds", type=int, default=12, help="alternation rounds over every configuration")
    parser.add_argument("--block", type=int, default=4, help="steps per configuration per round")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--json")
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # the ranks set --threads for torch themselves
    outcome = run_benchmark(parser, argv, rank_main)
    if isinstance(outcome, int):
        return outcome
    args, (results, wire_bytes) = outcome
    from collective_ops.tuning import CANDIDATES_MB

    print(
        f"# bucket_size_headroom: world {args.world}, gloo, {where()}, {args.rounds} rounds x {args.block} steps "
        "per configuration"
    )
    print("# median step as a ratio to DDP's default (bucket_cap_mb=25)")
    print(f"  {'model':<12} {'DDP 25 ms':>9}  " + " ".join(f"{mb:>6g}" for mb in CANDIDATES_MB) + "  (MiB)")
    for name, row in results.items():
        ref = row["ddp 25"]
        for kind in ("ddp", "collective_ops"):
            ratios = [row[f"{kind} {mb:g}"] / ref for mb in CANDIDATES_MB]
            label = f"{name} {'DDP' if kind == 'ddp' else 'wrap'}"
            print(f"  {label:<16} {ref:>5.1f}  " + " ".join(f"{r:>6.3f}" for r in ratios) + f"  best {min(ratios):.3f}")
        if COMPUTE_ALONE in row:
            limit = physical_limit(row, row[COMPUTE_ALONE], wire_bytes[name], args.world)
            print(f"    {limit.line('wrap at 25 MiB')}; each step x max(compute, wire):")
            for kind in ("ddp", "collective_ops"):
                ratios = [limit.ratio(row[f"{kind} {mb:g}"]) for mb in CANDIDATES_MB]
                label = f"{name} {'DDP' if kind == 'ddp' else 'wrap'}"
                print(f"  {label:<16} {'':>5}  " + " ".join(f"{r:>6.2f}" for r in ratios) + f"  best {min(ratios):.2f}")
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {"args": vars(args), "where": where(), "median_step_ms": results, "wire_bytes": wire_bytes}, indent=1
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
