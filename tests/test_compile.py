"""torch.compile(co.wrap(model)) against torch.compile(DDP(model)) on real Gloo ranks, with a plain optimizer
and with DistributedOptimizer (unsharded and sharded; and co.wrap(torch.compile(model)))."""

from __future__ import annotations

from tests.harness import run_ranks
from tests.reference import assert_identical

STEPS = 6  # past the step where DistributedOptimizer's launch-order planner runs (SCHEDULE_AFTER_STEPS)
# (our wrapper, its optimizer): a plain SGD, or DistributedOptimizer with the same settings
SETUPS = ("ddp", "ours", "ours+DistributedOptimizer", "ours+DistributedOptimizer(shard=True)", "compiled inside ours")


def _setup(kind: str, model):
    """(what is called in the loop, the wrapper, the optimizer)."""
    import torch

    import collective_ops as co

    sgd = {"lr": 0.1, "momentum": 0.9}
    if kind == "ddp":
        wrapped = torch.nn.parallel.DistributedDataParallel(model)
        return torch.compile(wrapped), wrapped, torch.optim.SGD(wrapped.parameters(), **sgd)
    if kind == "compiled inside ours":
        wrapped = co.wrap(torch.compile(model), bucket_size_mb=0.01)
        return wrapped, wrapped, co.DistributedOptimizer(wrapped, torch.optim.SGD, **sgd)
    wrapped = co.wrap(model, bucket_size_mb=0.01)
    if kind == "ours":
        return torch.compile(wrapped), wrapped, torch.optim.SGD(wrapped.parameters(), **sgd)
    optimizer = co.DistributedOptimizer(wrapped, torch.optim.SGD, shard="shard=True" in kind, **sgd)
    return torch.compile(wrapped), wrapped, optimizer


def compiled_checks(rank: int, world: int) -> dict:
    import torch
    import torch._dynamo as dynamo
    from torch._dynamo.utils import counters

    from tests.models import MLP, build, rank_batch
    from tests.test_distributed_optimizer import peeking_forwards

    out = {}
    for kind in SETUPS:
        dynamo.reset()
        counters.clear()
        model = build("mlp")
        compiled, wrapped, optimizer = _setup(kind, model)
        for step in range(STEPS):
            x, y = rank_batch(MLP, step, rank)
            loss = torch.nn.functional.cross_entropy(compiled(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        out[kind] = {k: v.detach().clone().numpy() for k, v in model.state_dict().items()}
        out[f"{kind}/graphs"] = counters["stats"]["unique_graphs"]
        if kind != "ddp":
            out[f"{kind}/steps"] = wrapped.comm_stats()["steps"]
            out[f"{kind}/launch_order"] = wrapped.manager.launch_order
            out[f"{kind}/buckets"] = len(wrapped.manager.plan.buckets)
            out[f"{kind}/trial"] = getattr(optimizer, "schedule_trial", None)
            # the planner gave up on this plan (rank 0's forwards compiled), not retrying with a collective each step
            out[f"{kind}/planning"] = getattr(optimizer, "_plans_schedule", lambda: False)()
    # a compiled submodule in an eager forward, reading another branch's weight while the step's updates are owed
    for shard in (False, True):
        out[f"compiled submodule, shard={shard}"] = peeking_forwards(
            rank, "peek-across", "adamw", shard, compiled="left"
        )
    return out


def test_compiled_wrap_equals_compiled_ddp_with_each_optimizer() -> None:
    for rank, out in enumerate(run_ranks(2, compiled_checks, timeout=600)):
        for kind in SETUPS[1:]:
            assert_identical(out[kind], out["ddp"], f"{kind} compiled vs compiled DDP, rank {rank}")
            assert out[f"{kind}/steps"] == STEPS  # every compiled step was reduced by the bucket manager
            # one graph for the model: the optimizer's per-module hooks are not traced into it
            assert out[f"{kind}/graphs"] == out["ddp/graphs"] == 1, (kind, out[f"{kind}/graphs"])
        for kind in ("ours+DistributedOptimizer",):  # the planner, which times the forward by modules, keeps plan order
            assert out[f"{kind}/trial"] is None and not out[f"{kind}/planning"]
            assert out[f"{kind}/launch_order"] == tuple(range(out[f"{kind}/buckets"]))
        for shard in (False, True):  # its graph cannot wait at a read: every owed update landed before it ran
            (ddp, ddp_evaluations), (ours, our_evaluations) = out[f"compiled submodule, shard={shard}"]
            assert_identical(ours, ddp, f"a compiled submodule reading another's weight, shard={shard}, rank {rank}")
            assert len(our_evaluations) == len(ddp_evaluations) == (2 if rank == 0 else 0)
            for got, want in zip(our_evaluations, ddp_evaluations):
                assert (got == want).all(), f"shard={shard}: rank 0's evaluation differs from DDP's"
