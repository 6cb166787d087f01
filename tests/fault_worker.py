"""One rank as a process of its own, for fault tests that time when every process has exited.

``python -m tests.fault_worker`` with RANK, WORLD_SIZE, MASTER_PORT set, and:
FAULT_SCENARIO  ``train`` (default: a wrapped MLP and a DistributedOptimizer, FAULT_STEPS steps),
                ``init`` (only the rendezvous) or ``state_on_rank_0`` (a sharded optimizer's state_dict() on
                rank 0 alone, its error caught, the script then ending without co.shutdown());
FAULT_MODEL     ``mlp`` (default) or ``cnn`` (BatchNorm: each forward broadcasts its buffers) for ``train``;
FAULT           ``stop`` (SIGSTOP), ``sleep`` (600 s), ``kill`` (SIGKILL), ``raise`` (an exception in the loop) or
                ``partition`` (runs FAULT_COMMAND, e.g. taking the link down), on rank FAULT_RANK
                before the backward of step FAULT_STEP (before its forward with FAULT_PHASE=forward, where
                the peers' forwards end in the collectives that settle a launch order), after FAULT_DELAY_S
                seconds; unset: no fault.
Prints ``FAULT_AT <unix time>`` just before the fault and ``ERROR <json text>`` for the error a rank
raises (then re-raised: the process exits as a client script would).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time


def _inject(fault: str) -> None:
    time.sleep(float(os.environ.get("FAULT_DELAY_S", "0")))  # (the collectives in flight finish meanwhile)
    print(f"FAULT_AT {time.time():.3f}", flush=True)
    if fault == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    elif fault == "sleep":  # a stall in Python (a slow loader, a long evaluation): its transport threads run on
        time.sleep(600)
    elif fault == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif fault == "raise":
        raise RuntimeError("injected failure in the training loop")
    elif fault == "partition":
        subprocess.run(os.environ["FAULT_COMMAND"], shell=True, check=True)
    else:
        raise ValueError(f"unknown FAULT={fault!r}")


def _train(rank: int) -> None:
    import torch

    import collective_ops as co
    from tests.models import build, rank_batch

    torch.manual_seed(0)
    name = os.environ.get("FAULT_MODEL", "mlp")  # cnn: BatchNorm, whose buffers each forward broadcasts
    model = co.wrap(build(name), bucket_size_mb=0.001)
    model_cls = type(model.module)
    optimizer = co.DistributedOptimizer(model, torch.optim.SGD, lr=0.1)
    fault, fault_rank, fault_step = os.environ.get("FAULT"), int(os.environ.get("FAULT_RANK", "0")), None
    if fault:
        fault_step = int(os.environ.get("FAULT_STEP", "2"))
    phase = os.environ.get("FAULT_PHASE", "backward")
    for step in range(int(os.environ.get("FAULT_STEPS", "5"))):
        x, y = rank_batch(model_cls, step, rank)
        optimizer.zero_grad()
        if step == fault_step and rank == fault_rank and phase == "forward":
            _inject(fault)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        if step == fault_step and rank == fault_rank and phase == "backward":
            _inject(fault)
        loss.backward()
        optimizer.step()
    optimizer.synchronize()
    co.shutdown()


def _state_on_rank_0(rank: int) -> None:
    """Two sharded steps; rank 0 alone calls opt.state_dict() (a collective) as a DDP loop checkpoints, catches the
    StallError and ends without co.shutdown(), while rank 1 waits in a barrier (until rank 0's exit ends it)."""
    import torch

    import collective_ops as co
    from collective_ops.bucketing.diagnosis import StallError
    from tests.models import MLP, build, rank_batch

    torch.manual_seed(0)
    model = co.wrap(build("mlp"), bucket_size_mb=0.001)
    optimizer = co.DistributedOptimizer(model, torch.optim.SGD, lr=0.1, shard=True)
    for step in range(2):
        x, y = rank_batch(MLP, step, rank)
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    if rank == 0:
        try:
            optimizer.state_dict()
        except StallError as exc:
            print("ERROR " + json.dumps(f"{type(exc).__name__}: {exc}"), flush=True)
    else:
        co.barrier()


def main() -> None:
    rank = int(os.environ["RANK"])
    try:
        import collective_ops as co

        co.init("gloo")
        scenario = os.environ.get("FAULT_SCENARIO", "train")
        if scenario == "train":
            _train(rank)
        elif scenario == "state_on_rank_0":
            _state_on_rank_0(rank)
        else:
            co.shutdown()
    except Exception as exc:
        print("ERROR " + json.dumps(f"{type(exc).__name__}: {exc}"), flush=True)
        raise
    print("DONE", flush=True)


if __name__ == "__main__":
    sys.exit(main())
