"""torch.compile(co.wrap(model)) against torch.compile(DDP(model)), with the eager pair beside them
(and wrap + DistributedOptimizer, eager and compiled).

    python benchmarks/compile_compare.py --link 1gbit --model transformer-5m

In the same processes, alternating blocks of steps: DDP and wrap, each eager and under
``torch.compile`` (default mode; both compiled graphs are split at bucket boundaries by
dynamo's DDPOptimizer). Reported: median step, and for wrap the communication still waiting
after backward (the manager's exposed time): a compiled backward in one piece hands every
gradient over at its end, so no bucket could launch during it.

On the emulated link (``--link``) it also prints compute alone (the same model and optimizer, no wrapper and no
communication, eager and compiled, setups of the same alternation; compiled steps against compiled compute), the
wire time at the link's rate of one step's bytes (as ``comm_stats()['bytes_per_step']`` counts them, wrap's) and
each step as a multiple of max(compute, wire): its distance to the physical limit (benchmarks/common.py
``physical_limit``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from torch import nn  # noqa: E402

from benchmarks.common import link_rate, physical_limit, run_benchmark, where  # noqa: E402
from benchmarks.ddp_compare import MODELS, alternate_steps, build_model  # noqa: E402


def rank_main(rank: int, world: int, port: int, args, queue) -> None:
    import collective_ops as co

    torch.set_num_threads(1)
    co.init("gloo", rank=rank, world_size=world, master_port=port)
    _, batch = build_model(args.model)
    gen = torch.Generator().manual_seed(rank)
    batches = [batch(gen) for _ in range(4)]
    setups, wrappers = {}, {}
    for kind in ("DDP", "wrap"):
        for compiled in (False, True):
            model, _ = build_model(args.model)
            if kind == "DDP":
                wrapped = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=args.bucket_size_mb)
            else:
                wrapped = co.wrap(model, bucket_size_mb=args.bucket_size_mb)
            label = f"{kind} {'compiled' if compiled else 'eager'}"
            runner = torch.compile(wrapped) if compiled else wrapped
            wrappers[label] = wrapped
            setups[label] = (runner, torch.optim.SGD(wrapped.parameters(), lr=1e-3, momentum=0.9), batches)
    for compiled in (False, True):  # wrap + DistributedOptimizer (its defaults), eager and compiled
        model, _ = build_model(args.model)
        wrapped = co.wrap(model, bucket_size_mb=args.bucket_size_mb)
        optimizer = co.DistributedOptimizer(wrapped, torch.optim.SGD, lr=1e-3, momentum=0.9)
        label = f"wrap+DO {'compiled' if compiled else 'eager'}"
        setups[label] = (torch.compile(wrapped) if compiled else wrapped, optimizer, batches)
    for compiled in (False, True) if link_rate() else ():  # on the link: the physical limit's compute, no wrapper
        model, _ = build_model(args.model)
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
        setups[_alone(compiled)] = (torch.compile(model) if compiled else model, optimizer, batches)
    times = alternate_steps(setups, args.rounds, args.block)
    result = {
        "median_step_ms": {key: statistics.median(v) * 1e3 for key, v in times.items()},
        "bytes_per_step": wrappers["wrap eager"].comm_stats()["bytes_per_step"],
        "exposed_ms": {
            label: wrappers[label].comm_stats()["mean_exposed_comm_s"] * 1e3
            for label in ("wrap eager", "wrap compiled")
        },
    }
    co.barrier()
    co.shutdown()
    if rank == 0:
        queue.put(result)


def _alone(compiled: bool) -> str:
    return f"compute alone {'compiled' if compiled else 'eager'}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--model", choices=MODELS, default="transformer-5m")
    parser.add_argument("--bucket-size-mb", type=float, default=1.0)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--block", type=int, default=3)
    outcome = run_benchmark(parser, argv, rank_main)
    if isinstance(outcome, int):
        return outcome
    args, r = outcome
    print(
        f"# compile_compare: {args.model}, {args.world} Gloo ranks, {where()}, bucket {args.bucket_size_mb:g} MiB, "
        f"torch {torch.__version__}; median step, {args.rounds} rounds x {args.block} steps alternating"
    )
    ms = r["median_step_ms"]
    limits = {  # on the link, eager steps against eager compute, compiled against compiled
        mode: physical_limit(ms, ms[_alone(mode == "compiled")], r["bytes_per_step"], args.world)
        for mode in ("eager", "compiled")
        if _alone(False) in ms
    }
    for mode, limit in limits.items():
        print(f"  {mode}: {limit.line('wrap')}")
    for label in ("DDP eager", "wrap eager", "wrap+DO eager", "DDP compiled", "wrap compiled", "wrap+DO compiled"):
        extra = f"  {limits[label.split()[-1]].column(ms[label])}" if limits else ""
        exposed = r["exposed_ms"].get(label)
        extra += f"  communication waited for after backward {exposed:.1f} ms" if exposed is not None else ""
        print(f"  {label:<17} {ms[label]:>8.1f} ms{extra}")
    print(f"  wrap compiled / DDP compiled: {ms['wrap compiled'] / ms['DDP compiled']:.3f}")
    print(
        f"  wrap+DO compiled / DDP compiled: {ms['wrap+DO compiled'] / ms['DDP compiled']:.3f}  (wrap+DO: wrap + "
        "DistributedOptimizer(SGD), its defaults; compiled, owed updates finish before each forward)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
