"""Collective benchmark in the style of nccl-tests / hccl_test, raw framework call beside the wrapper.

Per size: time per call (µs: calls are timed in blocks, alternating implementations; a
block's time is the slowest rank's, and the median block is reported), **algbw** = bytes /
time and **busbw** = algbw × factor, with nccl-tests' factors: 2(n-1)/n for allreduce,
(n-1)/n for allgather and reduce_scatter, 1 for broadcast. Bytes are the size of the
per-rank input for allreduce and broadcast, and of the full (gathered / pre-scatter)
tensor for allgather and reduce_scatter, as nccl-tests counts them. Each size ends with
a correctness check of the result (``wrong`` counts mismatching elements).

Run under ``torchrun`` (any world size), ``--spawn N`` to start N local ranks, or under
``msrun`` for MindSpore communication (``mint.distributed`` beside collective_ops).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import re
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

from .link import link_label

OPS = ("allreduce", "allgather", "broadcast", "reduce_scatter")
_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text: str) -> int:
    """'8', '64K', '256M', '1G' (powers of 1024) -> bytes."""
    match = re.fullmatch(r"\s*(\d+)\s*([KMG]?)B?\s*", str(text), flags=re.IGNORECASE)
    if not match:
        raise argparse.ArgumentTypeError(f"size {text!r} is not a number of bytes like 8, 64K, 256M or 1G")
    value = int(match.group(1)) * _UNITS[match.group(2).upper()]
    if value <= 0:
        raise argparse.ArgumentTypeError(f"size {text!r} must be positive")
    return value


def size_sweep(begin: int, end: int, factor: int) -> list[int]:
    if factor < 2:
        raise ValueError(f"the step factor must be >= 2, got {factor}")
    if begin > end:
        raise ValueError(f"the first size ({begin} B) is larger than the last ({end} B)")
    sizes, size = [], begin
    while size <= end:
        sizes.append(size)
        size *= factor
    return sizes


def bus_factor(op: str, world: int) -> float:
    """nccl-tests' busbw / algbw ratio."""
    if op == "allreduce":
        return 2 * (world - 1) / world
    if op in ("allgather", "reduce_scatter"):
        return (world - 1) / world
    if op == "broadcast":
        return 1.0
    raise ValueError(f"unknown collective {op!r}; use one of {', '.join(OPS)}")


def bandwidths(op: str, nbytes: int, seconds: float, world: int) -> tuple[float, float]:
    """(algbw, busbw) in GB/s (10^9 bytes per second, as nccl-tests)."""
    algbw = nbytes / seconds / 1e9 if seconds > 0 else math.inf
    return algbw, algbw * bus_factor(op, world)


@dataclass
class Row:
    op: str
    impl: str  # "raw" (framework call) or "collective_ops"
    bytes: int
    count: int
    dtype: str
    time_us: float
    algbw_gbs: float
    busbw_gbs: float
    wrong: int
    redop: str = "sum"  # the reduce op (nccl-tests' redop column); broadcast and allgather reduce nothing
    world: int = 1


def _impls(op: str, reduce_op: str) -> dict[str, Callable]:
    import torch.distributed as dist

    import collective_ops as co
    from collective_ops.comm.torch_engine import _TORCH_OPS, _all_gather_single, _reduce_scatter_single

    torch_op = _TORCH_OPS[reduce_op]
    raw = {
        "allreduce": lambda t, out: dist.all_reduce(t, op=torch_op),
        "broadcast": lambda t, out: dist.broadcast(t, src=0),
        "allgather": lambda t, out: _all_gather_single(out, t),
        "reduce_scatter": lambda t, out: _reduce_scatter_single(out, t, op=torch_op),
    }[op]
    ours = {
        "allreduce": lambda t, out: co.allreduce(t, op=reduce_op),
        "broadcast": lambda t, out: co.broadcast(t, src=0),
        "allgather": lambda t, out: co.allgather(t),
        "reduce_scatter": lambda t, out: co.reduce_scatter(t, op=reduce_op),
    }[op]
    return {"raw": raw, "collective_ops": ours}


def _element_count(op: str, nbytes: int, itemsize: int, world: int) -> int:
    """Elements of each rank's input: ``nbytes`` is the gathered size for allgather, the input size otherwise."""
    count = max(nbytes // itemsize, 1)
    if op == "allgather":
        return max(count // world, 1)
    if op == "reduce_scatter":  # divisible by the world size
        return max(count // world, 1) * world
    return count


def _tensors(op: str, nbytes: int, dtype, world: int, device):
    import torch

    count = _element_count(op, nbytes, torch.empty((), dtype=dtype).element_size(), world)
    t = torch.zeros(count, dtype=dtype, device=device)
    if op == "allgather":
        return t, torch.zeros(count * world, dtype=dtype, device=device)
    if op == "reduce_scatter":
        return t, torch.zeros(count // world, dtype=dtype, device=device)
    return t, None


REDUCED = {  # what each reduce op makes of the inputs 1, 2, ..., world
    "sum": lambda w: w * (w + 1) / 2,
    "avg": lambda w: (w + 1) / 2,
    "max": lambda w: float(w),
    "min": lambda w: 1.0,
    "prod": lambda w: float(math.factorial(w)),
}


def _count_wrong(op: str, got, world: int, count: int, reduce_op: str = "sum") -> int:
    """Wrong elements in ``got`` (numpy) after ``op`` on inputs filled with rank + 1 (``count`` per rank)."""
    import numpy as np

    got = np.asarray(got, dtype=np.float64).reshape(-1)
    if op == "broadcast":
        expected = np.ones(got.shape)
    elif op == "allgather":
        expected = np.repeat(np.arange(1, world + 1, dtype=np.float64), count)
    else:  # allreduce, reduce_scatter: reduce_op over 1..world everywhere
        expected = np.full(got.shape, REDUCED[reduce_op](world))
    if got.shape != expected.shape:
        return max(got.size, expected.size)
    return int((np.abs(got - expected) > 1e-3 * np.maximum(np.abs(expected), 1)).sum())


def _check_sweep_args(warmup: int, iters: int, rounds: int, impls: Sequence[str]) -> None:
    if warmup < 0 or iters < 1 or rounds < 1:
        raise ValueError(f"need warmup >= 0, iters >= 1 and rounds >= 1, got {warmup}, {iters}, {rounds}")
    unknown = set(impls) - {"raw", "collective_ops"}
    if unknown:
        raise ValueError(f"unknown implementation(s) {sorted(unknown)}; use raw and/or collective_ops")


def _check(op: str, impl: Callable, t, out, rank: int, world: int, reduce_op: str = "sum") -> int:
    """Run once on known data; count wrong elements."""
    t.fill_(rank + 1)
    result = impl(t, out)
    got = t if op in ("allreduce", "broadcast") else (out if result is None else result)
    return _count_wrong(op, got.double().cpu().numpy(), world, t.numel(), reduce_op)


def _sync(device) -> None:
    import torch

    if device.type != "cpu":
        accelerator = getattr(torch, "accelerator", None)  # torch >= 2.6; the device module before that
        sync = (
            accelerator.synchronize if hasattr(accelerator, "synchronize") else getattr(torch, device.type).synchronize
        )
        sync()


def time_alternating(
    calls: dict[str, Callable[[], object]],
    warmup: int,
    iters: int,
    rounds: int,
    sync: Callable[[], object],
    barrier: Callable[[], object],
) -> dict[str, list[float]]:
    """Seconds per call of each implementation, per block; implementations alternate block by block.

    Alternating spreads a noisy machine's drift over every implementation alike. ``sync``
    waits for the device (or MindSpore's queue), ``barrier`` lines the ranks up per block.
    """
    block = max(iters // rounds, 1)
    for call in calls.values():
        for _ in range(warmup):
            call()
    sync()
    per_block: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            barrier()
            start = time.perf_counter()
            for _ in range(block):
                call()
            sync()
            per_block[name].append((time.perf_counter() - start) / block)
    return per_block


def run_sweep(
    op: str,
    sizes: Sequence[int],
    dtype_name: str = "float32",
    reduce_op: str = "sum",
    warmup: int = 5,
    iters: int = 20,
    impls: Sequence[str] = ("raw", "collective_ops"),
    rounds: int = 5,
    progress: bool = True,
    check: bool = True,
) -> list[Row]:
    """Measure on the live process group; every rank returns the same rows.

    ``check=False`` skips the run on known data that counts wrong elements (``wrong`` is then
    -1): the tuner's fits need only times, and the check's float64 copy of the largest
    buffer was most of a training process's peak memory above DDP's.
    """
    import torch
    import torch.distributed as dist

    import collective_ops as co
    from collective_ops.runtime import get_engine

    _check_sweep_args(warmup, iters, rounds, impls)
    rank, world = co.get_rank(), co.get_world_size()
    engine = get_engine("torch")
    device = engine.device
    dtype = getattr(torch, dtype_name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {dtype_name!r}; use e.g. float32, float16, bfloat16, int32")
    all_impls = _impls(op, reduce_op)
    rows: list[Row] = []
    iterator = sizes
    if progress and rank == 0:
        try:
            from tqdm import tqdm

            iterator = tqdm(sizes, desc=op, unit="size", leave=False)
        except ImportError:
            pass
    for nbytes in iterator:
        t, out = _tensors(op, nbytes, dtype, world, device)
        total_bytes = t.numel() * t.element_size() * (world if op == "allgather" else 1)
        # Implementations alternate in blocks (ABAB...) so drift on a noisy machine hits both alike;
        # each block's time is the slowest rank's, and the median block is reported.
        calls = {name: (lambda impl=all_impls[name], t=t, out=out: impl(t, out)) for name in impls}
        per_block = time_alternating(calls, warmup, iters, rounds, lambda: _sync(device), dist.barrier)
        for name in impls:
            # bookkeeping collectives on the engine's device too: NCCL/HCCL groups take no CPU tensors
            times = engine.reduce_floats(per_block[name], "max")
            wrong = -1
            if check:
                counted = _check(op, all_impls[name], t, out, rank, world, reduce_op)
                wrong = int(engine.reduce_floats([counted], "sum")[0])
            seconds = float(torch.tensor(times, dtype=torch.float64).median())
            algbw, busbw = bandwidths(op, total_bytes, seconds, world)
            rows.append(
                Row(op, name, total_bytes, t.numel(), dtype_name, seconds * 1e6, algbw, busbw, wrong, reduce_op, world)
            )
    return rows


def run_sweep_mindspore(
    op: str,
    sizes: Sequence[int],
    dtype_name: str = "float32",
    reduce_op: str = "sum",
    warmup: int = 5,
    iters: int = 20,
    impls: Sequence[str] = ("raw", "collective_ops"),
    rounds: int = 5,
) -> list[Row]:
    """The same sweep on MindSpore communication (under msrun): mint.distributed beside collective_ops.

    MCCL (CPU) has no tensor-form allgather or reduce_scatter kernels, so those ops time the
    list-form allgather and collective_ops' composed reduce_scatter; every step ends with
    ``mindspore.runtime.synchronize()`` (CPU handles return before the work is done).
    """
    import mindspore as ms
    import mindspore.mint.distributed as mdist
    import numpy as np
    from mindspore import mint

    import collective_ops as co

    _check_sweep_args(warmup, iters, rounds, impls)
    rank, world = co.get_rank(), co.get_world_size()
    dtype = getattr(ms, dtype_name, None)
    if dtype is None or not isinstance(dtype, type(ms.float32)):
        raise ValueError(f"unknown dtype {dtype_name!r}; use e.g. float32, float16, int32")

    def raw(t):
        """The framework call; returns what to check (the gathered list concatenated for allgather)."""
        if op == "allreduce":
            mdist.all_reduce(t, op=reduce_op)
            return t
        if op == "broadcast":
            mdist.broadcast(t, 0)
            return t
        if op == "allgather":
            parts = [mint.zeros(t.shape, dtype=t.dtype) for _ in range(world)]
            mdist.all_gather(parts, t)
            return parts
        return co.reduce_scatter(t, op=reduce_op)  # no native CPU kernel to compare with

    ours = {
        "allreduce": lambda t: co.allreduce(t, op=reduce_op),
        "broadcast": lambda t: co.broadcast(t, src=0),
        "allgather": lambda t: co.allgather(t),
        "reduce_scatter": lambda t: co.reduce_scatter(t, op=reduce_op),
    }[op]
    all_impls = {"raw": raw, "collective_ops": ours}

    def as_numpy(result) -> np.ndarray:
        parts = result if isinstance(result, list) else [result]
        return np.concatenate([p.astype(ms.float32).asnumpy().reshape(-1) for p in parts])

    itemsize = int(ms.Tensor(np.zeros(1), dtype).itemsize)
    rows: list[Row] = []
    for nbytes in sizes:
        count = _element_count(op, nbytes, itemsize, world)
        t = ms.Tensor(np.ones(count), dtype)
        total_bytes = count * itemsize * (world if op == "allgather" else 1)
        calls = {name: (lambda impl=all_impls[name], t=t: impl(t)) for name in impls}
        per_block = time_alternating(calls, warmup, iters, rounds, ms.runtime.synchronize, mdist.barrier)
        for name in impls:
            times = ms.Tensor(np.asarray(per_block[name], dtype=np.float32))
            co.allreduce(times, op="max")
            probe = ms.Tensor(np.full(count, rank + 1.0), dtype)  # mint.full has no CPU kernel
            wrong = _count_wrong(op, as_numpy(all_impls[name](probe)), world, count, reduce_op)
            seconds = float(np.median(times.asnumpy()))
            algbw, busbw = bandwidths(op, total_bytes, seconds, world)
            rows.append(
                Row(op, name, total_bytes, count, dtype_name, seconds * 1e6, algbw, busbw, wrong, reduce_op, world)
            )
    return rows


def format_table(rows: Sequence[Row], world: int) -> str:
    lines = [
        f"# collective-ops bench: {rows[0].op if rows else ''}, {world} rank(s), {link_label()}; "
        "time = median block, slowest rank",
        f"# {'bytes':>12} {'count':>11} {'type':>8} {'redop':>6} {'impl':>15} {'time(us)':>11} {'algbw(GB/s)':>12} "
        f"{'busbw(GB/s)':>12} {'#wrong':>7}",
    ]
    for r in rows:
        redop = r.redop if r.op in ("allreduce", "reduce_scatter") else "none"
        lines.append(
            f"  {r.bytes:>12} {r.count:>11} {r.dtype:>8} {redop:>6} {r.impl:>15} {r.time_us:>11.1f} "
            f"{r.algbw_gbs:>12.4f} {r.busbw_gbs:>12.4f} {r.wrong:>7}"
        )
    return "\n".join(lines)


def summarize_overhead(rows: Sequence[Row]) -> dict:
    """The wrapper against the raw call: bandwidth ratio per size, added latency at the smallest size."""
    raw = {(r.op, r.bytes): r for r in rows if r.impl == "raw"}
    ours = {(r.op, r.bytes): r for r in rows if r.impl == "collective_ops"}
    pairs = sorted(set(raw) & set(ours), key=lambda k: k[1])
    if not pairs:
        return {}
    ratios = {k[1]: ours[k].busbw_gbs / raw[k].busbw_gbs for k in pairs if raw[k].busbw_gbs > 0}
    smallest = pairs[0]
    return {
        "bandwidth_ratio_by_bytes": ratios,
        "added_latency_us_at_smallest": ours[smallest].time_us - raw[smallest].time_us,
        "smallest_bytes": smallest[1],
    }


def write_outputs(rows: Sequence[Row], csv_path: str | None, json_path: str | None, plot_path: str | None) -> None:
    if csv_path:
        with open(csv_path, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(asdict(rows[0])))
            writer.writeheader()
            writer.writerows(asdict(r) for r in rows)
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"rows": [asdict(r) for r in rows], "overhead": summarize_overhead(rows)}, f, indent=1)
    if plot_path:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        for impl in sorted({r.impl for r in rows}):
            pts = [(r.bytes, r.busbw_gbs) for r in rows if r.impl == impl]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=impl)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("bytes")
        ax.set_ylabel("busbw (GB/s)")
        ax.set_title(f"{rows[0].op} busbw")
        ax.grid(True, alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(plot_path, dpi=120)
        plt.close(fig)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sizes = "bytes, or with K/M/G (powers of 1024: 64K = 65536)"
    parser.add_argument("--op", choices=OPS, default="allreduce", help="the collective (default: %(default)s)")
    parser.add_argument(
        "-b", "--minbytes", type=parse_size, default=parse_size("8"), help=f"first size, {sizes} (default: 8)"
    )
    parser.add_argument(
        "-e", "--maxbytes", type=parse_size, default=parse_size("64M"), help=f"last size, {sizes} (default: 64M)"
    )
    parser.add_argument(
        "-f", "--stepfactor", type=int, default=2, help="each size times this, >= 2 (default: %(default)s)"
    )
    parser.add_argument(
        "-d",
        "--dtype",
        default="float32",
        help="element type: float32, float16, bfloat16, int32, ... (default: %(default)s)",
    )
    parser.add_argument(
        "-o",
        "--reduce-op",
        default="sum",
        choices=["sum", "max", "min", "prod"],
        help="reduce op (default: %(default)s)",
    )
    parser.add_argument(
        "-w",
        "--warmup",
        type=int,
        default=5,
        help="untimed calls per implementation and size, >= 0 (default: %(default)s)",
    )
    parser.add_argument(
        "-n",
        "--iters",
        type=int,
        default=60,
        help="timed calls per implementation and size, >= 1 (default: %(default)s)",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=5,
        help="blocks the timed calls are split into; the median block is reported (default: %(default)s)",
    )
    parser.add_argument("--impl", action="append", choices=["raw", "collective_ops"], help="default: both")
    parser.add_argument("--backend", default=None, help="hccl, nccl or gloo (default: what the hardware offers)")
    parser.add_argument(
        "--spawn", type=int, default=0, help="start N local ranks (default: 0 = this process, or torchrun's ranks)"
    )
    parser.add_argument(
        "--link",
        default="none",
        help="run on 2 emulated nodes joined by a rate-limited link (a tc rate: 10gbit, 1gbit; needs root), "
        "launched as a 2-node torchrun job with --spawn/2 ranks per node (default --spawn 2); none = loopback",
    )
    parser.add_argument(
        "--launcher",
        choices=["torchrun", "msrun"],
        default="torchrun",
        help="with --link: start each node's ranks with torchrun (torch.distributed) or msrun (MindSpore "
        "communication) (default: %(default)s)",
    )
    parser.add_argument("--csv", help="write the rows here (with op, redop and world size)")
    parser.add_argument("--json", help="write the rows and the overhead summary here")
    parser.add_argument("--plot", help="PNG of busbw against size")


def validate(args: argparse.Namespace) -> str | None:
    """What is wrong with the command's arguments (a usage error), or None; checked before any rank starts."""
    try:
        size_sweep(args.minbytes, args.maxbytes, args.stepfactor)
        _check_sweep_args(args.warmup, args.iters, args.rounds, args.impl or ())
    except ValueError as exc:
        return str(exc)
    if args.spawn < 0:
        return f"--spawn takes a number of ranks >= 0, got {args.spawn}"
    if args.launcher != "torchrun" and args.link == "none":
        return (
            f"--launcher {args.launcher} starts the nodes of --link RATE; without a link, start the bench under msrun"
        )
    if args.link != "none":
        from .link import rate_bits

        try:
            rate_bits(args.link)
        except ValueError as exc:
            return str(exc)
        if (args.spawn or 2) % 2:
            return f"--spawn {args.spawn} does not split over the link's 2 nodes; use an even number"
    import importlib.util

    if importlib.util.find_spec("torch") is not None:  # a MindSpore-only install checks it in its sweep
        import torch

        if not isinstance(getattr(torch, args.dtype, None), torch.dtype):
            return f"unknown dtype {args.dtype!r}; use e.g. float32, float16, bfloat16, int32"
    if args.backend is not None:
        from ..launch import probe_hardware, select_backend

        try:
            select_backend(args.backend, probe_hardware(), environ={})
        except (RuntimeError, ValueError) as exc:
            return str(exc)
    return None


def _rank_main(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    import collective_ops as co

    co.init(args.backend, rank=rank, world_size=world, master_port=port)
    _run_and_report(args)


def _run_and_report(args: argparse.Namespace) -> None:
    import collective_ops as co

    sizes = size_sweep(args.minbytes, args.maxbytes, args.stepfactor)
    sweep = run_sweep_mindspore if co.context().framework == "mindspore" else run_sweep
    rows = sweep(
        args.op,
        sizes,
        args.dtype,
        args.reduce_op,
        args.warmup,
        args.iters,
        tuple(args.impl or ("raw", "collective_ops")),
        rounds=args.rounds,
    )
    if co.get_rank() == 0:
        print(format_table(rows, co.get_world_size()))
        overhead = summarize_overhead(rows)
        if overhead:
            big = [v for b, v in overhead["bandwidth_ratio_by_bytes"].items() if b >= 1 << 20]
            added = overhead["added_latency_us_at_smallest"]
            noise = "" if added >= 0 else " (negative: below this run's noise, no measurable added latency)"
            print(
                f"# collective_ops vs raw: added latency at {overhead['smallest_bytes']} B = "
                f"{added:.1f} us{noise}; busbw ratio at >= 1 MiB: "
                + (f"median {statistics.median(big):.3f}, min {min(big):.3f}" if big else "n/a")
            )
        write_outputs(rows, args.csv, args.json, args.plot)
    co.barrier()
    co.shutdown()


def _run_on_link(args: argparse.Namespace, argv: Sequence[str]) -> int:
    """This bench command as a 2-node torchrun or msrun job on the emulated link (one namespace per node)."""
    from .link import run_on_link_or_explain, strip_link_option

    world = args.spawn or 2  # validate() checked the rate and that it splits over 2 nodes
    # the nodes get the launcher's ranks, not --spawn, and must not relaunch themselves
    rest = strip_link_option(strip_link_option(strip_link_option(argv), "--spawn"), "--launcher")
    if args.launcher == "msrun":
        return _run_on_link_msrun(args.link, world, rest)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", str(world // 2)]
    torchrun += ["--node-rank", "{node_rank}", "--master-addr", "{master_addr}", "--master-port", "{master_port}"]
    return run_on_link_or_explain(
        args.link, lambda link, node: link.fill([*torchrun, "-m", "collective_ops.tools.cli", *rest], node)
    )


def _run_on_link_msrun(rate: str, world: int, rest: Sequence[str]) -> int:
    """The bench as a 2-node msrun job on the link: msrun starts a script file, so a two-line one calls the CLI
    (the workers' logs, one folder per node, stay in a temporary folder that is printed)."""
    import tempfile
    from pathlib import Path

    from .link import run_on_link_or_explain

    out = Path(tempfile.mkdtemp(prefix="collective-ops-bench-"))
    script = out / "bench_worker.py"
    script.write_text("import sys\nfrom collective_ops.tools.cli import main\nsys.exit(main(sys.argv[1:]))\n")
    package_root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")])))
    env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), env.get("PATH", "")])
    print(f"# msrun workers' logs: {out}", file=sys.stderr)
    command = msrun_node_command(world, str(script), str(out), rest)
    return run_on_link_or_explain(rate, lambda link, node: link.fill(command, node), log_dir=str(out), env=env)


def msrun_node_command(world: int, script: str, log_dir: str, args: Sequence[str]) -> list[str]:
    """One link node's msrun command line (a :meth:`~collective_ops.tools.link.Link.fill` template): half of
    ``world``'s ranks, rendezvous at node 0, the workers' logs under ``log_dir``/node<N>."""
    msrun = ["msrun", f"--worker_num={world}", f"--local_worker_num={world // 2}", "--node_rank={node_rank}"]
    msrun += ["--master_addr={master_addr}", "--master_port={master_port}", f"--log_dir={log_dir}/node{{node_rank}}"]
    return [*msrun, "--join=True", script, *args]


def run(args: argparse.Namespace) -> int:
    problem = validate(args)  # before starting anything: a usage error, never a traceback from a rank
    if problem:
        print(f"collective-ops bench: error: {problem}", file=sys.stderr)
        return 2
    if args.link != "none" and "COLLECTIVE_OPS_NODE_RANK" not in os.environ:
        return _run_on_link(args, getattr(args, "argv", sys.argv[1:]))
    if args.spawn:
        import socket

        import torch.multiprocessing as mp

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        mp.spawn(_rank_main, args=(args.spawn, port, args), nprocs=args.spawn)
        return 0
    import collective_ops as co

    co.init(args.backend)  # under msrun: MindSpore communication, so the MindSpore sweep
    _run_and_report(args)
    return 0
