"""msrun worker: ``Model(co.wrap(net), loss_fn, optimizer)`` (MindSpore's one-line form, with the wrapper as the
network) against ``Model(net, loss_fn, optimizer)`` under ``parallel_mode=DATA_PARALLEL``, in the mode given as
argv[1]; the forms that would train without a reduction, or cannot be shadowed by join(), refused.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import mindspore as ms
import numpy as np
from mindspore import nn
from mindspore.train import Model
from mindspore.train.loss_scale_manager import DynamicLossScaleManager, FixedLossScaleManager

import collective_ops as co
from collective_ops import runtime, tracing
from collective_ops.comm import mindspore_engine
from collective_ops.mindspore import TrainOneStepWithLossScaleCell
from tests.ms_workers.nets import batch, build, loss_fn
from tests.msrun_harness import write_result

MODE = sys.argv[1]
STEPS = 3
BUCKET_MB, FIRST_MB = 0.002, 0.001  # several buckets
# The compiled reduction sends gradients this large alone, the rest of a bucket concatenated: with these small
# networks' weights above it and their biases below, every path runs (fused groups, single members, buckets of
# gradients sent alone only). Restored at the end: the parts after this one in the same process reduce at the
# default threshold.
DEFAULT_ALONE_NUMEL, mindspore_engine.ALONE_NUMEL = mindspore_engine.ALONE_NUMEL, 64
ms.set_context(mode=ms.PYNATIVE_MODE if MODE == "pynative" else ms.GRAPH_MODE)
ctx = co.init()
rank, world = ctx.rank, ctx.world_size
out: dict = {"mode": MODE}


def dataset(steps: int = STEPS) -> ms.dataset.Dataset:
    """This rank's shard: ``steps`` batches of 4."""
    batches = [batch(step, rank) for step in range(steps)]
    x = np.concatenate([b[0].asnumpy() for b in batches])
    y = np.concatenate([b[1].asnumpy() for b in batches])
    return ms.dataset.NumpySlicesDataset({"x": x, "y": y}, shuffle=False).batch(4)


def weights(net) -> dict:
    return {p.name: p.asnumpy().tolist() for p in net.trainable_params()}


def momentum(net) -> nn.Optimizer:
    return nn.Momentum(net.trainable_params(), 0.1, 0.9)


def error_of(fn) -> str | None:
    try:
        fn()
    except Exception as error:  # noqa: BLE001 (the message is what the test reads)
        return f"{type(error).__name__}: {error}"
    return None


def wrapped_net(seed: int) -> co.mindspore.DataParallel:
    return co.wrap(build(seed), bucket_size_mb=BUCKET_MB, first_bucket_mb=FIRST_MB)


def train(model: Model, steps: int = STEPS) -> None:
    model.train(1, dataset(steps), dataset_sink_mode=False)


# MindSpore's own data parallel: Model(net, loss_fn, optimizer) builds its DistributedGradReducer
ms.set_auto_parallel_context(parallel_mode=ms.ParallelMode.DATA_PARALLEL, gradients_mean=True)
reference = build(0)
train(Model(reference, loss_fn, momentum(reference)))
out["reference"] = weights(reference)
# amp O2 with a static loss scale that does not drop steps (what MindSpore's CPU build runs of O2): the optimizer
# unscales, as FixedLossScaleManager(drop_overflow_update=False) asks
reference_o2 = build(0)
o2_optimizer = nn.Momentum(reference_o2.trainable_params(), 0.1, 0.9, loss_scale=1024.0)
scale = FixedLossScaleManager(1024.0, drop_overflow_update=False)
train(Model(reference_o2, loss_fn, o2_optimizer, amp_level="O2", loss_scale_manager=scale))
out["reference_o2"] = weights(reference_o2)
reference_adam = build(0)
train(Model(reference_adam, loss_fn, nn.Adam(reference_adam.trainable_params(), 0.01)))
out["reference_adam"] = weights(reference_adam)
ms.reset_auto_parallel_context()

# 1. the one-line form: every rank starts from its own weights (wrap broadcasts rank 0's)
wrapped = wrapped_net(rank)
model = Model(wrapped, loss_fn, momentum(wrapped))
train(model)
out["ours"] = weights(wrapped)
out["reducer"] = type(model._train_network.grad_reducer).__name__
out["steps_reduced"] = wrapped.comm_stats()["steps"]
out["wrapped_is_cell"] = isinstance(wrapped, nn.Cell)
out["names"] = [p.name for p in wrapped.trainable_params()] == [p.name for p in build(0).trainable_params()]

# 1b. dataset_sink_mode=True: the same steps (MindSpore's CPU build calls the step once per batch)
sunk = wrapped_net(rank)
Model(sunk, loss_fn, momentum(sunk)).train(1, dataset(), dataset_sink_mode=True)
out["sink"] = weights(sunk)
out["sink_steps"] = sunk.comm_stats()["steps"]

# 2. checkpoints: save_checkpoint(wrapped) loads into a plain network, and a plain checkpoint into a wrapper
directory = Path(os.environ["COLLECTIVE_OPS_TEST_OUT"]) / f"model-wrap-rank{rank}"
directory.mkdir(exist_ok=True)
ms.save_checkpoint(wrapped, str(directory / "wrapped.ckpt"))
plain = build(7)
not_loaded, _ = ms.load_param_into_net(plain, ms.load_checkpoint(str(directory / "wrapped.ckpt")))
out["plain_not_loaded"] = list(not_loaded)
out["plain_loaded"] = weights(plain)
into_wrapper = wrapped_net(rank)
not_loaded, _ = ms.load_param_into_net(into_wrapper, ms.load_checkpoint(str(directory / "wrapped.ckpt")))
out["wrapper_not_loaded"] = list(not_loaded)
out["wrapper_loaded"] = weights(into_wrapper)

# 3. nn.TrainOneStepCell built by hand over the wrapper: the same reduction
by_hand = wrapped_net(rank)
cell = nn.TrainOneStepCell(nn.WithLossCell(by_hand, loss_fn), momentum(by_hand))
Model(cell).train(1, dataset(), dataset_sink_mode=False)
out["train_one_step"] = weights(by_hand)

# 4. amp_level="O2" with the static loss scale, as the reference above
wrapped_o2 = wrapped_net(rank)
optimizer = nn.Momentum(wrapped_o2.trainable_params(), 0.1, 0.9, loss_scale=1024.0)
scale = FixedLossScaleManager(1024.0, drop_overflow_update=False)
train(Model(wrapped_o2, loss_fn, optimizer, amp_level="O2", loss_scale_manager=scale))
out["o2"] = weights(wrapped_o2)

# 5. a dynamic loss scale, which MindSpore's CPU build refuses: our loss-scale cell trains it, as when built by hand
dynamic = wrapped_net(rank)
model = Model(dynamic, loss_fn, momentum(dynamic), loss_scale_manager=DynamicLossScaleManager(2.0**10, 2, 2))
out["dynamic_cell"] = type(model._train_network).__name__
train(model)
out["dynamic"] = weights(dynamic)
explicit = wrapped_net(rank)
cell = TrainOneStepWithLossScaleCell(
    nn.WithLossCell(explicit, loss_fn), momentum(explicit), explicit, nn.DynamicLossScaleUpdateCell(2.0**10, 2, 2)
)
Model(cell).train(1, dataset(), dataset_sink_mode=False)
out["dynamic_by_hand"] = weights(explicit)
# MindSpore's own loss-scale cell built over the wrapper (its overflow check has no CPU kernel): it becomes ours
mindspores = wrapped_net(rank)
cell = nn.TrainOneStepWithLossScaleCell(
    nn.WithLossCell(mindspores, loss_fn), momentum(mindspores), nn.DynamicLossScaleUpdateCell(2.0**10, 2, 2)
)
out["mindspores_cell"] = type(cell).__name__
out["mindspores_cell_module"] = type(cell).__module__
Model(cell).train(1, dataset(), dataset_sink_mode=False)
out["dynamic_mindspores_cell"] = weights(mindspores)
out["graph_steps"] = mindspores.comm_stats()["steps"]

# 6. co.DistributedOptimizer is an nn.Optimizer: Model and nn.TrainOneStepCell take it, and its step reduces once
MOMENTUM = {"learning_rate": 0.1, "momentum": 0.9}
for name, optimizer_class, kwargs in (("momentum", nn.Momentum, MOMENTUM), ("adam", nn.Adam, {"learning_rate": 0.01})):
    net = wrapped_net(rank)
    train(Model(net, loss_fn, co.DistributedOptimizer(net, optimizer_class, **kwargs)))
    out[f"dist_opt_{name}"] = weights(net)
    out[f"dist_opt_{name}_steps"] = net.comm_stats()["steps"]
net = wrapped_net(rank)
cell = nn.TrainOneStepCell(nn.WithLossCell(net, loss_fn), co.DistributedOptimizer(net, nn.Momentum, **MOMENTUM))
Model(cell).train(1, dataset(), dataset_sink_mode=False)
out["dist_opt_cell"] = weights(net)
out["dist_opt_cell_steps"] = net.comm_stats()["steps"]
if MODE == "pynative":  # shard=True steps from Python
    net = wrapped_net(rank)
    train(Model(net, loss_fn, co.DistributedOptimizer(net, nn.Momentum, shard=True, **MOMENTUM)))
    out["dist_opt_shard"] = weights(net)

# 7. GRAPH: the steps of Model's compiled graph in comm_stats and the trace (flushed to the suite's trace file)
if MODE == "graph":
    traced = co.wrap(build(rank), bucket_size_mb=BUCKET_MB, first_bucket_mb=FIRST_MB, trace=True)
    model = Model(traced, loss_fn, momentum(traced))
    train(model, STEPS + 1)
    train(model, STEPS + 1)  # a second epoch: the graph compiled in the first is reused
    out["traced_stats"] = traced.comm_stats()
    tracing.flush(runtime.get_engine("mindspore"))
write_result(rank, out)  # what ran so far, kept should a refusal below fail (a GRAPH join() that goes ahead)

# 8. refused before any step: the bare network under a wrapper (no reduction); join() around Model in GRAPH mode
bare = wrapped_net(rank)
errors = {"bare_model": error_of(lambda: Model(bare.network, loss_fn, momentum(bare)))}
errors["bare_cell"] = error_of(lambda: nn.TrainOneStepCell(nn.WithLossCell(bare.network, loss_fn), momentum(bare)))
if MODE == "graph":  # join() shadows steps from Python: in GRAPH mode refused before any collective
    uneven = wrapped_net(rank)
    uneven_model = Model(uneven, loss_fn, momentum(uneven))

    def train_uneven() -> None:
        with uneven.join():
            train(uneven_model, STEPS + rank)

    errors["join"] = error_of(train_uneven)
    out["uneven_untouched"] = weights(uneven) == weights(wrapped_net(0))
out["errors"] = errors
co.barrier()
write_result(rank, out)
mindspore_engine.ALONE_NUMEL = DEFAULT_ALONE_NUMEL
