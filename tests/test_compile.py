"""torch.compile(co.wrap(model)) against torch.compile(DDP(model)) on real Gloo ranks."""

from __future__ import annotations

from tests.harness import run_ranks
from tests.reference import assert_identical


def compiled_checks(rank: int, world: int) -> dict:
    import torch
    import torch._dynamo as dynamo

    import collective_ops as co
    from tests.models import MLP, build, rank_batch

    out = {}
    for kind in ("ddp", "ours"):
        dynamo.reset()
        model = build("mlp")
        wrapped = (
            torch.nn.parallel.DistributedDataParallel(model) if kind == "ddp" else co.wrap(model, bucket_size_mb=0.01)
        )
        compiled = torch.compile(wrapped)
        optimizer = torch.optim.SGD(wrapped.parameters(), lr=0.1, momentum=0.9)
        for step in range(5):
            x, y = rank_batch(MLP, step, rank)
            loss = torch.nn.functional.cross_entropy(compiled(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        out[kind] = {k: v.detach().clone().numpy() for k, v in model.state_dict().items()}
        if kind == "ours":
            out["steps"] = wrapped.comm_stats()["steps"]
    return out


def test_compiled_wrap_equals_compiled_ddp_after_five_steps() -> None:
    for rank, out in enumerate(run_ranks(2, compiled_checks, timeout=600)):
        assert_identical(out["ours"], out["ddp"], f"compiled wrap vs compiled DDP, rank {rank}")
        assert out["steps"] == 5  # every compiled step was reduced by the bucket manager
