"""The trace picture of one step: eager ``co.wrap`` against ``torch.compile(co.wrap(model))``.

    python benchmarks/compile_trace.py --link 1gbit --output docs/figures/compile_trace_1gbit.png

Two runs (eager, then compiled), each with tracing on (``trace=True``); the picture shows rank
0's last step of each: backward, every bucket from its launch until finalize had it back, and
the communication still waited for after backward. Buckets that start inside the backward bar
overlap it; under ``torch.compile`` that needs the graph split at bucket boundaries, which
collective_ops asks dynamo for as DDP does (docs/benchmarks.md, torch.compile section).

On the emulated link (``--link``) each run also prints its median step, compute alone (the same model and optimizer,
no wrapper and no communication, compiled alike, stepped in turn with the traced model), the wire time at the link's
rate of one step's bytes (as ``comm_stats()['bytes_per_step']`` counts them, wrap's) and each step as a multiple of
max(compute, wire): its distance to the physical limit (benchmarks/common.py ``physical_limit``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from benchmarks.common import (  # noqa: E402
    add_link_option,
    link_rate,
    physical_limit,
    reporting_node,
    run_on_link_if_asked,
    spawn,
    where,
)
from benchmarks.ddp_compare import MODELS, build_model, one_step  # noqa: E402


def rank_main(rank: int, world: int, port: int, args, compiled: bool, trace_file: str, queue) -> None:
    import collective_ops as co

    os.environ["COLLECTIVE_OPS_TRACE_FILE"] = trace_file
    torch.set_num_threads(1)
    co.init("gloo", rank=rank, world_size=world, master_port=port)
    model, batch = build_model(args.model)
    gen = torch.Generator().manual_seed(rank)
    batches = [batch(gen) for _ in range(4)]
    wrapped = co.wrap(model, bucket_size_mb=args.bucket_size_mb, trace=True)
    runner = torch.compile(wrapped) if compiled else wrapped
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=1e-3, momentum=0.9)
    plain = _compute_alone(args.model, compiled) if link_rate() else None
    steps, alone = [], []
    for i in range(args.steps):
        steps.append(one_step(runner, optimizer, batches[i % len(batches)]))
        if plain is not None:  # in turn with the traced steps: the same machine noise
            alone.append(one_step(*plain, batches[i % len(batches)]))
    limit = _limit(steps, alone, wrapped.comm_stats()["bytes_per_step"], world) if plain is not None else None
    co.barrier()
    co.shutdown()  # merges every rank's trace into trace_file
    if rank == 0:
        queue.put((trace_file, limit))


def _compute_alone(name: str, compiled: bool) -> tuple:
    """The same model and optimizer with no wrapper and no communication (compiled alike): the physical limit's
    compute."""
    model, _ = build_model(name)
    return torch.compile(model) if compiled else model, torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)


def _limit(steps: list[float], alone: list[float], sent: int, world: int):
    """The median step and compute alone after 3 warm-up steps (as benchmarks/ddp_compare.py's alternation:
    compilation, the bucket rebuild), each step the slowest rank's, against max(compute, wire)."""
    from collective_ops.runtime import get_engine

    warm = min(3, len(steps) - 1)
    slowest = get_engine("torch").reduce_floats(steps[warm:] + alone[warm:], "max")
    median = statistics.median(slowest[: len(slowest) // 2]) * 1e3
    return physical_limit({"step": median}, statistics.median(slowest[len(slowest) // 2 :]) * 1e3, sent, world)


def _last_step(events: list[dict], rank: int = 0) -> tuple[list[dict], float]:
    mine = [e for e in events if e.get("pid") == rank and e.get("ph") == "X" and "step" in e.get("args", {})]
    step = max(e["args"]["step"] for e in mine if e["cat"] == "backward")
    chosen = [e for e in mine if e["args"]["step"] == step and e["cat"] in ("backward", "exposed", "bucket")]
    start = min(e["ts"] for e in chosen if e["cat"] == "backward")
    return chosen, start


def render(traces: dict[str, Path], title: str, output: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from collective_ops.tools.heatmap import load_events

    fig, axes = plt.subplots(len(traces), 1, figsize=(10, 2.2 + 1.6 * len(traces)), sharex=True)
    for ax, (label, path) in zip(axes, traces.items()):
        events, start = _last_step(load_events([path]))
        buckets = sorted({e["args"]["bucket"] for e in events if e["cat"] == "bucket"})
        rows = {"backward": 0, "exposed": 0, **{b: i + 1 for i, b in enumerate(buckets)}}
        colors = {"backward": "0.6", "exposed": "tab:red", "bucket": "tab:blue"}
        for e in events:
            row = rows[e["args"]["bucket"]] if e["cat"] == "bucket" else rows[e["cat"]]
            ax.barh(row, e["dur"] / 1e3, left=(e["ts"] - start) / 1e3, color=colors[e["cat"]], height=0.7)
        ax.set_yticks(range(len(buckets) + 1), ["backward / wait"] + [f"bucket {b}" for b in buckets], fontsize=7)
        ax.invert_yaxis()
        ax.set_title(label, fontsize=9, loc="left")
    axes[-1].set_xlabel("ms from the start of backward (rank 0, last step); gray: backward, red: waiting after it")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    output.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(output, dpi=110)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--model", choices=MODELS, default="transformer-5m")
    parser.add_argument("--bucket-size-mb", type=float, default=1.0)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--output", default="compile_trace.png")
    add_link_option(parser)
    args = parser.parse_args(argv)
    relaunched = run_on_link_if_asked(args, argv)
    if relaunched is not None:
        return relaunched
    folder = Path(tempfile.mkdtemp(prefix="compile-trace-"))
    traces, limits = {}, {}
    for label, compiled in (("co.wrap (eager)", False), ("torch.compile(co.wrap(model))", True)):
        outcome = spawn(rank_main, args.world, args, compiled, str(folder / f"{compiled}.json"))
        if reporting_node():
            traces[label], limits[label] = Path(outcome[0]), outcome[1]
    if not reporting_node():
        return 0
    title = f"{args.model}, {args.world} Gloo ranks, {where()}, buckets {args.bucket_size_mb:g} MiB, torch {torch.__version__}"
    render(traces, title, Path(args.output))
    print(f"# compile_trace: {title}\n  picture: {args.output}")
    for label, limit in limits.items():
        if limit is not None:  # (on the link) median step, 3 warm-up steps left out, slowest rank
            print(
                f"  {label}: {limit.line('wrap')}; step {limit.step_ms['step']:.1f} ms, {limit.column(limit.step_ms['step'])}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
