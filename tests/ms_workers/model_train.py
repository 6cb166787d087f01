"""msrun worker: ``mindspore.train.Model.train`` with collective_ops' reduction, against ``Model`` under
MindSpore's own data-parallel context (its DistributedGradReducer), in the mode given as argv[1].

The reference builds ``Model(net, loss_fn, optimizer)`` with ``parallel_mode=DATA_PARALLEL``; ours
builds ``Model(TrainOneStepCell(WithLossCell(wrapped.network, loss_fn), optimizer, wrapped))`` with
the parallel context reset, so MindSpore's reducer is not involved. Rank 0 alone writes a checkpoint
(``ModelCheckpoint``), which is then loaded with MindSpore's own API only.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import mindspore as ms
import numpy as np
from mindspore import nn
from mindspore.train import CheckpointConfig, LossMonitor, Model, ModelCheckpoint

import collective_ops as co
from collective_ops.mindspore import TrainOneStepCell
from tests.ms_workers.nets import batch, build, loss_fn
from tests.msrun_harness import write_result

MODE = sys.argv[1]
STEPS = 3
BUCKET_MB, FIRST_MB = 0.002, 0.001  # several buckets
ms.set_context(mode=ms.PYNATIVE_MODE if MODE == "pynative" else ms.GRAPH_MODE)
ctx = co.init()
rank, world = ctx.rank, ctx.world_size
out: dict = {"mode": MODE}


def dataset() -> ms.dataset.Dataset:
    """This rank's shard: the STEPS batches of 4 that adapter.py's loops use."""
    batches = [batch(step, rank) for step in range(STEPS)]
    x = np.concatenate([b[0].asnumpy() for b in batches])
    y = np.concatenate([b[1].asnumpy() for b in batches])
    return ms.dataset.NumpySlicesDataset({"x": x, "y": y}, shuffle=False).batch(4)


def weights(net) -> dict:
    return {p.name: p.asnumpy().tolist() for p in net.trainable_params()}


# 1. MindSpore's own data parallel: Model(net, loss_fn, optimizer) builds its DistributedGradReducer
ms.set_auto_parallel_context(parallel_mode=ms.ParallelMode.DATA_PARALLEL, gradients_mean=True)
reference = build(0)
Model(reference, loss_fn, nn.Momentum(reference.trainable_params(), 0.1, 0.9)).train(
    1, dataset(), callbacks=[LossMonitor(1)], dataset_sink_mode=False
)
out["reference"] = weights(reference)
ms.reset_auto_parallel_context()

# 2. ours: every rank starts from its own weights (wrap broadcasts rank 0's), rank 0 checkpoints
wrapped = co.wrap(build(rank), bucket_size_mb=BUCKET_MB, first_bucket_mb=FIRST_MB, overlap=MODE == "pynative")
with_loss = nn.WithLossCell(wrapped.network, loss_fn)
train_cell = TrainOneStepCell(with_loss, nn.Momentum(with_loss.trainable_params(), 0.1, 0.9), wrapped)
out["reducer"] = type(train_cell.grad_reducer).__name__
directory = Path(os.environ["COLLECTIVE_OPS_TEST_OUT"]) / f"checkpoints-rank{rank}"  # what each rank wrote
callbacks = [LossMonitor(1)]
if rank == 0:
    callbacks.append(
        ModelCheckpoint("net", str(directory), CheckpointConfig(save_checkpoint_steps=STEPS, keep_checkpoint_max=1))
    )
Model(train_cell).train(1, dataset(), callbacks=callbacks, dataset_sink_mode=False)
out["ours"] = weights(wrapped.network)
out["steps_reduced"] = wrapped.comm_stats()["steps"]

# 2b. Model.fit (train with evaluation after each epoch) with the same cell
fitted = co.wrap(build(rank), bucket_size_mb=BUCKET_MB, first_bucket_mb=FIRST_MB, overlap=MODE == "pynative")
with_loss = nn.WithLossCell(fitted.network, loss_fn)
fit_cell = TrainOneStepCell(with_loss, nn.Momentum(with_loss.trainable_params(), 0.1, 0.9), fitted)
evaluated = Model(
    fit_cell,
    eval_network=nn.WithEvalCell(fitted.network, loss_fn),
    metrics={"loss": nn.Loss(), "accuracy": nn.Accuracy()},
    eval_indexes=[0, 1, 2],  # (loss, logits, label) of WithEvalCell
)
evaluated.fit(1, dataset(), valid_dataset=dataset(), callbacks=[LossMonitor(1)], dataset_sink_mode=False)
out["fit"] = weights(fitted.network)
co.barrier()

# 3. the checkpoint: written by rank 0 only, loadable with MindSpore's API into a plain network
files = sorted(directory.glob("*.ckpt")) if directory.exists() else []
out["checkpoint_files"] = [f.name for f in files]
if files:
    plain = build(7)
    not_loaded, _ = ms.load_param_into_net(plain, ms.load_checkpoint(str(files[-1])))
    out["not_loaded"] = list(not_loaded)
    out["loaded"] = weights(plain)

write_result(rank, out)
