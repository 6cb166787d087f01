"""MindSpore under msrun (2 workers, CPU/MCCL): primitives against numpy."""

from __future__ import annotations

import numpy as np

from tests.msrun_harness import requires_mindspore, run_msrun
from tests.reference import OPS, check_allreduce

pytestmark = requires_mindspore


def test_primitives_match_numpy() -> None:
    results = run_msrun("primitives.py", world=2)
    world = 2
    for rank, out in enumerate(results):
        assert (out["framework"], out["backend"], out["world"]) == ("mindspore", "mccl", world)
        for dtype in ("float32", "float16", "bfloat16", "int64"):
            for op in OPS:
                if op == "avg" and dtype == "int64":
                    continue
                check_allreduce(np.array(out[f"allreduce/{dtype}/{op}"]), world, dtype, op)
                assert out[f"inplace/{dtype}/{op}"], "allreduce must return the tensor it reduced in place"
        assert out["async"] == [1.5] * 3 and out["async_completed"]
        np.testing.assert_array_equal(out["broadcast"], np.full((4, 2), 10.0))
        expected_gather = np.concatenate([np.arange(6).reshape(2, 3) + 100 * r for r in range(world)])
        np.testing.assert_array_equal(out["allgather"], expected_gather)
        np.testing.assert_array_equal(out["allgather_async"], expected_gather)
        full_sum = sum(np.arange(world * 4) * (r + 1) for r in range(world))
        np.testing.assert_array_equal(out["reduce_scatter"], full_sum[rank * 4 : rank * 4 + 4])
        np.testing.assert_array_equal(
            out["reduce_scatter_max"], (np.arange(world * 4) * world)[rank * 4 : rank * 4 + 4]
        )
        assert out["numpy_inplace"] == [True, [[3.0, 3.0], [3.0, 3.0]]]
        assert out["bucket_equal"], "fused GradientBucket result differs from per-tensor allreduce"
        # fp32 in add order at 100 KiB: [40 B + 8 KB], [120 KB alone: over the cap], [20 B]; fp16: one
        assert out["bucket_collectives"] == 4
        errors = out["errors"]
        assert "median" in errors["unknown_op"]
        assert "floating" in errors["int_avg"]
        assert "multiple of the world size" in errors["reduce_scatter_shape"]
        assert "0..1" in errors["bad_src"]
