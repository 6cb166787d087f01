"""msrun worker: ``with net.join():`` with uneven batches per rank, against the hand-computed average.

The reference trains the plain network through every step of the longest rank, each rank's
gradient all-gathered (zeros from a rank that has run out of data) and averaged as
DistributedGradReducer does (summed in rank order, then times float32(1/world)): what DDP's
``join()`` computes with its default divisor, the initial world size.
"""

from __future__ import annotations

import mindspore as ms
import numpy as np
from mindspore import nn
from mindspore.train import Model

import collective_ops as co
from tests.ms_workers.nets import batch, build, loss_fn
from tests.msrun_harness import write_result

ms.set_context(mode=ms.PYNATIVE_MODE)
ctx = co.init()
rank, world = ctx.rank, ctx.world_size
BATCHES = {0: 3, 1: 5, 2: 4}
LONGEST = max(BATCHES[r] for r in range(world))
out: dict = {}


def weights(net) -> dict:
    return {p.name: p.asnumpy().tolist() for p in net.trainable_params()}


def trainer(net):
    optimizer = nn.Momentum(net.trainable_params(), learning_rate=0.1, momentum=0.9)
    return optimizer, ms.value_and_grad(lambda x, y: loss_fn(net(x), y), None, optimizer.parameters)


# ours: rank r runs BATCHES[r] steps inside join()
wrapped = co.wrap(build(rank), bucket_size_mb=0.002, first_bucket_mb=0.001)
optimizer, grad_fn = trainer(wrapped)
with wrapped.join():
    for step in range(BATCHES[rank]):
        _, grads = grad_fn(*batch(step, rank))
        optimizer(wrapped.reduce(grads))
out["ours"] = weights(wrapped.network)
out["steps"] = wrapped.comm_stats()["steps"]

# the same inside mindspore.train.Model: Model(wrapped, loss_fn, optimizer).train(...) inside join()
under_model = co.wrap(build(rank), bucket_size_mb=0.002, first_bucket_mb=0.001)
batches = [batch(step, rank) for step in range(BATCHES[rank])]
data = ms.dataset.NumpySlicesDataset(
    {"x": np.concatenate([x.asnumpy() for x, _ in batches]), "y": np.concatenate([y.asnumpy() for _, y in batches])},
    shuffle=False,
).batch(4)
model = Model(under_model, loss_fn, nn.Momentum(under_model.trainable_params(), learning_rate=0.1, momentum=0.9))
with under_model.join():
    model.train(1, data, dataset_sink_mode=False)
out["model"] = weights(under_model)
out["model_steps"] = under_model.comm_stats()["steps"]

# the reference, by hand: every step of the longest rank, a rank out of data contributing zeros
reference = build(0)
optimizer, grad_fn = trainer(reference)
for step in range(LONGEST):
    if step < BATCHES[rank]:
        local = [g.asnumpy() for g in grad_fn(*batch(step, rank))[1]]
    else:
        local = [np.zeros(p.shape, np.float32) for p in optimizer.parameters]
    flat = np.concatenate([g.reshape(-1) for g in local])  # one all-gather per step for every gradient
    parts = co.allgather(flat.reshape(1, -1)).reshape(world, -1)
    total = parts[0]
    for part in parts[1:]:  # summed in rank order, element by element as before
        total = total + part
    total = total * np.float32(1.0 / world)
    sizes = np.cumsum([g.size for g in local])[:-1]
    averaged = [ms.Tensor(t.reshape(g.shape)) for t, g in zip(np.split(total, sizes), local)]
    optimizer(tuple(averaged))
out["reference"] = weights(reference)

write_result(rank, out)
