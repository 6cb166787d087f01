"""DDP's public switches, as loops ported from DDP use them, against torch DDP running the same loop.

nanoGPT accumulates by setting ``model.require_backward_grad_sync`` itself; Lightning accumulates under
``no_sync()``, evaluates on every rank under ``no_grad`` between steps, and calls
``torch.distributed.init_process_group`` before the model is wrapped (its launcher sets WORLD_SIZE, not RANK).
One rank group runs them all, on a process group made by the caller and adopted by ``co.init()``.
"""

from __future__ import annotations

import numpy as np

from tests.harness import free_port, run_ranks
from tests.reference import assert_identical

ACCUMULATE = 2


def _adopt_callers_group(rank: int, world: int, port: int) -> tuple:
    """Lightning's order: the harness's group let go of, the caller's made with only WORLD_SIZE in the
    environment, then ``co.init()`` (which wrap() calls too)."""
    import os

    import torch.distributed as dist

    import collective_ops as co

    co.shutdown()
    os.environ.pop("RANK", None)
    os.environ["WORLD_SIZE"] = str(world)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    context = co.init()
    return context.rank, context.world_size, context.backend


def _counting_allreduce(counter: list, bucket):
    """torch's allreduce hook (on the default group), counting the buckets reduced, on DDP and on ours alike."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    counter.append(1)
    return allreduce_hook(None, bucket)


def _nanogpt_loop(rank: int, model, steps: int = 5) -> tuple[dict, int]:
    """nanoGPT's accumulation: the flag set before each micro-step's forward, the step after the last."""
    import torch

    from tests.models import MLP, rank_batch
    from tests.reference import snapshot

    counter: list = []
    model.register_comm_hook(counter, _counting_allreduce)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(steps):
        for micro in range(ACCUMULATE):
            model.require_backward_grad_sync = micro == ACCUMULATE - 1
            x, y = rank_batch(MLP, ACCUMULATE * step + micro, rank)
            (torch.nn.functional.cross_entropy(model(x), y) / ACCUMULATE).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return snapshot(model.module), len(counter)


def _lightning_loop(rank: int, model, steps: int = 6, eval_every: int = 2) -> dict:
    """Lightning's pattern: accumulation under no_sync(), and every few steps an evaluation on every rank under
    no_grad (the model in eval mode, then back in train mode)."""
    import torch

    from tests.models import SmallCNN, rank_batch
    from tests.reference import snapshot

    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    states, outputs, losses = [], [], []
    for step in range(steps):
        for micro in range(ACCUMULATE):
            x, y = rank_batch(SmallCNN, ACCUMULATE * step + micro, rank)
            last = micro == ACCUMULATE - 1
            with torch.enable_grad() if last else model.no_sync():
                out = model(x)
                torch.nn.functional.cross_entropy(out, y).backward()
            outputs.append(out.detach().clone().numpy())
        optimizer.step()
        optimizer.zero_grad()
        if step % eval_every == eval_every - 1:
            model.eval()
            with torch.no_grad():
                total = 0.0
                for batch in range(2):
                    x, y = rank_batch(SmallCNN, 1000 + batch, rank)
                    out = model(x)
                    outputs.append(out.clone().numpy())
                    total += float(torch.nn.functional.cross_entropy(out, y))
            losses.append(total)
            model.train()
        states.append(snapshot(model.module))
    return {"states": states, "outputs": outputs, "eval_losses": np.array(losses)}


def switch_checks(rank: int, world: int, port: int) -> dict:
    import torch

    import collective_ops as co
    from tests.models import build

    out: dict = {"adopted": _adopt_callers_group(rank, world, port)}
    ddp = torch.nn.parallel.DistributedDataParallel(build("mlp"))
    ours = co.wrap(build("mlp"))
    out["nanogpt"] = (_nanogpt_loop(rank, ddp), _nanogpt_loop(rank, ours))
    out["nanogpt_steps_reduced"] = ours.manager.totals["steps"]
    ddp = torch.nn.parallel.DistributedDataParallel(build("cnn"))
    out["lightning"] = (_lightning_loop(rank, ddp), _lightning_loop(rank, co.wrap(build("cnn"))))
    return out


def test_ddp_switches_behave_as_in_ddp() -> None:
    results = run_ranks(2, switch_checks, free_port(), timeout=300)
    for rank, out in enumerate(results):
        # co.init() after the caller's init_process_group, with WORLD_SIZE but no RANK set: adopted
        assert out["adopted"] == (rank, 2, "gloo"), out["adopted"]

        # model.require_backward_grad_sync toggled per micro-step: reduced only where DDP reduces
        (ddp_weights, ddp_count), (our_weights, our_count) = out["nanogpt"]
        assert our_count == ddp_count == 5, (our_count, ddp_count)  # one bucket, reduced once per step
        assert out["nanogpt_steps_reduced"] == 5
        assert_identical(our_weights, ddp_weights, f"nanoGPT accumulation, rank {rank}")

        # buffers broadcast where DDP broadcasts them (once per accumulated step, before the first evaluation
        # forward): running statistics, outputs and evaluation losses as DDP's on every rank
        ddp, ours = out["lightning"]
        for step, (theirs, mine) in enumerate(zip(ddp["states"], ours["states"], strict=True)):
            assert_identical(mine, theirs, f"Lightning loop, rank {rank}, after step {step}")
        assert_identical(ours["outputs"], ddp["outputs"], f"Lightning loop outputs, rank {rank}")
        assert_identical(ours["eval_losses"], ddp["eval_losses"], f"Lightning loop evaluation, rank {rank}")
