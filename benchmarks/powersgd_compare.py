"""PowerSGD: torch DDP + powerSGD_hook against wrap(compression=co.PowerSGD(...)), with and without DistributedOptimizer.

    python benchmarks/powersgd_compare.py --link 1gbit --models transformer-5m --rank 4
    python benchmarks/powersgd_compare.py --models mlp --rounds 1 --block 2 --loss-steps 4   # a smoke run

Two phases on the same ranks. Loss: each setup (DDP at ``--loss-ddp-mb``) trains ``--loss-steps`` steps from the
same weights on the same batches (compression from step ``--start-iter``), and the mean training loss over ranks and the last
10 steps is printed. Time: the setups alternate in blocks of steps (benchmarks/ddp_compare.py's
``alternate_steps``, compressed from the first timed step on): compute alone (no communication), torch DDP
with ``powerSGD_hook`` at each bucket size of ``--ddp-mb`` (its best printed), ``wrap`` + PowerSGD with a plain
optimizer, and ``wrap`` + PowerSGD + ``DistributedOptimizer``. Printed beside each step: the wire time of
one compressed step's bytes at the link's rate (the factors and the uncompressed gradients: the same
elements under every bucketing), and the step as a multiple of max(compute alone, wire).
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

from benchmarks.common import (  # noqa: E402
    COMPUTE_ALONE,
    SYNCED_FLOOR,
    StepSynchronised,
    physical_limit,
    run_benchmark,
    where,
)
from benchmarks.ddp_compare import MODELS, alternate_steps, build_model  # noqa: E402

WRAP = "wrap + PowerSGD"
OVERLAPPED = "wrap + PowerSGD + DistributedOptimizer"


def serial_hook(hook):
    """torch's hook waited for inside the hook (--ddp-hook serial): its later allreduces, launched from Gloo's
    completion callbacks, cannot then cross another bucket's between ranks."""

    def serial(state, bucket):
        future = hook(state, bucket)
        future.wait()
        return future

    return serial


def _optimizer(args, model: nn.Module, wrapped=None):
    import collective_ops as co

    cls, kwargs = (
        (torch.optim.SGD, {"lr": 1e-3, "momentum": 0.9})
        if args.optimizer == "sgd"
        else (torch.optim.AdamW, {"lr": 1e-4, "weight_decay": 0.01})
    )
    if wrapped is not None:
        return co.DistributedOptimizer(wrapped, cls, **kwargs)
    return cls(model.parameters(), **kwargs)


def _setups(args, name: str, batches: list, start_iter: int) -> dict:
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_powersgd

    import collective_ops as co

    model, _ = build_model(name)
    setups = {COMPUTE_ALONE: (model, _optimizer(args, model), batches)}
    model, _ = build_model(name)
    setups[SYNCED_FLOOR] = (model, StepSynchronised(_optimizer(args, model)), batches)
    hook = torch_powersgd.powerSGD_hook if args.ddp_hook == "torch" else serial_hook(torch_powersgd.powerSGD_hook)
    for mb in args.ddp_mb:
        model, _ = build_model(name)
        ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=mb)
        state = torch_powersgd.PowerSGDState(
            None, matrix_approximation_rank=args.rank, start_powerSGD_iter=start_iter, random_seed=0
        )
        ddp.register_comm_hook(state, hook)
        setups[_ddp_label(mb)] = (ddp, _optimizer(args, ddp), batches)
    compression = co.PowerSGD(rank=args.rank, start_iter=start_iter, random_seed=0)
    model, _ = build_model(name)
    wrapped = co.wrap(model, bucket_size_mb=args.bucket_mb, compression=compression)
    setups[WRAP] = (wrapped, _optimizer(args, wrapped), batches)
    model, _ = build_model(name)
    wrapped = co.wrap(model, bucket_size_mb=args.bucket_mb, compression=compression)
    setups[OVERLAPPED] = (wrapped, _optimizer(args, wrapped, wrapped), batches)
    return setups


def _ddp_label(mb: float) -> str:
    return f"DDP {mb:g} MiB + powerSGD_hook"


def _final_losses(args, name: str, rank: int) -> dict[str, float]:
    """Each communicating setup trained ``--loss-steps`` steps on the same batches: the mean loss of the last
    10 steps, averaged over ranks."""
    from collective_ops.runtime import get_engine

    _, batch = build_model(name)
    gen = torch.Generator().manual_seed(1000 + rank)
    batches = [batch(gen) for _ in range(args.loss_steps)]
    losses = {}
    for key, (model, optimizer, _) in _setups(args, name, [], args.start_iter).items():
        if key in (COMPUTE_ALONE, SYNCED_FLOOR) or (key.startswith("DDP") and key != _ddp_label(args.loss_ddp_mb)):
            continue
        tail = []
        for x, y in batches:
            loss = nn.functional.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            tail = (tail + [loss.item()])[-10:]
        getattr(optimizer, "synchronize", lambda: None)()
        losses[key] = statistics.mean(tail)
    world = get_engine("torch").world_size
    summed = get_engine("torch").reduce_floats(list(losses.values()), "sum")
    return {key: value / world for key, value in zip(losses, summed)}


def rank_main(rank: int, world: int, port: int, args, queue) -> None:
    import collective_ops as co

    torch.set_num_threads(1)
    co.init("gloo", rank=rank, world_size=world, master_port=port)
    results = {}
    for name in args.models:
        losses = _final_losses(args, name, rank) if args.loss_steps else {}
        _, batch = build_model(name)
        gen = torch.Generator().manual_seed(rank)
        batches = [batch(gen) for _ in range(4)]
        setups = _setups(args, name, batches, start_iter=2)  # every timed step compressed (3 warm-up steps)
        times = alternate_steps(setups, args.rounds, args.block)
        ours = setups[WRAP][0]
        plan = ours.manager.plan
        results[name] = {
            "median_step_ms": {key: statistics.median(v) * 1e3 for key, v in times.items()},
            # compute alone from one setup's own steps (the plain model, no communication), timed in the alternation
            "compute_alone_ms": statistics.median(times[COMPUTE_ALONE]) * 1e3,
            # what one compressed step sent (factors and uncompressed gradients), and the gradients' own bytes
            "bytes_per_step": [ours.comm_stats()["bytes_per_step"], sum(b.nbytes for b in plan.buckets)],
            "loss": losses,
            "params_m": sum(p.numel() for p in ours.module.parameters()) / 1e6,
            "buckets": len(plan.buckets),
        }
        del setups
    co.barrier()
    co.shutdown()
    if rank == 0:
        queue.put(results)


def _report(args, results: dict) -> None:
    for name, r in results.items():
        ms = r["median_step_ms"]
        ddp = {k: v for k, v in ms.items() if k.startswith("DDP")}
        best = min(ddp, key=ddp.get) if ddp else None
        sent, full = r["bytes_per_step"]
        limit = physical_limit(ms, r["compute_alone_ms"], sent, args.world)
        r["wire_ms"] = limit.wire_ms
        uncompressed = physical_limit(ms, r["compute_alone_ms"], full, args.world).wire_ms
        print(
            f"  {name} ({r['params_m']:.1f}M params, {r['buckets']} buckets of {args.bucket_mb:g} MiB): "
            f"{limit.line('a compressed step')}; uncompressed {full / 2**20:.2f} MiB"
            + (f", {uncompressed:.0f} ms" if uncompressed is not None else "")
        )
        for key, value in sorted(ms.items(), key=lambda kv: kv[1]):
            ratio = f"  {value / ms[best]:.3f}x best DDP ({best})" if best and key != COMPUTE_ALONE else ""
            print(f"    {key:<40} {value:>7.1f} ms  {limit.column(value)}{ratio}")
        if r["loss"]:
            reference = r["loss"].get(_ddp_label(args.loss_ddp_mb))
            print(f"    training loss, mean of the last 10 of {args.loss_steps} steps (mean over ranks):")
            for key, value in r["loss"].items():
                versus = f"  {value / reference - 1:+.2%} against DDP" if reference else ""
                print(f"      {key:<40} {value:.4f}{versus}")


def _time_factor_products(args) -> int:
    """Thread CPU time of one step's factor products, torch's hook's ``bmm`` against the torch engine's ``bmm_``."""
    from collective_ops.comm.torch_engine import TorchEngine

    torch.set_num_threads(1)
    engine = TorchEngine.__new__(TorchEngine)  # (bmm_ needs no process group)

    def best_ms(products) -> float:
        runs = []
        for _ in range(5):
            start = time.thread_time()
            for _ in range(10):
                products()
            runs.append((time.thread_time() - start) / 10)
        return min(runs) * 1e3

    print(f"# factor products of one compressed step, rank {args.rank}, one thread, CPU ms (best of 5 x 10)")
    for name in args.models:
        model, _ = build_model(name)
        shapes = [(p.shape[0], p[0].numel()) for p in model.parameters() if p.dim() > 1]
        ms = [torch.randn(1, rows, cols) for rows, cols in shapes]
        ps = [torch.randn(1, rows, args.rank) for rows, _ in shapes]
        qs = [torch.randn(1, cols, args.rank) for _, cols in shapes]

        def hook_order(ms=ms, ps=ps, qs=qs):
            for m, p, q in zip(ms, ps, qs):
                torch.bmm(m, q, out=p)
                torch.bmm(m.transpose(1, 2), p, out=q)
                torch.bmm(p, q.transpose(1, 2), out=m)

        def engine_order(ms=ms, ps=ps, qs=qs):
            for m, p, q in zip(ms, ps, qs):
                engine.bmm_(p, m, q)
                engine.bmm_(q, m, p, transpose_a=True)
                engine.bmm_(m, p, q, transpose_b=True)

        hook, ours = best_ms(hook_order), best_ms(engine_order)
        print(
            f"  {name:<16} {len(shapes)} matrices: powerSGD_hook's bmm {hook:.1f} ms, engine {ours:.1f} ms "
            f"({hook / ours:.2f}x faster)"
        )
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--models", nargs="+", choices=MODELS, default=["transformer-5m"])
    parser.add_argument("--optimizer", choices=["sgd", "adamw"], default="sgd")
    parser.add_argument("--rank", type=int, default=4, help="PowerSGD's rank (torch: matrix_approximation_rank)")
    parser.add_argument("--start-iter", type=int, default=10, help="the loss phase's plain steps before compression")
    parser.add_argument("--loss-steps", type=int, default=300, help="steps of the loss phase (0: none)")
    parser.add_argument("--ddp-mb", type=float, nargs="+", default=[1, 5, 25], help="DDP bucket_cap_mb sweep")
    parser.add_argument("--loss-ddp-mb", type=float, default=25, help="the DDP bucket_cap_mb of the loss phase")
    parser.add_argument("--bucket-mb", type=float, default=25, help="wrap's bucket_size_mb")
    parser.add_argument(
        "--ddp-hook",
        choices=["torch", "serial"],
        default="serial",
        help="serial (default): torch's hook waited for inside the hook, so DDP's buckets reduce one after another; "
        "torch: the hook as torch ships it, which launches its later allreduces from Gloo's completion callbacks, "
        "where they cross another bucket's between ranks (seen here: gloo EnforceNotMet, an abort, with several "
        "buckets)",
    )
    parser.add_argument("--rounds", type=int, default=4, help="alternation rounds")
    parser.add_argument("--block", type=int, default=10, help="steps per configuration per round")
    parser.add_argument("--json")
    parser.add_argument(
        "--factor-products",
        action="store_true",
        help="only time, in this process on one thread, the three factor products of one compressed step of each "
        "model's gradient matrices (M Q, M^T P, P Q^T) as torch's hook forms them and as the engine does",
    )
    if parser.parse_known_args(argv)[0].factor_products:
        return _time_factor_products(parser.parse_args(argv))
    started = time.monotonic()
    outcome = run_benchmark(parser, argv, rank_main)
    if isinstance(outcome, int):
        return outcome
    args, results = outcome
    print(
        f"# powersgd_compare: {args.world} Gloo ranks, {where()}, {args.optimizer}, PowerSGD rank {args.rank}, "
        f"DDP's hook {args.ddp_hook}; "
        f"median step, {args.rounds} rounds x {args.block} steps alternating ({time.monotonic() - started:.0f} s)"
    )
    _report(args, results)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "where": where(), "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
