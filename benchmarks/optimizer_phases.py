"""Where a step's time goes: forward, backward and optimizer step, DDP against wrap with and without DistributedOptimizer.

    python benchmarks/optimizer_phases.py --link 1gbit --model transformer-5m
    python benchmarks/optimizer_phases.py --link 1gbit --optimizer adamw --bucket-size-mb auto --shard
    python benchmarks/optimizer_phases.py --compression powersgd --bucket-size-mb 25

Each setup trains ``--steps`` steps in turn (the loop: forward, zero_grad, backward, step) and
reports the median of each phase on rank 0, plus, for the DistributedOptimizer, the time its
forward pre-hooks spent finishing buckets (waiting for reductions, then updating; sharded also
waiting for all-gathers). ``--shard`` adds ``DistributedOptimizer(shard=True)``. ``--compression powersgd``
compresses every setup's gradients at rank 4 from the third step on (DDP with torch's ``powerSGD_hook``, waited
for inside the hook as benchmarks/powersgd_compare.py runs it), the steps after the first three timed.

On the emulated link (``--link``), and with ``--compression``, it also prints compute alone (the same model and
optimizer, no wrapper and no communication, trained in turn like the others), the wire time at the link's rate of
one step's bytes (as ``comm_stats()['bytes_per_step']`` counts them, wrap's) and each step as a multiple of
max(compute, wire): its distance to the physical limit (benchmarks/common.py ``physical_limit``). The step there is
the median of the whole loop. With ``--shard`` on the link it prints each DistributedOptimizer's floor: its step
if every transfer hid behind the compute it can overlap. Unsharded, the allreduces overlap backward:
max(backward, allreduce wire) + forward + step. Sharded, the reduce-scatters overlap backward, each rank updates 1/N
of the parameters, and the all-gathers step() launches overlap the next forward (its updates wait for step(), so no
all-gather starts in backward): max(backward, reduce-scatter wire) + step / N + max(forward, all-gather wire).
The phases are compute alone's; the wire times are one step's bytes per direction at the link's rate.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from torch import nn  # noqa: E402

from benchmarks.common import (  # noqa: E402
    COMPUTE_ALONE,
    link_rate,
    link_seconds,
    physical_limit,
    run_benchmark,
    where,
)
from benchmarks.ddp_compare import MODELS, build_model  # noqa: E402
from benchmarks.sharded_compare import step_wire_bytes  # noqa: E402


def _phases(model, optimizer, batches: list, steps: int, skip: int = 0, skipped=lambda: None) -> dict:
    """Median ms of each phase over the steps after the first ``skip`` (``skipped()`` called after them)."""
    record: dict[str, list[float]] = {"forward": [], "backward": [], "step": [], "total": []}
    for i in range(steps):
        if i == skip:
            skipped()
        x, y = batches[i % len(batches)]
        t0 = time.perf_counter()
        loss = nn.functional.cross_entropy(model(x), y)
        t1 = time.perf_counter()
        optimizer.zero_grad()
        t2 = time.perf_counter()
        loss.backward()
        t3 = time.perf_counter()
        optimizer.step()
        t4 = time.perf_counter()
        record["forward"].append(t1 - t0)
        record["backward"].append(t3 - t2)
        record["step"].append(t4 - t3)
        record["total"].append(t4 - t0)
    return {phase: statistics.median(values[skip:]) * 1e3 for phase, values in record.items()}


COMPRESSED_WARMUP = 3  # steps not timed with --compression: the plain ones before start_iter, and the first compressed
OPTIMIZERS = {"sgd": (torch.optim.SGD, {"lr": 1e-3, "momentum": 0.9}), "adamw": (torch.optim.AdamW, {"lr": 1e-4})}


def _time_forward_waits() -> list[float]:
    """Seconds each DistributedOptimizer forward pre-hook, and each read of a parameter before its module runs,
    spends finishing buckets (and, sharded, waiting for all-gathers), appended to the list returned; patched on
    the class (the sharded one inherits both), as the hooks hold bound methods."""
    from collective_ops.torch.optim.optimizer import DistributedOptimizer

    waits: list[float] = []
    for name in ("_before_forward_of", "read_owed"):
        method = DistributedOptimizer.__dict__[name]

        def timed(self, *args, method=method) -> None:
            start = time.perf_counter()
            method(self, *args)
            waits.append(time.perf_counter() - start)

        setattr(DistributedOptimizer, name, timed)
    return waits


def _compressed_ddp(ddp: nn.parallel.DistributedDataParallel) -> None:
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_powersgd

    from benchmarks.powersgd_compare import serial_hook

    state = torch_powersgd.PowerSGDState(None, matrix_approximation_rank=4, start_powerSGD_iter=2, random_seed=0)
    ddp.register_comm_hook(state, serial_hook(torch_powersgd.powerSGD_hook))


def rank_main(rank: int, world: int, port: int, args, queue) -> None:
    import collective_ops as co

    torch.set_num_threads(1)
    co.init("gloo", rank=rank, world_size=world, master_port=port)
    _, batch = build_model(args.model)
    gen = torch.Generator().manual_seed(rank)
    batches = [batch(gen) for _ in range(4)]
    optimizer_class, settings = OPTIMIZERS[args.optimizer]
    ddp_bucket = 25.0 if args.bucket_size_mb == "auto" else args.bucket_size_mb
    out = {}
    compression_on = args.compression != "none"
    skip = COMPRESSED_WARMUP if compression_on else 0
    waits = _time_forward_waits()
    if link_rate() or compression_on:  # the plain model and optimizer, no communication: the step's physical limit
        model, _ = build_model(args.model)
        out[COMPUTE_ALONE] = _phases(model, optimizer_class(model.parameters(), **settings), batches, args.steps, skip)
    model, _ = build_model(args.model)
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=ddp_bucket)
    compression = None
    if args.compression == "powersgd":
        _compressed_ddp(ddp)
        compression = co.PowerSGD(rank=4, start_iter=2, random_seed=0)
    out["DDP"] = _phases(ddp, optimizer_class(ddp.parameters(), **settings), batches, args.steps, skip)
    model, _ = build_model(args.model)
    wrapped = co.wrap(model, bucket_size_mb=args.bucket_size_mb, compression=compression)
    out["wrap"] = _phases(wrapped, optimizer_class(wrapped.parameters(), **settings), batches, args.steps, skip)
    sent = wrapped.comm_stats()["bytes_per_step"]
    gathered = sharded_sent = 0  # shard=True: the all-gathers' bytes per direction, and the whole step's
    for shard in (False, True) if args.shard else (False,):
        model, _ = build_model(args.model)
        wrapped = co.wrap(model, bucket_size_mb=args.bucket_size_mb, compression=compression)
        optimizer = co.DistributedOptimizer(wrapped, optimizer_class, shard=shard, **settings)
        waits.clear()
        label = f"DistributedOptimizer{'(shard=True)' if shard else ''}"
        out[label] = _phases(wrapped, optimizer, batches, args.steps, skip, waits.clear)
        out[label]["finishing buckets"] = sum(waits) / (args.steps - skip) * 1e3
        if shard:
            params = sum(p.numel() * p.element_size() for p in wrapped.parameters() if p.requires_grad)
            gathered, sharded_sent = params * (world - 1) // world, step_wire_bytes(label, wrapped, optimizer)
        optimizer.synchronize()
    co.barrier()
    co.shutdown()
    if rank == 0:
        queue.put((out, sent, (gathered, sharded_sent)))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--model", choices=MODELS, default="transformer-5m")
    parser.add_argument("--bucket-size-mb", type=_size, default=1.0, help="MiB, or auto (DDP then 25)")
    parser.add_argument("--optimizer", choices=OPTIMIZERS, default="sgd")
    parser.add_argument("--shard", action="store_true", help="also DistributedOptimizer(shard=True)")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--compression", choices=("none", "powersgd"), default="none")
    known, _ = parser.parse_known_args(argv)
    if known.compression != "none" and known.shard:
        parser.error("--compression powersgd does not combine with --shard (shard=True refuses PowerSGD)")
    if known.compression != "none" and known.steps <= COMPRESSED_WARMUP:
        parser.error(f"--compression times the steps after the first {COMPRESSED_WARMUP}: give --steps above it")
    outcome = run_benchmark(parser, argv, rank_main)
    if isinstance(outcome, int):
        return outcome
    args, (out, sent, sharded_bytes) = outcome
    print(
        f"# optimizer_phases: {args.model}, {args.world} Gloo ranks, {where()}, bucket {args.bucket_size_mb} MiB, "
        f"{args.optimizer}, compression {args.compression}"
    )
    print(f"  {'setup':<34} {'forward':>8} {'backward':>9} {'step':>6} {'finishing buckets':>18}  (median ms, rank 0)")
    for setup, phases in out.items():
        extra = phases.get("finishing buckets")
        print(
            f"  {setup:<34} {phases['forward']:>8.1f} {phases['backward']:>9.1f} {phases['step']:>6.1f} "
            + (f"{extra:>18.1f}" if extra is not None else "")
        )
    if COMPUTE_ALONE in out:
        totals = {setup: phases["total"] for setup, phases in out.items() if setup != COMPUTE_ALONE}
        limit = physical_limit(totals, out[COMPUTE_ALONE]["total"], sent, args.world)
        print("  median step (whole loop), rank 0:\n" + "\n".join(limit.lines(whose="wrap")))
    if args.shard and link_rate():
        print("\n".join(_floors(out[COMPUTE_ALONE], limit.wire_ms, *sharded_bytes, args.world)))
    return 0


def _floors(compute: dict, allreduce_ms: float, gathered: int, sharded_sent: int, world: int) -> list[str]:
    """Each DistributedOptimizer's floor on the link (see the module's docstring), from compute alone's phases."""
    gather_ms = link_seconds(gathered) * 1e3
    scatter_ms = link_seconds(sharded_sent) * 1e3 - gather_ms
    forward, backward, step = compute["forward"], compute["backward"], compute["step"]
    unsharded = max(backward, allreduce_ms) + forward + step
    sharded = max(backward, scatter_ms) + step / world + max(forward, gather_ms)
    return [
        "  floors (every transfer hidden behind the compute it can overlap; compute alone's phases):",
        f"    DistributedOptimizer              max(backward {backward:.1f}, allreduce wire {allreduce_ms:.1f}) "
        f"+ forward {forward:.1f} + step {step:.1f} = {unsharded:.1f} ms",
        f"    DistributedOptimizer(shard=True)  max(backward {backward:.1f}, reduce-scatter wire {scatter_ms:.1f}) "
        f"+ step/{world} {step / world:.1f} + max(forward {forward:.1f}, all-gather wire {gather_ms:.1f}) "
        f"= {sharded:.1f} ms ({sharded / unsharded:.3f}x the unsharded floor)",
    ]


def _size(value: str) -> float | str:
    return value if value == "auto" else float(value)


if __name__ == "__main__":
    sys.exit(main())
