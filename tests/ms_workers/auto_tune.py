"""msrun worker (PyNative): ``bucket_size_mb="auto"`` settles on rank 0's choice on every rank, and ``co.tune``.

Rank 0's simulator is made to rank the candidates in reverse (a rank whose profile differs from its peers'):
its choice then differs both from the other ranks' own best and from the default size, so a rank that kept
its own choice, or did not replan, shows in the result. The tuned run's weights are compared with a run
wrapped at the settled size from the start.
"""

from __future__ import annotations

import mindspore as ms
from mindspore import nn

import collective_ops as co
from collective_ops import online_tune
from collective_ops.bucketing.cost import CostModel
from tests.ms_workers.nets import batch, build, loss_fn
from tests.msrun_harness import write_result

ms.set_context(mode=ms.PYNATIVE_MODE)
ctx = co.init()
rank = ctx.rank
STEPS = 5
out: dict = {}


def train(wrapped, steps: int = STEPS) -> dict:
    optimizer = nn.Momentum(wrapped.trainable_params(), learning_rate=0.1, momentum=0.9)
    grad_fn = ms.value_and_grad(lambda x, y: loss_fn(wrapped(x), y), None, optimizer.parameters)
    for step in range(steps):
        _, grads = grad_fn(*batch(step, rank))
        optimizer(wrapped.reduce(grads))
    return {p.name: p.asnumpy().tolist() for p in wrapped.network.trainable_params()}


def settings(wrapped) -> list[float]:
    plan = wrapped.manager.plan
    return [plan.bucket_size_mb, plan.first_bucket_mb]


predict = online_tune.predict
if rank == 0:
    online_tune.predict = lambda *a, **k: predict(*a, **k)[::-1]
auto = co.wrap(build(rank), bucket_size_mb="auto", auto_tune_step=2)
out["pending_before"] = auto.tune_pending
out["auto"] = train(auto)
online_tune.predict = predict
out["pending_after"] = auto.tune_pending
out["settled"] = settings(auto)
best = auto.auto_tune_report[0]
out["own_best"] = [best.bucket_size_mb, best.first_bucket_mb]
out["fixed"] = train(co.wrap(build(rank), bucket_size_mb=out["settled"][0], first_bucket_mb=out["settled"][1]))

# co.tune over a MindSpore wrapper: profiled and trial steps of a functional loop; rank 0 decides
tuned = co.wrap(build(rank))
optimizer = nn.Momentum(tuned.trainable_params(), learning_rate=0.1, momentum=0.9)
grad_fn = ms.value_and_grad(lambda x, y: loss_fn(tuned(x), y), None, optimizer.parameters)


def step_fn() -> None:
    _, grads = grad_fn(*batch(0, rank))
    optimizer(tuned.reduce(grads))


# a given cost model: the link was swept once above (the "auto" tune)
result = co.tune(tuned, step_fn, confirm_top=1, confirm_steps=1, profile_steps=1, cost=CostModel(1e-4, 1e-9))
out["tune_result"] = [result.bucket_size_mb, result.first_bucket_mb]
out["tune_plan"] = settings(tuned)

write_result(rank, out)
