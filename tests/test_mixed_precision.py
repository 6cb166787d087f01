"""A bf16 model with fp32 main gradients and fp32 master weights (``master_weights=True``), sharded and not,
against the same recipe written in plain torch: each micro-step's bf16 gradient added into an fp32 copy,
averaged across ranks in fp32, AdamW on fp32 masters, cast back to bf16. Bit for bit at 2 ranks, through
``no_sync()`` accumulation (and, unsharded, accumulation by synchronised backwards), a re-initialised layer, a
checkpoint resumed in between, a bucket size changed after ``zero_grad()``, and clipping."""

from __future__ import annotations

import pytest

from tests.harness import run_checks

STEPS = 4
ACCUMULATION = 2
SYNCED_MICRO_STEPS_AT = 0  # unsharded: this step's micro-steps each reduce (no no_sync(), no zero_grad between)
REINIT_AT = 1  # before this step's forward a layer's bias is re-initialised in place (its master follows)
RESUME_AT = 2  # the checkpoint saved after this step is loaded into fresh objects, which train on
REPLAN_AT = 3  # after this step's zero_grad() the bucket size changes (more, smaller buckets)
REINIT = 3  # net.2.bias: its index among the model's parameters
BUCKET = {"bucket_size_mb": 0.004, "first_bucket_mb": 0.004}  # several buckets on the small MLP
ADAMW = {"lr": 3e-3, "weight_decay": 0.01}
MAX_NORM = 0.5


def _batches(step: int, micro: int, rank: int):
    import torch

    gen = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    return torch.randn(8, 16, generator=gen).to(torch.bfloat16), torch.randint(0, 4, (8,), generator=gen)


def _reference(rank: int, world: int, clip: bool, synced_micro_steps: bool) -> dict:
    """The recipe in plain torch on every rank's data (no library): fp32 main gradients and fp32 masters.
    ``synced_micro_steps``: at SYNCED_MICRO_STEPS_AT each micro-step's backward averages the main gradients,
    as a backward outside no_sync() does under DDP."""
    import torch
    import torch.distributed as dist

    from tests.models import build

    def average(grads):
        for g in grads:
            dist.all_reduce(g)
            g.div_(world)

    model = build("mlp").to(torch.bfloat16)
    params = list(model.parameters())
    masters = [p.detach().float().clone() for p in params]
    optimizer = torch.optim.AdamW(masters, **ADAMW)
    for step in range(STEPS):
        if step == REINIT_AT:
            with torch.no_grad():
                params[REINIT].zero_()
                masters[REINIT].zero_()
        main = [torch.zeros_like(m) for m in masters]
        each = synced_micro_steps and step == SYNCED_MICRO_STEPS_AT
        for micro in range(ACCUMULATION):
            x, y = _batches(step, micro, rank)
            loss = torch.nn.functional.cross_entropy(model(x).float(), y)
            loss.backward()
            for g, p in zip(main, params):
                g.add_(p.grad)  # the bf16 gradient added into its fp32 copy
                p.grad = None
            if each or micro == ACCUMULATION - 1:
                average(main)
        if clip:
            norms = torch.stack([torch.linalg.vector_norm(g) for g in main])
            coefficient = torch.clamp(MAX_NORM / (torch.linalg.vector_norm(norms) + 1e-6), max=1.0)
            for g in main:
                g.mul_(coefficient)
        for m, g in zip(masters, main):
            m.grad = g
        optimizer.step()
        with torch.no_grad():
            for p, m in zip(params, masters):
                p.copy_(m)
    return _result(model, masters)


def _ours(rank: int, world: int, shard: bool, clip: bool) -> dict:
    """The same, as a client writes it with collective_ops: accumulation under no_sync() (unsharded, one step by
    synchronised backwards), a bias re-initialised in place, a checkpoint saved after step RESUME_AT and loaded
    into a fresh model and optimizer, a bucket size changed after zero_grad(), evaluation on rank 0 alone."""
    import torch

    import collective_ops as co
    from tests.models import build

    def fresh():
        model = co.wrap(build("mlp").to(torch.bfloat16), **BUCKET)
        optimizer = co.DistributedOptimizer(
            model, torch.optim.AdamW, shard=shard, master_weights=True, grad_dtype=torch.float32, **ADAMW
        )
        return model, optimizer

    model, optimizer = fresh()
    grads_seen = []
    for step in range(STEPS):
        optimizer.zero_grad()
        if step == REPLAN_AT:
            model.set_bucket_size(0.002, 0.002)
        if step == REINIT_AT:
            optimizer.synchronize()  # (the last step's owed updates land first)
            with torch.no_grad():
                model.module.net[2].bias.zero_()
        for micro in range(ACCUMULATION):
            x, y = _batches(step, micro, rank)
            synced = micro == ACCUMULATION - 1 or (step == SYNCED_MICRO_STEPS_AT and not shard)
            with torch.enable_grad() if synced else model.no_sync():
                torch.nn.functional.cross_entropy(model(x).float(), y).backward()
            grads_seen += [p.grad is not None for p in model.module.parameters()]
        if clip:
            optimizer.clip_grad_norm_(MAX_NORM)
        optimizer.step()
        if rank == 0:
            with torch.no_grad():
                model.module(torch.zeros(2, 16, dtype=torch.bfloat16))  # an evaluation on one rank
        if step + 1 == RESUME_AT:
            weights, state = model.state_dict(), optimizer.state_dict()
            model, optimizer = fresh()
            model.load_state_dict(weights)
            optimizer.load_state_dict(state)
    state = optimizer.state_dict()["state"]
    masters = [state[i]["master_param"] for i in range(len(state))]
    out = _result(model.module, masters)
    out["grads_seen"] = any(grads_seen)
    out["state_dtypes"] = sorted({str(v.dtype) for entry in state.values() for v in entry.values()})
    return out


def _result(model, masters) -> dict:
    import torch

    weights = {n: p.detach().float().numpy().copy() for n, p in model.named_parameters()}
    return {"weights": weights, "masters": [m.detach().to(torch.float32).numpy().copy() for m in masters]}


def _bad_input(rank: int, world: int) -> dict[str, str]:
    import torch

    import collective_ops as co
    from tests.models import build

    def error(make, kind: type = ValueError) -> str:
        try:
            make()
        except (kind, TypeError) as exc:
            return str(exc)
        return "accepted"

    bf16 = lambda **kw: co.wrap(build("mlp").to(torch.bfloat16), **kw)  # noqa: E731
    masters = lambda model, cls=torch.optim.AdamW, **kw: co.DistributedOptimizer(  # noqa: E731
        model, cls, master_weights=True, **kw
    )
    out = {
        "fp32_masters": error(lambda: masters(co.wrap(build("mlp")))),
        "bad_dtype": error(lambda: co.DistributedOptimizer(bf16(), torch.optim.AdamW, grad_dtype="int8")),
        "no_masters": error(lambda: co.DistributedOptimizer(bf16(), torch.optim.AdamW, grad_dtype="float32")),
        "not_elementwise": error(lambda: masters(bf16(), torch.optim.Adagrad, lr=0.1)),
        "compression": error(lambda: masters(bf16(compression="bf16"))),
        "unused": error(lambda: masters(bf16(find_unused_parameters=True))),
        "not_views": error(lambda: masters(bf16(gradient_as_bucket_view=False))),
    }
    # a bucket holding parameters of two groups cannot be one flat update; the model is left as it was
    split = bf16(bucket_size_mb=25)
    first, *rest = split.module.parameters()
    out["two_groups"] = error(lambda: masters(split, params=[{"params": [first], "lr": 0.1}, {"params": rest}]))
    out["unchanged_after_refusal"] = split.manager.grad_dtype is None and split.optimizer is None
    # sync_gradients() and a GradScaler read p.grad, which main gradients leave None
    model = bf16()
    optimizer = masters(model)
    x, y = _batches(0, 0, rank)
    with model.no_sync():
        torch.nn.functional.cross_entropy(model(x).float(), y).backward()
    out["sync_gradients"] = error(model.sync_gradients, RuntimeError)
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(torch.nn.functional.cross_entropy(model(x).float(), y)).backward()
    out["grad_scaler"] = error(lambda: scaler.step(optimizer), RuntimeError)
    return out


def _checks(rank: int, world: int) -> dict:
    return {
        "reference": lambda: _reference(rank, world, clip=False, synced_micro_steps=True),
        "reference_clipped": lambda: _reference(rank, world, clip=True, synced_micro_steps=True),
        "reference_sharded": lambda: _reference(rank, world, clip=False, synced_micro_steps=False),
        "reference_sharded_clipped": lambda: _reference(rank, world, clip=True, synced_micro_steps=False),
        "replicated": lambda: _ours(rank, world, shard=False, clip=False),
        "replicated_clipped": lambda: _ours(rank, world, shard=False, clip=True),
        "sharded": lambda: _ours(rank, world, shard=True, clip=False),
        "sharded_clipped": lambda: _ours(rank, world, shard=True, clip=True),
        "bad_input": lambda: _bad_input(rank, world),
    }


@pytest.fixture(scope="module")
def two_ranks():
    return run_checks(2, _checks, timeout=240)


def _assert_equal(ours: dict, reference: dict, masters_tol: float = 0.0, weights_rtol: float = 0.0) -> None:
    import numpy as np

    for name, value in reference["weights"].items():
        np.testing.assert_allclose(ours["weights"][name], value, rtol=weights_rtol, atol=0, err_msg=name)
    for index, (got, want) in enumerate(zip(ours["masters"], reference["masters"])):
        np.testing.assert_allclose(got, want, rtol=masters_tol, atol=masters_tol * 0.01, err_msg=f"master {index}")


@pytest.mark.parametrize("layout", ["replicated", "sharded"])
def test_bf16_with_fp32_main_grads_and_masters_equals_the_plain_torch_recipe(two_ranks, layout: str) -> None:
    reference = "reference" if layout == "replicated" else "reference_sharded"
    for rank in range(2):
        ours = two_ranks[rank][layout]
        _assert_equal(ours, two_ranks[rank][reference])
        assert not ours["grads_seen"], "main gradients leave p.grad None after backward"
        assert ours["state_dtypes"] == ["torch.float32"], ours["state_dtypes"]


def test_clipping_the_fp32_main_grads_equals_torch_unsharded_and_is_within_rounding_sharded(two_ranks) -> None:
    """Unsharded, ``opt.clip_grad_norm_`` is torch's arithmetic on the fp32 main gradients: bit for bit. Sharded,
    each rank sums its own shards' norms first: the masters within fp32 rounding (1e-5 relative, 1e-7 absolute), the bf16 weights within one
    rounding of bf16 (a master that lands beside a rounding boundary)."""
    for rank in range(2):
        _assert_equal(two_ranks[rank]["replicated_clipped"], two_ranks[rank]["reference_clipped"])
        _assert_equal(
            two_ranks[rank]["sharded_clipped"],
            two_ranks[rank]["reference_sharded_clipped"],
            masters_tol=1e-5,
            weights_rtol=2**-7,
        )


def test_mixed_precision_options_that_do_not_fit_are_refused_with_what_to_do(two_ranks) -> None:
    errors = two_ranks[0]["bad_input"]
    assert "master_weights=True keeps fp32 masters of bf16/fp16 parameters" in errors["fp32_masters"]
    assert "grad_dtype='int8'" in errors["bad_dtype"] and "torch.float32" in errors["bad_dtype"]
    assert "pass master_weights=True too" in errors["no_masters"]
    assert "Adagrad" in errors["not_elementwise"] and "element-wise" in errors["not_elementwise"]
    assert "compression" in errors["compression"]
    assert "find_unused_parameters" in errors["unused"]
    assert "gradient_as_bucket_view=True" in errors["not_views"]
    assert "several parameter groups" in errors["two_groups"] and errors["unchanged_after_refusal"]
    assert "run the last micro-step's backward outside no_sync()" in errors["sync_gradients"]
    assert "GradScaler with main gradients" in errors["grad_scaler"]
