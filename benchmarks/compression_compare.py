"""fp16 on the wire: wrap(compression="fp16") against DDP's fp16_compress_hook, and what it does to the loss.

    python benchmarks/compression_compare.py --link 1gbit --model transformer-5m --bucket-size-mb 1 \
        --loss-steps 200 --plot docs/figures/compression_loss_1gbit.png

1. Step time, alternating blocks in the same processes: torch DDP with
   ``default_hooks.fp16_compress_hook`` and collective_ops.wrap with ``compression="fp16"``,
   both at ``--bucket-size-mb`` (first bucket 1 MiB, DDP's default), and both in fp32 for scale.
2. Loss curve: the wrapped model trained ``--loss-steps`` steps with fp32 and with fp16
   communication from the same weights and data (a pool of batches, cycled, so the loss
   falls); the relative gap between the curves is reported (and plotted with ``--plot``).

On the emulated link (``--link``) the step times also carry compute alone (the same model and optimizer, no wrapper
and no communication, a setup of the same alternation), the wire time at the link's rate of one step's bytes (as
``comm_stats()['bytes_per_step']`` counts them, fp32 or fp16: each row against its own) and each step as a multiple
of max(compute, wire): its distance to the physical limit (benchmarks/common.py ``physical_limit``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from torch import nn  # noqa: E402

from benchmarks.common import COMPUTE_ALONE, link_rate, physical_limit, run_benchmark, where  # noqa: E402
from benchmarks.ddp_compare import MODELS, alternate_steps, build_model  # noqa: E402


def _setup(args, kind: str, rank: int, batches: list) -> tuple:
    import collective_ops as co

    model, _ = build_model(args.model)
    mb = args.bucket_size_mb
    if kind == COMPUTE_ALONE:  # no wrapper, no communication
        wrapped = model
    elif kind.startswith("ddp"):
        wrapped = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=mb)
        if kind == "ddp fp16":
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

            wrapped.register_comm_hook(None, default_hooks.fp16_compress_hook)
    else:
        wrapped = co.wrap(model, bucket_size_mb=mb, compression="fp16" if kind == "wrap fp16" else None)
    return wrapped, torch.optim.SGD(wrapped.parameters(), lr=1e-3), batches


def _loss_curve(args, compression: str | None, batches: list) -> list[float]:
    import collective_ops as co
    from collective_ops.runtime import get_engine

    model, _ = build_model(args.model)
    wrapped = co.wrap(model, bucket_size_mb=args.bucket_size_mb, compression=compression)
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=args.lr, momentum=0.9)
    losses = []
    for step in range(args.loss_steps):
        x, y = batches[step % len(batches)]
        loss = nn.functional.cross_entropy(wrapped(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        engine = get_engine("torch")
        losses.append(engine.reduce_floats([float(loss.detach())], "sum")[0] / engine.world_size)
    wrapped.remove_hooks()
    return losses


def rank_main(rank: int, world: int, port: int, args, queue) -> None:
    import collective_ops as co

    torch.set_num_threads(1)
    co.init("gloo", rank=rank, world_size=world, master_port=port)
    _, batch = build_model(args.model)
    gen = torch.Generator().manual_seed(rank)
    batches = [batch(gen) for _ in range(args.pool)]
    kinds = ("ddp fp16", "wrap fp16", "ddp fp32", "wrap fp32") + ((COMPUTE_ALONE,) if link_rate() else ())
    setups = {kind: _setup(args, kind, rank, batches) for kind in kinds}
    times = alternate_steps(setups, args.rounds, args.block)
    out = {
        "median_step_ms": {kind: statistics.median(v) * 1e3 for kind, v in times.items()},
        # what one step sends, as the library counts it: fp16 half of fp32's
        "bytes_per_step": {p: setups[f"wrap {p}"][0].comm_stats()["bytes_per_step"] for p in ("fp32", "fp16")},
    }
    del setups
    if args.loss_steps:
        out["loss_fp32"] = _loss_curve(args, None, batches)
        out["loss_fp16"] = _loss_curve(args, "fp16", batches)
    co.barrier()
    co.shutdown()
    if rank == 0:
        queue.put(out)


def _plot(path: str, fp32: list[float], fp16: list[float], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 5.5), sharex=True, height_ratios=(3, 1))
    top.plot(fp32, label="fp32 communication", linewidth=1.2)
    top.plot(fp16, label='compression="fp16"', linewidth=1.0, linestyle="--")
    top.set_ylabel("training loss (mean over ranks)")
    top.set_title(title, fontsize=10)
    top.legend()
    gap = [(b - a) / a * 100 for a, b in zip(fp32, fp16)]
    bottom.plot(gap, color="tab:red", linewidth=0.8)
    bottom.axhline(0, color="gray", linewidth=0.5)
    bottom.set_ylabel("fp16 - fp32 (%)")
    bottom.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--model", choices=MODELS, default="transformer-5m")
    parser.add_argument("--bucket-size-mb", type=float, default=1.0, help="the same for DDP and wrap (MiB)")
    parser.add_argument("--rounds", type=int, default=6, help="alternation rounds")
    parser.add_argument("--block", type=int, default=3, help="steps per configuration per round")
    parser.add_argument("--loss-steps", type=int, default=200, help="steps of each loss curve (0: none)")
    parser.add_argument("--pool", type=int, default=8, help="batches per rank, cycled")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--plot", help="PNG of the two loss curves")
    parser.add_argument("--json")
    outcome = run_benchmark(parser, argv, rank_main)
    if isinstance(outcome, int):
        return outcome
    args, r = outcome
    ms = r["median_step_ms"]
    print(
        f"# compression_compare: {args.model}, {args.world} Gloo ranks, {where()}, bucket {args.bucket_size_mb:g} MiB; "
        f"median step, {args.rounds} rounds x {args.block} steps alternating"
    )
    limits = {  # on the link, each precision's own: what its step sends
        p: physical_limit(ms, ms[COMPUTE_ALONE], r["bytes_per_step"][p], args.world)
        for p in ("fp32", "fp16")
        if COMPUTE_ALONE in ms
    }
    for p, limit in limits.items():
        print(f"  {p}: {limit.line(f'wrap {p}')}")
    for kind in ("ddp fp32", "wrap fp32", "ddp fp16", "wrap fp16"):
        column = f"  {limits[kind[-4:]].column(ms[kind])}" if limits else ""
        print(f"  {kind:<10} {ms[kind]:>8.1f} ms{column}")
    print(f"  wrap fp16 / DDP fp16 hook: {ms['wrap fp16'] / ms['ddp fp16']:.3f}")
    if args.loss_steps:
        fp32, fp16 = r["loss_fp32"], r["loss_fp16"]
        gaps = [abs(b - a) / a for a, b in zip(fp32, fp16)]
        tail = max(gaps[-50:])
        print(
            f"  loss over {args.loss_steps} steps: fp32 {fp32[0]:.4f} -> {fp32[-1]:.4f}, fp16 {fp16[0]:.4f} -> "
            f"{fp16[-1]:.4f}; largest relative gap {max(gaps) * 100:.3f}% (last 50 steps: {tail * 100:.3f}%)"
        )
        if args.plot:
            _plot(args.plot, fp32, fp16, f"{args.model}, {args.world} ranks, {where()}: fp32 vs fp16 communication")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "where": where(), **r}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
