"""msrun worker (PyNative): ``compression=co.PowerSGD(...)`` on MindSpore, for the test to hold against torch DDP +
``powerSGD_hook`` fed the same gradients.

An MLP with weights of two shapes (two of them alike, apart in the bucket) and biases, one bucket, trained 6 steps
in a functional loop (each rank its own batches, SGD): every step's local gradients and reduced ones
(``net.reduce``), at PowerSGD rank 2 and 4. Then: a run resumed from ``compression_state_dict()`` after step 3
against an uninterrupted one, the unsharded ``DistributedOptimizer`` against ``net.reduce`` + the same optimizer,
``Model(wrapped, ...).train`` against the functional loop, ``overlap=True`` against ``overlap=False``, a
zero-gradient weight, and what is refused.
"""

from __future__ import annotations

import sys

import mindspore as ms
import numpy as np
from mindspore import nn

import collective_ops as co
from tests.msrun_harness import write_result
from tests.reference import collect_errors

MODE = sys.argv[1]  # the suite's ("pynative"); every case runs PyNative, compiled_gradients switches to GRAPH and back
STEPS, START, SEED = 6, 2, 3
BUCKET_MB = 25.0  # one bucket
ms.set_context(mode=ms.PYNATIVE_MODE)
ctx = co.init()
rank, world = ctx.rank, ctx.world_size
out: dict = {"world": world}


class MLP(nn.Cell):
    """16 -> 32 -> 32 -> 32 -> 4: weights (32, 16), (32, 32) twice and (4, 32) (too small to compress), biases."""

    def __init__(self) -> None:
        super().__init__()
        self.fc0, self.fc1, self.fc2, self.head = nn.Dense(16, 32), nn.Dense(32, 32), nn.Dense(32, 32), nn.Dense(32, 4)
        self.tanh = nn.Tanh()

    def construct(self, x):
        return self.head(self.tanh(self.fc2(self.tanh(self.fc1(self.tanh(self.fc0(x)))))))


def build(seed: int = 0) -> MLP:
    ms.set_seed(seed)
    return MLP()


def batch(step: int, r: int):
    rng = np.random.default_rng(1000 + 100 * step + r)
    x = rng.standard_normal((8, 16)).astype(np.float32)
    return ms.Tensor(x), ms.Tensor(rng.integers(0, 4, 8).astype(np.int32))


loss_fn = nn.CrossEntropyLoss()


def compression(matrix_rank: int = 2) -> co.PowerSGD:
    return co.PowerSGD(rank=matrix_rank, start_iter=START, random_seed=SEED)


def weights(net) -> dict:
    return {p.name: p.asnumpy().tolist() for p in net.trainable_params()}


def train(net, optimizer, steps: range, distributed: bool = False, record: dict | None = None) -> None:
    def loss_of(x, y):  # (a named function: GRAPH mode compiles no lambda defined inside a call)
        return loss_fn(net(x), y)

    grad_fn = ms.value_and_grad(loss_of, None, optimizer.parameters)
    for step in steps:
        _, grads = grad_fn(*batch(step, rank))
        if distributed:
            optimizer(grads)
            continue
        reduced = net.reduce(grads)
        if record is not None:
            record["local"].append([g.asnumpy().tolist() for g in grads])
            record["reduced"].append([g.asnumpy().tolist() for g in reduced])
            record["bucket_order"].append([list(b.param_indices) for b in net.manager.plan.buckets])
        optimizer(reduced)


def against_torch(matrix_rank: int) -> dict:
    net = co.wrap(build(), bucket_size_mb=BUCKET_MB, compression=compression(matrix_rank))
    record: dict = {"local": [], "reduced": [], "bucket_order": []}
    train(net, nn.SGD(net.trainable_params(), learning_rate=0.1), range(STEPS), record=record)
    record["shapes"] = [list(p.shape) for p in net.trainable_params()]
    record["compressing"] = net.manager.comm_hook.compressing
    return record


def resumed() -> tuple[dict, dict]:
    """(6 steps uninterrupted, 3 steps then a checkpoint loaded into a new wrapper of other weights, 3 more)."""
    net = co.wrap(build(), bucket_size_mb=BUCKET_MB, compression=compression())
    train(net, nn.SGD(net.trainable_params(), learning_rate=0.1), range(STEPS))
    uninterrupted = weights(net)
    net = co.wrap(build(), bucket_size_mb=BUCKET_MB, compression=compression())
    train(net, nn.SGD(net.trainable_params(), learning_rate=0.1), range(3))
    saved = {p.name: ms.Parameter(ms.Tensor(p.asnumpy()), name=p.name) for p in net.trainable_params()}
    state = net.compression_state_dict()
    net = co.wrap(build(seed=7), bucket_size_mb=BUCKET_MB, compression=compression())
    ms.load_param_into_net(net, saved)
    net.load_compression_state_dict(state)
    train(net, nn.SGD(net.trainable_params(), learning_rate=0.1), range(3, STEPS))
    return uninterrupted, weights(net)


def with_distributed_optimizer() -> tuple[dict, dict]:
    """(net.reduce + nn.Momentum, co.DistributedOptimizer(net, nn.Momentum)), both under the same PowerSGD."""
    runs = []
    for distributed in (False, True):
        net = co.wrap(build(), bucket_size_mb=BUCKET_MB, compression=compression())
        if distributed:
            optimizer = co.DistributedOptimizer(net, nn.Momentum, learning_rate=0.1, momentum=0.9)
        else:
            optimizer = nn.Momentum(net.trainable_params(), learning_rate=0.1, momentum=0.9)
        train(net, optimizer, range(STEPS), distributed=distributed)
        if distributed:
            optimizer.synchronize()
        runs.append(weights(net))
    return runs[0], runs[1]


def with_model() -> tuple[dict, dict]:
    """(net.reduce + nn.SGD in a functional loop, mindspore.train.Model(wrapped, loss_fn, nn.SGD).train), both under
    the same PowerSGD, on the same batches of each rank: Model's training cell reduces through the wrapper."""
    from mindspore.train import Model

    net = co.wrap(build(), bucket_size_mb=BUCKET_MB, compression=compression())
    train(net, nn.SGD(net.trainable_params(), learning_rate=0.1), range(STEPS))
    functional = weights(net)
    net = co.wrap(build(), bucket_size_mb=BUCKET_MB, compression=compression())
    batches = [batch(step, rank) for step in range(STEPS)]
    data = ms.dataset.NumpySlicesDataset(
        {
            "x": np.concatenate([x.asnumpy() for x, _ in batches]),
            "y": np.concatenate([y.asnumpy() for _, y in batches]),
        },
        shuffle=False,
    ).batch(8)
    Model(net, loss_fn, nn.SGD(net.trainable_params(), learning_rate=0.1)).train(1, data, dataset_sink_mode=False)
    return functional, weights(net)


def overlapped() -> tuple[dict, dict]:
    """(overlap=False, overlap=True) under the same PowerSGD, net.reduce + nn.SGD: with overlap the parameter hooks
    launch the bucket (its first allreduce) during backward, and net.reduce finishes it."""
    runs = []
    for overlap in (False, True):
        net = co.wrap(build(), bucket_size_mb=BUCKET_MB, overlap=overlap, compression=compression())
        train(net, nn.SGD(net.trainable_params(), learning_rate=0.1), range(STEPS))
        runs.append(weights(net))
        runs.append(net.comm_stats()["mode"])
    return runs


def compiled_gradients() -> list | str:
    """(gradients from PyNative, from a GRAPH-mode value_and_grad), each step's reduced by net.reduce(grads) from
    Python under the same PowerSGD, nn.SGD: the compiled gradients may round differently, so fp32 rounding apart.
    What failed instead, as text: this case's failure is its test's alone."""
    runs = []
    try:
        for mode in (ms.PYNATIVE_MODE, ms.GRAPH_MODE):
            ms.set_context(mode=mode)
            net = co.wrap(build(), bucket_size_mb=BUCKET_MB, compression=compression())
            train(net, nn.SGD(net.trainable_params(), learning_rate=0.1), range(STEPS))
            runs += [weights(net), net.manager.comm_hook.compressing]
    except Exception as exc:  # noqa: BLE001  (reported by the test)
        return f"{type(exc).__name__}: {exc}"
    finally:
        ms.set_context(mode=ms.PYNATIVE_MODE)
    return runs


def zero_gradient_matrix() -> dict:
    """A weight whose gradient is zero on every rank (its layer's input zeroed, as a zero-initialised layer feeds
    the next), compressed at rank 4: its reduced gradient is zero and no gradient is NaN (torch's QR above rank 2)."""
    net = co.wrap(build(), bucket_size_mb=BUCKET_MB, compression=compression(4))
    grad_fn = ms.value_and_grad(lambda x, y: loss_fn(net(x * 0), y), None, net.trainable_params())
    finite, fc0_weight_zero = True, True
    for step in range(START + 2):
        _, grads = grad_fn(*batch(step, rank))
        reduced = [g.asnumpy() for g in net.reduce(grads)]
        finite = finite and all(bool(np.isfinite(g).all()) for g in reduced)
        fc0_weight_zero = fc0_weight_zero and not reduced[0].any()
    return {"finite": finite, "fc0_weight_zero": fc0_weight_zero, "compressing": net.manager.comm_hook.compressing}


out["rank2"] = against_torch(2)
out["zero_gradient_matrix"] = zero_gradient_matrix()
out["rank4"] = against_torch(4)
out["resumed"] = resumed()
out["distributed_optimizer"] = with_distributed_optimizer()
out["model"] = with_model()
out["overlap"] = overlapped()
out["compiled_gradients"] = compiled_gradients()
out["errors"] = collect_errors(
    {
        "graph": lambda: co.wrap(build(), compression=compression()).graph_reducer(),
        "sum": lambda: co.wrap(build(), reduce_op="sum", compression=compression()),
        "shard": lambda: co.DistributedOptimizer(
            co.wrap(build(), overlap=False, compression=compression()), nn.SGD, shard=True, learning_rate=0.1
        ),
    }
)
write_result(rank, out)
