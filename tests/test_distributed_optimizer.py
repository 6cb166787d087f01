"""DistributedOptimizer against torch DDP + the same optimizer class, on real Gloo ranks (one spawn per world size)."""

from __future__ import annotations

import contextlib
import functools
import time

import numpy as np
import pytest
import torch

from collective_ops.bucketing.update.planner import TRIAL_BLOCK_STEPS, TRIAL_CANDIDATES, TRIAL_ROUNDS
from tests.harness import run_checks, run_ranks
from tests.reference import InTurn, assert_identical, snapshot, two_losses_per_step

STEPS = 20
LEAD_S = 0.05  # a backward spent before the first gradient in the order trial's model (see _SlowOutputBackward)


class _SlowOutputBackward(torch.autograd.Function):
    """Identity whose backward takes LEAD_S: an output layer whose backward runs before any gradient is ready."""

    @staticmethod
    def forward(ctx, output: torch.Tensor) -> torch.Tensor:
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        time.sleep(LEAD_S)
        return grad


def _make_optimizer(kind: str):
    import torch

    if kind == "sgd":
        return torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}
    if kind == "adamw_tensor_lr":  # (a new tensor each call: an LR scheduler fills it in place)
        return torch.optim.AdamW, {"lr": torch.tensor(1e-2), "weight_decay": 0.01}
    return torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.01}


def _train(
    rank: int, model, optimizer, model_cls, *, scheduler=None, accumulate: int = 1, steps: int = STEPS, unused=None
):
    """The loop of the issue: forward, zero_grad, backward, step (micro-steps under no_sync when accumulating)."""
    import torch

    from tests.models import rank_batch

    for step in range(steps):
        for micro in range(accumulate):
            x, y = rank_batch(model_cls, accumulate * step + micro, rank)
            quiet = micro < accumulate - 1
            with model.no_sync() if quiet else torch.enable_grad():
                kwargs = {} if unused is None else {"use_branch": unused(rank, step)}
                loss = torch.nn.functional.cross_entropy(model(x, **kwargs), y)
                if micro == 0:
                    optimizer.zero_grad()
                loss.backward()
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
    if not isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return snapshot(model)  # the wrapper's state_dict: the last step's owed updates land first
    return snapshot(model.module)


def _pair(
    rank: int, build, opt_kind: str, *, find_unused: bool = False, wrap_kwargs=None, arrange=None, **train_kwargs
) -> tuple[dict, dict]:
    """(DDP + optimizer, wrap + DistributedOptimizer) after the same training; ``arrange(wrapped)`` before it."""
    import torch

    import collective_ops as co

    scheduler_of = train_kwargs.pop("scheduler_of", None)
    ddp = torch.nn.parallel.DistributedDataParallel(build(), find_unused_parameters=find_unused)
    cls, kwargs = _make_optimizer(opt_kind)
    plain = cls(ddp.parameters(), **kwargs)
    ours_model = co.wrap(
        build(), bucket_size_mb=0.004, first_bucket_mb=0.001, find_unused_parameters=find_unused, **(wrap_kwargs or {})
    )
    ours = co.DistributedOptimizer(ours_model, cls, **_make_optimizer(opt_kind)[1])
    if arrange is not None:
        arrange(ours_model)
    results = []
    for model, optimizer in ((ddp, plain), (ours_model, ours)):
        scheduler = scheduler_of(optimizer) if scheduler_of else None
        results.append(_train(rank, model, optimizer, **train_kwargs, scheduler=scheduler))
    return results[0], results[1]


def clipped_step(rank: int, model, optimizer) -> tuple[float, dict]:
    """One step clipped to norm 0.5: torch's clip_grad_norm_ for DDP, the optimizer's own for ours."""
    import torch

    import collective_ops as co
    from tests.models import MLP, rank_batch

    x, y = rank_batch(MLP, 0, rank)
    loss = torch.nn.functional.cross_entropy(model(x), y) * 50
    optimizer.zero_grad()
    loss.backward()
    if isinstance(optimizer, co.torch.DistributedOptimizer):
        norm = optimizer.clip_grad_norm_(0.5)
    else:
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
    optimizer.step()
    return float(norm), snapshot(model.module)  # the inner module's own state_dict: owed updates land first


def _ddp_or_ours(ours: bool, build, make_optimizer, wrap_kwargs: dict | None = None) -> tuple:
    """(model, optimizer): ``wrap`` + ``make_optimizer(model)``, or the reference, torch DDP + AdamW."""
    import torch

    import collective_ops as co

    if ours:
        model = co.wrap(build(), bucket_size_mb=0.004, **(wrap_kwargs or {}))
        return model, make_optimizer(model)
    model = torch.nn.parallel.DistributedDataParallel(build())
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def assert_evaluations_equal_ddp(results: list[dict], label: str) -> None:
    """The ``eval_between_steps`` results of every rank (under no_grad, and under inference_mode): weights and
    evaluation outputs as DDP's."""
    for rank, out in enumerate(results):
        for key in ("eval_between_steps", "inference_between_steps"):
            (ddp, ddp_evals), (ours, our_evals) = out[key]
            assert_identical(ours, ddp, f"weights, {key}, {label}rank {rank}")
            assert_identical(our_evals, ddp_evals, f"evaluation outputs after each step, {key}, {label}rank {rank}")


def assert_scaled_training_equals_ddp(results: list[dict], label: str, clip_exact: bool = True) -> None:
    """The ``scaled_training`` results of every rank: one overflow (scale halved once), weights as DDP's; also
    with ``scaler.unscale_(opt)`` and a clip between backward and step (``clip_exact=False``: the norm summed from
    shards, in another order than torch's, so within fp32 rounding)."""
    for rank, out in enumerate(results):
        for key in ("grad_scaler", "grad_scaler_one_element", "grad_scaler_unscale_clip", "grad_scaler_new_protocol"):
            if key not in out:  # (sharded: refused, checked apart)
                continue
            (ddp, ddp_scale), (ours, our_scale) = out[key]
            assert ddp_scale == our_scale == 2.0**9, f"{key}, {label}rank {rank}: one overflow, halved once"
            if clip_exact or key != "grad_scaler_unscale_clip":
                assert_identical(ours, ddp, f"{key}, {label}rank {rank}")
                continue
            for name in ddp:
                np.testing.assert_allclose(ours[name], ddp[name], rtol=1e-6, atol=1e-7, err_msg=f"{key}: {name}")


def zero_grad_after_step(rank: int, build, make_optimizer, set_to_none: bool, steps: int = 6) -> tuple[dict, dict]:
    """(DDP, ours) with the loop ordered backward, step, zero_grad: zero_grad comes while updates are owed."""
    import torch

    from tests.models import MLP, rank_batch

    results = []
    for ours in (False, True):
        model, optimizer = _ddp_or_ours(ours, build, make_optimizer)
        for step in range(steps):
            x, y = rank_batch(MLP, step, rank)
            torch.nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=set_to_none)
        results.append(snapshot(model if ours else model.module))
    return results[0], results[1]


def eval_between_steps(
    rank: int, build, make_optimizer, steps: int = 5, inference_mode: bool = False
) -> tuple[tuple, tuple]:
    """(DDP, ours) evaluating under model.eval() and no_grad after every step: the evaluation sees updated weights.
    With ``inference_mode``, under ``torch.inference_mode()`` instead (Lightning's validation), and once before
    training too (its sanity check): the owed updates it pays for must leave no inference tensor behind."""
    import torch

    from tests.models import MLP, rank_batch

    def evaluate(model, evaluations: list) -> None:
        model.eval()
        with torch.inference_mode() if inference_mode else torch.no_grad():
            evaluations.append(model(rank_batch(MLP, 100, rank)[0]).numpy().copy())
        model.train()

    results = []
    for ours in (False, True):
        model, optimizer = _ddp_or_ours(ours, build, make_optimizer)
        evaluations = []
        if inference_mode:
            evaluate(model, evaluations)
        for step in range(steps):
            x, y = rank_batch(MLP, step, rank)
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
            evaluate(model, evaluations)
        results.append((snapshot(model if ours else model.module), evaluations))
    return results[0], results[1]


class MatmulSGD(torch.optim.Optimizer):
    """SGD whose update goes through a matmul, as Shampoo-like preconditioners' do: autocast would run it in bf16."""

    def __init__(self, params, lr: float = 0.1) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    g = p.grad.reshape(p.grad.shape[0], -1)
                    identity = torch.eye(g.shape[1], dtype=g.dtype, device=g.device)
                    p.add_(torch.mm(g, identity).reshape(p.shape), alpha=-group["lr"])


def autocast_forward(rank: int, steps: int = 6) -> tuple:
    """(DDP, ours) with the forward under bf16 autocast and an optimizer whose update is a matmul, the
    reductions landing late so that every update is applied in the next forward's pre-hooks, inside its
    autocast: the update must run in fp32 there, as a plain step after backward does."""
    import torch

    import collective_ops as co
    from tests.models import MLP, build, rank_batch

    results = []
    for ours in (False, True):
        if ours:
            model = co.wrap(build("mlp"), bucket_size_mb=0.004, comm_hook=late_allreduce)
            optimizer = co.DistributedOptimizer(model, MatmulSGD, lr=0.1)
        else:
            model = torch.nn.parallel.DistributedDataParallel(build("mlp"))
            optimizer = MatmulSGD(model.parameters(), lr=0.1)
        for step in range(steps):
            x, y = rank_batch(MLP, step, rank)
            optimizer.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logits = model(x)
            torch.nn.functional.cross_entropy(logits.float(), y).backward()
            optimizer.step()
        results.append(snapshot(model.module))
    return results[0], results[1]


def step_with_closure(rank: int, build, make_optimizer, steps: int = 4) -> tuple[tuple, tuple]:
    """(DDP, ours) stepping through a closure that runs zero_grad, the forward and the backward, as Lightning's
    automatic optimization calls ``optimizer.step(closure)``: weights, and the losses step() returned."""
    import torch

    from tests.models import MLP, rank_batch

    results = []
    for ours in (False, True):
        model, optimizer = _ddp_or_ours(ours, build, make_optimizer)
        losses = []
        for step in range(steps):
            x, y = rank_batch(MLP, step, rank)

            def closure(x=x, y=y, model=model, optimizer=optimizer):
                optimizer.zero_grad()
                loss = torch.nn.functional.cross_entropy(model(x), y)
                loss.backward()
                return loss

            losses.append(float(optimizer.step(closure)))
        results.append((snapshot(model if ours else model.module), losses))
    return results[0], results[1]


def assert_closure_steps_equal_ddp(results: list[dict], label: str) -> None:
    for rank, out in enumerate(results):
        (ddp, ddp_losses), (ours, our_losses) = out["closure"]
        assert_identical(ours, ddp, f"{label}weights after closure steps, rank {rank}")
        assert our_losses == ddp_losses, f"{label}losses step(closure) returned, rank {rank}"


def resumed_through_torch_dcp(rank: int, steps: int = 3, more: int = 2, shard: bool = False) -> tuple:
    """torch.distributed.checkpoint's get_state_dict() after ``steps``, saved with ``dcp.save`` (sharded: each rank
    writes its own part), then loaded as DCP's docs load (``get_state_dict`` of the fresh pair, ``dcp.load`` into
    it, then set) into a fresh model (other initial weights) and a fresh optimizer (no state yet: DCP initialises
    it with a zero-lr step), the model's state first and the optimizer's after it, as a loop restoring them one by
    one (torchtitan's) does (set_state_dict() loads the optimizer first: its initial step would not show on the
    weights), ``more`` steps; and the same into torch's DDP + AdamW (the checkpoint names entries as the model
    does). (The run continued, resumed as ours, resumed into DDP.)"""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_model_state_dict, set_optimizer_state_dict

    import collective_ops as co
    from tests.models import MLP, build
    from tests.reference import remove_shared_folder, shared_temporary_folder

    settings = {"lr": 1e-2, "weight_decay": 0.01}

    def ours(seed: int) -> tuple:
        model = co.wrap(build("mlp", seed=seed), bucket_size_mb=0.004)
        return model, co.DistributedOptimizer(model, torch.optim.AdamW, shard=shard, **settings)

    def ddp(seed: int) -> tuple:
        model = torch.nn.parallel.DistributedDataParallel(build("mlp", seed=seed))
        return model, torch.optim.AdamW(model.parameters(), **settings)

    model, opt = ours(0)
    _train(rank, model, opt, MLP, steps=steps)
    path = shared_temporary_folder()
    model_state, optim_state = get_state_dict(model, opt)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=path)
    results = [_train(rank, model, opt, MLP, steps=more)]
    for build_pair in (ours, ddp):
        resumed, resumed_opt = build_pair(1)
        model_state, optim_state = get_state_dict(resumed, resumed_opt)
        dcp.load({"model": model_state, "optim": optim_state}, checkpoint_id=path)
        set_model_state_dict(resumed, model_state)
        set_optimizer_state_dict(resumed, resumed_opt, optim_state)
        results.append(_train(rank, resumed, resumed_opt, MLP, steps=more))
    remove_shared_folder(path)
    return tuple(results)


def state_read_after_step(rank: int, steps: int = 4) -> tuple[list, list]:
    """(DDP + AdamW, ours) AdamW's first moments read from ``optimizer.state`` right after every step(), the
    reductions landing late so that the updates are owed there: ours must apply them first."""
    import torch

    import collective_ops as co
    from tests.models import MLP, build, rank_batch

    results = []
    for ours in (False, True):
        model, optimizer = _ddp_or_ours(
            ours,
            lambda: build("mlp"),
            lambda m: co.DistributedOptimizer(m, torch.optim.AdamW, lr=1e-2),
            {"comm_hook": late_allreduce},
        )
        params, moments = list(model.module.parameters()), []
        for step in range(steps):
            x, y = rank_batch(MLP, step, rank)
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
            moments.append([optimizer.state[p]["exp_avg"].clone().numpy() for p in params])
        results.append(moments)
    return results[0], results[1]


def _step_without_scaler_argument(optimizer, *args, **kwargs):
    """``optimizer``'s class step, behind a signature without ``grad_scaler``."""
    return type(optimizer).step(optimizer, *args, **kwargs)


def scaled_training(
    rank: int,
    build,
    make_optimizer,
    steps: int = 6,
    unscale_clip: bool = False,
    wrap_kwargs: dict | None = None,
    one_element: bool = False,
    new_protocol: bool = False,
    torch_clip: bool = False,
) -> tuple[tuple, tuple]:
    """(DDP, ours) with torch.amp.GradScaler's loop, step 2 overflowing (skipped, the scale halved): the whole
    loss, or with ``one_element`` one element of the first weight's gradient on rank 1 only (sharded, its sum
    then lives in one rank's shard). With ``unscale_clip``, torch's recipe for clipping: ``scaler.unscale_(opt)``
    right after backward, then a clip to norm 0.5 (torch's for DDP, the optimizer's own for ours; with
    ``torch_clip``, torch's over ``model.parameters()`` for ours too, after ``opt.gather_gradients()``). With
    ``new_protocol``, ours is stepped by torch's announced GradScaler protocol (``grad_scale`` and ``found_inf``
    set on the optimizer, no ``grad_scaler`` argument): torch 2.13's GradScaler takes it for an optimizer whose
    ``step`` has no such parameter."""
    import warnings

    import torch

    from tests.models import MLP, rank_batch

    def overflow_one_element(grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        grad.view(-1)[0] = float("inf")
        return grad

    results = []
    for ours in (False, True):
        model, optimizer = _ddp_or_ours(ours, build, make_optimizer, wrap_kwargs)
        if ours and new_protocol:
            optimizer.step = functools.partial(_step_without_scaler_argument, optimizer)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
        first_weight = next(iter(model.module.parameters()))
        for step in range(steps):
            x, y = rank_batch(MLP, step, rank)
            overflow = step == 2
            handle = (
                first_weight.register_hook(overflow_one_element) if one_element and overflow and rank == 1 else None
            )
            scale = float("inf") if overflow and not one_element else 1.0
            loss = torch.nn.functional.cross_entropy(model(x), y) * scale
            optimizer.zero_grad()
            scaler.scale(loss).backward()
            if unscale_clip:
                scaler.unscale_(optimizer)  # reads optimizer.param_groups: ours finishes the reductions first
                if ours and torch_clip:
                    optimizer.gather_gradients()
                if ours and not torch_clip:
                    optimizer.clip_grad_norm_(0.5)
                else:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            if handle is not None:
                handle.remove()
            with warnings.catch_warnings():  # torch announces a change of this protocol (FutureWarning)
                warnings.simplefilter("ignore", FutureWarning)
                scaler.step(optimizer)
            scaler.update()
        results.append((snapshot(model if ours else model.module), scaler.get_scale()))
    return results[0], results[1]


def nonfinite_step_refused(rank: int, build, make_optimizer, steps: int = 5, bad_step: int = 2) -> dict:
    """``wrap(check_finite=True)`` + ``make_optimizer``: at ``bad_step`` rank 1's gradient of the output bias is
    NaN; the loop catches step()'s error and goes on. Against DDP + AdamW trained without that batch."""
    import torch

    import collective_ops as co
    from tests.models import MLP, rank_batch

    ddp, ddp_optimizer = _ddp_or_ours(False, build, make_optimizer)
    model = co.wrap(build(), bucket_size_mb=0.004, check_finite=True)
    optimizer = make_optimizer(model)
    poisoned = list(model.module.parameters())[-1]  # one small parameter: in one rank's shard when sharded
    poison = [False]
    poisoned.register_hook(lambda g: g * float("nan") if poison[0] and rank == 1 else g)
    out: dict = {"errors": []}
    for step in range(steps):
        x, y = rank_batch(MLP, step, rank)
        for net, opt in ((ddp, ddp_optimizer), (model, optimizer)):
            if net is ddp and step == bad_step:
                continue
            opt.zero_grad()
            poison[0] = step == bad_step
            torch.nn.functional.cross_entropy(net(x), y).backward()
            if net is model and step == bad_step:
                out["before"] = (snapshot(model.module), _state_arrays(optimizer.state_dict()))
                try:
                    opt.step()
                except FloatingPointError as exc:
                    out["errors"].append(str(exc))
                out["after"] = (snapshot(model.module), _state_arrays(optimizer.state_dict()))
            else:
                opt.step()
    out["ddp"], out["ours"] = snapshot(ddp.module), snapshot(model.module)
    return out


def gradients_changed_before_step(
    rank: int, build, make_optimizer, steps: int = 6, cases: tuple[str, ...] = ("torch_clip", "one_gradient")
) -> dict:
    """Loops that change gradients in place between backward and step, as DDP loops do: torch's
    clip_grad_norm_ on a list of the parameters taken before training (model.parameters() itself finishes
    the reductions first), and one parameter's gradient scaled (the first layer's, its bucket reduced
    last); sharded also torch's clip over ``opt.param_groups`` (as Lightning clips) and over the parameters
    after ``opt.finish_reductions()``. Where step() refused, and whether any parameter had changed by then."""
    import torch

    import collective_ops as co
    from tests.models import MLP, rank_batch

    out = {}
    for case in cases:
        model = co.wrap(build(), bucket_size_mb=0.004)
        optimizer = make_optimizer(model)
        held = list(model.parameters())
        out[case] = {"error": None, "at": None, "unchanged": None}
        for step in range(steps):
            x, y = rank_batch(MLP, step, rank)
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            if case == "torch_clip":
                torch.nn.utils.clip_grad_norm_(held, 0.1)
            elif case == "clip_over_param_groups":
                torch.nn.utils.clip_grad_norm_([p for group in optimizer.param_groups for p in group["params"]], 0.1)
            elif case == "clip_after_finish_reductions":
                optimizer.finish_reductions()
                torch.nn.utils.clip_grad_norm_(held, 0.1)
            else:
                model.module.net[0].weight.grad.mul_(0.5)
            before = {n: p.detach().clone() for n, p in model.module.named_parameters()}
            try:
                optimizer.step()
            except RuntimeError as exc:
                after = dict(model.module.named_parameters())
                out[case] = {
                    "error": str(exc),
                    "at": step,
                    "unchanged": all(torch.equal(before[n], after[n]) for n in before),
                }
                break
    return out


def assert_changed_gradients_refused(results: list[dict], label: str) -> None:
    """The ``gradients_changed_before_step`` results of every rank: step() refused, nothing applied."""
    for rank, out in enumerate(result["changed_gradients"] for result in results):
        for case, got in out.items():
            assert got["error"] is not None, f"{label}{case}, rank {rank}: trained on silently"
            assert "changed in place between backward()" in got["error"], got["error"]
            if label.startswith("sharded"):  # what works there: the shards' clip, or the gradients gathered
                assert "opt.clip_grad_norm_(max_norm)" in got["error"] and "gather_gradients()" in got["error"]
                assert "Take the parameters through the model" not in got["error"]  # (no help under shard=True)
            else:
                assert "opt.finish_reductions()" in got["error"], got["error"]
            assert got["unchanged"], f"{label}{case}, rank {rank}: a refused step updated parameters"
        assert "'net.0.weight'" in out["one_gradient"]["error"]


def clipped_by_torch_after_finish_reductions(rank: int, build, make_optimizer, steps: int = 5) -> tuple[dict, dict]:
    """(DDP, ours) clipping with torch.nn.utils.clip_grad_norm_ after opt.finish_reductions(): gradients final.
    The clip takes a list of the parameters made before training (model.parameters() would finish the
    reductions itself)."""
    import torch

    from tests.models import MLP, rank_batch

    results = []
    for ours in (False, True):
        model, optimizer = _ddp_or_ours(ours, build, make_optimizer)
        held = list(model.parameters())
        for step in range(steps):
            x, y = rank_batch(MLP, step, rank)
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            if ours:
                optimizer.finish_reductions()
            torch.nn.utils.clip_grad_norm_(held, 0.1)
            optimizer.step()
        results.append(snapshot(model if ours else model.module))
    return results[0], results[1]


def group_added_mid_training(
    rank: int, build, shard: bool, steps: int = 5, at: int = 2, given: bool = False
) -> tuple[dict, dict]:
    """(DDP + SGD, ours) training the last layer first, the others added as a group of their own at step
    ``at`` (``add_param_group``, as when unfreezing layers). ``given``: two plain SGDs (the last layer's
    weight, its bias) stepped in turn, given both to ours; the group is added to the first SGD directly (so
    it lands between the two SGDs' groups), the second halving its lr after every step (its owed update must
    use the lr of its step, found by group, not by position)."""
    import torch

    import collective_ops as co
    from tests.models import MLP, rank_batch

    results = []
    for ours in (False, True):
        net = build()
        first = list(net.net[4].parameters())
        rest = [p for layer in (net.net[0], net.net[2]) for p in layer.parameters()]
        plain = torch.optim.SGD(first[:1] if given else first, lr=0.05, momentum=0.9)
        both = [plain, torch.optim.SGD(first[1:], lr=0.05, momentum=0.9)]
        if ours:
            model = co.wrap(net, bucket_size_mb=0.004, comm_hook=late_allreduce if given else None)
            if given:
                optimizer = co.DistributedOptimizer(model, both)
            else:
                optimizer = co.DistributedOptimizer(
                    model, torch.optim.SGD, params=first, lr=0.05, momentum=0.9, shard=shard
                )
        else:
            model = torch.nn.parallel.DistributedDataParallel(net)
            optimizer = InTurn(both) if given else plain
        scheduler = torch.optim.lr_scheduler.StepLR(both[1], step_size=1, gamma=0.5) if given else None
        for step in range(steps):
            if step == at:
                (plain if given else optimizer).add_param_group({"params": rest, "lr": 0.01})
            x, y = rank_batch(MLP, step, rank)
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
            if scheduler is not None:
                scheduler.step()
        results.append(snapshot(net))
    return results[0], results[1]


def read_through_the_model(
    rank: int, build, make_optimizer, clip: str | None, steps: int = 5, gather: bool = False
) -> tuple[tuple, tuple]:
    """(DDP, ours): a DDP loop that takes the parameters through the model, torch's clip_grad_norm_ (``clip``
    "norm") or clip_grad_value_ ("value") on model.parameters() after backward (ours after
    ``opt.gather_gradients()`` with ``gather``), and an EMA (AveragedModel) updated after step(), while
    updates are still owed. Weights and EMA weights."""
    import torch

    from tests.models import MLP, rank_batch

    results = []
    for ours in (False, True):
        model, optimizer = _ddp_or_ours(ours, build, make_optimizer)
        ema = torch.optim.swa_utils.AveragedModel(model.module)
        for step in range(steps):
            x, y = rank_batch(MLP, step, rank)
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            if ours and gather:
                optimizer.gather_gradients()
            if clip == "norm":
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
            elif clip == "value":
                torch.nn.utils.clip_grad_value_(model.parameters(), 0.002)
            optimizer.step()
            ema.update_parameters(model)
        results.append((snapshot(model if ours else model.module), snapshot(ema.module)))
    return results[0], results[1]


class _LateHandle:
    """A reduction that reports itself complete only ``seconds`` after its launch (and waits that long)."""

    def __init__(self, handle, seconds: float) -> None:
        self._handle, self._done_at = handle, time.perf_counter() + seconds

    def is_completed(self) -> bool:
        return time.perf_counter() >= self._done_at and self._handle.is_completed()

    def wait(self):
        time.sleep(max(0.0, self._done_at - time.perf_counter()))
        return self._handle.wait()


def late_allreduce(ctx):
    """The default reduction, landing 0.2 s late: a step() right after backward owes every bucket's update
    whatever the machine's speed (the unsharded path applies those that landed in step() itself)."""
    from collective_ops.bucketing.hooks import allreduce_hook

    return _LateHandle(allreduce_hook(ctx), 0.2)


class _LateGather:
    """An all-gather whose result reaches the parameters only when waited for, ``seconds`` after its launch: the
    real all-gather lands in a scratch copy of the bucket, copied in at the wait."""

    def __init__(self, handle, scratch: torch.Tensor, buffer: torch.Tensor, seconds: float) -> None:
        self._handle, self._scratch, self._buffer = handle, scratch, buffer
        self._done_at = time.perf_counter() + seconds

    def is_completed(self) -> bool:
        return False

    def wait(self, timeout=None):
        from collective_ops.bucketing.interfaces import wait_with_timeout

        time.sleep(max(0.0, self._done_at - time.perf_counter()))
        wait_with_timeout(self._handle, None)
        self._buffer.copy_(self._scratch)
        return self._buffer


@contextlib.contextmanager
def late_gathers(seconds: float = 0.05):
    """Sharded all-gathers of updated parameters landing ``seconds`` late (as a slow link has them): a forward
    that reads a parameter before waiting for its bucket's all-gather reads the step's old values."""
    from collective_ops.comm.torch_engine import TorchEngine

    real = TorchEngine.all_gather_shard

    def late(self, buffer, async_op=False, group=None):
        scratch = buffer.clone()
        handle = real(self, scratch, async_op=True, group=group)
        gather = _LateGather(handle, scratch, buffer, seconds)
        if async_op:
            return gather
        gather.wait()
        return None

    TorchEngine.all_gather_shard = late
    try:
        yield
    finally:
        TorchEngine.all_gather_shard = real


class _CopiedBackWork:
    """An allreduce's work whose result lands in the caller's tensor on another thread (see copied_back_late)."""

    def __init__(self, thread) -> None:
        self._thread = thread

    def is_completed(self) -> bool:
        return not self._thread.is_alive()

    def wait(self, timeout=None) -> bool:
        self._thread.join()
        return True


@contextlib.contextmanager
def copied_back_late(seconds: float = 0.05):
    """torch.distributed.all_reduce as Gloo runs it on device tensors: reduced in a host copy, the result copied
    back into the tensor given (an in-place copy, moving its version counter) on another thread, ``seconds``
    after the launch, while the loop may be between backward() and step()."""
    import threading

    real = torch.distributed.all_reduce

    def emulated(tensor, op=torch.distributed.ReduceOp.SUM, group=None, async_op=False):
        staged = tensor.detach().clone()
        work = real(staged, op=op, group=group, async_op=True)

        def copy_back() -> None:
            work.wait()
            time.sleep(seconds)
            tensor.copy_(staged)

        thread = threading.Thread(target=copy_back, daemon=True)
        thread.start()
        if not async_op:
            thread.join()
            return None
        return _CopiedBackWork(thread)

    torch.distributed.all_reduce = emulated
    try:
        yield
    finally:
        torch.distributed.all_reduce = real


def results_copied_back_late(rank: int, steps: int = 4) -> tuple[dict, dict]:
    """(DDP + AdamW, DistributedOptimizer(AdamW)) after a loop that logs for 0.2 s between backward() and
    step(), with every allreduce of ours landing as Gloo lands device tensors (copied_back_late): the
    transport's own writes into a bucket are not the loop's in-place changes."""
    import collective_ops as co
    from tests.models import MLP, build, rank_batch

    results = []
    for ours in (False, True):
        model, optimizer = _ddp_or_ours(
            ours, lambda: build("mlp"), lambda m: co.DistributedOptimizer(m, torch.optim.AdamW, lr=1e-2)
        )
        with copied_back_late() if ours else contextlib.nullcontext():
            for step in range(steps):
                x, y = rank_batch(MLP, step, rank)
                optimizer.zero_grad()
                torch.nn.functional.cross_entropy(model(x), y).backward()
                time.sleep(0.2)
                optimizer.step()
            results.append(snapshot(model.module))
    return results[0], results[1]


def peeking_forwards(
    rank: int, name: str, opt_kind: str, shard: bool = False, steps: int = 5, compiled: str | None = None
) -> tuple:
    """(DDP, ours) for a model whose forward reads parameters of modules before those run (tests.models.PEEKING),
    with every reduction (sharded: all-gather) landing late, so each step()'s updates are owed when the next
    forward reads them; rank 0 alone evaluates the inner module (no_grad) after every other step. Weights, and
    rank 0's evaluations. ``compiled``: that submodule under torch.compile (in both), in an eager forward."""
    import torch

    import collective_ops as co
    from tests.models import MLP, build, rank_batch

    cls, kwargs = _make_optimizer(opt_kind)
    results = []
    for ours in (False, True):
        net = build(name)
        if compiled is not None:
            # (inductor: its kernels read the parameters directly; the "eager" backends' graphs run as torch
            # calls, which the optimizer's torch function mode sees anyway)
            setattr(net, compiled, torch.compile(getattr(net, compiled)))
        if ours:
            late = {} if shard else {"comm_hook": late_allreduce}
            model = co.wrap(net, bucket_size_mb=0.004, first_bucket_mb=0.001, **late)
            optimizer = co.DistributedOptimizer(model, cls, shard=shard, **kwargs)
        else:
            model = torch.nn.parallel.DistributedDataParallel(net)
            optimizer = cls(model.parameters(), **kwargs)
        evaluations = []
        with late_gathers() if ours and shard else contextlib.nullcontext():
            for step in range(steps):
                x, y = rank_batch(MLP, step, rank)
                optimizer.zero_grad()
                torch.nn.functional.cross_entropy(model(x), y).backward()
                optimizer.step()
                if rank == 0 and step % 2 == 1:
                    with torch.no_grad():
                        evaluations.append(model.module(rank_batch(MLP, 100, rank)[0]).numpy().copy())
            results.append((snapshot(model if ours else model.module), evaluations))
    return results[0], results[1]


def assert_peeking_forwards_equal_ddp(results: list[dict], label: str) -> None:
    """The ``peeking_forwards`` results of every rank (under ``peeking_<model>_<optimizer>``) as DDP's."""
    from tests.models import PEEKING

    for rank, out in enumerate(results):
        for name in PEEKING:
            for opt_kind in ("sgd", "adamw"):
                (ddp, ddp_evaluations), (ours, our_evaluations) = out[f"peeking_{name}_{opt_kind}"]
                case = f"{label}{name} ({opt_kind}), rank {rank}"
                assert_identical(ours, ddp, case)
                assert len(our_evaluations) == len(ddp_evaluations) == (2 if rank == 0 else 0), case
                for step, (got, want) in enumerate(zip(our_evaluations, ddp_evaluations)):
                    np.testing.assert_array_equal(got, want, err_msg=f"{case}: evaluation {step}")


def params_changed_after_step(
    rank: int, build, make_optimizer, steps: int = 6, at: int = 3, wrap_kwargs: dict | None = None
) -> dict:
    """Loops that change parameters right after step(), while its updates (sharded: all-gathers) are owed.
    "reloaded": (DDP, ours) after loading a checkpoint of step 1 (the inner module's weights, the optimizer's
    state) at step ``at``. "submodule": (DDP, ours), each (the last layer's state_dict() read right after step
    ``at``, the weights at the end), where only the middle layer's weights of step 1 were loaded then, through
    that layer's own load_state_dict(). "edited": one layer's weight scaled in place through the inner module;
    where it was refused (its error and step), or None if training went on."""
    import copy

    import torch

    from tests.models import MLP, rank_batch

    out: dict = {"reloaded": [], "submodule": [], "edited": None}
    for case in ("ddp", "ours", "edited", "ddp_submodule", "ours_submodule"):
        model, optimizer = _ddp_or_ours(case.startswith("ours") or case == "edited", build, make_optimizer, wrap_kwargs)
        try:
            for step in range(steps):
                x, y = rank_batch(MLP, step, rank)
                optimizer.zero_grad()
                torch.nn.functional.cross_entropy(model(x), y).backward()
                optimizer.step()
                if step == 1:
                    saved = copy.deepcopy((model.module.state_dict(), optimizer.state_dict()))
                    saved_middle = copy.deepcopy(model.module.net[2].state_dict())
                if step == at and case == "edited":
                    with torch.no_grad():
                        model.module.net[0].weight.mul_(0.5)
                elif step == at and case.endswith("submodule"):
                    last_read = {k: v.clone().numpy() for k, v in model.module.net[4].state_dict().items()}
                    model.module.net[2].load_state_dict(saved_middle)
                elif step == at:
                    model.module.load_state_dict(saved[0])
                    optimizer.load_state_dict(saved[1])
        except RuntimeError as exc:
            if case != "edited":
                raise
            out["edited"] = (str(exc), step)
            continue
        if case.endswith("submodule"):
            out["submodule"].append((last_read, snapshot(model.module)))
        elif case != "edited":
            out["reloaded"].append(snapshot(model.module))
    return out


def assert_changed_params_handled(results: list[dict], label: str, at: int = 3) -> None:
    """The ``params_changed_after_step`` results of every rank: the reload as DDP's, the edit refused."""
    for rank, out in enumerate(result["changed_params"] for result in results):
        ddp, ours = out["reloaded"]
        assert_identical(ours, ddp, f"{label}checkpoint loaded after step(), rank {rank}")
        (ddp_read, ddp_end), (our_read, our_end) = out["submodule"]
        assert_identical(our_read, ddp_read, f"{label}a submodule's state_dict() read after step(), rank {rank}")
        assert_identical(our_end, ddp_end, f"{label}a submodule's weights loaded after step(), rank {rank}")
        assert out["edited"] is not None, f"{label}rank {rank}: an in-place change after step() trained on silently"
        error, step = out["edited"]
        assert step == at + 1 and "['net.0.weight']" in error and "changed in place after step()" in error, error
        assert "opt.synchronize()" in error, error


def frozen_layer_in_params(rank: int, shard: bool, steps: int = 4) -> tuple[tuple, tuple]:
    """(DDP + AdamW, ours): the first layer frozen before wrapping and its parameters given to the optimizer
    anyway (``model.parameters()``, as fine-tuning loops do). Weights and the optimizer's state_dict."""
    import torch

    import collective_ops as co
    from tests.models import MLP, build, rank_batch

    results = []
    for ours in (False, True):
        net = build("mlp")
        net.net[0].requires_grad_(False)
        if ours:
            model = co.wrap(net, bucket_size_mb=0.004)
            optimizer = co.DistributedOptimizer(model, torch.optim.AdamW, lr=1e-2, shard=shard)
        else:
            model = torch.nn.parallel.DistributedDataParallel(net)
            optimizer = torch.optim.AdamW(net.parameters(), lr=1e-2)
        for step in range(steps):
            x, y = rank_batch(MLP, step, rank)
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
        state = optimizer.state_dict()
        results.append((snapshot(net), _state_arrays(state), state["param_groups"][0]["params"]))
    return results[0], results[1]


def step_after_no_sync_only(rank: int, build, make_optimizer) -> dict:
    """A step whose only backward ran under no_sync(): its error, and whether the parameters stayed as they were."""
    import torch

    from tests.models import MLP, rank_batch

    model, optimizer = _ddp_or_ours(True, build, make_optimizer)
    x, y = rank_batch(MLP, 0, rank)
    optimizer.zero_grad()
    with model.no_sync():
        torch.nn.functional.cross_entropy(model(x), y).backward()
    before = [p.detach().clone() for p in model.module.parameters()]
    try:
        optimizer.step()
        error = None
    except RuntimeError as exc:
        error = str(exc)
    unchanged = all(torch.equal(a, b) for a, b in zip(before, model.module.parameters()))
    return {"error": error, "unchanged": unchanged}


def assert_step_after_no_sync_only_refused(results: list[dict], label: str) -> None:
    for rank, out in enumerate(result["no_sync_only"] for result in results):
        assert out["error"] is not None, f"{label}rank {rank}: stepped on gradients never averaged"
        assert "no backward outside it has averaged" in out["error"] and "outside no_sync()" in out["error"]
        assert out["unchanged"], f"{label}rank {rank}: the refused step changed parameters"


def _state_arrays(state_dict: dict) -> dict:
    """An optimizer state_dict's tensors, by parameter and key (numpy, for assert_identical)."""
    return {f"{i}/{k}": v.detach().numpy().copy() for i, entry in state_dict["state"].items() for k, v in entry.items()}


def _split_optimizers(model, first_cls, first_kwargs: dict, rest_cls, rest_kwargs: dict) -> list:
    """Two plain optimizers over a model's parameters: ``first_cls`` for the matrices, ``rest_cls`` for the rest."""
    matrices = [p for p in model.parameters() if p.ndim == 2]
    rest = [p for p in model.parameters() if p.ndim != 2]
    return [first_cls(matrices, **first_kwargs), rest_cls(rest, **rest_kwargs)]


def several_optimizers(rank: int, build, steps: int = 6) -> dict:
    """DDP + plain Muon (matrices) + AdamW (the rest) against one DistributedOptimizer given both, its reductions
    landing late so that every step's updates are owed (``in_flight`` after each step). Weights; each plain
    optimizer's own state_dict() read directly after the last step (owed updates must land first); the
    DistributedOptimizer's state_dict loaded into plain optimizers and into a new DistributedOptimizer. AdamW's
    own checkpoint of step 1, its lr halved, is loaded into it directly at step 3, as into the two under DDP;
    Muon has an LR scheduler of its own."""
    import copy
    import warnings

    import torch

    import collective_ops as co
    from tests.models import MLP, rank_batch

    muon, adamw = (torch.optim.Muon, {"lr": 0.02}), (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.01})
    out: dict = {}
    for ours in (False, True):
        if ours:
            model = co.wrap(build(), bucket_size_mb=0.004, comm_hook=late_allreduce)
        else:
            model = torch.nn.parallel.DistributedDataParallel(build())
        plain = _split_optimizers(model, *muon, *adamw)
        stepper = co.DistributedOptimizer(model, plain) if ours else InTurn(plain)
        scheduler = torch.optim.lr_scheduler.StepLR(plain[0], step_size=1, gamma=0.7)  # Muon's own schedule
        owed = []
        with warnings.catch_warnings(record=True) as heard:
            warnings.simplefilter("always")
            for step in range(steps):
                x, y = rank_batch(MLP, step, rank)
                stepper.zero_grad()
                torch.nn.functional.cross_entropy(model(x), y).backward()
                stepper.step()
                scheduler.step()
                owed.append(ours and stepper.in_flight)
                if step == 1:  # AdamW's own checkpoint, read directly, with its lr halved
                    early = copy.deepcopy(plain[1].state_dict())
                    early["param_groups"][0]["lr"] /= 2
                if step == 3:  # ... loaded into it directly while updates are owed
                    plain[1].load_state_dict(early)
        states = [_state_arrays(optimizer.state_dict()) for optimizer in plain]  # read directly, not through ours
        out["ours" if ours else "ddp"] = (snapshot(model.module), states, owed, [str(w.message) for w in heard])
    saved = stepper.state_dict()
    reloaded = _split_optimizers(build(), *muon, *adamw)
    for optimizer, state in zip(reloaded, saved["optimizers"]):
        optimizer.load_state_dict(state)
    fresh = co.wrap(build())
    again = co.DistributedOptimizer(fresh, _split_optimizers(fresh, *muon, *adamw))
    again.load_state_dict(saved)
    out["reloaded"] = [_state_arrays(optimizer.state_dict()) for optimizer in reloaded]
    out["reloaded_ours"] = [_state_arrays(state) for state in again.state_dict()["optimizers"]]
    return out


def optimizer_beside(rank: int, build, steps: int = 5) -> dict:
    """DDP + SGD (matrices) + AdamW (the rest), against a DistributedOptimizer(SGD, params=matrices) with a plain
    AdamW beside it over the rest, its step() before and after ours (the reductions landing late: a plain step
    reads gradients still in flight unless they are finished first); the same under torch.amp.GradScaler, whose
    step(adamw) unscales AdamW's gradients in place before AdamW's step() (no hook runs there). Whether our step
    was still in flight after the plain one ran first (its own buckets keep their overlap). Sharded, refused."""
    import torch

    import collective_ops as co
    from tests.models import MLP, rank_batch

    sgd, adamw = (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}), (torch.optim.AdamW, {"lr": 1e-2})
    out: dict = {"in_flight_after_plain": []}
    for case in (
        "ddp",
        "plain_after",
        "plain_first",
        "sharded",
        "ddp_scaled",
        "scaled_plain_first",
        "scaled_plain_after",
    ):
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10) if "scaled" in case else None
        if case.startswith("ddp"):
            model = torch.nn.parallel.DistributedDataParallel(build())
            optimizers = _split_optimizers(model, *sgd, *adamw)
            plain = ours = None
        else:
            model = co.wrap(build(), bucket_size_mb=0.004, comm_hook=None if case == "sharded" else late_allreduce)
            plain = _split_optimizers(model, *sgd, *adamw)[1]
            matrices = [p for p in model.parameters() if p.ndim == 2]
            ours = co.DistributedOptimizer(model, sgd[0], params=matrices, shard=case == "sharded", **sgd[1])
            optimizers = [plain, ours] if case.endswith("plain_first") else [ours, plain]
        try:
            for step in range(steps):
                x, y = rank_batch(MLP, step, rank)
                for optimizer in optimizers:
                    optimizer.zero_grad()
                loss = torch.nn.functional.cross_entropy(model(x), y)
                (loss if scaler is None else scaler.scale(loss)).backward()
                for optimizer in optimizers:
                    if scaler is None:
                        optimizer.step()
                    else:
                        scaler.step(optimizer)
                    if optimizer is plain and case == "plain_first":
                        out["in_flight_after_plain"].append(model.manager.deferred_pending)
                if scaler is not None:
                    scaler.update()
        except RuntimeError as exc:
            out[case] = str(exc)
            continue
        out[case] = snapshot(model.module if case.startswith("ddp") else model)
    return out


def two_models(rank: int, build, steps: int = 4) -> dict:
    """Two wrapped models, each with its own DistributedOptimizer (a GAN's generator and discriminator), their
    reductions landing late, against DDP + AdamW for each: weights; and whether each step() left its updates in
    flight (the global step pre-hook must not finish one optimizer's reductions for the other model)."""
    import torch

    import collective_ops as co
    from tests.models import MLP, rank_batch

    out: dict = {"in_flight_after_step": []}
    for case in ("ddp", "ours"):
        models, optimizers = [], []
        for _ in range(2):
            if case == "ddp":
                model = torch.nn.parallel.DistributedDataParallel(build())
                optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
            else:
                model = co.wrap(build(), bucket_size_mb=0.004, comm_hook=late_allreduce)
                optimizer = co.DistributedOptimizer(model, torch.optim.AdamW, lr=1e-2)
            models.append(model)
            optimizers.append(optimizer)
        for step in range(steps):
            for k, (model, optimizer) in enumerate(zip(models, optimizers)):
                x, y = rank_batch(MLP, 10 * step + k, rank)
                optimizer.zero_grad()
                torch.nn.functional.cross_entropy(model(x), y).backward()
                optimizer.step()
                if case == "ours":
                    out["in_flight_after_step"].append(optimizer.in_flight)
        out[case] = [snapshot(model.module if case == "ddp" else model) for model in models]
    return out


def assert_nonfinite_step_refused(results: list[dict], label: str) -> None:
    """The ``nonfinite_step_refused`` results of every rank: refused on each, nothing applied, then DDP's."""
    for rank, out in enumerate(result["nonfinite"] for result in results):
        assert len(out["errors"]) == 1, f"{label}rank {rank}: step() must refuse the NaN step, on every rank"
        error = out["errors"][0]
        assert "non-finite gradients" in error and "'net.4.bias'" in error and "not applied" in error, error
        assert ("before reduction: ['net.4.bias']" in error) == (rank == 1), error
        assert_identical(out["after"][0], out["before"][0], f"{label}parameters after the refused step, rank {rank}")
        assert_identical(out["after"][1], out["before"][1], f"{label}optimizer state after it, rank {rank}")
        assert_identical(out["ours"], out["ddp"], f"{label}trained on after it, as DDP without that batch, rank {rank}")


def _two_losses_then_backwards(rank: int, steps: int = 4) -> tuple[dict, dict]:
    """(DDP + AdamW with a forward and backward per micro-batch, ours with both forwards before either backward):
    two backwards per step without no_sync(). The second backward's outputs are reached while the first's
    reductions are still in flight (no forward came between to finish them): refused until the twenty-fourth
    session ("a gradient arrived while the previous step's buckets are still being finished"). torch's DDP
    itself comes out wrong with both forwards first (0.12 off a single-process average in a scratch run)."""
    import torch

    import collective_ops as co
    from tests.models import MLP, build

    def train(ours: bool) -> dict:
        net = build("mlp")
        if ours:
            model = co.wrap(net, bucket_size_mb=0.004, first_bucket_mb=0.001)
            optimizer = co.DistributedOptimizer(model, torch.optim.AdamW, lr=1e-2)
        else:
            model = torch.nn.parallel.DistributedDataParallel(net)
            optimizer = torch.optim.AdamW(net.parameters(), lr=1e-2)
        two_losses_per_step(model, optimizer, MLP, rank, steps, losses_first=ours)
        return snapshot(net)

    return train(False), train(True)


def evaluations_on_one_rank(rank: int, world: int, steps: int = 40, every: int = 3) -> dict:
    """nanoGPT's loop: every few steps rank 0 alone evaluates (model.eval(), no_grad), which issues no collective on
    any rank. DDP + AdamW, then ours: wrap + AdamW, DistributedOptimizer with schedule="auto" (and
    bucket_size_mb="auto": the online tune, the first-step rebuild and the order trial all happen within the run),
    with "plan", and with shard=True. Each: (weights, what settled)."""
    import torch

    import collective_ops as co
    from tests.models import MLP, build, rank_batch

    def train(model, optimizer) -> dict:
        for step in range(steps):
            x, y = rank_batch(MLP, step, rank)
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
            if rank == 0 and step % every == 0:
                model.eval()
                with torch.no_grad():
                    model(rank_batch(MLP, 100, rank)[0])
                model.train()
        return snapshot(model.module)

    ddp = torch.nn.parallel.DistributedDataParallel(build("mlp"))
    out: dict = {"ddp": train(ddp, torch.optim.AdamW(ddp.parameters(), lr=1e-2))}
    model = co.wrap(build("mlp"), bucket_size_mb="auto")
    out["wrap"] = (train(model, torch.optim.AdamW(model.parameters(), lr=1e-2)), model.tune_pending)
    cases = {"auto": {"schedule": "auto"}, "auto_tuned": {"schedule": "auto"}, "plan": {"schedule": "plan"}}
    for name, kwargs in (*cases.items(), ("shard", {"shard": True})):
        model = co.wrap(build("mlp"), bucket_size_mb="auto" if name == "auto_tuned" else 0.004)
        optimizer = co.DistributedOptimizer(model, torch.optim.AdamW, lr=1e-2, **kwargs)
        weights = train(model, optimizer)
        trial = optimizer.schedule_trial
        out[name] = (weights, (model.tune_pending, trial is not None and len(trial["orders"])))
    return out


def weights_whichever_order_is_kept(rank: int, world: int, steps: int = 36) -> dict:
    """The same training twice with schedule="auto", the order trial's winner forced: the baseline (every bucket
    finished in backward), then its last candidate: the best chunked order wherever one was planned (shortlisted
    here even where simulated slower). A model with a 2 MiB bucket, which chunk_candidates_mib could cut. Each:
    (weights, orders tried, kept, planned order lengths)."""
    import torch

    import collective_ops as co
    from collective_ops.bucketing.update import planner
    from collective_ops.bucketing.update.schedule import OrderTrial

    shortlist = planner.shortlist

    def with_any_chunked(predictions: list, count: int, buckets: int) -> list:
        out = shortlist(predictions, count, buckets)
        chunked = next((p.order for p in predictions if len(p.order) > buckets), None)
        return out if chunked is None or chunked in out else [*out, chunked]

    def build() -> torch.nn.Module:
        torch.manual_seed(0)
        layers = [torch.nn.Linear(64, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 256), torch.nn.ReLU()]
        return torch.nn.Sequential(*layers, torch.nn.Linear(256, 4))

    out, pick = {}, OrderTrial.pick
    planner.shortlist = with_any_chunked
    try:
        for forced in ("first", "last"):
            OrderTrial.pick = staticmethod(
                lambda medians, margin=0.02, f=forced: 0 if f == "first" else len(medians) - 1
            )
            model = co.wrap(build(), bucket_size_mb=4)
            optimizer = co.DistributedOptimizer(model, torch.optim.AdamW, lr=1e-3)
            for step in range(steps):
                generator = torch.Generator().manual_seed(1000 * step + rank)
                x, y = torch.randn(16, 64, generator=generator), torch.randint(0, 4, (16,), generator=generator)
                optimizer.zero_grad()
                torch.nn.functional.cross_entropy(model(x), y).backward()
                optimizer.step()
            trial = optimizer.schedule_trial or {}
            planned = sorted({len(p.order) for p in optimizer.schedule_report or []})
            out[forced] = (snapshot(model), trial.get("orders"), trial.get("kept"), planned)
    finally:
        OrderTrial.pick, planner.shortlist = pick, shortlist
    return out


def optimizer_checks(rank: int, world: int) -> dict:
    """Every check of the two-rank group, by name (tests.harness.run_checks runs each on its own)."""
    import torch

    import collective_ops as co
    from tests.models import MLP, PEEKING, Reordered, SmallCNN, TinyTransformer, WithUnusedBranch, build

    checks: dict = {}
    for name, cls in (("transformer", TinyTransformer), ("cnn", SmallCNN)):
        for opt in ("sgd", "adamw"):
            checks[f"{name}_{opt}"] = functools.partial(_pair, rank, lambda n=name: build(n), opt, model_cls=cls)
    checks["scheduler"] = functools.partial(
        _pair,
        rank,
        lambda: build("mlp"),
        "adamw",
        model_cls=MLP,
        scheduler_of=lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.8),
    )
    # a tensor lr, which the scheduler fills in place after step(): the owed updates (landing late) take the
    # lr of their step()
    checks["scheduler_tensor_lr"] = functools.partial(
        _pair,
        rank,
        lambda: build("mlp"),
        "adamw_tensor_lr",
        model_cls=MLP,
        wrap_kwargs={"comm_hook": late_allreduce},
        scheduler_of=lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5),
    )
    # OneCycleLR also cycles AdamW's betas (SGD's momentum) each step: the owed updates, landing late, take the
    # betas of their step(), not the next one's
    for kind in ("adamw", "sgd"):
        checks[f"scheduler_momentum_{kind}"] = functools.partial(
            _pair,
            rank,
            lambda: build("mlp"),
            kind,
            model_cls=MLP,
            wrap_kwargs={"comm_hook": late_allreduce},
            scheduler_of=lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.05, total_steps=STEPS + 1),
        )
    checks["accumulation"] = functools.partial(
        _pair, rank, lambda: build("mlp"), "sgd", model_cls=MLP, accumulate=3, steps=6
    )
    checks["losses_first"] = functools.partial(_two_losses_then_backwards, rank)
    checks["one_rank_evaluations"] = functools.partial(evaluations_on_one_rank, rank, world)
    # classic weight_norm / spectral_norm derive weights in pre-hooks of their own: ours must run first (the owed
    # updates land 0.2 s late, so they are owed at every forward, whatever the machine's speed)
    checks["classic_norms"] = functools.partial(
        _pair, rank, lambda: build("classic-norms"), "adamw", model_cls=MLP, wrap_kwargs={"comm_hook": late_allreduce}
    )
    checks["parametrized_norms"] = functools.partial(
        _pair,  # their parametrization form: weights computed as the module reads them
        rank,
        lambda: build("parametrized-norms"),
        "adamw",
        model_cls=MLP,
        steps=6,
        wrap_kwargs={"comm_hook": late_allreduce},
    )
    # activation checkpointing: the blocks' forward, and our pre-hooks on them, run again inside backward while
    # this step's buckets are in flight (updates owed at every forward, as above)
    for name in ("checkpointed", "checkpointed-reentrant", "checkpointed-head"):
        checks[name] = functools.partial(
            _pair,
            rank,
            lambda n=name: build(n),
            "adamw",
            model_cls=MLP,
            steps=6,
            wrap_kwargs={"comm_hook": late_allreduce},
        )

    def held_back(wrapped, chunks: int, held: int) -> None:  # what schedule="auto" sets up: the first and last
        from collective_ops.bucketing.update.schedule import held_order_in_chunks  # buckets (or chunks) held

        manager = wrapped.manager
        counts = [chunks if manager.chunkable(b) else 1 for b in range(len(manager.plan.buckets))]
        manager.set_launch_order(held_order_in_chunks(counts, sum(counts) - held, held))
        assert (max(counts) > 1) == (chunks > 1)  # "held_in_chunks" sends some bucket in chunks

    for name, opt_kind, chunks, held in (("held", "sgd", 1, 2), ("held_in_chunks", "adamw", 3, 4)):
        checks[name] = functools.partial(
            _pair,
            rank,
            lambda: build("transformer"),
            opt_kind,
            model_cls=TinyTransformer,
            wrap_kwargs={"rebuild_buckets": False},
            arrange=functools.partial(held_back, chunks=chunks, held=held),
        )

    def unused_net():
        torch.manual_seed(0)
        return WithUnusedBranch()

    checks["unused"] = functools.partial(
        _pair,
        rank,
        unused_net,
        "adamw",
        model_cls=MLP,
        find_unused=True,
        unused=lambda r, s: not (r == 1 and s % 3 != 1),
    )

    def reordered():
        torch.manual_seed(0)
        return Reordered()

    checks["out_of_order"] = functools.partial(_pair, rank, reordered, "sgd", model_cls=MLP)
    for name in PEEKING:  # forwards reading parameters of modules before those run, with the updates owed
        for opt_kind in ("sgd", "adamw"):
            checks[f"peeking_{name}_{opt_kind}"] = functools.partial(peeking_forwards, rank, name, opt_kind)

    for set_to_none in (True, False):
        checks[f"zero_grad_after_step_{set_to_none}"] = functools.partial(
            zero_grad_after_step,
            rank,
            lambda: build("mlp"),
            lambda m: co.DistributedOptimizer(m, torch.optim.AdamW, lr=1e-2),
            set_to_none,
        )

    checks["grad_scaler"] = functools.partial(
        scaled_training, rank, lambda: build("mlp"), lambda m: co.DistributedOptimizer(m, torch.optim.AdamW, lr=1e-2)
    )
    checks["grad_scaler_one_element"] = functools.partial(
        scaled_training,
        rank,
        lambda: build("mlp"),
        lambda m: co.DistributedOptimizer(m, torch.optim.AdamW, lr=1e-2),
        one_element=True,
    )
    checks["grad_scaler_new_protocol"] = functools.partial(
        scaled_training,
        rank,
        lambda: build("mlp"),
        lambda m: co.DistributedOptimizer(m, torch.optim.AdamW, lr=1e-2),
        new_protocol=True,
    )
    checks["grad_scaler_unscale_clip"] = functools.partial(
        scaled_training,  # reductions landing late: unscale_ would race them
        rank,
        lambda: build("mlp"),
        lambda m: co.DistributedOptimizer(m, torch.optim.AdamW, lr=1e-2),
        unscale_clip=True,
        wrap_kwargs={"comm_hook": late_allreduce},
    )
    checks["nonfinite"] = functools.partial(
        nonfinite_step_refused,
        rank,
        lambda: build("mlp"),
        lambda m: co.DistributedOptimizer(m, torch.optim.AdamW, lr=1e-2),
    )
    checks["changed_gradients"] = functools.partial(
        gradients_changed_before_step,
        rank,
        lambda: build("mlp"),
        lambda m: co.DistributedOptimizer(m, torch.optim.AdamW, lr=1e-2),
    )
    checks["group_added"] = functools.partial(group_added_mid_training, rank, lambda: build("mlp"), shard=False)
    checks["group_added_to_given"] = functools.partial(
        group_added_mid_training, rank, lambda: build("mlp"), shard=False, given=True
    )
    checks["frozen_layer"] = functools.partial(frozen_layer_in_params, rank, shard=False)
    checks["no_sync_only"] = functools.partial(
        step_after_no_sync_only,
        rank,
        lambda: build("mlp"),
        lambda m: co.DistributedOptimizer(m, torch.optim.AdamW, lr=1e-2),
    )
    checks["changed_params"] = functools.partial(
        params_changed_after_step,
        rank,
        lambda: build("mlp"),
        lambda m: co.DistributedOptimizer(m, torch.optim.AdamW, lr=1e-2),
        wrap_kwargs={"comm_hook": late_allreduce},
    )
    checks["through_the_model"] = functools.partial(
        read_through_the_model,
        rank,
        lambda: build("mlp"),
        lambda m: co.DistributedOptimizer(m, torch.optim.AdamW, lr=1e-2),
        clip="norm",
    )
    checks["copied_back_late"] = functools.partial(results_copied_back_late, rank)
    checks["torch_clip_after_finish"] = functools.partial(
        clipped_by_torch_after_finish_reductions,
        rank,
        lambda: build("mlp"),
        lambda m: co.DistributedOptimizer(m, torch.optim.AdamW, lr=1e-2),
    )
    for key, inference_mode in (("eval_between_steps", False), ("inference_between_steps", True)):
        checks[key] = functools.partial(
            eval_between_steps,
            rank,
            lambda: build("mlp"),
            lambda m: co.DistributedOptimizer(m, torch.optim.AdamW, lr=1e-2),
            inference_mode=inference_mode,
        )
    checks["several_optimizers"] = functools.partial(several_optimizers, rank, lambda: build("mlp"))
    checks["autocast_forward"] = functools.partial(autocast_forward, rank)
    checks["state_read_after_step"] = functools.partial(state_read_after_step, rank)
    checks["closure"] = functools.partial(
        step_with_closure, rank, lambda: build("mlp"), lambda m: co.DistributedOptimizer(m, torch.optim.AdamW, lr=1e-2)
    )
    checks["given_one"] = functools.partial(
        zero_grad_after_step,  # one optimizer built by the user, given in place of a class
        rank,
        lambda: build("mlp"),
        lambda m: co.DistributedOptimizer(m, torch.optim.AdamW(m.parameters(), lr=1e-2)),
        set_to_none=True,
    )
    checks["optimizer_beside"] = functools.partial(optimizer_beside, rank, lambda: build("mlp"))
    checks["two_models"] = functools.partial(two_models, rank, lambda: build("mlp"))

    checks["state_roundtrip"] = functools.partial(state_roundtrip, rank)
    checks["flat_updates"] = functools.partial(flat_bucket_updates, rank)
    checks["dcp_resumed"] = functools.partial(resumed_through_torch_dcp, rank)
    checks["clip"] = functools.partial(clip_after_ddp, rank)
    checks[("schedule", "broadcast_orders", "schedule_overlapped", "schedule_weights")] = functools.partial(
        launch_order_planned, rank
    )
    checks["auto_size"] = functools.partial(auto_bucket_size, rank)
    checks["errors"] = functools.partial(bad_input_errors, rank)
    return checks


# (class, settings) per kind of the flat per-bucket update: the element-wise classes step one tensor per bucket,
# Adagrad (not vouched for) per parameter
FLAT_KINDS = {
    "sgd": ("SGD", {"lr": 0.05, "momentum": 0.9, "weight_decay": 1e-3}),
    "adam": ("Adam", {"lr": 1e-2, "foreach": True}),
    "adamw": ("AdamW", {"lr": 1e-2, "weight_decay": 0.01, "foreach": True}),
    "adamw_single": ("AdamW", {"lr": 1e-2, "weight_decay": 0.01, "foreach": False}),
    "adamw_fused": ("AdamW", {"lr": 1e-2, "weight_decay": 0.01, "fused": True}),
    "adagrad": ("Adagrad", {"lr": 1e-2}),
}


def flat_bucket_updates(rank: int, kinds: tuple[str, ...] = tuple(FLAT_KINDS), steps: int = 3) -> dict:
    """Per kind: DDP + the class, ours, and ours stepping per parameter over the same buckets (an optimizer of the
    class given in its place), each trained 2 micro-steps a step (the first under no_sync), saved after ``steps``
    steps, resumed into a new model and optimizer, then ``steps`` more; with the tensors each of our class's calls
    stepped (numels) and the buckets' sizes."""
    import copy

    import torch
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    import collective_ops as co
    from tests.models import MLP, build, rank_batch

    def train(model, optimizer, first: int) -> None:
        for step in range(first, first + steps):
            optimizer.zero_grad()
            for micro in range(2):
                x, y = rank_batch(MLP, 2 * step + micro, rank)
                with model.no_sync() if micro == 0 else torch.enable_grad():
                    torch.nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()

    def run(kind: str, setup: str) -> tuple[dict, dict, list, list]:
        cls_name, kwargs = FLAT_KINDS[kind]
        cls = getattr(torch.optim, cls_name)

        def make():
            if setup == "ddp":
                model = torch.nn.parallel.DistributedDataParallel(build("mlp"))
                return model, cls(model.parameters(), **kwargs)
            model = co.wrap(build("mlp"), bucket_size_mb=0.004, first_bucket_mb=0.001)
            given = cls(model.parameters(), **kwargs) if setup == "per_parameter" else cls
            return model, co.DistributedOptimizer(model, given, **({} if setup == "per_parameter" else kwargs))

        model, optimizer = make()
        calls: list = []
        hook = register_optimizer_step_pre_hook(
            lambda opt, args, kw: (
                calls.append([p.numel() for g in opt.param_groups for p in g["params"]])
                if opt is not optimizer
                else None
            )
        )
        try:
            train(model, optimizer, 0)
            saved = copy.deepcopy((model.module.state_dict(), optimizer.state_dict()))
            model, optimizer = make()  # resumed in a new model and optimizer
            model.module.load_state_dict(saved[0])
            optimizer.load_state_dict(saved[1])
            train(model, optimizer, steps)
            state = optimizer.state_dict()["state"]
            weights = snapshot(model.module)
        finally:
            hook.remove()
        buckets = [b.numel for b in model.manager.plan.buckets] if setup != "ddp" else []
        arrays = {f"{i}/{k}": torch.as_tensor(v).numpy().copy() for i, s in state.items() for k, v in s.items()}
        return weights, arrays, calls, buckets

    return {kind: {setup: run(kind, setup) for setup in ("ddp", "ours", "per_parameter")} for kind in kinds}


def state_roundtrip(rank: int) -> tuple:
    import torch

    import collective_ops as co
    from tests.models import MLP, build

    # state_dict round trip through a plain optimizer of the same class, and training continued from it
    model = co.wrap(build("mlp"), bucket_size_mb=0.004)
    opt = co.DistributedOptimizer(model, torch.optim.AdamW, lr=1e-2)
    _train(rank, model, opt, MLP, steps=3)
    saved = opt.state_dict()
    plain = torch.optim.AdamW(build("mlp").parameters(), lr=1e-2)
    plain.load_state_dict(saved)
    back = co.DistributedOptimizer(co.wrap(build("mlp"), bucket_size_mb=0.004), torch.optim.AdamW, lr=1e-2)
    back.load_state_dict(plain.state_dict())
    return (
        {f"{i}/{k}": v.numpy() for i, s in saved["state"].items() for k, v in s.items()},
        {f"{i}/{k}": v.numpy() for i, s in back.state_dict()["state"].items() for k, v in s.items()},
        saved["param_groups"] == back.state_dict()["param_groups"],
    )


def clip_after_ddp(rank: int) -> tuple:
    import torch

    import collective_ops as co
    from tests.models import build

    # clip_grad_norm_ on the averaged gradients, as torch's after DDP
    clipped = functools.partial(clipped_step, rank)
    ddp = torch.nn.parallel.DistributedDataParallel(build("mlp"))
    ours_model = co.wrap(build("mlp"), bucket_size_mb=0.004)
    return (
        clipped(ddp, torch.optim.SGD(ddp.parameters(), lr=0.1)),
        clipped(ours_model, co.DistributedOptimizer(ours_model, torch.optim.SGD, lr=0.1)),
    )


def launch_order_planned(rank: int) -> tuple:
    import torch

    import collective_ops as co

    # the launch order planned after step 3 from rank 0's profile (schedule="auto", the default), its shortlist
    # run in turn against plan order, the fastest kept: every forward's order recorded, weights against DDP
    from collective_ops.bucketing.update.planner import broadcast_orders
    from tests.models import TinyTransformer, build

    model = co.wrap(build("transformer"), bucket_size_mb=0.004, first_bucket_mb=0.001)
    opt = co.DistributedOptimizer(model, torch.optim.SGD, lr=0.05, momentum=0.9)
    opt.chunk_candidates_mib = (0.002,)  # 4 KB buckets: chunked orders are weighed too
    ran, overlapped = [], []

    def note(module, args):
        ran.append(list(model.manager.launch_order))
        overlapped.append(opt.defers)  # how the last backward ran (set at the end of the forward before it)

    model.module.register_forward_pre_hook(note)
    model.module.register_forward_hook(lambda module, args, output: _SlowOutputBackward.apply(output))
    trial_steps = 4 + (3 + TRIAL_CANDIDATES) * TRIAL_BLOCK_STEPS * TRIAL_ROUNDS + 2
    ours = _train(rank, model, opt, TinyTransformer, steps=trial_steps)
    ddp = torch.nn.parallel.DistributedDataParallel(build("transformer"))
    theirs = _train(
        rank, ddp, torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9), TinyTransformer, steps=trial_steps
    )
    report, trial = opt.schedule_report, opt.schedule_trial
    trial = None if trial is None else {**trial, "orders": [list(o) for o in trial["orders"]]}
    whole = None if report is None else sum(len(p.order) == len(model.manager.plan.buckets) for p in report)
    broadcast = broadcast_orders(model.engine, [(0, 1, 0, 2), (2, 1, 0)] if rank == 0 else [(1, 0)])
    schedule = (list(model.manager.launch_order), (whole, len(report or [])), ran, trial)
    return schedule, broadcast, (overlapped, opt.defers), (theirs, ours)


def auto_bucket_size(rank: int) -> tuple:
    import torch

    import collective_ops as co
    from tests.models import TinyTransformer, build

    # bucket_size_mb="auto" with it: the size chosen by the simulated overlapped step
    model = co.wrap(build("transformer"), bucket_size_mb="auto")
    opt = co.DistributedOptimizer(model, torch.optim.SGD, lr=0.05, schedule="auto")
    _train(rank, model, opt, TinyTransformer, steps=5)
    plan = model.manager.plan
    return (dict(model.auto_tune_overlapped), (plan.bucket_size_mb, plan.first_bucket_mb))


def bad_input_errors(rank: int) -> dict:
    import torch

    import collective_ops as co
    from tests.models import MLP, build

    # bad input: each refused with what to do
    errors = {}
    stranger = torch.nn.Parameter(torch.zeros(3))
    from torch.distributed.optim import ZeroRedundancyOptimizer

    class CountingSGD(torch.optim.SGD):
        """Keeps a per-step count in its groups (as schedule-free optimizers do): per-bucket steps would not
        advance it as a plain optimizer does."""

        def step(self, closure=None):
            for group in self.param_groups:
                group["k"] = group.get("k", 0) + 1
            return super().step(closure)

    def counting_step():
        model = co.wrap(build("mlp"))
        _train(rank, model, co.DistributedOptimizer(model, CountingSGD, lr=0.1), MLP, steps=1)

    def second_optimizer():  # two classes over parts of one model (Muon + AdamW, say): not two of ours
        model = co.wrap(build("mlp"))
        weights = [p for name, p in model.named_parameters() if name.endswith("weight")]
        first = co.DistributedOptimizer(model, torch.optim.SGD, params=weights, lr=0.1)
        rest = [p for name, p in model.named_parameters() if not name.endswith("weight")]
        return first, co.DistributedOptimizer(model, torch.optim.AdamW, params=rest, lr=1e-2)

    def given(kind: str):  # optimizers built by the user, given in place of a class
        model = co.wrap(build("mlp"))
        matrices = [p for p in model.parameters() if p.ndim == 2]
        sgd = torch.optim.SGD(matrices, lr=0.1)
        if kind == "settings":
            return co.DistributedOptimizer(model, [sgd], lr=0.1)
        if kind == "shared":
            return co.DistributedOptimizer(model, [sgd, torch.optim.AdamW(model.parameters())])
        if kind == "sharded":
            return co.DistributedOptimizer(model, [sgd], shard=True)
        optimizer = co.DistributedOptimizer(
            model, [sgd, torch.optim.AdamW([p for p in model.parameters() if p.ndim != 2])]
        )
        if kind == "direct_step":
            return sgd.step()
        if kind == "add_group":
            return optimizer.add_param_group({"params": matrices[:1]})
        return optimizer.load_state_dict(sgd.state_dict())

    for key, call in {
        **{f"given_{kind}": functools.partial(given, kind) for kind in ("settings", "shared", "sharded")},
        **{f"given_{kind}": functools.partial(given, kind) for kind in ("direct_step", "add_group", "load")},
        "not_wrapped": lambda: co.DistributedOptimizer(build("mlp"), torch.optim.SGD, lr=0.1),
        "not_a_class": lambda: co.DistributedOptimizer(co.wrap(build("mlp")), "adam", lr=0.1),
        "foreign_params": lambda: co.DistributedOptimizer(
            co.wrap(build("mlp")), torch.optim.SGD, params=[stranger], lr=0.1
        ),
        "schedule": lambda: co.DistributedOptimizer(co.wrap(build("mlp")), torch.optim.SGD, lr=0.1, schedule="x"),
        "needs_closure": lambda: co.DistributedOptimizer(co.wrap(build("mlp")), torch.optim.LBFGS),
        "zero": lambda: co.DistributedOptimizer(co.wrap(build("mlp")), ZeroRedundancyOptimizer),
        "group_mutation": counting_step,
        "second_optimizer": second_optimizer,
        "chunk_sizes": lambda: setattr(
            co.DistributedOptimizer(co.wrap(build("mlp")), torch.optim.SGD, lr=0.1), "chunk_candidates_mib", (2, 0)
        ),
    }.items():
        try:
            call()
            errors[key] = None
        except (TypeError, ValueError, RuntimeError) as exc:
            errors[key] = str(exc)
    return errors


@pytest.fixture(scope="module")
def two_ranks() -> list[dict]:
    return run_checks(2, optimizer_checks, timeout=300)


CASES = [
    "transformer_sgd",
    "transformer_adamw",
    "cnn_sgd",
    "cnn_adamw",
    "scheduler",
    "scheduler_tensor_lr",
    "scheduler_momentum_adamw",
    "scheduler_momentum_sgd",
    "accumulation",
    "losses_first",
    "unused",
    "held",
]


@pytest.mark.parametrize(
    "case",
    [
        *CASES,
        "held_in_chunks",
        "out_of_order",
        "zero_grad_after_step_True",
        "zero_grad_after_step_False",
        "group_added",
        "group_added_to_given",
        "given_one",
        "classic_norms",
        "parametrized_norms",
        "checkpointed",
        "checkpointed-reentrant",
        "checkpointed-head",
    ],
)
def test_bit_equal_to_ddp_with_the_same_optimizer(two_ranks, case: str) -> None:
    for rank, out in enumerate(two_ranks):
        ddp, ours = out[case]
        assert_identical(ours, ddp, f"{case}, rank {rank}, {STEPS} steps")


def test_a_result_the_transport_copies_back_during_the_loop_is_not_taken_for_the_loops_change(two_ranks) -> None:
    """Gloo lands device tensors' results with an in-place copy on its own thread (found on an H200): a bucket
    landing while the loop logs between backward() and step() trains as DDP, with no changed-gradients error."""
    for rank, out in enumerate(two_ranks):
        ddp, ours = out["copied_back_late"]
        assert_identical(ours, ddp, f"rank {rank}")


def test_an_evaluation_on_one_rank_alone_issues_no_collective_and_trains_as_ddp(two_ranks) -> None:
    for rank, out in enumerate(two_ranks):
        results = dict(out["one_rank_evaluations"])
        ddp = results.pop("ddp")
        for name, (weights, _) in results.items():
            assert_identical(weights, ddp, f"{name} with evaluations on rank 0 alone, rank {rank}")
        # what settles outside backward happened during the run: the online tune, the order trial (planned
        # over several buckets, and over one after the tune; sharded: plan order, then the shortlist)
        assert results["wrap"][1] is False
        assert results["auto"][1][1] >= 3 and results["auto_tuned"][1] == (False, 2), results
        assert results["plan"][1] == (False, False) and results["shard"][1][1] >= 2, results


def test_weights_do_not_depend_on_which_order_the_trial_keeps_at_three_ranks() -> None:
    """At 3 ranks a bucket sent in chunks sums differently from the same bucket sent whole (Gloo's ring adds each
    element in an order set by its place in the buffer), so only whole-bucket orders are planned there: whichever
    the timed trial keeps, the weights are the same."""
    for rank, out in enumerate(run_ranks(3, weights_whichever_order_is_kept, timeout=300)):
        (first, tried, kept_first, planned), (last, tried_again, kept_last, _) = out["first"], out["last"]
        buckets = len(tried[0])
        assert kept_first == 0 and kept_last == len(tried_again) - 1 > 0 and tried_again[kept_last] != tried[0]
        assert planned == [buckets], f"chunked orders planned at 3 ranks: lengths {planned}"
        assert_identical(last, first, f"weights with the trial's first vs last order kept, rank {rank}")


def test_a_forward_reading_parameters_before_their_module_runs_reads_them_updated(two_ranks) -> None:
    """The step's updates still owed (reductions landing late): a parent's forward reading a child's bias before
    the child runs, a branch reading a later branch's bias, a tied weight read before either holder runs; and
    rank 0 alone evaluating under no_grad. Weights and evaluations as DDP's, bit for bit."""
    assert_peeking_forwards_equal_ddp(two_ranks, "")


def test_state_dict_round_trips_through_a_plain_optimizer(two_ranks) -> None:
    for out in two_ranks:
        saved, back, groups_equal = out["state_roundtrip"]
        assert saved.keys() == back.keys() and len(saved) > 0
        assert_identical(back, saved, "state after DistributedOptimizer -> AdamW -> DistributedOptimizer")
        assert groups_equal


def test_resumed_through_torch_distributed_checkpoint_as_if_never_stopped(two_ranks) -> None:
    """get_state_dict()/set_*_state_dict() of torch.distributed.checkpoint, into a fresh model and optimizer, ours
    or torch's DDP + AdamW (the wrapper's checkpoints name entries as the model does, not module.*)."""
    for rank, out in enumerate(two_ranks):
        continued, resumed, into_ddp = out["dcp_resumed"]
        assert_identical(resumed, continued, f"resumed from DCP's state dicts, rank {rank}")
        assert_identical(into_ddp, continued, f"resumed into DDP + AdamW from DCP's state dicts, rank {rank}")


def test_clip_grad_norm_matches_torch_on_averaged_gradients(two_ranks) -> None:
    for out in two_ranks:
        (ddp_norm, ddp_params), (our_norm, our_params) = out["clip"]
        assert ddp_norm > 0.5 and our_norm == ddp_norm
        assert_identical(our_params, ddp_params, "after clipping and one step")


def test_a_launch_order_is_planned_tried_and_kept_the_same_on_every_rank(two_ranks) -> None:
    trial = two_ranks[0]["schedule"][3]
    assert trial is not None and trial == two_ranks[1]["schedule"][3]  # measured, reduced and kept alike
    tried, kept = trial["orders"], trial["kept"]
    n = len(tried[0])
    orders = [out["schedule"][0] for out in two_ranks]
    assert orders[0] == orders[1] and set(orders[0]) == set(range(n))
    whole, every = two_ranks[0]["schedule"][1]
    assert whole == (n + 1) * (n + 2) // 2 < every  # every (deferred, held_from) simulated; chunked ones too
    ran = [out["schedule"][2] for out in two_ranks]
    assert ran[0] == ran[1]  # every forward ran under the same order on every rank
    # every bucket finished in backward (in plan order), plan order overlapped, then the shortlist: the best
    # whole-bucket orders and, where simulated faster than those, the best chunked one
    assert tried[0] == tried[1] == list(range(n)) and len(tried) in (2 + TRIAL_CANDIDATES, 3 + TRIAL_CANDIDATES)
    assert all(len(order) == n for order in tried[: 2 + TRIAL_CANDIDATES]) and len(tried[-1]) >= n
    assert trial["overlapped"] == [False] + [True] * (len(tried) - 1)
    assert all(order in ran[0] for order in tried) and orders[0] == tried[kept]
    medians = trial["median_s"]
    assert min(medians) >= LEAD_S  # whole steps timed: the backward before the first gradient counts
    assert kept == 0 or medians[kept] == min(medians) < 0.98 * medians[0]
    assert ran[0][-1] == orders[0]  # the kept order runs from then on
    overlapped, defers_after = two_ranks[0]["schedule_overlapped"]
    assert overlapped == two_ranks[1]["schedule_overlapped"][0]  # every rank ran each candidate alike
    assert defers_after == trial["overlapped"][kept] and overlapped[-1] == defers_after
    start = overlapped.index(False)  # the trial's first step: its candidate 0 finishes buckets in backward
    blocks = [overlapped[start + k * TRIAL_BLOCK_STEPS] for k in range(len(tried))]
    assert blocks == trial["overlapped"], overlapped
    for rank, out in enumerate(two_ranks):
        assert_identical(out["schedule_weights"][1], out["schedule_weights"][0], f"orders switched, rank {rank}")


def test_shortlisted_orders_reach_every_rank_whatever_their_lengths(two_ranks) -> None:
    assert all(out["broadcast_orders"] == [(0, 1, 0, 2), (2, 1, 0)] for out in two_ranks)  # rank 0's


def test_the_shortlist_takes_a_chunked_order_only_where_simulated_faster() -> None:
    from collective_ops.bucketing.update.planner import shortlist
    from collective_ops.bucketing.update.schedule import OrderPrediction

    def predicted(order, step_s):
        return OrderPrediction(order, 0, step_s, 0.0, 0, step_s)

    whole = [predicted((1, 0, 2), 2.0), predicted((0, 1, 2), 2.5), predicted((2, 1, 0), 3.0)]
    chunked = predicted((0, 1, 0, 2), 1.5)
    assert shortlist([chunked, *whole], 2, 3) == [(1, 0, 2), (2, 1, 0), (0, 1, 0, 2)]
    assert shortlist([*whole, predicted((0, 1, 0, 2), 2.2)], 2, 3) == [(1, 0, 2), (2, 1, 0)]


def test_auto_bucket_size_is_chosen_by_the_overlapped_step(two_ranks) -> None:
    steps, chosen = two_ranks[0]["auto_size"]
    assert len(steps) >= 7  # every candidate size (and first bucket) simulated with its best launch order
    assert chosen == min(steps, key=steps.get) or steps[chosen] == min(steps.values())
    assert two_ranks[1]["auto_size"][1] == chosen  # rank 0's choice, on every rank


def test_evaluation_between_steps_sees_updated_weights(two_ranks) -> None:
    assert_evaluations_equal_ddp(two_ranks, "")


def test_grad_scaler_loop_with_an_overflow_step_equals_ddp(two_ranks) -> None:
    assert_scaled_training_equals_ddp(two_ranks, "")


def test_a_closure_is_called_once_and_its_loss_returned_as_torch_optimizers_do(two_ranks) -> None:
    assert_closure_steps_equal_ddp(two_ranks, "")


def test_optimizer_state_read_right_after_step_is_that_steps(two_ranks) -> None:
    for rank, out in enumerate(two_ranks):
        ddp, ours = out["state_read_after_step"]
        for step, (theirs, mine) in enumerate(zip(ddp, ours, strict=True)):
            assert_identical(mine, theirs, f"AdamW exp_avg read after step {step}, rank {rank}")


def test_updates_owed_into_an_autocast_forward_run_as_a_plain_step_does(two_ranks) -> None:
    """The forward pre-hooks apply the owed updates inside the loop's autocast region: an update through a
    matmul ran in bf16 there (silently off DDP's by ~5e-5 after 6 steps) until the twenty-first session."""
    for rank, out in enumerate(two_ranks):
        ddp, ours = out["autocast_forward"]
        assert_identical(ours, ddp, f"weights after bf16-autocast forwards, rank {rank}")


def test_check_finite_refuses_a_nan_step_on_every_rank_and_training_goes_on(two_ranks) -> None:
    assert_nonfinite_step_refused(two_ranks, "")


def test_gradients_changed_between_backward_and_step_are_refused_not_trained_on(two_ranks) -> None:
    """torch.nn.utils.clip_grad_norm_(model.parameters()) right after backward() clipped gradients still being
    reduced, and trained on silently: now step() refuses, before any update."""
    assert_changed_gradients_refused(two_ranks, "")


def assert_frozen_layer_as_ddp(results: list[dict], label: str) -> None:
    for rank, out in enumerate(result["frozen_layer"] for result in results):
        (ddp, ddp_state, ddp_numbers), (ours, our_state, our_numbers) = out
        assert_identical(ours, ddp, f"{label}weights with a frozen layer, rank {rank}")
        assert_identical(our_state, ddp_state, f"{label}optimizer state, rank {rank}")
        assert our_numbers == ddp_numbers, (our_numbers, ddp_numbers)


def test_a_step_on_gradients_never_averaged_is_refused(two_ranks) -> None:
    """Every backward of the step under no_sync(): DDP + a plain optimizer trains each rank on its own data
    (the replicas part, silently); the DistributedOptimizer refuses, nothing applied."""
    assert_step_after_no_sync_only_refused(two_ranks, "")


def test_a_frozen_layer_given_to_the_optimizer_trains_and_saves_as_ddp(two_ranks) -> None:
    assert_frozen_layer_as_ddp(two_ranks, "")


def test_parameters_changed_after_step_are_loaded_after_it_or_refused(two_ranks) -> None:
    """model.module.load_state_dict() right after step() landed under the owed updates (and an in-place edit
    of a parameter was updated on, silently): the load now comes after them, the edit is refused. A submodule's
    own state_dict() read stale weights (the last step's updates missing) and its own load_state_dict() was
    refused at the owed write: both now as under DDP."""
    assert_changed_params_handled(two_ranks, "")


def test_parameters_taken_through_the_model_are_final(two_ranks) -> None:
    """model.parameters() finishes the step's work in flight: torch's clip after backward and an EMA after step()
    see what they see under DDP (before, the clip raced the reductions and the EMA averaged stale weights)."""
    assert_through_the_model_equals_ddp(two_ranks, "")


def assert_through_the_model_equals_ddp(results: list[dict], label: str) -> None:
    for rank, out in enumerate(results):
        (ddp, ddp_ema), (ours, our_ema) = out["through_the_model"]
        assert_identical(ours, ddp, f"{label}weights, rank {rank}")
        assert_identical(our_ema, ddp_ema, f"{label}EMA of the weights, rank {rank}")


def test_torch_clipping_after_finish_reductions_equals_ddp(two_ranks) -> None:
    for rank, out in enumerate(two_ranks):
        ddp, ours = out["torch_clip_after_finish"]
        assert_identical(ours, ddp, f"clip_grad_norm_ after finish_reductions(), rank {rank}")


def test_bad_input_is_refused_with_what_to_do(two_ranks) -> None:
    errors = two_ranks[0]["errors"]
    assert "collective_ops.wrap" in errors["not_wrapped"]
    assert "torch.optim.Optimizer subclass" in errors["not_a_class"]
    assert "not a parameter of the wrapped model" in errors["foreign_params"]
    assert "schedule must be one of" in errors["schedule"]
    assert "LBFGS.step() needs a closure" in errors["needs_closure"]
    assert "ZeroRedundancyOptimizer is a distributed optimizer" in errors["zero"] and "shard=True" in errors["zero"]
    assert "CountingSGD.step() changed param_groups[0]['k']" in errors["group_mutation"]
    assert "co.wrap(net)" in errors["group_mutation"]
    assert "one per model" in errors["second_optimizer"] and "give both to one" in errors["second_optimizer"]
    assert "takes no settings or params (got lr)" in errors["given_settings"]
    assert "is in both SGD and AdamW" in errors["given_shared"]
    assert "shard=True takes an optimizer class" in errors["given_sharded"]
    assert "SGD.step() called directly" in errors["given_direct_step"]
    assert "which one should train the group" in errors["given_add_group"]
    assert "adamw.add_param_group(group)" in errors["given_add_group"]
    assert "holds 2 optimizers (SGD, AdamW)" in errors["given_load"]
    assert "each positive and finite" in errors["chunk_sizes"] and "(2, 0)" in errors["chunk_sizes"]


def test_several_optimizers_in_one_keep_the_overlap_and_equal_ddp(two_ranks) -> None:
    """Muon for the matrices and AdamW for the rest, given to one DistributedOptimizer: every step's updates
    owed past step() (the overlap kept), weights and each optimizer's own state_dict as DDP + the two."""
    for rank, out in enumerate(result["several_optimizers"] for result in two_ranks):
        (ddp, ddp_states, _, _), (ours, our_states, owed, heard) = out["ddp"], out["ours"]
        assert all(owed), f"rank {rank}: updates applied within step(), not overlapped: {owed}"
        assert not [w for w in heard if "lr_scheduler.step()" in w], heard  # Muon's scheduler: no false warning
        assert_identical(ours, ddp, f"Muon + AdamW weights, rank {rank}")
        for k, (theirs, mine) in enumerate(zip(ddp_states, our_states)):
            assert mine.keys() == theirs.keys() and mine, f"optimizer {k}'s state, rank {rank}"
            assert_identical(mine, theirs, f"optimizer {k}'s own state_dict() read after step(), rank {rank}")
        for k, (saved, plain, ours_again) in enumerate(zip(our_states, out["reloaded"], out["reloaded_ours"])):
            assert_identical(plain, saved, f"optimizer {k}'s state loaded into a plain one, rank {rank}")
            assert_identical(ours_again, saved, f"optimizer {k}'s state loaded into a new DistributedOptimizer")


def test_a_plain_optimizer_beside_steps_on_averaged_gradients(two_ranks) -> None:
    """A plain AdamW over the parameters the DistributedOptimizer was not given steps on averaged gradients
    (their buckets finished at the end of backward), before or after ours, under a GradScaler too: as DDP + the
    two. Our own buckets stay in flight across a plain step run first. Sharded it is refused."""
    for rank, out in enumerate(result["optimizer_beside"] for result in two_ranks):
        for case in ("plain_after", "plain_first", "scaled_plain_first", "scaled_plain_after"):
            assert isinstance(out[case], dict), f"{case}, rank {rank}: {out[case]}"
            assert_identical(out[case], out["ddp_scaled" if "scaled" in case else "ddp"], f"{case}, rank {rank}")
        assert any(out["in_flight_after_plain"]), "a plain step must finish only its own buckets, not ours"
        assert "AdamW.step() over parameters of a model whose DistributedOptimizer has shard=True" in out["sharded"]
        assert "or use shard=False" in out["sharded"]


def test_element_wise_classes_update_each_bucket_in_one_call_bit_equal_to_ddp(two_ranks) -> None:
    """SGD (momentum, weight decay), Adam and AdamW (foreach and single-tensor) step each bucket as one flat tensor:
    one call of the class per bucket, bit-equal to DDP + the class through no_sync accumulation and a checkpoint
    resumed into a new model and optimizer (state_dict in torch's per-parameter format), and to our own
    per-parameter step. fused=True runs the fused kernel on the flat tensor, whose rounding depends on where an
    element sits in the kernel's vector lanes: within 1e-6 relative of DDP + fused AdamW after 6 steps. Adagrad, not vouched for as element-wise, steps per parameter, equal to DDP's."""
    for rank, out in enumerate(result["flat_updates"] for result in two_ranks):
        for kind, runs in out.items():
            (ddp_weights, ddp_state, _, _) = runs["ddp"]
            (weights, state, calls, buckets) = runs["ours"]
            (per_weights, per_state, per_calls, _) = runs["per_parameter"]
            where = f"{kind}, rank {rank}"
            if kind == "adamw_fused":  # the fused kernel rounds by where an element sits in its vector lanes
                for reference in (ddp_weights, per_weights):
                    for key in reference:
                        np.testing.assert_allclose(weights[key], reference[key], rtol=1e-6, atol=1e-7, err_msg=where)
            else:
                assert_identical(weights, ddp_weights, f"{where}: weights against DDP + the class")
                assert_identical(state, ddp_state, f"{where}: state_dict against DDP + the class")
                assert_identical(weights, per_weights, f"{where}: flat against per-parameter weights")
                assert_identical(state, per_state, f"{where}: flat against per-parameter state")
            assert len(buckets) > 1 and max(map(len, per_calls)) > 1, where
            if kind == "adagrad":
                assert calls and max(map(len, calls)) > 1, f"{where}: Adagrad must step per parameter: {calls}"
                continue
            # one call per bucket and step, each over exactly one tensor: the bucket's flat buffer
            assert all(len(call) == 1 and call[0] in buckets for call in calls), f"{where}: {calls[:3]}"
            assert len(calls) == 6 * len(buckets), f"{where}: {len(calls)} calls for {len(buckets)} buckets x 6 steps"


def test_two_models_each_with_a_distributed_optimizer(two_ranks) -> None:
    """Two wrapped models with a DistributedOptimizer each train as under DDP, and each step() keeps its overlap
    with the next forward (stepping one does not finish the other's reductions, nor its own)."""
    for rank, out in enumerate(result["two_models"] for result in two_ranks):
        for k, (ours, ddp) in enumerate(zip(out["ours"], out["ddp"])):
            assert_identical(ours, ddp, f"model {k}, rank {rank}")
        assert all(out["in_flight_after_step"]), f"rank {rank}: a step lost its overlap {out['in_flight_after_step']}"


def three_rank_checks(rank: int, world: int) -> dict:
    from tests.models import TinyTransformer, build

    return {
        "sgd": _pair(rank, lambda: build("transformer"), "sgd", model_cls=TinyTransformer, steps=10),
        "flat_updates": flat_bucket_updates(rank, ("sgd", "adamw")),
    }


def test_three_ranks_within_rounding() -> None:
    """At 3 ranks Gloo's ring sums in another order for another bucket layout: equal to fp32 rounding. The flat
    per-bucket update there is bit-identical to the per-parameter update on the same buckets (the same sums)."""
    for out in run_ranks(3, three_rank_checks, timeout=300):
        ddp, ours = out["sgd"]
        for key in ddp:
            np.testing.assert_allclose(ours[key], ddp[key], rtol=1e-5, atol=1e-6, err_msg=key)
        for kind, runs in out["flat_updates"].items():
            (ddp_weights, *_), (weights, state, *_), (per_weights, per_state, *_) = (
                runs["ddp"],
                runs["ours"],
                runs["per_parameter"],
            )
            assert_identical(weights, per_weights, f"{kind}: flat against per-parameter weights, 3 ranks")
            assert_identical(state, per_state, f"{kind}: flat against per-parameter state, 3 ranks")
            for key in ddp_weights:
                np.testing.assert_allclose(weights[key], ddp_weights[key], rtol=1e-5, atol=1e-6, err_msg=key)


def traced_run(rank: int, world: int) -> None:
    import torch

    import collective_ops as co
    from tests.models import TinyTransformer, build

    model = co.wrap(build("transformer"), bucket_size_mb=0.004, first_bucket_mb=0.001, trace=True)
    optimizer = co.DistributedOptimizer(model, torch.optim.SGD, lr=0.05, momentum=0.9)
    _train(rank, model, optimizer, TinyTransformer, steps=5)


def test_the_trace_shows_updates_and_forward_waits_and_one_schedule_for_every_rank(tmp_path) -> None:
    from collections import defaultdict

    from collective_ops.tools.heatmap import load_events

    trace = tmp_path / "trace.json"
    run_ranks(2, traced_run, env={"COLLECTIVE_OPS_TRACE_FILE": str(trace)})
    events = load_events([trace])
    updates = [e for e in events if e.get("cat") == "optimizer"]
    for rank in (0, 1):
        kinds = {e["args"]["kind"] for e in updates if e["pid"] == rank}
        assert kinds == {"update", "forward wait"}, (rank, kinds)
        assert any(e["args"]["module"] for e in updates if e["pid"] == rank and e["args"]["kind"] == "forward wait")
    # the communication schedule (bucket launch order of every step) is the same on every rank
    launches = defaultdict(list)
    for e in sorted((e for e in events if e.get("cat") == "bucket"), key=lambda e: e["ts"]):
        launches[(e["pid"], e["args"]["step"])].append(e["args"]["bucket"])
    steps = sorted({step for _, step in launches})
    assert len(steps) >= 4
    for step in steps:
        assert launches[(0, step)] == launches[(1, step)] and len(launches[(0, step)]) > 1, step


def _forward_hooks_per_module(rank: int, world: int) -> dict[str, int]:
    from torch import nn

    import collective_ops as co

    torch.manual_seed(0)
    inner = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Dropout(0.0), nn.Sequential(nn.Linear(8, 4), nn.Tanh()))
    model = co.wrap(inner, bucket_size_mb=0.001)
    co.DistributedOptimizer(model, torch.optim.SGD, lr=0.1)
    return {name or "root": len(m._forward_pre_hooks) for name, m in inner.named_modules()}


def test_only_modules_that_may_read_an_owed_parameter_carry_a_forward_pre_hook() -> None:
    """The model's forward start and each module with trained parameters of its own: activations, dropouts and
    containers cost the step no hook call (their reads, if any, are their nearest hooked ancestor's)."""
    (hooks,) = run_ranks(1, _forward_hooks_per_module)
    assert hooks == {"root": 1, "0": 1, "1": 0, "2": 0, "3": 0, "3.0": 1, "3.1": 0}, hooks
