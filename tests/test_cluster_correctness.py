"""Defects that would train silently wrong (or break) on real clusters, each against torch DDP on real Gloo ranks.

One spawn of 2 ranks runs every check (starting processes costs seconds); the assertions
are made in the parent. Each check names the behaviour it pins down.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

from tests.harness import run_ranks
from tests.reference import assert_identical, snapshot


def _error(call) -> str | None:
    try:
        call()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def _accumulation(rank: int, model, sync_by_call: bool, rounds: int = 2, micro_steps: int = 3) -> dict:
    """Micro-batches under no_sync(); the last one synchronises (DDP) or sync_gradients() does (ours)."""
    import torch

    from tests.models import MLP, rank_batch

    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for round_ in range(rounds):
        optimizer.zero_grad()
        for micro in range(micro_steps):
            x, y = rank_batch(MLP, 10 * round_ + micro, rank)
            quiet = sync_by_call or micro < micro_steps - 1
            with model.no_sync() if quiet else torch.enable_grad():
                torch.nn.functional.cross_entropy(model(x), y).backward()
        if sync_by_call:
            model.sync_gradients()
        optimizer.step()
    return snapshot(model.module)


def _unused_run(rank: int, model, schedule: str) -> dict:
    """``branch`` is unused at some synchronising steps on some ranks; gradients are kept between steps.

    "stale": rank 1 skips the branch at steps 0 and 2, zero_grad(set_to_none=False) keeps zeros in .grad.
    "accumulated": the branch is used only in the no_sync micro-steps, not at the synchronising one.
    """
    import torch

    from tests.models import MLP, rank_batch

    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(3):
        optimizer.zero_grad(set_to_none=False)
        if schedule == "stale":
            x, y = rank_batch(MLP, step, rank)
            use = not (rank == 1 and step != 1)
            torch.nn.functional.cross_entropy(model(x, use_branch=use), y).backward()
        else:
            for micro in range(3):
                x, y = rank_batch(MLP, 10 * step + micro, rank)
                last = micro == 2
                with torch.enable_grad() if last else model.no_sync():
                    torch.nn.functional.cross_entropy(model(x, use_branch=not last), y).backward()
        optimizer.step()
    return snapshot(model.module)


class ChannelsLastCNN:
    """SmallCNN in channels_last memory format (the fast layout for convolutions on GPU/NPU)."""

    @staticmethod
    def build():
        import torch

        from tests.models import build

        return build("cnn").to(memory_format=torch.channels_last)


def _cnn_steps(rank: int, model) -> tuple[dict, list]:
    import torch

    from tests.models import SmallCNN, rank_batch

    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(3):
        x, y = rank_batch(SmallCNN, step, rank)
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x.to(memory_format=torch.channels_last)), y).backward()
        optimizer.step()
    layouts = [(tuple(p.grad.stride()), tuple(p.stride())) for p in model.module.parameters() if p.dim() == 4]
    return snapshot(model.module), layouts


def _mlp_steps(rank: int, model, steps: int = 4) -> dict:
    import torch

    from tests.models import MLP, rank_batch

    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(steps):
        x, y = rank_batch(MLP, step, rank)
        optimizer.zero_grad()
        out = model(x)
        torch.nn.functional.cross_entropy(out["logits"] if isinstance(out, dict) else out, y).backward()
        optimizer.step()
    return snapshot(model.module)


def _gradient_penalty_steps(rank: int, model, steps: int = 4) -> dict:
    """A WGAN-GP critic's loop: autograd.grad of the outputs for the inputs (reaching no parameter's .grad)
    with create_graph, then one backward through both; zero_grad(set_to_none=False) keeps zeros."""
    import torch

    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(steps):
        gen = torch.Generator().manual_seed(step * 10 + rank)
        real, fake = torch.randn(16, 16, generator=gen), torch.randn(16, 16, generator=gen)
        mix = torch.rand(16, 1, generator=gen)
        between = (mix * real + (1 - mix) * fake).requires_grad_(True)
        (grad,) = torch.autograd.grad(model(between).sum(), between, create_graph=True)
        penalty = ((grad.norm(2, dim=1) - 1) ** 2).mean()
        loss = model(fake).mean() - model(real).mean() + 10 * penalty
        optimizer.zero_grad(set_to_none=False)
        loss.backward()
        optimizer.step()
    return snapshot(model.module)


def _average_by_hand(net, world: int) -> None:
    """The reference's reduction: one all-reduce per gradient, then the division."""
    import torch.distributed as dist

    for p in net.parameters():
        dist.all_reduce(p.grad)
        p.grad /= world


def _failing_module():
    """An identity module whose backward raises while its ``fail`` is set (an injected failure mid-backward)."""
    import torch

    class FailingBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, fail):
            ctx.fail = fail
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            if ctx.fail:
                raise RuntimeError("a backward failed (injected)")
            return grad, None

    class Failing(torch.nn.Module):
        fail = False

        def forward(self, x):
            return FailingBackward.apply(x, self.fail)

    return Failing()


def _failed_backward_steps(rank: int, wrap, world: int, steps: int = 5, failing: int = 2) -> dict:
    """The model's last module raises in backward at step ``failing`` on every rank: after backward reached the
    model's output, before any parameter's gradient. The loop catches it and goes on with the next batch.
    ``wrap`` None: the reference (one all-reduce per gradient)."""
    import torch

    from tests.models import MLP, build, rank_batch

    failing_module = _failing_module()
    net = torch.nn.Sequential(build("mlp"), failing_module)
    model = net if wrap is None else wrap(net)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(steps):
        x, y = rank_batch(MLP, step, rank)
        optimizer.zero_grad()
        failing_module.fail = step == failing
        try:
            torch.nn.functional.cross_entropy(model(x), y).backward()
        except RuntimeError as exc:
            assert "injected" in str(exc), exc
            continue
        if wrap is None:
            _average_by_hand(net, world)
        optimizer.step()
    return snapshot(net)


def _partway_failed_backward_error(rank: int) -> list[str]:
    """Every rank's backward raises after its last layers' buckets were sent; the loop catches it, then calls
    sync_gradients() and runs the next forward: what each raises (the half-reduced step cannot be resumed)."""
    import torch

    import collective_ops as co
    from tests.models import MLP, rank_batch

    failing = _failing_module()
    failing.fail = True
    torch.manual_seed(0)
    layers = [torch.nn.Linear(16, 64), failing, torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4)]
    model = co.wrap(torch.nn.Sequential(*layers), bucket_size_mb=0.004)
    x, y = rank_batch(MLP, 0, rank)
    try:
        torch.nn.functional.cross_entropy(model(x), y).backward()
    except RuntimeError as exc:
        assert "injected" in str(exc), exc
    assert model.manager._next_launch > 0, "the failure must come after a bucket was sent"
    said = []
    for call in (model.sync_gradients, lambda: model(x)):
        try:
            call()
            said.append("nothing raised")
        except RuntimeError as exc:
            said.append(str(exc))
    return said


def _wrapped_under_checkpoint_steps(rank: int, wrap, world: int, reentrant: bool, steps: int = 4) -> dict:
    """The whole (wrapped) model under the loop's own activation checkpoint: its forward runs again inside
    backward. ``wrap`` None: the reference (one all-reduce per gradient)."""
    import torch
    from torch.utils.checkpoint import checkpoint

    from tests.models import MLP, build, rank_batch

    net = build("mlp")
    model = net if wrap is None else wrap(net)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(steps):
        x, y = rank_batch(MLP, step, rank)
        optimizer.zero_grad()
        logits = checkpoint(model, x.requires_grad_(reentrant), use_reentrant=reentrant)
        torch.nn.functional.cross_entropy(logits, y).backward()
        if wrap is None:
            _average_by_hand(net, world)
        optimizer.step()
    return snapshot(net)


def _scaler_run(rank: int, model) -> dict:
    """GradScaler on CPU; step 0 overflows (an inf in rank 1's input): the scaler must skip it, then train on."""
    import torch

    from tests.models import MLP, rank_batch

    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    scales = []
    for step in range(3):
        x, y = rank_batch(MLP, step, rank)
        if step == 0 and rank == 1:
            x[0, 0] = float("inf")
        optimizer.zero_grad()
        scaler.scale(torch.nn.functional.cross_entropy(model(x), y)).backward()
        scaler.step(optimizer)
        scaler.update()
        scales.append(float(scaler.get_scale()))
    return {"params": snapshot(model.module), "scales": scales}


class _RecordingHandle:
    """Wraps a collective's handle; remembers whether anyone waited for it."""

    def __init__(self, handle, log: list, index: int, fail: bool) -> None:
        self.handle, self.log, self.index, self.fail = handle, log, index, fail

    def wait(self, *args, **kwargs):
        self.handle.wait()
        self.log.append(self.index)
        if self.fail:
            raise KeyError("a bug in the completion callback")

    def is_completed(self) -> bool:
        return self.handle.is_completed()


def _run_section(out: dict, name: str, section) -> None:
    """One check's failure is recorded (its test fails, naming it), not allowed to mask the others."""
    import traceback

    try:
        section()
    except Exception:
        out[name] = traceback.format_exc()


def correctness_checks(rank: int, world: int) -> dict:
    import torch
    from torch import nn

    import collective_ops as co
    from tests.models import MLP, WithUnusedBranch, build, rank_batch

    ddp = nn.parallel.DistributedDataParallel
    out: dict = {}

    # 1. sync_gradients() after no_sync() accumulation: one reduction outside backward, DDP's result; twice
    def section_1() -> None:
        out["accum_ddp"] = _accumulation(rank, ddp(build("mlp")), sync_by_call=False)
        out["accum_view"] = _accumulation(rank, co.wrap(build("mlp"), bucket_size_mb=0.01), sync_by_call=True)
        copy_mode = co.wrap(build("mlp"), bucket_size_mb=0.01, gradient_as_bucket_view=False)
        out["accum_copy"] = _accumulation(rank, copy_mode, sync_by_call=True)

    _run_section(out, "section_1", section_1)

    # 2. ranks that differ only in requires_grad, or in the bucket size they ask for: refused at wrap everywhere
    def section_2() -> None:
        frozen = build("mlp")
        if rank == 1:
            frozen.net[0].weight.requires_grad_(False)
        out["frozen_on_one_rank"] = _error(lambda: co.wrap(frozen))
        out["bucket_size_differs"] = _error(lambda: co.wrap(build("mlp"), bucket_size_mb=0.01 * (rank + 1)))
        # options that change a step's collectives: one rank's extra all-reduce would pair with another's bucket
        for option, values in DIFFERING_OPTIONS.items():
            options = {option: values[rank]}
            out[f"{option}_differs"] = _error(lambda options=options: co.wrap(build("mlp"), **options))

    _run_section(out, "section_2", section_2)

    # 3. requires_grad changed after wrap: a clear error at the next backward (every rank changed it alike)
    def section_3() -> None:
        for change in ("freeze", "unfreeze"):
            model = build("mlp")
            model.net[2].bias.requires_grad_(change == "freeze")
            wrapped = co.wrap(model, bucket_size_mb=0.001)
            model.net[2].bias.requires_grad_(change != "freeze")
            x, y = rank_batch(MLP, 0, rank)
            out[f"requires_grad_{change}"] = _error(
                lambda w=wrapped, x=x, y=y: nn.functional.cross_entropy(w(x), y).backward()
            )
            wrapped.remove_hooks()

    _run_section(out, "section_3", section_3)

    # 4. find_unused_parameters with kept gradients (copy and view mode) and with no_sync accumulation
    def section_4() -> None:
        for schedule in ("stale", "accumulated"):
            torch.manual_seed(0)
            out[f"unused_{schedule}_ddp"] = _unused_run(
                rank, ddp(WithUnusedBranch(), find_unused_parameters=True), schedule
            )
            for view in (False, True):
                torch.manual_seed(0)
                ours = co.wrap(
                    WithUnusedBranch(), bucket_size_mb=0.001, find_unused_parameters=True, gradient_as_bucket_view=view
                )
                out[f"unused_{schedule}_{'view' if view else 'copy'}"] = _unused_run(rank, ours, schedule)

    _run_section(out, "section_4", section_4)

    # 5. sparse gradients: refused at wrap (module) or at the first backward (functional), with what to do
    def section_5() -> None:
        sparse_model = nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Linear(4, 2))
        out["sparse_module"] = _error(lambda: co.wrap(sparse_model))

        class FunctionalSparse(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.table = nn.Parameter(torch.randn(10, 4))

            def forward(self, idx):
                return nn.functional.embedding(idx, self.table, sparse=True).sum()

        torch.manual_seed(0)
        functional = co.wrap(FunctionalSparse())
        out["sparse_functional"] = _error(lambda: functional(torch.tensor([1, 2])).backward())
        functional.remove_hooks()

    _run_section(out, "section_5", section_5)

    # 6. channels_last: gradient views with the parameters' strides, results equal to DDP's
    def section_6() -> None:
        out["cl_ddp"], _ = _cnn_steps(rank, ddp(ChannelsLastCNN.build()))
        out["cl_ours"], out["cl_layouts"] = _cnn_steps(rank, co.wrap(ChannelsLastCNN.build(), bucket_size_mb=0.001))

    _run_section(out, "section_6", section_6)

    # 7. parameters on more than one device: refused (meta stands in for a second accelerator)
    def section_7() -> None:
        two_devices = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4, device="meta"))
        out["two_devices"] = _error(lambda: co.wrap(two_devices))
        # DDP's name for the bucket size is understood; two disagreeing sizes are not
        out["bucket_cap_mb"] = co.wrap(build("mlp"), bucket_cap_mb=1).manager.plan.bucket_size_mb
        out["bucket_cap_mb_conflict"] = _error(lambda: co.wrap(build("mlp"), bucket_size_mb=5, bucket_cap_mb=1))

    _run_section(out, "section_7", section_7)

    # 8. check_finite with a GradScaler whose overflow step is skipped: no error, DDP's result
    def section_8() -> None:
        out["scaler_ddp"] = _scaler_run(rank, ddp(build("mlp")))
        out["scaler_ours"] = _scaler_run(rank, co.wrap(build("mlp"), check_finite=True))

    _run_section(out, "section_8", section_8)

    # 9. a comm hook whose completion fails: an honest error, and every other bucket in flight waited for
    def section_9() -> None:
        waited: list[int] = []
        launched: list[int] = []
        engine = co.runtime.get_engine("torch")

        def failing_hook(ctx):
            launched.append(ctx.bucket.index)
            handle = engine.allreduce(ctx.buffer, "sum", async_op=True)
            return _RecordingHandle(handle, waited, ctx.bucket.index, fail=ctx.bucket.index == 0)

        model = co.wrap(build("mlp"), bucket_size_mb=0.001, comm_hook=failing_hook)
        x, y = rank_batch(MLP, 0, rank)
        out["hook_error"] = _error(lambda: nn.functional.cross_entropy(model(x), y).backward())
        out["hook_launched_waited"] = (sorted(launched), sorted(waited))
        model.remove_hooks()

    _run_section(out, "section_9", section_9)

    # 10. activation checkpointing: a block's forward runs again inside backward (the reentrant form runs a
    #     backward of its own there, which ends first: with the output layer inside it, before the outer one
    #     reaches the first layer). Every parameter is used, so find_unused_parameters=True must give DDP's
    #     result without it (DDP itself raises with it and the reentrant form: "mark a variable ready only once")
    def section_10() -> None:
        for name in ("checkpointed", "checkpointed-reentrant", "checkpointed-head", "checkpointed-head-dict"):
            out[f"{name}_ddp"] = _mlp_steps(rank, ddp(build(name)))
            for find_unused in (False, True):
                wrapped = co.wrap(build(name), bucket_size_mb=0.004, find_unused_parameters=find_unused)
                out[f"{name}_ours_{find_unused}"] = _mlp_steps(rank, wrapped)
        # a backward that reaches the outputs but no parameter (a gradient penalty's autograd.grad) is no step
        out["penalty_ddp"] = _gradient_penalty_steps(rank, ddp(build("mlp")))
        wrapped = co.wrap(build("mlp"), bucket_size_mb=0.004, find_unused_parameters=True)
        out["penalty_ours"] = _gradient_penalty_steps(rank, wrapped)
        out["penalty_steps"] = wrapped.manager.totals["steps"]
        # a backward that raised after reaching the outputs, before any parameter's gradient, caught by the loop:
        # training goes on
        out["failed_backward_reference"] = _failed_backward_steps(rank, None, world)
        wrap = functools.partial(co.wrap, bucket_size_mb=0.004)
        out["failed_backward_ours"] = _failed_backward_steps(rank, wrap, world)
        out["partway_failed_backward"] = _partway_failed_backward_error(rank)
        # the wrapped model under the loop's own checkpoint: a forward of the wrapper inside backward
        for reentrant in (False, True):
            reference = _wrapped_under_checkpoint_steps(rank, None, world, reentrant)
            out[f"under_checkpoint_{reentrant}_reference"] = reference
            unused = functools.partial(co.wrap, bucket_size_mb=0.004, find_unused_parameters=True)
            out[f"under_checkpoint_{reentrant}_ours"] = _wrapped_under_checkpoint_steps(rank, unused, world, reentrant)

    _run_section(out, "section_10", section_10)

    return out


# wrap options that change a step's collectives, as rank 0 and rank 1 pass them in section 2
DIFFERING_OPTIONS = {
    "find_unused_parameters": (False, True),
    "check_step_alignment": (True, False),
    "compression": (None, "fp16"),
    "broadcast_buffers": (True, False),
}


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_ranks(2, correctness_checks, timeout=300)


def _section(results: list[dict], name: str) -> list[dict]:
    for rank, out in enumerate(results):
        assert name not in out, f"{name} crashed on rank {rank}:\n{out[name]}"
    return results


def test_sync_gradients_after_no_sync_equals_ddp(results) -> None:
    for out in _section(results, "section_1"):
        assert_identical(out["accum_view"], out["accum_ddp"], "no_sync + sync_gradients (view) vs DDP")
        assert_identical(out["accum_copy"], out["accum_ddp"], "no_sync + sync_gradients (copy) vs DDP")


def test_ranks_that_plan_differently_are_refused_at_wrap(results) -> None:
    for out in _section(results, "section_2"):
        error = out["frozen_on_one_rank"]
        assert error and error.startswith("ModelMismatchError"), error
        assert "'net.0.weight'" in error and "requires_grad False" in error and "rank 1" in error
        error = out["bucket_size_differs"]
        assert error and error.startswith("ModelMismatchError") and "bucket_size_mb 0.02" in error, error
        for option, values in DIFFERING_OPTIONS.items():
            error = out[f"{option}_differs"]
            assert error and error.startswith("ModelMismatchError") and "wrap options" in error, error
            assert all(f"{option} {value}" in error for value in values), error


def test_requires_grad_changed_after_wrap_is_an_error(results) -> None:
    for out in _section(results, "section_3"):
        for change in ("freeze", "unfreeze"):
            error = out[f"requires_grad_{change}"]
            assert error and "requires_grad changed after wrap() for ['net.2.bias']" in error, error


@pytest.mark.parametrize("schedule", ["stale", "accumulated"])
@pytest.mark.parametrize("mode", ["copy", "view"])
def test_unused_parameters_end_with_the_reduced_gradient(results, schedule: str, mode: str) -> None:
    for out in _section(results, "section_4"):
        assert_identical(out[f"unused_{schedule}_{mode}"], out[f"unused_{schedule}_ddp"], f"{schedule} {mode} vs DDP")


def test_sparse_gradients_are_refused_with_what_to_do(results) -> None:
    for out in _section(results, "section_5"):
        assert "Embedding(sparse=True)" in out["sparse_module"] and "sparse=False" in out["sparse_module"]
        assert "received a sparse gradient" in out["sparse_functional"] and "'table'" in out["sparse_functional"]


def test_gradient_views_keep_the_parameter_layout(results) -> None:
    for out in _section(results, "section_6"):
        assert out["cl_layouts"] and all(grad == param for grad, param in out["cl_layouts"]), out["cl_layouts"]
        assert_identical(out["cl_ours"], out["cl_ddp"], "channels_last CNN vs DDP")


def test_parameters_on_two_devices_are_refused(results) -> None:
    for out in _section(results, "section_7"):
        assert "2 devices (cpu, meta)" in out["two_devices"] and "one process per device" in out["two_devices"]
        assert out["bucket_cap_mb"] == 1.0 and "disagree" in out["bucket_cap_mb_conflict"]


def test_check_finite_lets_a_grad_scaler_skip_overflow_steps(results) -> None:
    for out in _section(results, "section_8"):
        assert out["scaler_ours"]["scales"] == out["scaler_ddp"]["scales"] == [512.0, 512.0, 512.0]
        assert_identical(out["scaler_ours"]["params"], out["scaler_ddp"]["params"], "GradScaler run vs DDP")


def test_a_failing_completion_is_not_blamed_on_peers_and_nothing_is_left_in_flight(results) -> None:
    for out in _section(results, "section_9"):
        error = out["hook_error"]
        assert error and error.startswith("CommHookError") and "not a communication failure" in error, error
        launched, waited = out["hook_launched_waited"]
        assert len(launched) > 1 and waited == launched, (launched, waited)


@pytest.mark.parametrize("find_unused", [False, True])
@pytest.mark.parametrize(
    "name", ["checkpointed", "checkpointed-reentrant", "checkpointed-head", "checkpointed-head-dict"]
)
def test_activation_checkpointing_trains_as_ddp(results, name: str, find_unused: bool) -> None:
    for rank, out in enumerate(_section(results, "section_10")):
        assert_identical(out[f"{name}_ours_{find_unused}"], out[f"{name}_ddp"], f"{name}, rank {rank}")


def test_a_gradient_penalty_loop_trains_as_ddp_and_its_autograd_grad_is_no_step(results) -> None:
    for rank, out in enumerate(_section(results, "section_10")):
        assert_identical(out["penalty_ours"], out["penalty_ddp"], f"WGAN-GP loop, rank {rank}")
        assert out["penalty_steps"] == 4, out["penalty_steps"]  # one reduction per iteration


def test_training_goes_on_after_a_backward_that_raised_before_any_gradient(results) -> None:
    for rank, out in enumerate(_section(results, "section_10")):
        assert_identical(out["failed_backward_ours"], out["failed_backward_reference"], f"rank {rank}")


def test_the_forward_after_a_backward_that_raised_partway_says_the_step_cannot_be_resumed(results) -> None:
    for rank, out in enumerate(_section(results, "section_10")):
        synced, forward = out["partway_failed_backward"]
        assert "after a backward that raised partway" in synced and "restart the ranks" in synced, (rank, synced)
        assert "raised after some buckets were sent" in forward, (rank, forward)
        assert "restart the ranks from the last checkpoint" in forward, (rank, forward)


@pytest.mark.parametrize("reentrant", [False, True])
def test_a_wrapped_model_under_the_loops_own_checkpoint_trains_as_the_reference(results, reentrant: bool) -> None:
    for rank, out in enumerate(_section(results, "section_10")):
        ours, reference = out[f"under_checkpoint_{reentrant}_ours"], out[f"under_checkpoint_{reentrant}_reference"]
        assert_identical(ours, reference, f"rank {rank}")


def test_plan_fingerprint_ignores_the_device_index() -> None:
    from collective_ops.bucketing import ParamSpec, plan_buckets

    def plan(device: str):
        specs = [ParamSpec(f"p{i}", 1000 * (i + 1), "float32", device, 4) for i in range(6)]
        return plan_buckets(specs, bucket_size_mb=0.01)

    assert plan("cuda:0").fingerprint() == plan("cuda:1").fingerprint()
    assert plan("cuda:0").fingerprint() != plan("cpu").fingerprint()
    assert np.all([b.device == "cuda:1" for b in plan("cuda:1").buckets])
