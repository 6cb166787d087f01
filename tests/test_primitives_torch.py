"""Primitives across real Gloo processes (2 and 3 ranks) against a numpy reference."""

from __future__ import annotations

import numpy as np
import pytest

from tests.harness import run_ranks
from tests.reference import OPS, check_allreduce, check_gather_and_scatter, collect_errors, rank_input

DTYPES = ["float32", "float16", "bfloat16", "int64"]


def primitive_checks(rank: int, world: int) -> dict:
    import torch
    import torch.distributed as dist

    import collective_ops as co

    out: dict = {}
    for dtype in DTYPES:
        for op in OPS:
            if op == "avg" and dtype == "int64":
                continue
            t = torch.from_numpy(rank_input(rank, op)).to(getattr(torch, dtype))
            returned = co.allreduce(t, op=op)
            assert returned is t, "allreduce must work in place and return its tensor"
            out[("allreduce", dtype, op)] = t.double().numpy()

    # torch ReduceOp values are accepted too
    t = torch.full((3,), float(rank + 1))
    co.allreduce(t, op=dist.ReduceOp.MAX)
    out["reduceop_enum"] = t.numpy()

    # async: a handle with wait() and is_completed()
    t = torch.full((1000,), float(rank + 1))
    handle = co.allreduce(t, op="avg", async_op=True)
    result = handle.wait()
    out["async_completed"] = handle.is_completed()
    out["async_result"] = result.numpy().copy()

    # broadcast from the last rank, in place, sync and async
    src = world - 1
    t = torch.full((4, 2), float(rank * 10), dtype=torch.float16)
    co.broadcast(t, src=src)
    out["broadcast"] = t.double().numpy()
    t = torch.full((3,), rank, dtype=torch.int64)
    co.broadcast(t, src=0, async_op=True).wait()
    out["broadcast_async"] = t.numpy()

    # allgather: concatenated along dim 0, in rank order
    piece = torch.arange(6, dtype=torch.float32).view(2, 3) + 100 * rank
    out["allgather"] = co.allgather(piece).numpy()
    out["allgather_async"] = co.allgather(piece.to(torch.bfloat16), async_op=True).wait().double().numpy()

    # reduce_scatter: this rank's chunk of the reduced tensor
    full = torch.arange(world * 4, dtype=torch.float32) * (rank + 1)
    out["reduce_scatter"] = co.reduce_scatter(full).numpy()
    out["reduce_scatter_max"] = co.reduce_scatter(full.view(world, 4), op="max", async_op=True).wait().numpy()
    out["reduce_scatter_avg"] = co.reduce_scatter(full, op="avg").numpy()

    # numpy arrays: shared memory, reduced in place
    arr = np.full((2, 2), rank + 1.0, dtype=np.float32)
    returned = co.allreduce(arr)
    out["numpy_inplace"] = (returned is arr, arr.copy())
    gathered = co.allgather(np.array([rank], dtype=np.int64))
    out["numpy_allgather"] = (type(gathered).__name__, gathered)

    # half-precision sums (at 2 Gloo ranks an all-gather and torch's add): bit-equal to Gloo's own allreduce,
    # over values from subnormals to overflow
    from collective_ops.runtime import get_engine

    gen = torch.Generator().manual_seed(rank)
    spread = torch.randn(20000, generator=gen) * torch.logspace(-9, 5, 20000)[torch.randperm(20000, generator=gen)]
    for dtype in (torch.float16, torch.bfloat16):
        x = spread.to(dtype)
        expected = x.clone()
        dist.all_reduce(expected)
        synced, launched = x.clone(), x.clone().view(100, 200)
        co.allreduce(synced)
        co.allreduce(launched, async_op=True).wait()
        averaged = x.clone()
        co.allreduce(averaged, op="avg")
        out[("half_sum", str(dtype))] = [t.reshape(-1).view(torch.int16).numpy() for t in (expected, synced, launched)]
        out[("half_avg", str(dtype))] = (
            (expected / world).view(torch.int16).numpy(),
            averaged.view(torch.int16).numpy(),
        )
    engine = get_engine("torch")

    out["shards"] = _shard_exchange_checks(engine, rank, world)

    # bad input: refused before any communication, with a message that says what to do
    cases = {
        "unknown_op": lambda: co.allreduce(torch.ones(2), op="median"),
        "non_contiguous": lambda: co.allreduce(torch.ones(4, 4).t()),
        "int_avg": lambda: co.allreduce(torch.ones(2, dtype=torch.int64), op="avg"),
        "reduce_scatter_shape": lambda: co.reduce_scatter(torch.ones(world * 2 + 1)),
        "bad_src": lambda: co.broadcast(torch.ones(2), src=world),
        "sparse": lambda: co.allreduce(torch.ones(2, 2).to_sparse()),
        "not_a_tensor": lambda: co.allreduce([1.0, 2.0]),
        "strided_numpy": lambda: co.allreduce(np.ones(3, dtype=np.float32)[::2]),
        "readonly_numpy": lambda: co.allreduce(np.frombuffer(b"\0" * 12, dtype=np.float32)),
    }
    out["errors"] = collect_errors(cases)
    return out


def _shard_exchange_checks(engine, rank: int, world: int) -> dict:
    """The sharded optimizer's reduce-scatter and all-gather (point-to-point on Gloo): a shard of one piece and of
    several 1 MiB pieces, two of each in flight at once, the all-gathers on a group of
    their own: every rank's sum in rank order (bit for bit) and every rank's shard in its place."""
    import torch
    import torch.distributed as dist

    gen = torch.Generator().manual_seed(100 + rank)
    sizes = {"one_piece": 1000 * world, "pieces": ((5 << 20) // 8) * world}  # 2.5 MiB fp32 shards: 3 pieces
    buffers = {name: torch.randn(numel, generator=gen) * 1e3 for name, numel in sizes.items()}
    everyone = {name: [torch.empty_like(b) for _ in range(world)] for name, b in buffers.items()}
    for name, buffer in buffers.items():
        dist.all_gather(everyone[name], buffer)
    originals = {name: b.clone() for name, b in buffers.items()}
    handles = [engine.reduce_scatter_shard(buffers[name], async_op=True) for name in sizes]
    group = engine.new_group()
    gathered = {name: torch.full((numel,), float("nan")) for name, numel in sizes.items()}
    for buffer in gathered.values():
        engine.shard_of(buffer).copy_(torch.arange(buffer.numel() // world) + 1e6 * rank)
    gathers = [engine.all_gather_shard(buffer, async_op=True, group=group) for buffer in gathered.values()]
    out = {}
    for name, handle, gather in zip(sizes, handles, gathers):
        shard = handle.wait()
        gather.wait()
        expected = everyone[name][0].clone()
        for part in everyone[name][1:]:
            expected += part
        shard_numel = sizes[name] // world
        mine = slice(rank * shard_numel, (rank + 1) * shard_numel)
        others = torch.ones(sizes[name], dtype=torch.bool)
        others[mine] = False
        out[name] = {
            "sum_bits_equal": torch.equal(shard.view(torch.int32), expected[mine].view(torch.int32)),
            "is_buffer_shard": shard.data_ptr() == buffers[name][mine].data_ptr(),
            "rest_unchanged": torch.equal(buffers[name][others], originals[name][others]),
            "gathered": torch.equal(
                gathered[name], torch.cat([torch.arange(shard_numel) + 1e6 * r for r in range(world)]).float()
            ),
        }
    dist.destroy_process_group(group)
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_primitives_match_numpy(world: int) -> None:
    results = run_ranks(world, primitive_checks)
    for rank, out in enumerate(results):
        for dtype in DTYPES:
            for op in OPS:
                if op == "avg" and dtype == "int64":
                    continue
                check_allreduce(out[("allreduce", dtype, op)], world, dtype, op)
        np.testing.assert_array_equal(out["reduceop_enum"], np.full(3, float(world)))
        assert out["async_completed"] is True
        np.testing.assert_array_equal(out["async_result"], np.full(1000, (world + 1) / 2, dtype=np.float32))
        np.testing.assert_array_equal(out["broadcast"], np.full((4, 2), (world - 1) * 10.0))
        np.testing.assert_array_equal(out["broadcast_async"], np.zeros(3))
        check_gather_and_scatter(out, rank, world)
        for name, checks in out["shards"].items():
            assert all(checks.values()), (rank, name, checks)
        np.testing.assert_array_equal(
            out["reduce_scatter_max"], (np.arange(world * 4) * world)[rank * 4 : rank * 4 + 4].reshape(1, 4)
        )
        full_sum = sum(np.arange(world * 4) * (r + 1) for r in range(world))
        np.testing.assert_allclose(out["reduce_scatter_avg"], full_sum[rank * 4 : rank * 4 + 4] / world, rtol=1e-7)
        same, arr = out["numpy_inplace"]
        assert same
        np.testing.assert_array_equal(arr, np.full((2, 2), sum(r + 1.0 for r in range(world)), dtype=np.float32))
        kind, gathered = out["numpy_allgather"]
        assert kind == "ndarray"
        np.testing.assert_array_equal(gathered, np.arange(world))
        for dtype in ("torch.float16", "torch.bfloat16"):
            expected, synced, launched = out[("half_sum", dtype)]
            np.testing.assert_array_equal(synced, expected, err_msg=f"{dtype} sum against Gloo's, rank {rank}")
            np.testing.assert_array_equal(launched, expected, err_msg=f"{dtype} async sum against Gloo's")
            np.testing.assert_array_equal(*out[("half_avg", dtype)], err_msg=f"{dtype} average against Gloo's")
        errors = out["errors"]
        assert "median" in errors["unknown_op"] and "sum" in errors["unknown_op"]
        assert "contiguous()" in errors["non_contiguous"]
        assert "floating" in errors["int_avg"]
        assert "multiple of the world size" in errors["reduce_scatter_shape"]
        assert f"0..{world - 1}" in errors["bad_src"]
        assert "to_dense()" in errors["sparse"]
        assert "cannot communicate a builtins.list" in errors["not_a_tensor"]
        assert "contiguous" in errors["strided_numpy"]
        assert "read-only" in errors["readonly_numpy"] and "a.copy()" in errors["readonly_numpy"]


@pytest.mark.parametrize(
    "message, transport",
    [
        ("Application timeout caused pair closure", True),  # Gloo, a peer blocked in another collective
        ("[../third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:40855", True),
        ("Timed out waiting 60000ms for send operation to complete", True),
        ("The size of tensor a (3) must match the size of tensor b (4)", False),  # a comm hook's own bug
    ],
)
def test_transport_failures_are_told_from_comm_hook_bugs(message: str, transport: bool) -> None:
    """What the stall and failure reports blame: Gloo's messages as seen in 2-rank runs, against a hook's error."""
    from collective_ops.comm.torch_engine import TorchEngine

    assert TorchEngine.is_transport_error(RuntimeError(message)) is transport
