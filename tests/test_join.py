"""Uneven inputs: ``with model.join():`` against torch DDP's ``join()``, on real Gloo ranks with 5/7/9 batches."""

from __future__ import annotations

import numpy as np
import pytest

from tests.harness import run_ranks
from tests.reference import assert_identical, snapshot

BATCHES = {0: 5, 1: 7, 2: 9}


def _uneven(
    rank: int,
    model,
    use_join_class: bool = False,
    model_cls=None,
    divide: bool = True,
    distributed: bool = False,
    arrange=None,
    shard: bool = False,
    zero_grad_last: bool = False,
    scaled: bool = False,
    snapshot_wrapper: bool = False,
    scheduled: bool = False,
) -> dict:
    import warnings

    import torch
    from torch.distributed.algorithms import Join

    import collective_ops as co
    from tests.models import MLP, rank_batch

    model_cls = model_cls or MLP
    if distributed:  # updates overlapped with the next forward
        optimizer = co.DistributedOptimizer(model, torch.optim.SGD, lr=0.1, momentum=0.9, shard=shard)
        if arrange is not None:
            arrange(model)
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if use_join_class:  # as DDP-style code lists its joinables: the model, and the optimizer when it is one
        context = Join([model, optimizer] if distributed else [model], divide_by_initial_world_size=divide)
    else:
        context = model.join(divide_by_initial_world_size=divide)
    # a GradScaler's power-of-two scale is undone exactly: the weights of the loop without it, a joined rank's too
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, enabled=scaled)
    # an LR scheduler steps on the ranks still training only (a joined rank's loop is over)
    scheduler = (
        torch.optim.lr_scheduler.OneCycleLR(optimizer, 0.2, total_steps=max(BATCHES.values())) if scheduled else None
    )
    with context, warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch announces a change of scaler.step's protocol
        for step in range(BATCHES[rank]):
            x, y = rank_batch(model_cls, step, rank)
            loss = torch.nn.functional.cross_entropy(model(x), y)
            if not zero_grad_last:
                optimizer.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            if zero_grad_last:  # a joined rank then shadows steps with no gradients left on its parameters
                optimizer.zero_grad()
            if scheduler is not None:
                scheduler.step()
    owner = model if distributed or snapshot_wrapper else model.module  # ours: the wrapper's (owed updates land first)
    return snapshot(owner)


def join_checks(rank: int, world: int) -> dict:
    import torch

    import collective_ops as co
    from tests.models import SmallCNN, UntiedLM, build

    out = {
        "ddp": _uneven(rank, torch.nn.parallel.DistributedDataParallel(build("mlp"))),
        "ours": _uneven(rank, co.wrap(build("mlp"), bucket_size_mb=0.01)),
        "ours_join_class": _uneven(rank, co.wrap(build("mlp"), bucket_size_mb=0.01), use_join_class=True),
        "ddp_cnn": _uneven(rank, torch.nn.parallel.DistributedDataParallel(build("cnn")), True, SmallCNN),
        "ours_cnn": _uneven(rank, co.wrap(build("cnn"), bucket_size_mb=0.001), model_cls=SmallCNN),
        # divided by the ranks still active, as DDP's join(divide_by_initial_world_size=False)
        "ddp_active": _uneven(rank, torch.nn.parallel.DistributedDataParallel(build("mlp")), divide=False),
        "ours_active": _uneven(rank, co.wrap(build("mlp"), bucket_size_mb=0.01), divide=False),
        "ours_active_join_class": _uneven(rank, co.wrap(build("mlp"), bucket_size_mb=0.01), True, divide=False),
        "ours_distributed": _uneven(rank, co.wrap(build("mlp"), bucket_size_mb=0.01), distributed=True),
        "ours_distributed_join_class": _uneven(
            rank, co.wrap(build("mlp"), bucket_size_mb=0.01), True, distributed=True
        ),
        # a row-sparse table: a joined rank's shadow steps take part in the lookups' exchange with no lookups
        "ddp_lm": _uneven(rank, torch.nn.parallel.DistributedDataParallel(build("untied-lm")), model_cls=UntiedLM),
        "ours_lm": _uneven(rank, co.wrap(build("untied-lm"), bucket_size_mb=0.001), model_cls=UntiedLM),
        "ours_lm_distributed": _uneven(
            rank, co.wrap(build("untied-lm"), bucket_size_mb=0.001), model_cls=UntiedLM, distributed=True
        ),
    }

    def held_back(wrapped) -> None:  # a planned order: the first and last buckets held to the end of backward
        from collective_ops.bucketing.update.schedule import held_order

        count = len(wrapped.manager.plan.buckets)
        wrapped.manager.set_launch_order(held_order(count, count - 1, 1))

    out["ours_distributed_held"] = _uneven(
        rank,
        co.wrap(build("mlp"), bucket_size_mb=0.01, rebuild_buckets=False),
        distributed=True,
        arrange=held_back,
    )

    def held_back_in_chunks(wrapped) -> None:  # a chunked order: the shadow steps send the same chunks
        from collective_ops.bucketing.update.schedule import held_order_in_chunks

        chunks = [3] * len(wrapped.manager.plan.buckets)
        wrapped.manager.set_launch_order(held_order_in_chunks(chunks, sum(chunks) - 2, 2))

    out["ours_distributed_held_in_chunks"] = _uneven(
        rank,
        co.wrap(build("mlp"), bucket_size_mb=0.01, rebuild_buckets=False),
        distributed=True,
        arrange=held_back_in_chunks,
    )
    # sharded: a joined rank keeps updating its shards (and all-gathering them) in the steps it shadows
    out["ours_sharded"] = _uneven(rank, co.wrap(build("mlp"), bucket_size_mb=0.01), distributed=True, shard=True)
    out["ours_sharded_scaled"] = _uneven(  # a joined rank steps through its GradScaler, as its peers still do
        rank, co.wrap(build("mlp"), bucket_size_mb=0.01), distributed=True, shard=True, scaled=True
    )
    out["ours_sharded_join_class"] = _uneven(
        rank, co.wrap(build("mlp"), bucket_size_mb=0.01), True, distributed=True, shard=True
    )
    out["ours_sharded_zero_grad_last"] = _uneven(
        rank, co.wrap(build("mlp"), bucket_size_mb=0.01), distributed=True, shard=True, zero_grad_last=True
    )
    out["ours_sharded_active"] = _uneven(
        rank, co.wrap(build("mlp"), bucket_size_mb=0.01), divide=False, distributed=True, shard=True
    )
    out["ddp_scheduled"] = _uneven(rank, torch.nn.parallel.DistributedDataParallel(build("mlp")), scheduled=True)
    out["ours_sharded_scheduled"] = _uneven(  # lr and momentum from the active ranks' OneCycleLR
        rank, co.wrap(build("mlp"), bucket_size_mb=0.01), distributed=True, shard=True, scheduled=True
    )
    out["ours_sharded_lm"] = _uneven(
        rank, co.wrap(build("untied-lm"), bucket_size_mb=0.001), model_cls=UntiedLM, distributed=True, shard=True
    )
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_join_equals_ddp_join_with_uneven_inputs(world: int) -> None:
    results = run_ranks(world, join_checks, timeout=240)
    for rank, out in enumerate(results):
        for ours, ddp in (
            ("ours", "ddp"),
            ("ours_join_class", "ddp"),
            ("ours_active", "ddp_active"),
            ("ours_active_join_class", "ddp_active"),
            ("ours_distributed", "ddp"),
            ("ours_distributed_join_class", "ddp"),
            ("ours_distributed_held", "ddp"),
            ("ours_distributed_held_in_chunks", "ddp"),
            ("ours_lm", "ddp_lm"),
            ("ours_lm_distributed", "ddp_lm"),
            ("ours_sharded", "ddp"),
            ("ours_sharded_scaled", "ddp"),
            ("ours_sharded_join_class", "ddp"),
            ("ours_sharded_active", "ddp_active"),
            ("ours_sharded_zero_grad_last", "ddp"),
            ("ours_sharded_lm", "ddp_lm"),
            ("ours_sharded_scheduled", "ddp_scheduled"),
        ):
            if world == 2:
                assert_identical(out[ours], out[ddp], f"{ours} vs DDP join, rank {rank}")
            else:  # Gloo's ring sums 3 operands in a bucket-layout dependent order
                for key, value in out[ddp].items():
                    np.testing.assert_allclose(out[ours][key], value, rtol=1e-5, atol=1e-6, err_msg=f"{ours} {key}")
        assert not all(np.array_equal(out["ddp_active"][k], out["ddp"][k]) for k in out["ddp"])  # they differ
        # with BatchNorm buffers: after join every rank holds the last joiner's parameters and buffers, as DDP's
        for key, value in out["ddp_cnn"].items():
            np.testing.assert_allclose(out["ours_cnn"][key], value, rtol=1e-5, atol=1e-6, err_msg=f"cnn {key}")
    for key in results[0]["ours"]:  # every rank ends with the same model
        assert all(np.array_equal(r["ours"][key], results[0]["ours"][key]) for r in results)


def join_powersgd_checks(rank: int, world: int) -> dict:
    """PowerSGD from step 2 (rank 0 joins after 3 compressed steps), several buckets: a plain optimizer, and the
    distributed optimizer, whose step ends with the Q factors' allreduce of its last bucket still to launch."""
    import collective_ops as co
    from tests.models import build

    models = []

    def compressed():
        models.append(co.wrap(build("mlp"), bucket_size_mb=0.01, compression=co.PowerSGD(rank=2, start_iter=2)))
        return models[-1]

    out = {
        "plain": _uneven(rank, compressed(), snapshot_wrapper=True),
        "distributed": _uneven(rank, compressed(), distributed=True),
        "distributed_join_class": _uneven(rank, compressed(), True, distributed=True),
    }
    hooks = [model.manager.comm_hook for model in models]
    out["compressed"] = all(hook.compressing and hook.numel_after < hook.numel_before for hook in hooks)
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_join_with_powersgd_under_the_distributed_optimizer_equals_the_plain_optimizer(world: int) -> None:
    """A joined rank's shadow steps launch PowerSGD's two allreduces per bucket in the order its peers do, whose
    distributed optimizer defers its updates to the next forward (there Join's own allreduce comes first): the
    run finishes and equals the same compression with a plain optimizer, bit for bit."""
    results = run_ranks(world, join_powersgd_checks, timeout=120)
    for rank, out in enumerate(results):
        assert out["compressed"], f"rank {rank}: PowerSGD never compressed a step"
        assert_identical(out["distributed"], out["plain"], f"DistributedOptimizer + PowerSGD under join, rank {rank}")
        assert_identical(out["distributed_join_class"], out["plain"], f"... with Join([model, opt]), rank {rank}")
    for key in results[0]["plain"]:  # every rank ends with the same model
        assert all(np.array_equal(r["plain"][key], results[0]["plain"][key]) for r in results)


def test_a_joined_rank_takes_each_scheduled_setting_of_its_active_peers_in_place() -> None:
    """share_settings on a joined rank: tensors filled in place (a tensor lr, as schedulers fill it; tensor betas),
    Adam's betas kept a tuple, an int kept an int only where the value is whole (an int lr of 1 may become 0.5);
    settings no scheduler changes (eps) left as the rank built them; a different number of settings on some rank
    refused on every rank, naming what to do."""
    import torch

    from collective_ops.torch.optim.joined_settings import share_settings

    def groups(lr, betas, momentum, eps):
        return [
            {"lr": torch.tensor(lr), "betas": betas, "weight_decay": 0.01, "eps": eps},
            {"lr": lr, "momentum": momentum},
        ]

    # the active peer's lr (a tensor), betas (tensors), weight_decay; second group's lr and momentum
    active = [float(torch.tensor(0.25)), float(torch.tensor(0.85)), float(torch.tensor(0.99)), 0.01, 0.5, 1.0]

    class Ranks:  # the active peer and this joined rank: the number of values, then the max of the values
        rank = 1

        def __init__(self, counts: tuple = (len(active), len(active))) -> None:
            self.replies = iter([[max(counts), -min(counts)], active])

        def reduce_floats(self, values, op):
            assert op == "max"
            return next(self.replies)

    joined = groups(0.5, (torch.tensor(0.9), torch.tensor(0.999)), 0, 1e-6)
    joined[1]["lr"] = 1
    tensor_lr, beta1 = joined[0]["lr"], joined[0]["betas"][0]
    share_settings(Ranks(), joined, active=False)
    assert joined[0]["lr"] is tensor_lr and float(tensor_lr) == 0.25
    assert isinstance(joined[0]["betas"], tuple) and joined[0]["betas"][0] is beta1
    assert [float(b) for b in joined[0]["betas"]] == [float(torch.tensor(0.85)), float(torch.tensor(0.99))]
    assert joined[1] == {"lr": 0.5, "momentum": 1} and isinstance(joined[1]["momentum"], int)
    assert joined[0]["eps"] == 1e-6
    with pytest.raises(ValueError, match="differ in number between ranks.*same parameter groups"):
        share_settings(Ranks(counts=(7, 6)), groups(0.5, (0.9, 0.999), 0, 1e-6), active=False)
