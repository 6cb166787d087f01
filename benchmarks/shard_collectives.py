"""What the sharded optimizer's collectives cost on Gloo: allreduce, Gloo's reduce_scatter, all-to-all
(whole and in 1 MiB pieces per rank) and all-gather (whole and in pieces), for one buffer size.

    python benchmarks/shard_collectives.py --link 1gbit --mib 4
    python benchmarks/shard_collectives.py --link 1gbit --mib 21.3

The reasons behind ``TorchEngine.reduce_scatter_shard`` / ``all_gather_shard`` on Gloo. Median of
``--iters`` calls after one warm-up, rank 0's time.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from benchmarks.common import run_benchmark, where  # noqa: E402

PIECE_BYTES = 1 << 20


def rank_main(rank: int, world: int, port: int, args, queue) -> None:
    import collective_ops as co

    torch.set_num_threads(1)
    co.init("gloo", rank=rank, world_size=world, master_port=port)
    numel = int(args.mib * 2**20 / 4) // world * world
    shard = numel // world
    x, received, out = torch.randn(numel), torch.empty(numel), torch.empty(numel)
    mine = x.narrow(0, rank * shard, shard)
    step = PIECE_BYTES // 4

    def pieces(buffer: torch.Tensor, start: int, length: int) -> list[torch.Tensor]:
        return [buffer.narrow(0, r * shard + start, length) for r in range(world)]

    def in_pieces(call) -> None:
        works = [call(start, min(step, shard - start)) for start in range(0, shard, step)]
        for work in works:
            work.wait()

    calls = {
        "allreduce": lambda: dist.all_reduce(x),
        "reduce_scatter (Gloo's)": lambda: dist.reduce_scatter_tensor(mine.clone(), x),
        "all_to_all, whole": lambda: dist.all_to_all_single(received, x),
        "all_to_all, 1 MiB pieces": lambda: in_pieces(
            lambda s, n: dist.all_to_all(pieces(received, s, n), pieces(x, s, n), async_op=True)
        ),
        "all_gather, whole": lambda: dist.all_gather_into_tensor(out, mine),
        "all_gather, 1 MiB pieces": lambda: in_pieces(
            lambda s, n: dist.all_gather(pieces(out, s, n), mine.narrow(0, s, n), async_op=True)
        ),
    }
    results = {}
    for name, call in calls.items():
        times = []
        for _ in range(args.iters + 1):
            dist.barrier()
            start = time.perf_counter()
            call()
            times.append(time.perf_counter() - start)
        results[name] = statistics.median(times[1:]) * 1e3
    co.barrier()
    co.shutdown()
    if rank == 0:
        queue.put(results)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--mib", type=float, default=4.0, help="buffer size in MiB (fp32)")
    parser.add_argument("--iters", type=int, default=5)
    outcome = run_benchmark(parser, argv, rank_main)
    if isinstance(outcome, int):
        return outcome
    args, results = outcome
    print(f"# shard_collectives: {args.world} Gloo ranks, {where()}, {args.mib:g} MiB fp32, median of {args.iters}")
    for name, ms in results.items():
        print(f"  {name:<28} {ms:8.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
