"""Step time and peak memory: torch DistributedDataParallel against collective_ops.wrap.

Same model, same data, same world size, on CPU (Gloo) or one accelerator per rank (``--backend nccl``). Step time: both wrappers live in the same
processes and alternate in blocks of steps (so machine noise hits both alike); the
median step of each is reported with their ratio. Peak memory: each wrapper trains in
fresh processes and the growth of peak RSS over the unwrapped model is reported (on CPU
there is no allocator counter; on GPU/NPU the allocator's peak is used).

    python benchmarks/ddp_compare.py --world 2 --models transformer cnn --steps 30
    python benchmarks/ddp_compare.py --bucket-size-mb 5 --json out.json
    python benchmarks/ddp_compare.py --models mlp transformer --step-check-cost --no-memory

``--step-check-cost`` also times collective_ops with ``check_step_alignment=False`` in the same alternation:
the price of the per-step check that the ranks reduce the same iteration (one small all-reduce per step).

On the emulated link (``--link``) it also prints compute alone (the same model and optimizer, no wrapper and no
communication, a setup of the same alternation), the wire time at the link's rate of one step's bytes (as
``comm_stats()['bytes_per_step']`` counts them, wrap's) and each step as a multiple of max(compute, wire): its
distance to the physical limit (benchmarks/common.py ``physical_limit``).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from torch import nn  # noqa: E402

from benchmarks.common import (  # noqa: E402
    COMPUTE_ALONE,
    add_link_option,
    link_rate,
    physical_limit,
    reporting_node,
    run_on_link_if_asked,
    spawn,
    where,
)

MODELS = ("transformer", "cnn", "mlp", "transformer-5m")
UNCHECKED = "collective_ops_unchecked"  # check_step_alignment=False


def build_model(name: str) -> tuple[nn.Module, callable]:
    """A model and a batch factory (per rank, per step).

    ``transformer-5m`` (5.7M parameters, 23 MB of fp32 gradients) is the emulated-link workload:
    at 1gbit its allreduce (~185 ms) is as long as its compute (~190 ms on one core, batch 10 x 64
    tokens), the communication-bound regime.
    """
    torch.manual_seed(0)
    if name in ("transformer", "transformer-5m"):
        vocab, dim, seq, layers, ffn = (8000, 512, 64, 6, 2048) if name == "transformer" else (5000, 256, 64, 4, 1024)
        layer = nn.TransformerEncoderLayer(dim, 8, ffn, dropout=0.0, batch_first=True)

        class LM(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.embed = nn.Embedding(vocab, dim)
                self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
                self.head = nn.Linear(dim, vocab)

            def forward(self, tokens):
                return self.head(self.encoder(self.embed(tokens))).flatten(0, 1)

        rows = 4 if name == "transformer" else 10  # transformer-5m: ~190 ms of compute per step on one core

        def batch(gen):
            tokens = torch.randint(0, vocab, (rows, seq), generator=gen)
            return tokens, torch.roll(tokens, -1, 1).flatten()

        return LM(), batch
    if name == "cnn":
        from examples.train_resnet import ResNet

        def batch(gen):
            return torch.randn(8, 3, 64, 64, generator=gen), torch.randint(0, 100, (8,), generator=gen)

        return ResNet((2, 2, 2, 2), num_classes=100), batch
    if name == "mlp":

        def batch(gen):
            return torch.randn(64, 1024, generator=gen), torch.randint(0, 10, (64,), generator=gen)

        return nn.Sequential(
            *[m for _ in range(8) for m in (nn.Linear(1024, 1024), nn.ReLU())], nn.Linear(1024, 10)
        ), batch
    raise ValueError(f"unknown model {name!r}; use one of {MODELS}")


def wrap_with(kind: str, model: nn.Module, bucket_size_mb: float) -> nn.Module:
    if kind == COMPUTE_ALONE:  # no wrapper, no communication: the compute that bounds every step
        return model
    if kind == "ddp":
        return nn.parallel.DistributedDataParallel(model, bucket_cap_mb=bucket_size_mb)
    import collective_ops as co

    return co.wrap(model, bucket_size_mb=bucket_size_mb, check_step_alignment=kind != UNCHECKED)


def one_step(model, optimizer, batch, clock=time.perf_counter) -> float:
    """One training step's seconds on ``clock`` (``time.process_time``: the CPU time of this process's threads)."""
    x, y = batch
    start = clock()
    loss = nn.functional.cross_entropy(model(x), y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    _sync(x.device)  # on GPU/NPU the step ends when its kernels do
    return clock() - start


def _sync(device: torch.device) -> None:
    from collective_ops.tools.bench import _sync as sync_device

    sync_device(device)


def training_setup(name: str, kind: str, bucket_size_mb: float, rank: int, device: str = "cpu") -> tuple:
    """(wrapped model, SGD optimizer, this rank's 4 batches) for ``kind`` "ddp", "collective_ops" or
    ``COMPUTE_ALONE`` (the model unwrapped)."""
    model, batch = build_model(name)
    wrapped = wrap_with(kind, model.to(device), bucket_size_mb)
    gen = torch.Generator().manual_seed(rank)
    batches = [tuple(t.to(device) for t in batch(gen)) for _ in range(4)]
    return wrapped, torch.optim.SGD(wrapped.parameters(), lr=1e-3), batches


MAX_SETTLING_STEPS = 60


def alternate_steps(setups: dict, rounds: int, block: int, warmup: int = 3, clock=time.perf_counter) -> dict:
    """Step times of every setup, alternating in blocks of ``block`` steps, the order reversed every round.

    Machine noise then hits every setup alike. Each step's time is the slowest rank's progress
    through its block (:func:`slowest_rank_steps`; reduced once at the end: a collective per step
    would wait for communication a setup leaves in flight, as a DistributedOptimizer does until
    the next forward). A setup whose optimizer has
    ``synchronize()`` finishes its in-flight work at the end of each block, inside the block's
    last step, so none of it spills into the next setup's time. Warm-up steps first (they
    include collective_ops' bucket rebuild after step 1 and an "auto" bucket size settling, and last
    while an optimizer says it is ``settling``: a DistributedOptimizer trying launch orders).
    """
    from collective_ops.runtime import get_engine

    for wrapped, optimizer, batches in setups.values():
        for i in range(warmup):
            one_step(wrapped, optimizer, batches[i % len(batches)])
        for i in range(MAX_SETTLING_STEPS):  # a DistributedOptimizer choosing its launch order: warm-up too
            if not getattr(optimizer, "settling", False):
                break
            one_step(wrapped, optimizer, batches[i % len(batches)])
        finish_block(optimizer)
    times = {key: [] for key in setups}
    keys = list(setups)
    for round_ in range(rounds):
        for key in keys if round_ % 2 == 0 else keys[::-1]:
            wrapped, optimizer, batches = setups[key]
            for i in range(block):
                seconds = one_step(wrapped, optimizer, batches[i % len(batches)], clock)
                if i == block - 1:
                    start = clock()
                    finish_block(optimizer)
                    seconds += clock() - start
                times[key].append(seconds)
    engine = get_engine("torch")
    return {key: slowest_rank_steps(values, block, engine) for key, values in times.items()}


def slowest_rank_steps(seconds: list[float], block: int, engine) -> list[float]:
    """Step times (blocks of ``block`` steps, this rank's ``seconds``) as the slowest rank's progress.

    Within a block, the time to finish step j is the largest over ranks of the time each rank
    took for steps 1..j; a step's time is its increase. The block's steps then add up to its
    slowest rank's time, its wall time. The largest of each step over ranks does not: where ranks
    take a wait in different steps (a DistributedOptimizer's forward waits for the link, one
    rank in step j, its peer in step j+1), it counts both waits, and a 256 ms step on each rank
    (medians of each rank's own step times) read as 290 ms (emulated link, 1gbit, transformer-5m).
    Where ranks move in step, as DDP's do, it is each step's largest time.
    """
    elapsed = [sum(seconds[start : start + j + 1]) for start in range(0, len(seconds), block) for j in range(block)]
    slowest = engine.reduce_floats(elapsed, "max")
    return [slowest[i] - (slowest[i - 1] if i % block else 0.0) for i in range(len(slowest))]


def finish_block(optimizer) -> None:
    synchronize = getattr(optimizer, "synchronize", None)
    if synchronize is not None:
        synchronize()


def time_rank(rank: int, world: int, port: int, args, queue) -> None:
    import collective_ops as co

    torch.set_num_threads(args.threads)
    device = co.init(args.backend, rank=rank, world_size=world, master_port=port).device
    results = {}
    kinds = ("ddp", "collective_ops") + ((UNCHECKED,) if args.step_check_cost else ())
    kinds += (COMPUTE_ALONE,) if link_rate() else ()  # on the link: the step's physical limit
    for name in args.models:
        setups = {kind: training_setup(name, kind, args.bucket_size_mb, rank, device) for kind in kinds}
        times = alternate_steps(setups, max(args.steps // args.block, 1), args.block)
        results[name] = {
            kind: {"median_step_ms": statistics.median(v) * 1e3, "steps": len(v)} for kind, v in times.items()
        }
        stats = setups["collective_ops"][0].comm_stats()
        results[name]["collective_ops"].update(buckets=stats["buckets"], bytes_per_step=stats["bytes_per_step"])
        results[name]["params_m"] = sum(p.numel() for p in setups["ddp"][0].parameters()) / 1e6
    co.barrier()
    co.shutdown()
    if rank == 0:
        queue.put(results)


def memory_rank(rank: int, world: int, port: int, args, kind: str, name: str, queue) -> None:
    import collective_ops as co

    torch.set_num_threads(args.threads)
    device = torch.device(co.init(args.backend, rank=rank, world_size=world, master_port=port).device)
    model, batch = build_model(name)
    model.to(device)
    gen = torch.Generator().manual_seed(rank)
    data = [tuple(t.to(device) for t in batch(gen)) for _ in range(2)]
    accelerator = None if device.type == "cpu" else getattr(torch, device.type)

    def peak_kib() -> int:  # the allocator's peak on GPU/NPU, the process's peak RSS on CPU
        if accelerator is not None:
            return accelerator.max_memory_allocated(device) // 1024
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss

    baseline = peak_kib()
    plain_opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    for i in range(2):  # the unwrapped model's own peak: activations, gradients
        x, y = data[i]
        nn.functional.cross_entropy(model(x), y).backward()
        plain_opt.zero_grad(set_to_none=True)
    before = peak_kib()
    wrapped = wrap_with(kind, model, args.bucket_size_mb)
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=1e-3)
    for i in range(4):
        one_step(wrapped, optimizer, data[i % 2])
    after = peak_kib()
    co.barrier()
    co.shutdown()
    if rank == 0:
        queue.put(
            {
                "peak_rss_mb": after / 1024,
                "growth_over_unwrapped_mb": (after - before) / 1024,
                "base_mb": baseline / 1024,
            }
        )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--models", nargs="+", choices=MODELS, default=["transformer", "cnn"])
    parser.add_argument("--steps", type=int, default=30, help="timed steps per wrapper")
    parser.add_argument("--block", type=int, default=5, help="steps per alternation block")
    parser.add_argument("--bucket-size-mb", type=float, default=25.0)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument(
        "--backend", default="gloo", help="gloo (CPU, the default), nccl (one GPU per rank) or hccl (one NPU per rank)"
    )
    parser.add_argument("--no-memory", action="store_true")
    parser.add_argument(
        "--step-check-cost", action="store_true", help="also time collective_ops with check_step_alignment=False"
    )
    parser.add_argument("--json")
    add_link_option(parser)
    args = parser.parse_args(argv)
    relaunched = run_on_link_if_asked(args, argv)
    if relaunched is not None:
        return relaunched
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))

    results = spawn(time_rank, args.world, args)
    if not args.no_memory:
        for name in args.models:
            for kind in ("ddp", "collective_ops"):
                memory = spawn(memory_rank, args.world, args, kind, name)
                if reporting_node():
                    results[name][kind].update(memory)
    if not reporting_node():
        return 0
    print(
        f"# ddp_compare: world {args.world}, {args.backend}, {where()}, bucket_size_mb={args.bucket_size_mb:g}, "
        f"{args.steps} timed steps each"
    )
    print(
        f"# {'model':<12} {'params':>8} {'DDP ms':>9} {'ours ms':>9} {'time ratio':>10} {'DDP +MB':>9} {'ours +MB':>9} {'mem ratio':>9}"
    )
    for name in args.models:
        r = results[name]
        ddp, ours = r["ddp"], r["collective_ops"]
        ratio = ours["median_step_ms"] / ddp["median_step_ms"]
        line = f"  {name:<12} {r['params_m']:>7.1f}M {ddp['median_step_ms']:>9.1f} {ours['median_step_ms']:>9.1f} {ratio:>10.3f}"
        if "growth_over_unwrapped_mb" in ddp:
            dm, om = ddp["growth_over_unwrapped_mb"], ours["growth_over_unwrapped_mb"]
            line += f" {dm:>9.1f} {om:>9.1f} {om / dm if dm > 0 else float('nan'):>9.3f}"
        print(line)
        if UNCHECKED in r:
            unchecked = r[UNCHECKED]["median_step_ms"]
            print(
                f"    step-alignment check: {ours['median_step_ms']:.2f} ms with it, {unchecked:.2f} ms without "
                f"(ratio {ours['median_step_ms'] / unchecked:.3f})"
            )
        if COMPUTE_ALONE in r:
            steps = {kind: r[kind]["median_step_ms"] for kind in r if kind not in (COMPUTE_ALONE, "params_m")}
            limit = physical_limit(steps, r[COMPUTE_ALONE]["median_step_ms"], ours["bytes_per_step"], args.world)
            print("\n".join(limit.lines(whose="collective_ops")))
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "where": where(), "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
