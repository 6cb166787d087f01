"""GradientBucket and the bucket manager across real Gloo processes."""

from __future__ import annotations

import numpy as np
import pytest

from tests.harness import run_ranks


def tensors_for(rank: int, integer_valued: bool):
    import torch

    gen = torch.Generator().manual_seed(rank)
    # 200 fp32 tensors totalling 60 MiB and 200 fp16 tensors totalling 6 MiB
    sizes32 = [60 * 2**20 // 4 // 200] * 200
    sizes16 = [6 * 2**20 // 2 // 200] * 200
    out = []
    for n, dtype in [(s, torch.float32) for s in sizes32] + [(s, torch.float16) for s in sizes16]:
        t = torch.randn(n, generator=gen) * 8
        out.append((t.round() if integer_valued else t).to(dtype))
    return out


def bucket_checks(rank: int, world: int) -> dict:
    import torch

    import collective_ops as co

    integer_valued = world > 2  # 3-rank sums are exact only on integers (any summation order)
    fused = tensors_for(rank, integer_valued)
    reference = [t.clone() for t in fused]
    for t in reference:
        co.allreduce(t)  # per-tensor reference
    bucket = co.GradientBucket(bucket_size_mb=25)
    for t in fused:
        bucket.add(t)
    bucket.allreduce()
    out = {
        "num_collectives": bucket.num_collectives,
        "bitwise_equal": all(torch.equal(a, b) for a, b in zip(fused, reference)),
    }

    # avg, async, numpy arrays and non-contiguous tensors (copied into the buffer, written back in place)
    arrays = [np.full((3, 4), rank + 1.0, dtype=np.float32), np.arange(5, dtype=np.float32) * (rank + 1)]
    strided = torch.full((4, 4), float(rank + 1)).t()
    bucket = co.GradientBucket(bucket_size_mb=1, reduce_op="avg")
    for a in arrays:
        bucket.add(a)
    handle = bucket.allreduce(async_op=True)
    handle.wait()
    torch_bucket = co.GradientBucket(bucket_size_mb=1, reduce_op="max")
    torch_bucket.add(strided)
    torch_bucket.add(torch.ones(2) * rank)
    torch_bucket.allreduce()
    out["numpy_avg"] = [a.copy() for a in arrays]
    out["strided_max"] = strided.numpy().copy()
    out["numpy_collectives"] = bucket.num_collectives
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_gradient_bucket_matches_per_tensor_allreduce(world: int) -> None:
    for rank, out in enumerate(run_ranks(world, bucket_checks)):
        assert out["bitwise_equal"], f"rank {rank}: fused result differs from per-tensor allreduce"
        assert out["num_collectives"] == 3 + 1, "60 MiB fp32 at 25 MiB -> 3, 6 MiB fp16 -> 1"
        mean = sum(r + 1.0 for r in range(world)) / world
        np.testing.assert_array_equal(out["numpy_avg"][0], np.full((3, 4), mean, dtype=np.float32))
        np.testing.assert_allclose(out["numpy_avg"][1], np.arange(5) * mean, rtol=1e-7)
        np.testing.assert_array_equal(out["strided_max"], np.full((4, 4), float(world)))
        assert out["numpy_collectives"] == 1


def manager_checks(rank: int, world: int) -> dict:
    """Each rank leaves a different parameter unused; find_unused_parameters keeps ranks in step."""

    from collective_ops.bucketing import BucketManager, ParamSpec, plan_buckets
    from collective_ops.runtime import get_engine

    engine = get_engine("torch")
    params = [ParamSpec(f"p{i}", 256, "float32", "cpu", 4) for i in range(8)]
    plan = plan_buckets(params, bucket_size_mb=2048 / 2**20, first_bucket_mb=1024 / 2**20)
    manager = BucketManager(plan, engine, reduce_op="avg", find_unused_parameters=True)
    results = []
    for step in range(3):
        order = list(range(8)) if rank % 2 else list(reversed(range(8)))
        for i in order:
            if i == (rank + step) % 8:
                continue  # unused on this rank this step
            buffer, offset, numel = manager.param_segment(i)
            engine.segment(buffer, offset, numel).fill_(float((rank + 1) * (i + 1) + step))
            manager.mark_ready(i)
        manager.finalize()
        results.append([engine.segment(*manager.param_segment(i)).clone().numpy() for i in range(8)])
    return {"values": results, "unused": sorted(manager.globally_unused), "buckets": len(manager.plan.buckets)}


@pytest.mark.parametrize("world", [2, 3])
def test_manager_unused_parameters_across_ranks(world: int) -> None:
    outs = run_ranks(world, manager_checks)
    for step in range(3):
        for i in range(8):
            contributions = [(r + 1) * (i + 1) + step if i != (r + step) % 8 else 0.0 for r in range(world)]
            expected = np.float32(sum(np.float32(c) * np.float32(1 / world) for c in contributions))
            for out in outs:
                np.testing.assert_allclose(out["values"][step][i], np.full(256, expected), rtol=1e-6)
    assert all(out["unused"] == [] for out in outs)
    assert len({out["buckets"] for out in outs}) == 1
