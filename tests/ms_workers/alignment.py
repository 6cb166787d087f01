"""msrun worker: a rank that skips a step's reduction (as a loop does for a loss it alone found non-finite).

Each after-backward path (compiled, eager) trains 4 steps; the last rank skips ``net.reduce(grads)`` at step 1,
so its step-2 gradients would be averaged with its peers' step-1 ones. Every rank must raise
StepMisalignedError at the reduction that would mix them (its peers' step 1, its own step 2), naming each rank's
forward count, and apply nothing of it. (A loop that went on after it would pair later steps off by one.)
"""

from __future__ import annotations

import sys

import mindspore as ms
from mindspore import nn

import collective_ops as co
from collective_ops.bucketing import StepMisalignedError
from tests.ms_workers.nets import batch, build, loss_fn
from tests.msrun_harness import write_result

MODE = sys.argv[1]
SKIP_STEP = 1
ms.set_context(mode=ms.PYNATIVE_MODE)
ctx = co.init()
rank, world = ctx.rank, ctx.world_size
out: dict = {}


def forward_of(net):
    return lambda x, y: loss_fn(net(x), y)


for path, compiled in {"compiled": True, "eager": False}.items():
    net = co.wrap(
        build(rank), bucket_size_mb=0.002, first_bucket_mb=0.001, compile_reduction=compiled, check_step_alignment=True
    )
    net.set_train(True)
    opt = nn.Momentum(net.trainable_params(), 0.1, 0.9)
    grad_fn = ms.value_and_grad(forward_of(net), None, opt.parameters)
    raised, updated = [], []
    for step in range(4):
        _loss, grads = grad_fn(*batch(step, rank))
        if step == SKIP_STEP and rank == world - 1:
            continue  # this rank alone skips the step
        try:
            grads = net.reduce(grads)
        except StepMisalignedError as exc:
            raised.append((step, str(exc)))
            break  # as a loop that lets it end the run: the ranks have issued the same collectives
        opt(grads)
        updated.append(step)
    out[path] = {"raised": raised, "updated": updated, "mode": net.comm_stats()["mode"]}
    co.barrier()

write_result(rank, out)
