"""msrun worker: wrap(network) against nn.DistributedGradReducer, in the mode given as argv[1].

argv[2] (optional) is the bucket size in MiB. At 3 workers MCCL's ring sums a fused bucket's
elements in another order than one gradient at a time (DistributedGradReducer on CPU), which
moves the last bit; buckets of one gradient each (a tiny size) isolate the averaging arithmetic,
which must then be the reducer's to the bit. ``fused`` is the default-size run for comparison.
The checks that reach the same reduction by another route (a parameter unused on one rank,
accumulation, TrainOneStepCell, parameter groups) and the bad-input checks run at 2 workers
only: the world size does not change what they check, and a 3-worker start on 2 cores is costly.
"""

from __future__ import annotations

import sys

import mindspore as ms
import numpy as np
from mindspore import nn

import collective_ops as co
from collective_ops.comm import mindspore_engine
from collective_ops.consistency import ModelMismatchError
from collective_ops.mindspore import TrainOneStepCell
from tests.ms_workers.nets import batch, build, loss_fn
from tests.msrun_harness import write_result
from tests.reference import collect_errors

MODE = sys.argv[1]
BUCKET_MB = float(sys.argv[2]) if len(sys.argv) > 2 else 0.002
FIRST_MB = min(0.001, BUCKET_MB)
ms.set_context(mode=ms.PYNATIVE_MODE if MODE == "pynative" else ms.GRAPH_MODE)
ctx = co.init(trace=MODE == "pynative")  # the test reads the trace of PyNative's hooks
rank, world = ctx.rank, ctx.world_size
out: dict = {"mode": MODE}
ROUTES = world == 2  # the checks of other routes to the same reduction (see above)
# In GRAPH mode the main run already takes the compiled after-backward path (no hooks run there); its other
# after-backward paths, and the unused-parameter and accumulation routes (plain reductions of what backward
# returned, as in PyNative's), are PyNative's checks: GRAPH keeps the main run, TrainOneStepCell's in-graph
# reduction and bad input.
AFTER_BACKWARD_PATHS = MODE == "pynative"


def train(net, reduce, steps: int = 3, use_branch_fn=lambda step: True):
    opt = nn.Momentum(net.trainable_params(), learning_rate=0.1, momentum=0.9)

    def forward(x, y, use_branch):
        return loss_fn(net(x, use_branch), y)

    grad_fn = ms.value_and_grad(forward, None, opt.parameters)
    first = None
    for step in range(steps):
        x, y = batch(step, rank)
        _loss, grads = grad_fn(x, y, use_branch_fn(step))
        grads = reduce(grads)
        first = first or [g.asnumpy().tolist() for g in grads]
        opt(grads)
    return {p.name: p.asnumpy().tolist() for p in net.trainable_params()}, first


def dgr_reducer(net):
    return nn.DistributedGradReducer(net.trainable_params(), mean=True, degree=world)


# 1. against DistributedGradReducer (every rank starts from different weights: wrap broadcasts rank 0's)
reference_net = build(0)
out["dgr"], out["dgr_grads"] = train(reference_net, dgr_reducer(reference_net))
wrapped = co.wrap(build(rank), bucket_size_mb=BUCKET_MB, first_bucket_mb=FIRST_MB, overlap=MODE == "pynative")
out["ours"], out["ours_grads"] = train(wrapped.network, wrapped.reduce)
out["stats"] = wrapped.comm_stats()

# 1b. both after-backward paths: one compiled graph (the default) and eager bucket by bucket
for name, compiled in (("compiled", True), ("eager", False)) if AFTER_BACKWARD_PATHS else ():
    after = co.wrap(
        build(rank), bucket_size_mb=BUCKET_MB, first_bucket_mb=FIRST_MB, overlap=False, compile_reduction=compiled
    )
    out[f"after_{name}"], _ = train(after.network, after.reduce)
    out[f"after_{name}_stats"] = after.comm_stats()
    # fp16 on the wire: the compiled graph must do the eager compression hook's arithmetic, on gradients it
    # concatenates and on those it sends alone (every weight here, with the threshold at 64 elements)
    after = co.wrap(
        build(rank), bucket_size_mb=BUCKET_MB, overlap=False, compile_reduction=compiled, compression="fp16"
    )
    alone_numel, mindspore_engine.ALONE_NUMEL = mindspore_engine.ALONE_NUMEL, 64
    try:
        out[f"fp16_{name}"], _ = train(after.network, after.reduce)
    finally:  # (the later checks of this process reduce at the default threshold)
        mindspore_engine.ALONE_NUMEL = alone_numel
    out[f"fp16_{name}_mode"] = after.comm_stats()["mode"]

# 1c. fused buckets after backward (the default sizes), for the comparison at odd world sizes
if AFTER_BACKWARD_PATHS:
    fused = co.wrap(build(rank), overlap=False, compile_reduction=False)
    out["fused"], _ = train(fused.network, fused.reduce)

# 2. a parameter unused on rank 1 in steps 0 and 2
if ROUTES and MODE == "pynative":
    unused_fn = lambda step: not (rank == 1 and step != 1)  # noqa: E731
    reference_net = build(0)
    out["unused_dgr"], _ = train(reference_net, dgr_reducer(reference_net), use_branch_fn=unused_fn)
    wrapped_unused = co.wrap(build(0), bucket_size_mb=BUCKET_MB, overlap=MODE == "pynative")
    out["unused_ours"], _ = train(wrapped_unused.network, wrapped_unused.reduce, use_branch_fn=unused_fn)


# 3. gradient accumulation: two micro-batches under no_sync, the sum reduced once
def accumulate(net, reduce, quiet):
    def forward(x, y):
        return loss_fn(net(x), y)

    grad_fn = ms.value_and_grad(forward, None, net.trainable_params())
    total = None
    with quiet():
        for micro in range(2):
            _, grads = grad_fn(*batch(micro, rank))
            total = grads if total is None else tuple(a + b for a, b in zip(total, grads))
    return [g.asnumpy().tolist() for g in reduce(total)]


import contextlib  # noqa: E402

if ROUTES and MODE == "pynative":
    reference_net = build(0)
    out["accum_dgr"] = accumulate(reference_net, dgr_reducer(reference_net), contextlib.nullcontext)
    wrapped_acc = co.wrap(build(0), bucket_size_mb=BUCKET_MB, overlap=MODE == "pynative")
    out["accum_ours"] = accumulate(wrapped_acc.network, wrapped_acc.reduce, wrapped_acc.no_sync)

# 4. TrainOneStepCell-style training against the functional loop: PyNative through reduce(), GRAPH with the
#    compiled reduction inside the step's graph (where DistributedGradReducer would sit)
if ROUTES:
    if MODE == "graph":
        # as data-parallel MindSpore scripts run it (benchmarks/mindspore_compare.py --train-cell too): nn.TrainOneStepCell
        # then builds its own DistributedGradReducer, the reference the compiled reducer replaces in the graph
        ms.set_auto_parallel_context(parallel_mode=ms.ParallelMode.DATA_PARALLEL, gradients_mean=True)
        reference_net = build(0)
        reference_cell = nn.TrainOneStepCell(
            nn.WithLossCell(reference_net, loss_fn), nn.Momentum(reference_net.trainable_params(), 0.1, 0.9)
        )
        assert isinstance(reference_cell.grad_reducer, nn.DistributedGradReducer)
        for step in range(3):
            reference_cell(*batch(step, rank))
        out["train_one_step_dgr"] = {p.name: p.asnumpy().tolist() for p in reference_net.trainable_params()}
    wrapped_cell = co.wrap(build(0), bucket_size_mb=BUCKET_MB, overlap=MODE == "pynative")
    with_loss = nn.WithLossCell(wrapped_cell.network, loss_fn)
    step_cell = TrainOneStepCell(with_loss, nn.Momentum(with_loss.trainable_params(), 0.1, 0.9), wrapped_cell)
    for step in range(3):
        step_cell(*batch(step, rank))
    out["train_one_step"] = {p.name: p.asnumpy().tolist() for p in wrapped_cell.network.trainable_params()}

# 6. overlap: gradients changed between backward and reduce() (a loss scale unscaled out of place) are refused;
#    before, reduce() returned the reduction of backward's gradients, silently dropping the change
if MODE == "pynative":
    changed = co.wrap(build(0), bucket_size_mb=BUCKET_MB, overlap=True)
    changed_grad_fn = ms.value_and_grad(lambda x, y: loss_fn(changed.network(x), y), None, changed.trainable_params())
    _, grads = changed_grad_fn(*batch(0, rank))
    try:
        changed.reduce(tuple(g * 0.5 for g in grads))
        out["changed_grads_error"] = None
    except ValueError as exc:
        out["changed_grads_error"] = str(exc)
    _, grads = changed_grad_fn(*batch(1, rank))  # the next step: unchanged gradients, reduced as the reducer does
    out["after_changed"] = [g.asnumpy().tolist() for g in changed.reduce(grads)]
    reference_net = build(0)
    reference_fn = ms.value_and_grad(lambda x, y: loss_fn(reference_net(x), y), None, reference_net.trainable_params())
    _, grads = reference_fn(*batch(1, rank))
    out["after_changed_dgr"] = [g.asnumpy().tolist() for g in dgr_reducer(reference_net)(grads)]


# 7. an optimizer with parameter groups (no 'order_params') lists its parameters, so value_and_grad over them its
#    gradients, group by group: reduce(grads, params=optimizer.parameters) is DistributedGradReducer's over them
def grouped_train(net, reduce_of):
    params = net.trainable_params()
    groups = [
        {"params": [p for p in params if "weight" in p.name], "weight_decay": 0.01},
        {"params": [p for p in params if "weight" not in p.name]},
    ]
    opt = nn.Momentum(groups, learning_rate=0.1, momentum=0.9)
    grad_fn = ms.value_and_grad(lambda x, y: loss_fn(net(x), y), None, opt.parameters)
    reduce = reduce_of(opt)
    for step in range(3):
        _, grads = grad_fn(*batch(step, rank))
        opt(reduce(grads))
    return {p.name: p.asnumpy().tolist() for p in params}


if MODE == "pynative" and ROUTES:  # the parameter mapping is mode-independent Python; GRAPH would compile the lambdas
    reference_net = build(0)
    out["grouped_dgr"] = grouped_train(
        reference_net, lambda opt: nn.DistributedGradReducer(opt.parameters, mean=True, degree=world)
    )
    grouped = co.wrap(build(0), bucket_size_mb=BUCKET_MB, overlap=True)
    out["grouped_ours"] = grouped_train(grouped.network, lambda opt: lambda g: grouped.reduce(g, params=opt.parameters))

# 5. bad input: refused on every rank, no hang
if ROUTES:
    out["errors"] = collect_errors(
        {
            "mismatch": lambda: co.wrap(nn.Dense(4, 5 if rank == 0 else 6)),
            # an option that adds a collective (the usage map's all-reduce) on one rank only
            "options_differ": lambda: co.wrap(build(0), find_unused_parameters=rank == 1),
            "bucket_zero": lambda: co.wrap(build(0), bucket_size_mb=0),
            "already_wrapped": lambda: co.wrap(wrapped),
            "wrong_count": lambda: wrapped.reduce((ms.Tensor(np.ones(1, np.float32)),)),
            # gradients in another order than the parameters (as an optimizer's parameter groups list them)
            "wrong_order": lambda: wrapped.reduce(
                tuple(ms.Tensor(np.zeros(p.shape, np.float32)) for p in reversed(wrapped.trainable_params()))
            ),
            "graph_reducer_eager_only": lambda: co.wrap(build(0), compile_reduction=False).graph_reducer(),
            "graph_reducer_some_params": lambda: wrapped.graph_reducer(wrapped.trainable_params()[:1]),
        },
        (ValueError, TypeError, ModelMismatchError),
    )

write_result(rank, out)
