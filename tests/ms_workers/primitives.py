"""msrun worker: every primitive and GradientBucket on MindSpore tensors (checked by tests/test_mindspore.py)."""

from __future__ import annotations

import mindspore as ms
import numpy as np

import collective_ops as co
from tests.msrun_harness import write_result
from tests.reference import OPS, collect_errors, rank_input

ms.set_context(mode=ms.PYNATIVE_MODE)
ctx = co.init()  # msrun's environment: MindSpore communication
rank, world = ctx.rank, ctx.world_size
out: dict = {"framework": ctx.framework, "backend": ctx.backend, "world": world}


def as_list(t) -> list:
    return (t.astype(ms.float32) if t.dtype == ms.bfloat16 else t).asnumpy().astype(np.float64).tolist()


for dtype in ("float32", "float16", "bfloat16", "int64"):
    for op in OPS:
        if op == "avg" and dtype == "int64":
            continue
        t = ms.Tensor(rank_input(rank, op)).astype(getattr(ms, dtype))
        returned = co.allreduce(t, op=op)
        out[f"allreduce/{dtype}/{op}"] = as_list(t)
        out[f"inplace/{dtype}/{op}"] = returned is t

t = ms.Tensor(np.full((1000,), rank + 1.0, dtype=np.float32))
handle = co.allreduce(t, op="avg", async_op=True)
out["async"] = as_list(handle.wait())[:3]
out["async_completed"] = handle.is_completed()

t = ms.Tensor(np.full((4, 2), rank * 10.0, dtype=np.float16))
co.broadcast(t, src=world - 1)
out["broadcast"] = as_list(t)

piece = ms.Tensor(np.arange(6, dtype=np.float32).reshape(2, 3) + 100 * rank)
out["allgather"] = as_list(co.allgather(piece))
out["allgather_async"] = as_list(co.allgather(piece, async_op=True).wait())

full = ms.Tensor(np.arange(world * 4, dtype=np.float32) * (rank + 1))
out["reduce_scatter"] = as_list(co.reduce_scatter(full))
out["reduce_scatter_max"] = as_list(co.reduce_scatter(full, op="max"))

arr = np.full((2, 2), rank + 1.0, dtype=np.float32)
returned = co.allreduce(arr)
out["numpy_inplace"] = [returned is arr, arr.tolist()]

# GradientBucket on MindSpore tensors: fused result equals per-tensor allreduce
rng = np.random.default_rng(rank)
tensors = [ms.Tensor(rng.standard_normal(n).astype(np.float32)) for n in (10, 2000, 30_000, 5)]
tensors += [ms.Tensor(rng.standard_normal(n).astype(np.float16)) for n in (7, 300)]
reference = [t.copy() for t in tensors]
for t in reference:
    co.allreduce(t)
bucket = co.GradientBucket(bucket_size_mb=0.1)
for t in tensors:
    bucket.add(t)
bucket.allreduce()
out["bucket_equal"] = all(np.array_equal(a.asnumpy(), b.asnumpy()) for a, b in zip(tensors, reference))
out["bucket_collectives"] = bucket.num_collectives

out["errors"] = collect_errors(
    {
        "unknown_op": lambda: co.allreduce(ms.Tensor(np.ones(2, np.float32)), op="median"),
        "int_avg": lambda: co.allreduce(ms.Tensor(np.ones(2, np.int64)), op="avg"),
        "reduce_scatter_shape": lambda: co.reduce_scatter(ms.Tensor(np.ones(world * 2 + 1, np.float32))),
        "bad_src": lambda: co.broadcast(ms.Tensor(np.ones(2, np.float32)), src=world),
    }
)

write_result(rank, out)
