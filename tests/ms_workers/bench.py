"""msrun worker: the benchmark sweep on MindSpore communication (checked by tests/test_mindspore.py)."""

from __future__ import annotations

from dataclasses import asdict

import mindspore as ms

import collective_ops as co
from collective_ops.tools.bench import OPS, run_sweep_mindspore
from tests.msrun_harness import write_result

ms.set_context(mode=ms.PYNATIVE_MODE)
ctx = co.init()
rows = {op: [asdict(r) for r in run_sweep_mindspore(op, [64, 4096], warmup=1, iters=2, rounds=1)] for op in OPS}
write_result(ctx.rank, rows)
