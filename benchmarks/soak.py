"""Soak: a long run of a wrapped model; resident memory must not grow, nothing may leak on re-wrap.

    python benchmarks/soak.py --steps 1000 --world 2

Reports RSS at step 100 and at the last step (goal: growth < 1%), then wraps, trains and
deletes 20 more wrappers of the same model and reports hooks left on its parameters
(goal: 0) and RSS again.
"""

from __future__ import annotations

import argparse
import gc
import resource
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * resource.getpagesize() / 2**20


def rank_main(rank: int, world: int, port: int, args, queue) -> None:
    import torch

    import collective_ops as co
    from tests.models import MLP, build, rank_batch

    torch.set_num_threads(1)
    co.init("gloo", rank=rank, world_size=world, master_port=port)
    model = co.wrap(build("mlp"), bucket_size_mb=0.01)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    batches = [rank_batch(MLP, i, rank) for i in range(8)]
    marks = {}
    for step in range(1, args.steps + 1):
        x, y = batches[step % 8]
        loss = torch.nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step in (100, args.steps):
            gc.collect()
            marks[step] = rss_mb()
    plain = model.module
    model.remove_hooks()
    del model, optimizer
    for _ in range(20):  # wrap, train a step, delete
        wrapped = co.wrap(plain, bucket_size_mb=0.01)
        x, y = batches[0]
        torch.nn.functional.cross_entropy(wrapped(x), y).backward()
        plain.zero_grad(set_to_none=True)
        del wrapped
        gc.collect()
    hooks_left = sum(len(p._post_accumulate_grad_hooks or {}) for p in plain.parameters())
    marks["after_rewraps"] = rss_mb()
    co.barrier()
    co.shutdown()
    if rank == 0:
        queue.put({"rss_mb": marks, "hooks_left": hooks_left})


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--world", type=int, default=2)
    args = parser.parse_args(argv)
    if args.steps < 100:
        parser.error("--steps must be at least 100 (RSS is compared with step 100)")
    from benchmarks.common import spawn

    result = spawn(rank_main, args.world, args)
    rss = result["rss_mb"]
    growth = (rss[args.steps] - rss[100]) / rss[100] * 100
    print(f"# soak: {args.steps} steps, {args.world} Gloo ranks, MLP, Adam (rank 0)")
    print(
        f"  RSS at step 100: {rss[100]:.1f} MiB; at step {args.steps}: {rss[args.steps]:.1f} MiB; growth {growth:+.2f}%"
    )
    print(
        f"  after 20 wrap/train/delete cycles: RSS {rss['after_rewraps']:.1f} MiB; hooks left on parameters: {result['hooks_left']}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
