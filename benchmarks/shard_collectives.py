"""What the sharded optimizer's collectives cost on Gloo: allreduce, Gloo's reduce_scatter, all-to-all
(whole and in 1 MiB pieces per rank), all-gather (whole and in pieces) and point-to-point exchanges of the
same pieces (what the engine uses), for one buffer size: wall time and the process's CPU time.

    python benchmarks/shard_collectives.py --link 1gbit --mib 4
    python benchmarks/shard_collectives.py --link 1gbit --mib 21.3

The reasons behind ``TorchEngine.reduce_scatter_shard`` / ``all_gather_shard`` on Gloo. Median of
``--iters`` calls after one warm-up, rank 0's time (CPU: ``time.process_time``, every thread of the process).

On the emulated link (``--link``) a column adds each call's wire time: the bytes each rank sends, (n-1)/n of the
buffer (an allreduce twice that), at the link's rate.
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

from benchmarks.common import link_rate, link_seconds, run_benchmark, where  # noqa: E402
from collective_ops.tools.bench import bus_factor  # noqa: E402

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

    def exchange(sent_from, received_into, start: int, length: int) -> list:
        """Point-to-point, as ``TorchEngine._send_pieces``: ``sent_from(peer)`` to each peer."""
        works = []
        for peer in (r for r in range(world) if r != rank):
            works.append(dist.isend(sent_from(peer).narrow(0, start, length), dst=peer))
            works.append(dist.irecv(received_into.narrow(0, peer * shard + start, length), src=peer))
        return works

    def in_pieces(call) -> None:
        works = [call(start, min(step, shard - start)) for start in range(0, shard, step)]
        for work in works:
            for one in work if isinstance(work, list) else [work]:
                one.wait()

    calls = {
        "allreduce": lambda: dist.all_reduce(x),
        "reduce_scatter (Gloo's)": lambda: dist.reduce_scatter_tensor(mine.clone(), x),
        "all_to_all, whole": lambda: dist.all_to_all_single(received, x),
        "all_to_all, 1 MiB pieces": lambda: in_pieces(
            lambda s, n: dist.all_to_all(pieces(received, s, n), pieces(x, s, n), async_op=True)
        ),
        "point-to-point RS, pieces": lambda: in_pieces(
            lambda s, n: exchange(lambda peer: x.narrow(0, peer * shard, shard), received, s, n)
        ),
        "all_gather, whole": lambda: dist.all_gather_into_tensor(out, mine),
        "all_gather, 1 MiB pieces": lambda: in_pieces(
            lambda s, n: dist.all_gather(pieces(out, s, n), mine.narrow(0, s, n), async_op=True)
        ),
        "point-to-point AG, pieces": lambda: in_pieces(lambda s, n: exchange(lambda peer: mine, out, s, n)),
    }
    results = {}
    for name, call in calls.items():
        times, cpu = [], []
        for _ in range(args.iters + 1):
            dist.barrier()
            start, cpu_start = time.perf_counter(), time.process_time()
            call()
            times.append(time.perf_counter() - start)
            cpu.append(time.process_time() - cpu_start)
        results[name] = (statistics.median(times[1:]) * 1e3, statistics.median(cpu[1:]) * 1e3)
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
    nbytes = int(args.mib * 2**20 / 4) // args.world * args.world * 4
    print(f"  {'call':<28} {'wall':>8} {'CPU':>8}" + (f" {'wire':>8}" if link_rate() else "") + "  (ms)")
    for name, (wall, cpu) in results.items():
        # wire: the call's bytes from each rank at the link's rate: an allreduce's twice the others'
        seconds = link_seconds(bus_factor("allreduce" if name == "allreduce" else "allgather", args.world) * nbytes)
        print(f"  {name:<28} {wall:8.1f} {cpu:8.1f}" + (f" {seconds * 1e3:8.1f}" if seconds is not None else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
