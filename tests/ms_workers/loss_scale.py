"""msrun worker: mixed-precision steps with a dynamic loss scale, collective_ops' reducer against MindSpore's.

The reference is ``nn.TrainOneStepWithLossScaleCell`` built under ``parallel_mode=DATA_PARALLEL``
(its DistributedGradReducer, its overflow flag summed over ranks); MindSpore's CPU build has no
float-status kernel (``NPUGetFloatStatusV2``, ``FloatStatus``), so the reference checks the reduced
gradients with ``IsFinite`` instead, as its GPU path does with ``FloatStatus``. Ours is
``collective_ops.mindspore.TrainOneStepWithLossScaleCell``, with hooks (PyNative,
``overlap=True``), the compiled after-backward reduction (PyNative, ``overlap=False``) and the
in-graph reduction (GRAPH). At step ``OVERFLOW_STEP`` the last rank's batch holds an inf: every rank
must skip that step and halve the scale, the other rank although its own gradients were finite.
"""

from __future__ import annotations

import sys

import mindspore as ms
import numpy as np
from mindspore import nn, ops

import collective_ops as co
from collective_ops.mindspore import TrainOneStepWithLossScaleCell
from tests.ms_workers.nets import batch, build, loss_fn
from tests.msrun_harness import write_result

MODE = sys.argv[1]
STEPS = 6
OVERFLOW_STEP = 2
ms.set_context(mode=ms.PYNATIVE_MODE if MODE == "pynative" else ms.GRAPH_MODE)
ctx = co.init()
rank, world = ctx.rank, ctx.world_size
out: dict = {"mode": MODE}


class ReferenceCell(nn.TrainOneStepWithLossScaleCell):
    """MindSpore's cell; on CPU its overflow check is all(IsFinite) of the reduced gradients, summed over ranks."""

    def get_overflow_status(self, status, compute_output):
        finite = ops.stack([ops.IsFinite()(grad).all() for grad in compute_output]).all()
        overflowed = 1.0 - finite.astype(ms.float32)
        return self.allreduce(overflowed) > 0.5


def scale_cell() -> nn.Cell:
    return nn.DynamicLossScaleUpdateCell(loss_scale_value=2.0**10, scale_factor=2, scale_window=2)


def batch_at(step: int):
    x, y = batch(step, rank)
    if step == OVERFLOW_STEP and rank == world - 1:
        values = x.asnumpy()
        values[0, 0, 0, 0] = np.inf
        x = ms.Tensor(values)
    return x, y


def run(cell: nn.Cell, network: nn.Cell) -> dict:
    steps = []
    for step in range(STEPS):
        loss, overflow, scale = cell(*batch_at(step))
        steps.append((float(loss.asnumpy()), bool(overflow.asnumpy()), float(scale.asnumpy())))
    return {"steps": steps, "weights": {p.name: p.asnumpy().tolist() for p in network.trainable_params()}}


def momentum(network: nn.Cell) -> nn.Optimizer:
    return nn.Momentum(network.trainable_params(), 0.1, 0.9)


# MindSpore's own data parallel: its cell under DATA_PARALLEL builds a DistributedGradReducer
ms.set_auto_parallel_context(parallel_mode=ms.ParallelMode.DATA_PARALLEL, gradients_mean=True)
reference = build(0)
with_loss = nn.WithLossCell(reference, loss_fn)
out["reference"] = run(ReferenceCell(with_loss, momentum(with_loss), scale_sense=scale_cell()), reference)
ms.reset_auto_parallel_context()

# ours, on each path this mode has: every rank starts from its own weights (wrap broadcasts rank 0's)
paths = {"hooks": True, "after backward": False} if MODE == "pynative" else {"in graph": False}
for path, overlap in paths.items():
    wrapped = co.wrap(build(rank), bucket_size_mb=0.002, first_bucket_mb=0.001, overlap=overlap)
    with_loss = nn.WithLossCell(wrapped.network, loss_fn)
    cell = TrainOneStepWithLossScaleCell(with_loss, momentum(with_loss), wrapped, scale_sense=scale_cell())
    out[path] = run(cell, wrapped.network)
    out[path]["mode"] = wrapped.comm_stats()["mode"]
    co.barrier()

write_result(rank, out)
