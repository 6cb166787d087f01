"""Collectives and communication time per step, without bucketing and with it, for real model shapes.

    python benchmarks/bucketing_benchmark.py                       # ResNet-50 and BERT-Large, 2 Gloo ranks
    python benchmarks/bucketing_benchmark.py --models resnet50 --sizes 1 5 25 --reps 5
    python benchmarks/bucketing_benchmark.py --scaling             # + step time and weak scaling, N = 1, 2

Without bucketing every gradient tensor is its own allreduce (the seed's manual loop);
with bucketing the plan of collective_ops.wrap decides (first bucket 1 MiB, then
``bucket_size_mb``). Communication time is measured on the live Gloo group with real
buffers of each model's gradient sizes (no compute), median of ``--reps`` passes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from torch import nn  # noqa: E402

from benchmarks.common import spawn  # noqa: E402
from collective_ops.bucketing import ParamSpec, plan_buckets  # noqa: E402


def resnet50() -> nn.Module:
    from examples.train_resnet import ResNet

    return ResNet((3, 4, 6, 3), num_classes=1000)


def bert_large() -> nn.Module:
    """BERT-Large's shapes: 24 layers, hidden 1024, 16 heads, FFN 4096, vocab 30522, 512 positions."""

    class BertLarge(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.word = nn.Embedding(30522, 1024)
            self.position = nn.Embedding(512, 1024)
            self.token_type = nn.Embedding(2, 1024)
            self.embed_norm = nn.LayerNorm(1024)
            self.layers = nn.ModuleList(
                nn.TransformerEncoderLayer(1024, 16, 4096, dropout=0.0, batch_first=True) for _ in range(24)
            )
            self.pooler = nn.Linear(1024, 1024)

    return BertLarge()


MODELS = {"resnet50": resnet50, "bert_large": bert_large}


def specs_of(name: str) -> list[ParamSpec]:
    with torch.device("meta"):  # shapes only: no memory
        model = MODELS[name]()
    return [ParamSpec(n, p.numel(), "float32", "cpu", 4) for n, p in model.named_parameters() if p.requires_grad]


def collectives(specs: list[ParamSpec], bucket_mb: float | None) -> list[int]:
    """Element counts of the collectives one step issues."""
    if bucket_mb is None:
        return [s.numel for s in reversed(specs)]
    return [b.numel for b in plan_buckets(specs, bucket_mb, min(1.0, bucket_mb)).buckets]


def time_collectives(sizes: list[int], reps: int) -> float:
    """Median seconds to allreduce buffers of ``sizes`` (async launch in order, then wait), slowest rank."""
    import torch.distributed as dist

    buffers = [torch.ones(n) for n in sizes]
    samples = []
    for _ in range(reps + 1):
        dist.barrier()
        start = time.perf_counter()
        works = [dist.all_reduce(b, async_op=True) for b in buffers]
        for w in works:
            w.wait()
        t = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        samples.append(float(t))
    return statistics.median(samples[1:])  # the first pass warms up


def rank_main(rank: int, world: int, port: int, args, queue) -> None:
    import collective_ops as co

    torch.set_num_threads(1)
    co.init("gloo", rank=rank, world_size=world, master_port=port)
    results = {}
    for name in args.models:
        specs = specs_of(name)
        rows = []
        for bucket_mb in [None, *args.sizes]:
            sizes = collectives(specs, bucket_mb)
            seconds = None if args.no_timing else time_collectives(sizes, args.reps)
            rows.append({"bucket_size_mb": bucket_mb, "collectives": len(sizes), "comm_s": seconds})
        results[name] = {
            "tensors": len(specs),
            "mbytes": sum(s.nbytes for s in specs) / 1e6,
            "mib": sum(s.nbytes for s in specs) / 2**20,
            "rows": rows,
        }
    co.barrier()
    co.shutdown()
    if rank == 0:
        queue.put(results)


def scaling_rank(rank: int, world: int, port: int, args, queue) -> None:
    import collective_ops as co
    from examples.train_resnet import ResNet

    torch.set_num_threads(1)
    co.init("gloo", rank=rank, world_size=world, master_port=port)
    torch.manual_seed(0)
    model = co.wrap(ResNet((2, 2, 2, 2), num_classes=100))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(rank)
    x, y = torch.randn(8, 3, 64, 64, generator=gen), torch.randint(0, 100, (8,), generator=gen)
    times = []
    for step in range(args.scaling_steps + 2):
        start = time.perf_counter()
        loss = nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step >= 2:
            times.append(time.perf_counter() - start)
    median = torch.tensor([statistics.median(times)], dtype=torch.float64)
    torch.distributed.all_reduce(median, op=torch.distributed.ReduceOp.MAX)
    co.barrier()
    co.shutdown()
    if rank == 0:
        queue.put({"world": world, "step_s": float(median), "images_per_s": 8 * world / float(median)})


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=["resnet50", "bert_large"])
    parser.add_argument("--sizes", nargs="+", type=float, default=[1, 5, 10, 25, 50, 100], help="bucket_size_mb values")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--no-timing", action="store_true", help="count collectives only")
    parser.add_argument("--scaling", action="store_true", help="also step time at N = 1 and N = --world")
    parser.add_argument("--scaling-steps", type=int, default=10)
    parser.add_argument("--json")
    args = parser.parse_args(argv)

    results = spawn(rank_main, args.world, args)
    for name, r in results.items():
        print(
            f"# {name}: {r['tensors']} gradient tensors, {r['mbytes']:.1f} MB ({r['mib']:.1f} MiB) fp32; "
            f"{args.world} Gloo ranks" + ("" if args.no_timing else f", median of {args.reps} passes")
        )
        base = r["rows"][0]["comm_s"]
        timed = not args.no_timing  # --no-timing counts collectives only: no time columns to print
        print(
            f"  {'bucket_size_mb':>14} {'collectives':>12}"
            + (f" {'comm s/step':>12} {'vs per-tensor':>14}" if timed else "")
        )
        for row in r["rows"]:
            label = "per tensor" if row["bucket_size_mb"] is None else f"{row['bucket_size_mb']:g}"
            times = f" {row['comm_s']:>12.3f} {row['comm_s'] / base:>14.3f}" if timed else ""
            print(f"  {label:>14} {row['collectives']:>12}{times}")
    if args.scaling:
        one = spawn(scaling_rank, 1, args)
        many = spawn(scaling_rank, args.world, args)
        efficiency = many["images_per_s"] / (args.world * one["images_per_s"])
        results["scaling"] = {"1": one, str(args.world): many, "efficiency": efficiency}
        print("# weak scaling, ResNet-18-shaped model, 8 images/rank/step, 1 thread per rank")
        for r in (one, many):
            print(f"  N={r['world']}: step {r['step_s'] * 1e3:.0f} ms, {r['images_per_s']:.1f} images/s")
        print(f"  efficiency = throughput(N={args.world}) / ({args.world} x throughput(N=1)) = {efficiency:.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
