"""msrun worker: DistributedOptimizer(net, cls, shard=True) against nn.DistributedGradReducer + the same optimizer.

argv[2] (optional) is the bucket size in MiB (default: small buckets, so shard boundaries split parameters).
Every run trains from rank 0's weights (wrap broadcasts them) on each rank's own batches. At 2 workers
every check runs; at 3 (a costly start on 2 cores) a plain Adam's state resharded over 3 and trained on
against the reference, and the state's size there.
"""

from __future__ import annotations

import sys

import mindspore as ms
import numpy as np
from mindspore import nn

import collective_ops as co
from tests.ms_workers.nets import batch, build, loss_fn
from tests.msrun_harness import write_result
from tests.reference import collect_errors

MODE = sys.argv[1]
BUCKET_MB = float(sys.argv[2]) if len(sys.argv) > 2 else 0.01
ms.set_context(mode=ms.PYNATIVE_MODE)
ctx = co.init()
rank, world = ctx.rank, ctx.world_size
out: dict = {"world": world}
ADAM = (nn.Adam, {"learning_rate": 0.01, "weight_decay": 0.01})
MOMENTUM = (nn.Momentum, {"learning_rate": 0.1, "momentum": 0.9})


def weights(net) -> dict:
    return {p.name: p.asnumpy().tolist() for p in net.trainable_params()}


def groups_of(params) -> list[dict]:
    """Weights decayed and at their own learning rate, the rest not: MindSpore's group dicts."""
    return [
        {"params": [p for p in params if "weight" in p.name], "weight_decay": 0.01, "lr": 0.02},
        {"params": [p for p in params if "weight" not in p.name]},
    ]


def train(net, optimizer, reduce, steps: range) -> None:
    grad_fn = ms.value_and_grad(lambda x, y: loss_fn(net(x), y), None, optimizer.parameters)
    for step in steps:
        _, grads = grad_fn(*batch(step, rank))
        optimizer(reduce(grads))


def reference(cls, kwargs, steps: range = range(3), grouped: bool = False, net=None):
    """The same training with DistributedGradReducer and the plain optimizer (rank 0's weights everywhere)."""
    net = net or build(0)
    params = groups_of(net.trainable_params()) if grouped else net.trainable_params()
    optimizer = cls(params, **kwargs)
    train(net, optimizer, nn.DistributedGradReducer(optimizer.parameters, mean=True, degree=world), steps)
    return net, optimizer


def ours(cls, kwargs, steps: range = range(3), grouped: bool = False, shard: bool = True):
    net = co.wrap(build(rank), bucket_size_mb=BUCKET_MB, overlap=False)
    params = groups_of(net.trainable_params()) if grouped else None
    optimizer = co.DistributedOptimizer(net, cls, params, shard=shard, **kwargs)
    train(net.network, optimizer, lambda grads: grads, steps)
    return net, optimizer


def plain_state(optimizer) -> dict:
    return {p.name: p.asnumpy().tolist() for p in optimizer.get_parameters() if p.name not in _param_names(optimizer)}


def _param_names(optimizer) -> set:
    return {p.name for p in optimizer.parameters}


def listed(state: dict) -> dict:
    return {k: np.asarray(v).tolist() for k, v in state.items()}


def state_sizes(opt, ref_opt, net) -> dict:
    """This rank's state elements, sharded and plain (the plain optimizer's tensors of more than one element)."""
    return {
        "sharded": opt.state_elements(),
        "pieces": opt.piece_elements,
        "plain": sum(
            int(p.size) for p in ref_opt.get_parameters() if p.name not in _param_names(ref_opt) and p.size > 1
        ),
        "params": sum(int(p.size) for p in net.trainable_params()),
        "padding": opt._layout.padding(rank),
    }


# 1. three steps of Adam (weight decay) and of Momentum: weights and the gathered state against the reference's
#    (at 3 workers the resharding below trains Adam sharded against the reference: its check stands for this one)
for name, (cls, kwargs) in (("adam", ADAM), ("momentum", MOMENTUM)) if world == 2 else ():
    ref_net, ref_opt = reference(cls, kwargs)
    net, opt = ours(cls, kwargs)
    out[f"{name}_ref"], out[f"{name}_ours"] = weights(ref_net), weights(net.network)
    out[f"{name}_ref_state"], out[f"{name}_ours_state"] = plain_state(ref_opt), listed(opt.gathered_state())
    out[f"{name}_state"] = state_sizes(opt, ref_opt, net)

# 4. a plain optimizer's state (the reference's after 2 steps) loaded by a sharded one: resharded at this world size
ref_net, ref_opt = reference(*ADAM, steps=range(2))
ref_state = {p.name: p.asnumpy().copy() for p in ref_opt.get_parameters() if p.name not in _param_names(ref_opt)}
resharded_net = co.wrap(build(1), bucket_size_mb=BUCKET_MB, overlap=False)
ms.load_param_into_net(
    resharded_net.network,
    {p.name: ms.Parameter(ms.Tensor(p.asnumpy()), name=p.name) for p in ref_net.trainable_params()},
)
resharded_opt = co.DistributedOptimizer(resharded_net, nn.Adam, shard=True, **ADAM[1])
resharded_opt.load_gathered_state(ref_state)
train(resharded_net.network, resharded_opt, lambda grads: grads, range(2, 4))
train(ref_net, ref_opt, nn.DistributedGradReducer(ref_opt.parameters, mean=True, degree=world), range(2, 4))
out["resharded_ours"], out["resharded_ref"] = weights(resharded_net.network), weights(ref_net)
out["resharded_state"] = state_sizes(resharded_opt, ref_opt, resharded_net)


if world == 2:  # world-independent checks: once
    # 2. parameter groups (own weight decay and learning rate), and shard=False on the same call
    ref_net, _ = reference(*ADAM, grouped=True)
    net, _ = ours(*ADAM, grouped=True)
    out["grouped_ref"], out["grouped_ours"] = weights(ref_net), weights(net.network)
    net, _ = ours(*ADAM, shard=False)
    out["unsharded_ours"] = weights(net.network)
    # the wrapper replanned after the optimizer was built (as reduce()'s rebuild or a new size would): the
    # shards, and the state that belongs to them, stay on the plan they were cut from
    net = co.wrap(build(rank), bucket_size_mb=BUCKET_MB, overlap=False)
    opt = co.DistributedOptimizer(net, MOMENTUM[0], shard=True, **MOMENTUM[1])
    net.manager.replan(25.0)
    train(net.network, opt, lambda grads: grads, range(3))
    out["replanned_ours"] = weights(net.network)

    # 3. checkpoint: the gathered state after 2 steps, loaded into a plain optimizer (the reference's loop) and into a
    #    new sharded one; both continue 2 steps as the sharded optimizer that saved it does
    net, opt = ours(*ADAM, steps=range(2))
    # copies: asnumpy() may share the parameter's memory, which the all-gather writes in place
    saved_state, saved_weights = opt.gathered_state(), {p.name: p.asnumpy().copy() for p in net.trainable_params()}
    train(net.network, opt, lambda grads: grads, range(2, 4))
    out["resumed_ours"] = weights(net.network)
    plain_net = build(1)
    ms.load_param_into_net(plain_net, {k: ms.Parameter(ms.Tensor(v), name=k) for k, v in saved_weights.items()})
    plain_opt = nn.Adam(plain_net.trainable_params(), **ADAM[1])
    not_loaded, _ = ms.load_param_into_net(
        plain_opt, {k: ms.Parameter(ms.Tensor(v), name=k) for k, v in saved_state.items()}, strict_load=True
    )
    out["plain_not_loaded"] = [k for k in not_loaded if k not in _param_names(plain_opt)]
    train(plain_net, plain_opt, nn.DistributedGradReducer(plain_opt.parameters, mean=True, degree=world), range(2, 4))
    out["resumed_plain"] = weights(plain_net)
    loaded_net = co.wrap(build(1), bucket_size_mb=BUCKET_MB, overlap=False)
    ms.load_param_into_net(
        loaded_net.network, {k: ms.Parameter(ms.Tensor(v), name=k) for k, v in saved_weights.items()}
    )
    loaded_opt = co.DistributedOptimizer(loaded_net, *ADAM[:1], shard=True, **ADAM[1])
    loaded_opt.load_gathered_state(saved_state)
    train(loaded_net.network, loaded_opt, lambda grads: grads, range(2, 4))
    out["resumed_sharded"] = weights(loaded_net.network)
    # the same resume with the weights loaded after the optimizer was built (a loop that builds everything, then
    # restores a checkpoint): the pieces were copies taken at construction, and the first step's all-gather wrote
    # the old weights back over the loaded ones
    # (seen by the parameters' data address, or version; an ops.assign moves neither: reload_network_params())
    for how in ("load_param_into_net", "copy_", "assign_then_reload"):
        late_net = co.wrap(build(1), bucket_size_mb=BUCKET_MB, overlap=False)
        late_opt = co.DistributedOptimizer(late_net, *ADAM[:1], shard=True, **ADAM[1])
        if how == "load_param_into_net":
            loaded = {k: ms.Parameter(ms.Tensor(v), name=k) for k, v in saved_weights.items()}
            ms.load_param_into_net(late_net.network, loaded)
        for param in late_net.trainable_params() if how != "load_param_into_net" else ():
            if how == "copy_":
                param.copy_(ms.Tensor(saved_weights[param.name]))
            else:
                ms.ops.assign(param, ms.Tensor(saved_weights[param.name]))
        if how == "assign_then_reload":
            late_opt.reload_network_params()
        late_opt.load_gathered_state(saved_state)
        train(late_net.network, late_opt, lambda grads: grads, range(2, 4))
        out[f"resumed_late_{how}"] = weights(late_net.network)

    # 5. refused, on every rank, with what to do
    overlapping = co.wrap(build(0), overlap=True)
    small = co.wrap(build(0), bucket_size_mb=BUCKET_MB, overlap=False)
    out["errors"] = collect_errors(
        {
            "overlap": lambda: co.DistributedOptimizer(overlapping, nn.Adam, shard=True),
            "lamb": lambda: co.DistributedOptimizer(small, nn.Lamb, shard=True, learning_rate=0.01),
            "centralized": lambda: co.DistributedOptimizer(
                small,
                nn.Momentum,
                [{"params": small.trainable_params(), "grad_centralization": True}],
                shard=True,
                learning_rate=0.1,
                momentum=0.9,
            ),
            "some_params": lambda: co.DistributedOptimizer(small, nn.Adam, small.trainable_params()[:2], shard=True),
            "not_wrapped": lambda: co.DistributedOptimizer(build(0), nn.Adam, shard=True),
            "not_an_optimizer": lambda: co.DistributedOptimizer(small, object, shard=True),
            "wrong_count": lambda: co.DistributedOptimizer(small, nn.Adam, shard=True)(
                (ms.Tensor(np.ones(1, np.float32)),)
            ),
            "bad_state": lambda: co.DistributedOptimizer(small, nn.Adam, shard=True).load_gathered_state(
                {"global_step": 0}
            ),
            "wrong_order": lambda: co.DistributedOptimizer(small, nn.Adam, shard=True)(
                tuple(ms.Tensor(np.zeros(p.shape, np.float32)) for p in reversed(small.trainable_params()))
            ),
            "join": lambda: small.join().__enter__(),  # small has sharded optimizers (above)
        },
        (ValueError, TypeError, KeyError),
    )

write_result(rank, out)
