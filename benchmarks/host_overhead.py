"""The host's share of a step: models of many tiny tensors, so that compute is near zero and what is left is
the Python and dispatch work each wrapper and optimizer adds per tensor and per bucket.

    python benchmarks/host_overhead.py                                # mlp, transformer, cnn; 400 and 2000 tensors; world 1 and 2
    python benchmarks/host_overhead.py --models mlp --tensors 400 --worlds 1 --rounds 3
    python benchmarks/host_overhead.py --json benchmarks/results/host_overhead.json
    python benchmarks/host_overhead.py --clock cpu --calls 10     # CPU seconds, and Python calls per step

Every setup of one (model, tensors, world) lives in the same processes and alternates with the others in blocks of
steps, the order reversed every round (benchmarks/ddp_compare.py ``alternate_steps``), so machine noise hits them
alike. Per setup it prints the median step, its spread over rounds, the ratio to its peer (DDP with the same
optimizer, ``foreach=True``; DDP + ``ZeroRedundancyOptimizer`` for ``shard=True``; DDP + ``powerSGD_hook`` for
PowerSGD) and to the bare loop (the model with no wrapper and the same optimizer: the limit), and the microseconds
per parameter tensor and per bucket beyond the bare loop. On a shared machine whose speed swings between runs,
``--calls`` adds a figure noise cannot move: the Python function calls of one step (cProfile's count), and their
ratio to the peer's; DDP's per-gradient work is C++ and costs it no Python call.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import platform
import pstats
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from torch import nn  # noqa: E402

from benchmarks.common import spawn  # noqa: E402
from benchmarks.ddp_compare import alternate_steps, finish_block, one_step  # noqa: E402

MODELS = ("mlp", "transformer", "cnn")
WIDTH = 16  # every layer this wide: a tensor costs its host work and next to no arithmetic
BATCH = 4

ADAMW = {"lr": 1e-3, "weight_decay": 0.01, "foreach": True}
SGD = {"lr": 1e-2, "momentum": 0.9, "weight_decay": 1e-4, "foreach": True}

# label -> (wrapper, optimizer, peer label); wrappers: bare, ddp, wrap, do (DistributedOptimizer), shard, zero
# (DDP + ZeroRedundancyOptimizer), ddp-powersgd (DDP + powerSGD_hook), wrap-powersgd
SETUPS = {
    "bare loop + AdamW": ("bare", "adamw", None),
    "DDP + AdamW": ("ddp", "adamw", None),
    "wrap + AdamW": ("wrap", "adamw", "DDP + AdamW"),
    "DistributedOptimizer(AdamW)": ("do", "adamw", "DDP + AdamW"),
    "bare loop + SGD": ("bare", "sgd", None),
    "DDP + SGD": ("ddp", "sgd", None),
    "DistributedOptimizer(SGD)": ("do", "sgd", "DDP + SGD"),
    "DDP + ZeroRedundancyOptimizer(AdamW)": ("zero", "adamw", None),
    "DistributedOptimizer(AdamW, shard=True)": ("shard", "adamw", "DDP + ZeroRedundancyOptimizer(AdamW)"),
    "DDP + powerSGD_hook + AdamW": ("ddp-powersgd", "adamw", None),
    "wrap(compression=PowerSGD) + AdamW": ("wrap-powersgd", "adamw", "DDP + powerSGD_hook + AdamW"),
}
BARE = {"adamw": "bare loop + AdamW", "sgd": "bare loop + SGD"}
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
POWERSGD_RANK = 2
POWERSGD_START = 2  # both start compressing at the same step (DDP's hook counts its own iterations)


def build_model(name: str, tensors: int) -> nn.Module:
    """A model of about ``tensors`` parameter tensors, each of at most WIDTH x WIDTH elements."""
    torch.manual_seed(0)
    if name == "mlp":  # Linear: weight + bias
        return nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(tensors // 2)])
    if name == "transformer":  # 12 tensors a block: attention in/out, two linears, two norms
        blocks = max(tensors // 12, 1)
        layer = nn.TransformerEncoderLayer(WIDTH, 2, 2 * WIDTH, dropout=0.0, batch_first=True)
        return nn.TransformerEncoder(layer, blocks, enable_nested_tensor=False)
    if name == "cnn":  # conv (weight, bias) + BatchNorm (weight, bias; two running buffers)
        layers = []
        for _ in range(max(tensors // 4, 1)):
            layers += [nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4)]
        return nn.Sequential(*layers)
    raise ValueError(f"unknown model {name!r}; choose from {MODELS}")


def batches(name: str, rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Four batches for this rank; the loss is a cross-entropy over the last dimension (one_step's)."""
    gen = torch.Generator().manual_seed(rank)
    shape = {"mlp": (BATCH, WIDTH), "transformer": (BATCH, 2, WIDTH), "cnn": (BATCH, 4, 4, 4)}[name]

    def one() -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(*shape, generator=gen)
        # classes over the last dimension (mlp, transformer: rows flattened by _Loss), or the channels (cnn)
        labels = (BATCH, 4, 4) if name == "cnn" else (BATCH * (2 if name == "transformer" else 1),)
        return x, torch.randint(0, shape[1] if name == "cnn" else WIDTH, labels, generator=gen)

    return [one() for _ in range(4)]


class _Loss(nn.Module):
    """Flattens the model's output so one_step's cross_entropy(model(x), y) fits every model."""

    def __init__(self, inner: nn.Module, name: str) -> None:
        super().__init__()
        self.inner = inner
        self.name = name

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.inner(x)
        return out.flatten(0, -2) if self.name != "cnn" else out


def _optimizer_class(kind: str):
    return (torch.optim.AdamW, ADAMW) if kind == "adamw" else (torch.optim.SGD, SGD)


def build_setup(label: str, name: str, tensors: int, bucket_size_mb: float, world: int):
    """(model, optimizer) for one row of SETUPS."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    import collective_ops as co

    wrapper, opt_kind, _ = SETUPS[label]
    cls, kwargs = _optimizer_class(opt_kind)
    model = build_model(name, tensors)
    if wrapper == "bare":
        return model, cls(model.parameters(), **kwargs)
    if wrapper in ("ddp", "zero", "ddp-powersgd"):
        ddp = DDP(model, bucket_cap_mb=bucket_size_mb)
        if wrapper == "ddp-powersgd":
            state = psgd.PowerSGDState(
                process_group=None, matrix_approximation_rank=POWERSGD_RANK, start_powerSGD_iter=POWERSGD_START
            )
            ddp.register_comm_hook(state, psgd.powerSGD_hook)
        if wrapper == "zero":
            return ddp, ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=cls, **kwargs)
        return ddp, cls(ddp.parameters(), **kwargs)
    if wrapper == "wrap-powersgd":
        compression = co.PowerSGD(rank=POWERSGD_RANK, start_iter=POWERSGD_START)
        wrapped = co.wrap(model, bucket_size_mb=bucket_size_mb, compression=compression)
        return wrapped, cls(wrapped.parameters(), **kwargs)
    wrapped = co.wrap(model, bucket_size_mb=bucket_size_mb)
    if wrapper == "wrap":
        return wrapped, cls(wrapped.parameters(), **kwargs)
    return wrapped, co.DistributedOptimizer(wrapped, cls, shard=wrapper == "shard", **kwargs)


def _buckets(model) -> int | None:
    stats = getattr(model, "comm_stats", None)
    return stats()["buckets"] if stats else None


def rank_main(rank: int, world: int, port: int, args, queue) -> None:
    import collective_ops as co

    torch.set_num_threads(1)
    co.init("gloo", rank=rank, world_size=world, master_port=port)
    labels = [label for label in SETUPS if _wanted(label, args.setups)]
    results = {}
    for name in args.models:
        for tensors in args.tensors:
            data = batches(name, rank)
            setups = {}
            for label in labels:
                model, optimizer = build_setup(label, name, tensors, args.bucket_size_mb, world)
                setups[label] = (_Loss(model, name), optimizer, data)
            times = alternate_steps(setups, args.rounds, args.block, clock=CLOCKS[args.clock])
            count = sum(1 for _ in setups[labels[0]][0].parameters())
            results[f"{name}/{tensors}"] = {
                "model": name,
                "tensors": count,
                "steps": {label: [t * 1e3 for t in values] for label, values in times.items()},
                "buckets": {label: _buckets(setups[label][0].inner) for label in labels},
                "block": args.block,
                "calls": {label: python_calls_per_step(*setups[label], args.calls) for label in labels}
                if args.calls
                else {},
            }
            del setups
    co.barrier()
    co.shutdown()
    if rank == 0:
        queue.put(results)


def python_calls_per_step(model, optimizer, data, steps: int) -> float:
    """The Python function calls (cProfile's count, C functions included) of one step, the mean of ``steps`` steps
    after the timed ones: the host's work as a count, which other tenants of the machine do not move."""
    profile = cProfile.Profile()
    profile.enable()
    for i in range(steps):
        one_step(model, optimizer, data[i % len(data)])
    profile.disable()
    calls = sum(entry[1] for entry in pstats.Stats(profile, stream=io.StringIO()).stats.values())
    finish_block(optimizer)  # (as after a timed block: nothing in flight into the next setup)
    return calls / steps


def _wanted(label: str, chosen: list[str] | None) -> bool:
    """All setups, or the chosen ones with their peers and bare loops."""
    if not chosen:
        return True
    needed = set(chosen) | {SETUPS[c][2] for c in chosen} | {BARE[SETUPS[c][1]] for c in chosen}
    return label in needed


def block_medians(steps_ms: list[float], block: int) -> list[float]:
    """Each block's mean step (ms): one figure a round, the unit the spread is taken over."""
    return [statistics.fmean(steps_ms[i : i + block]) for i in range(0, len(steps_ms), block)]


def table(result: dict) -> list[dict]:
    """Rows: setup, median ms/step, spread (min-max of the rounds' block means), x peer, x bare, us/tensor and
    us/bucket beyond the bare loop."""
    rows = []
    steps = result["steps"]
    median = {label: statistics.median(v) for label, v in steps.items()}
    calls = result.get("calls", {})
    for label, values in steps.items():
        wrapper, opt, peer = SETUPS[label]
        rounds = block_medians(values, result["block"])
        bare = median.get(BARE[opt])
        beyond = None if bare is None else (median[label] - bare) * 1e3
        buckets = result["buckets"].get(label)
        rows.append(
            {
                "setup": label,
                "ms_per_step": round(median[label], 3),
                "spread_ms": [round(min(rounds), 3), round(max(rounds), 3)],
                "x_peer": None if peer not in median else round(median[label] / median[peer], 3),
                "peer": peer,
                "x_bare": None if bare is None else round(median[label] / bare, 3),
                "us_per_tensor_beyond_bare": None if beyond is None else round(beyond / result["tensors"], 2),
                "buckets": buckets,
                "us_per_bucket_beyond_bare": None if beyond is None or not buckets else round(beyond / buckets, 1),
                "python_calls_per_step": round(calls[label]) if label in calls else None,
                "x_peer_calls": round(calls[label] / calls[peer], 3) if label in calls and peer in calls else None,
            }
        )
    return rows


def print_table(title: str, rows: list[dict]) -> None:
    print(f"\n{title}")
    print(
        f"  {'setup':<42} {'ms/step':>8} {'spread':>15} {'x peer':>7} {'x bare':>7} {'us/tensor':>9} "
        f"{'buckets':>7} {'us/bucket':>9} {'calls/step':>10} {'x peer':>7}"
    )
    for r in rows:

        def fmt(value, spec):
            return format(value, spec) if value is not None else "-".rjust(len(format(0, spec)))

        spread = f"{r['spread_ms'][0]:.2f}-{r['spread_ms'][1]:.2f}"
        print(
            f"  {r['setup']:<42} {r['ms_per_step']:>8.2f} {spread:>15} {fmt(r['x_peer'], '7.3f')} "
            f"{fmt(r['x_bare'], '7.3f')} {fmt(r['us_per_tensor_beyond_bare'], '9.2f')} "
            f"{fmt(r['buckets'], '7d')} {fmt(r['us_per_bucket_beyond_bare'], '9.1f')} "
            f"{fmt(r.get('python_calls_per_step'), '10d')} {fmt(r.get('x_peer_calls'), '7.3f')}"
        )


def commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT)
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "collective_ops"], capture_output=True, text=True, cwd=ROOT
        ).stdout.strip()
        return out.stdout.strip() + ("+changes" if dirty else "")
    except OSError:
        return "unknown"


def machine() -> str:
    import os

    return (
        f"{os.cpu_count()} cores, {platform.processor() or platform.machine()}, Python "
        f"{platform.python_version()}, torch {torch.__version__}; Gloo over loopback, 1 thread per rank"
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    parser.add_argument("--tensors", nargs="+", type=int, default=[400, 2000], help="parameter tensors per model")
    parser.add_argument("--worlds", nargs="+", type=int, default=[1, 2], help="world sizes (Gloo ranks)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds of alternation (each setup's spread)")
    parser.add_argument("--block", type=int, default=10, help="steps per setup per round")
    parser.add_argument("--bucket-size-mb", type=float, default=25.0, help="DDP's bucket_cap_mb and wrap's size")
    parser.add_argument("--setups", nargs="*", choices=list(SETUPS), help="only these (and their peers, bare loop)")
    parser.add_argument(
        "--clock",
        choices=list(CLOCKS),
        default="wall",
        help="wall: elapsed time; cpu: this process's CPU seconds (all its threads: the host's work, unmoved by "
        "other tenants of a shared machine)",
    )
    parser.add_argument(
        "--calls",
        type=int,
        default=0,
        metavar="STEPS",
        help="also count each setup's Python function calls per step (cProfile, over STEPS steps after the timed ones)",
    )
    parser.add_argument("--json", help="write the tables here (a data file with command, commit and machine)")
    args = parser.parse_args(argv)
    tables = []
    for world in args.worlds:
        results = spawn(rank_main, world, args)
        for result in results.values():
            title = (
                f"{result['model']}, {result['tensors']} tensors, world {world} (Gloo), "
                f"bucket_size_mb={args.bucket_size_mb}, {args.clock} clock"
            )
            rows = table(result)
            print_table(title, rows)
            tables.append(
                {"title": title, "model": result["model"], "tensors": result["tensors"], "world": world, "rows": rows}
            )
    if args.json:
        data = {
            "benchmark": "benchmarks/host_overhead.py",
            "command": "python benchmarks/host_overhead.py " + " ".join(sys.argv[1:] if argv is None else argv),
            "commit": commit(),
            "machine": machine(),
            "rounds": args.rounds,
            "block": args.block,
            "clock": args.clock,
            "tables": tables,
        }
        Path(args.json).write_text(json.dumps(data, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
