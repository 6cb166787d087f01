"""compression=co.PowerSGD(...) against torch DDP + powerSGD_hook, through a checkpoint, under DistributedOptimizer."""

from __future__ import annotations

import functools

import numpy as np
import pytest

from tests.harness import run_checks
from tests.reference import assert_identical, snapshot

STEPS = 6
START = 2  # two plain steps, then four compressed: warm start and error feedback carry over three times
SEED = 3
# The MLP's buckets as DDP lays them out with bucket_cap_mb=0.004 after its rebuild: [b2, w2, b1, w1] and
# [b0, w0] (a DDP bucket closes after the parameter that passes the cap); wrap's planner closes before it,
# so a cap of the first bucket's 17680 bytes gives the same two buckets.
DDP_CAP_MB, OUR_CAP_MB = 0.004, 0.0169


def _serial(hook):
    """torch's hook, waited for inside the hook: it launches its later allreduces from Gloo's completion
    callbacks, where two buckets' collectives can cross between ranks (a size mismatch or a hang on Gloo)."""

    def serial(state, bucket):
        future = hook(state, bucket)
        future.wait()
        return future

    return serial


def _zigzag():
    """MLP-shaped (16 in, 4 out), its 64 x 64 and 64 x 16 weights apart in the bucket: torch's hook compresses
    same-shaped gradients side by side (their factors and their random draws in that order)."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    sizes = (16, 64, 64, 16, 64, 64, 4)
    layers = [nn.Linear(a, b) for a, b in zip(sizes, sizes[1:])]
    return nn.Sequential(*(m for layer in layers for m in (layer, nn.Tanh())))


def _reduced_gradients(rank: int, model, model_cls, steps: int = STEPS, client_loop: bool = False) -> list[list]:
    """Each step's reduced gradients (SGD by hand in between, the same on both sides). ``client_loop``: each
    step starts with an evaluation on rank 0 alone, then accumulates a micro-batch under no_sync()."""
    import torch

    from tests.models import rank_batch

    params = [p for p in model.parameters() if p.requires_grad]
    out = []
    for step in range(steps):
        x, y = rank_batch(model_cls, step, rank)
        model.zero_grad()
        if client_loop:
            if rank == 0:
                model.eval()
                with torch.no_grad():
                    model(x)
                model.train()
            with model.no_sync():
                torch.nn.functional.cross_entropy(model(x.flip(0)), y.flip(0)).backward()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        out.append([p.grad.detach().clone().numpy() for p in params])
        with torch.no_grad():
            for p in params:
                p -= 0.1 * p.grad
    return out


def _against_ddp(
    rank: int,
    name: str,
    matrix_rank: int,
    ddp_cap: float,
    our_cap: float,
    warm_start: bool = True,
    client_loop: bool = False,
    error_feedback: bool = True,
) -> tuple[list, list]:
    import torch
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_powersgd

    import collective_ops as co
    from tests.models import MODELS, build

    def build_model():
        return _zigzag() if name == "zigzag" else build(name)

    ddp = torch.nn.parallel.DistributedDataParallel(build_model(), bucket_cap_mb=ddp_cap)
    state = torch_powersgd.PowerSGDState(
        None,
        matrix_approximation_rank=matrix_rank,
        start_powerSGD_iter=START,
        random_seed=SEED,
        warm_start=warm_start,
        use_error_feedback=error_feedback,
    )
    ddp.register_comm_hook(state, _serial(torch_powersgd.powerSGD_hook))
    ours = co.wrap(
        build_model(),
        bucket_size_mb=our_cap,
        first_bucket_mb=our_cap,
        compression=co.PowerSGD(
            rank=matrix_rank, start_iter=START, random_seed=SEED, warm_start=warm_start, error_feedback=error_feedback
        ),
    )
    cls = MODELS["mlp" if name == "zigzag" else name]
    return _reduced_gradients(rank, ddp, cls, client_loop=client_loop), _reduced_gradients(
        rank, ours, cls, client_loop=client_loop
    )


def _bytes_per_step(rank: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """comm_stats' bytes and collectives of the last plain step and of a compressed one (the MLP at rank 2)."""
    import torch

    model = _powersgd_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    _train(rank, model, optimizer, range(START))
    plain = model.comm_stats()
    _train(rank, model, optimizer, range(START, START + 1))
    compressed = model.comm_stats()
    return tuple((stats["bytes_per_step"], stats["collectives_per_step"]) for stats in (plain, compressed))


def _train(rank: int, model, optimizer, steps: range, name: str = "mlp") -> None:
    import torch

    from tests.models import MODELS, rank_batch

    for step in steps:
        x, y = rank_batch(MODELS[name], step, rank)
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()


def _powersgd_mlp(seed: int = 0, warm_start: bool = True, name: str = "mlp", cap_mb: float = OUR_CAP_MB):
    import collective_ops as co
    from tests.models import build

    compression = co.PowerSGD(rank=2, start_iter=START, random_seed=SEED, warm_start=warm_start)
    return co.wrap(build(name, seed=seed), bucket_size_mb=cap_mb, first_bucket_mb=cap_mb, compression=compression)


def _resumed(rank: int, cap_mb: float = OUR_CAP_MB) -> tuple[dict, dict]:
    """(uninterrupted, resumed from a checkpoint after step 4 into a new model, its buckets of ``cap_mb``, and a
    new optimizer)."""
    import io

    import torch

    model = _powersgd_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    _train(rank, model, optimizer, range(7))
    uninterrupted = snapshot(model.module)

    model = _powersgd_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    _train(rank, model, optimizer, range(4))
    saved = io.BytesIO()
    torch.save(
        {"model": model.state_dict(), "optim": optimizer.state_dict(), "compression": model.compression_state_dict()},
        saved,
    )
    saved.seek(0)
    checkpoint = torch.load(saved, weights_only=False)
    model = _powersgd_mlp(seed=7, cap_mb=cap_mb)  # other weights: all of them come from the checkpoint
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model.load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optim"])
    model.load_compression_state_dict(checkpoint["compression"])
    _train(rank, model, optimizer, range(4, 7))
    return uninterrupted, snapshot(model.module)


def _replanned(rank: int) -> tuple[dict, dict]:
    """(uninterrupted, the same with its buckets replanned into one after step 4: memory carried over)."""
    import torch

    runs = []
    for replan in (False, True):
        model = _powersgd_mlp()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        _train(rank, model, optimizer, range(4))
        if replan:
            model.set_bucket_size(25, first_bucket_mb=25)
            assert len(model.manager.plan.buckets) == 1
        _train(rank, model, optimizer, range(4, 7))
        runs.append(snapshot(model.module))
    return runs[0], runs[1]


def _with_distributed_optimizer(
    rank: int,
    steps: int,
    schedule: str | None = None,
    warm_start: bool = True,
    checkpoint_at: int | None = None,
    name: str = "mlp",
) -> tuple[dict, dict]:
    """(wrap + torch AdamW, wrap + DistributedOptimizer(AdamW)), both compressed alike. ``checkpoint_at``: the
    second saved after that many steps (its updates still owed to the next forward), resumed in a new model."""
    import io

    import torch

    import collective_ops as co

    def build(seed: int = 0):
        model = _powersgd_mlp(seed, warm_start, name)
        return model, co.DistributedOptimizer(model, torch.optim.AdamW, lr=1e-2, schedule=schedule)

    plain_model = _powersgd_mlp(warm_start=warm_start, name=name)
    _train(rank, plain_model, torch.optim.AdamW(plain_model.parameters(), lr=1e-2), range(steps), name)
    model, optimizer = build()
    first = steps if checkpoint_at is None else checkpoint_at
    if checkpoint_at is not None and schedule == "plan":  # every update owed to the next forward, whatever the timing
        model.manager.bucket_ready = lambda bucket: False
    _train(rank, model, optimizer, range(first), name)
    model.manager.__dict__.pop("bucket_ready", None)
    if checkpoint_at is not None:
        assert optimizer.in_flight == (schedule == "plan"), "the checkpoint is meant to be taken with updates owed"
        saved = io.BytesIO()
        compression = model.compression_state_dict()  # first: it lands the owed updates and their errors
        torch.save({"model": model.state_dict(), "optim": optimizer.state_dict(), "compression": compression}, saved)
        saved.seek(0)
        checkpoint = torch.load(saved, weights_only=False)
        model, optimizer = build(seed=7)
        model.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optim"])
        model.load_compression_state_dict(checkpoint["compression"])
        _train(rank, model, optimizer, range(first, steps), name)
    return snapshot(plain_model.module), snapshot(model.module)


def _auto_tuned(rank: int) -> dict:
    """bucket_size_mb='auto' under PowerSGD: the size it settled on, rank 0's prediction for it, and what the
    hook's reductions of the settled plan send."""
    import torch

    import collective_ops as co
    from tests.models import build

    compression = co.PowerSGD(rank=2, start_iter=START, random_seed=SEED)
    model = co.wrap(build("mlp"), bucket_size_mb="auto", compression=compression)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    _train(rank, model, optimizer, range(START + 2))  # tuned at the end of step 2; compressed from step 3
    plan, hook = model.manager.plan, model.manager.comm_hook
    chosen = next(
        p
        for p in model.auto_tune_report
        if (p.bucket_size_mb, p.first_bucket_mb) == (plan.bucket_size_mb, plan.first_bucket_mb)
    )
    return {
        "size": (plan.bucket_size_mb, plan.first_bucket_mb),
        "predicted": list(chosen.nbytes),
        "sent": [hook.wire_nbytes(bucket) for bucket in plan.buckets],
        "bytes_per_step": model.comm_stats()["bytes_per_step"],
        "fp32": sum(bucket.nbytes for bucket in plan.buckets),
    }


def _errors(rank: int) -> dict:
    import torch

    import collective_ops as co
    from tests.models import build
    from tests.reference import collect_errors

    other = co.wrap(build("mlp"), compression=co.PowerSGD(rank=1, start_iter=START))
    return collect_errors(
        {
            "start_iter": lambda: co.PowerSGD(start_iter=1),
            "rank": lambda: co.PowerSGD(rank=0),
            "sum": lambda: co.wrap(build("mlp"), reduce_op="sum", compression=co.PowerSGD()),
            "shard": lambda: co.DistributedOptimizer(
                co.wrap(build("mlp"), compression=co.PowerSGD()), torch.optim.SGD, lr=0.1, shard=True
            ),
            "other_options": lambda: other.load_compression_state_dict(_powersgd_mlp().compression_state_dict()),
        }
    )


def _state_refused_on_one_rank(rank: int) -> str:
    """Every rank gathers the compression state for a checkpoint (as Lightning's saving does) while rank 0 cannot
    give its own (a step left in flight): what each rank raises (every rank, not rank 0 alone)."""
    import torch

    from collective_ops.torch.rank_states import RankCompressionStates

    model = _powersgd_mlp()
    _train(rank, model, torch.optim.SGD(model.parameters(), lr=0.1), range(4))
    if rank == 0:
        model.manager.comm_hook._pending.append(None)  # as a step given up after a failure leaves it
    try:
        RankCompressionStates(model).state_dict()
    except RuntimeError as exc:
        return str(exc)
    finally:
        model.manager.comm_hook._pending.clear()
    return "nothing raised"


def _states_for_a_checkpoint(rank: int) -> dict:
    """RankCompressionStates.state_dict() written by rank 1, and written by every rank (writer None): which ranks'
    states each rank holds, and whether the held ones are each rank's own; whether loading its own state, and
    another rank's, warns."""
    import warnings

    import torch

    from collective_ops.torch.optim.state_json import encode
    from collective_ops.torch.rank_states import RankCompressionStates

    model = _powersgd_mlp()
    _train(rank, model, torch.optim.SGD(model.parameters(), lr=0.1), range(4))
    own = model.compression_state_dict()
    out = {}
    for label, writer in (("rank 1 writes", 1), ("every rank writes", None)):
        saved = RankCompressionStates(model, writer=lambda writer=writer: writer).state_dict()
        ranks = saved["ranks"]
        out[label] = None if ranks is None else len(ranks)
        if ranks is not None:
            assert saved["world_size"] == 2
            assert encode(ranks[rank]) == encode(own), f"{label}: rank {rank}'s own state differs"  # bit for bit
    fresh = _powersgd_mlp()
    for label, state in (("own", own), ("another rank's", {**own, "rank": 1 - rank})):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fresh.load_compression_state_dict(state)
        out[f"warned loading {label}"] = any("error-feedback memory is its own" in str(w.message) for w in caught)
    return out


def powersgd_checks(rank: int, world: int) -> dict:
    return {
        "ddp_rank2": functools.partial(_against_ddp, rank, "mlp", 2, DDP_CAP_MB, OUR_CAP_MB),
        "ddp_rank4": functools.partial(_against_ddp, rank, "mlp", 4, DDP_CAP_MB, OUR_CAP_MB),
        # one bucket: every gradient of the transformer in it, same-shaped ones compressed side by side
        "ddp_transformer": functools.partial(_against_ddp, rank, "transformer", 4, 25, 25),
        "ddp_same_shapes_apart": functools.partial(_against_ddp, rank, "zigzag", 1, 25, 25),
        # new Q factors every step: each bucket's seed is drawn in bucket order, as DDP's buckets run
        "ddp_no_warm_start": functools.partial(_against_ddp, rank, "mlp", 2, DDP_CAP_MB, OUR_CAP_MB, False),
        "ddp_client_loop": functools.partial(_against_ddp, rank, "mlp", 2, DDP_CAP_MB, OUR_CAP_MB, client_loop=True),
        # the gradients compressed as they are, nothing carried to the next step
        "ddp_no_error_feedback": functools.partial(
            _against_ddp, rank, "mlp", 4, DDP_CAP_MB, OUR_CAP_MB, error_feedback=False
        ),
        "resumed": functools.partial(_resumed, rank),
        # the two buckets' memory loaded into one (the state is kept by parameter)
        "resumed_other_buckets": functools.partial(_resumed, rank, 25),
        "replanned": functools.partial(_replanned, rank),
        "bytes": functools.partial(_bytes_per_step, rank),
        "errors": functools.partial(_errors, rank),
        "state_refused_on_one_rank": functools.partial(_state_refused_on_one_rank, rank),
        "states_for_a_checkpoint": functools.partial(_states_for_a_checkpoint, rank),
        "auto": functools.partial(_auto_tuned, rank),
        # overlapped: each bucket's update lands in the next forward
        "distributed_optimizer": functools.partial(_with_distributed_optimizer, rank, 8, "plan"),
        "distributed_optimizer_checkpoint": functools.partial(_with_distributed_optimizer, rank, 8, "plan", True, 4),
        # the launch-order trial (plan order, reversed, finished in backward), new Q factors every step
        "distributed_optimizer_trial": functools.partial(_with_distributed_optimizer, rank, 30, None, False),
        # 4-D convolution gradients, BatchNorm buffers broadcast at each forward while a bucket's Q is owed
        "distributed_optimizer_cnn": functools.partial(_with_distributed_optimizer, rank, 8, "plan", name="cnn"),
    }


@pytest.fixture(scope="module")
def two_ranks() -> list:
    return run_checks(2, powersgd_checks, timeout=240)


@pytest.mark.parametrize(
    "case",
    [
        "ddp_rank2",
        "ddp_rank4",
        "ddp_transformer",
        "ddp_same_shapes_apart",
        "ddp_no_warm_start",
        "ddp_client_loop",
        "ddp_no_error_feedback",
    ],
)
def test_reduced_gradients_equal_to_ddp_powersgd_hook_to_fp32_rounding(two_ranks, case: str) -> None:
    """The same algorithm as torch's hook; the engine forms the factor products in another summation order
    (faster on CPU), so each step's reduced gradients agree to fp32 rounding, relative to each gradient's size."""
    for results in two_ranks:
        ddp, ours = results[case]
        for step, (a, b) in enumerate(zip(ddp, ours, strict=True)):
            for name, x, y in zip(range(len(a)), a, b, strict=True):
                x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
                scale = max(np.abs(x).max(), 1e-30)
                assert np.abs(x - y).max() <= FP32_AGREEMENT * scale, (
                    f"{case}, rank {results.rank}, step {step}, gradient #{name}: "
                    f"max |ddp - ours| = {np.abs(x - y).max():.3g}, {np.abs(x - y).max() / scale:.3g} of its largest"
                )


# fp32 rounding: ~3e-7 of the largest gradient at the first compressed step, up to ~1.1e-6 after error feedback and
# warm start carry it over the cases' steps (measured); a wrong algorithm (no orthogonalisation, no error feedback) misses by far more
FP32_AGREEMENT = 1e-5


@pytest.mark.parametrize("case", ["resumed", "resumed_other_buckets", "replanned"])
def test_a_run_resumed_from_a_checkpoint_equals_an_uninterrupted_one(two_ranks, case: str) -> None:
    for results in two_ranks:
        uninterrupted, resumed = results[case]
        assert_identical(uninterrupted, resumed, f"rank {results.rank}")


@pytest.mark.parametrize(
    "case",
    [
        "distributed_optimizer",
        "distributed_optimizer_checkpoint",
        "distributed_optimizer_trial",
        "distributed_optimizer_cnn",
    ],
)
def test_distributed_optimizer_equals_the_same_compression_with_a_plain_optimizer(two_ranks, case: str) -> None:
    for results in two_ranks:
        plain, distributed = results[case]
        assert_identical(plain, distributed, f"rank {results.rank}")


def test_comm_stats_count_the_compressed_bytes_and_both_allreduces(two_ranks) -> None:
    # bucket [b2, w2, b1, w1]: w1 (64 x 64) alone compresses at rank 2 (w2, 4 x 64, would send 272 > 256
    # elements): 324 uncompressed + P 128 + Q 128; bucket [b0, w0]: 64 + P 128 + Q 32. A compressed bucket takes
    # two allreduces (uncompressed gradients and P, then Q), a plain one one; every step adds its alignment check.
    (plain_bytes, plain_collectives), (compressed_bytes, compressed_collectives) = two_ranks[0]["bytes"]
    assert (plain_bytes, compressed_bytes) == (5508 * 4, (580 + 224) * 4)
    assert (plain_collectives, compressed_collectives) == (2 + 1, 4 + 1)


def test_auto_bucket_size_settles_alike_on_every_rank_on_rank_0s_compressed_prediction(two_ranks) -> None:
    ours, peer = two_ranks[0]["auto"], two_ranks[1]["auto"]
    assert ours["size"] == peer["size"]
    assert ours["predicted"] == ours["sent"]  # priced as the hook sends it, not at fp32
    assert sum(ours["predicted"]) == ours["bytes_per_step"] < ours["fp32"]


def test_settings_it_cannot_honour_are_refused_with_what_to_do(two_ranks) -> None:
    errors = two_ranks[0]["errors"]
    assert "start_iter=1" in errors["start_iter"] and "at least 2" in errors["start_iter"]
    assert "positive int" in errors["rank"]
    assert "reduce_op='avg'" in errors["sum"]
    assert "without shard=True" in errors["shard"]
    assert "same PowerSGD options" in errors["other_options"]


def test_layout_compresses_matrices_that_pay_grouped_by_shape_as_torch_does() -> None:
    from collective_ops.bucketing.compression.powersgd import bucket_layout

    # a bias, a 64 x 64 weight, a 4-D convolution weight (16 x 3*3*8), another 64 x 64, a 4 x 64 head
    shapes = [(64,), (64, 64), (16, 8, 3, 3), (64, 64), (4, 64)]
    offsets = [0, 64, 64 + 4096, 64 + 4096 + 1152, 64 + 2 * 4096 + 1152]
    layout = bucket_layout(offsets, shapes, rank=2, min_compression_rate=2)
    # the head: (4 + 64) * 2 * 2 = 272 elements would not pay for its 256; the bias never does
    assert layout.uncompressed == ((0, 64), (offsets[4], 256))
    assert [(m.offset, m.rows, m.cols, m.rank) for m in layout.matrices] == [
        (64, 64, 64, 2),
        (offsets[3], 64, 64, 2),  # beside the first 64 x 64, ahead of the convolution
        (offsets[2], 16, 72, 2),
    ]
    assert [m.p_offset for m in layout.matrices] == [0, 128, 256]
    assert [m.q_offset for m in layout.matrices] == [0, 128, 256]
    assert (layout.p_numel, layout.q_numel) == (128 + 128 + 32, 128 + 128 + 144)


def _square_layers(count: int = 16, side: int = 1024) -> tuple[list, list]:
    """``count`` layers of a ``side`` x ``side`` weight and its bias (4 MiB each in fp32): shapes and specs."""
    from collective_ops.bucketing import ParamSpec

    shapes = [shape for _ in range(count) for shape in ((side, side), (side,))]
    return shapes, [ParamSpec(f"p{i}", _numel(s), "float32", "cpu", 4) for i, s in enumerate(shapes)]


def _numel(shape: tuple) -> int:
    return shape[0] * (shape[1] if len(shape) > 1 else 1)


def _sent_by_the_hook(shapes: list, plan, options) -> list[int]:
    """What the hook's reduction of each of ``plan``'s buckets sends once compressed (its ``wire_nbytes``, from
    the layout it lays out at launch: a fresh hook per plan, as after a replan)."""
    from types import SimpleNamespace

    from collective_ops.bucketing.compression.powersgd import PowerSGDHook

    hook = PowerSGDHook(options)
    hook.bind_shapes(shapes)
    for bucket in plan.buckets:
        hook._layout(SimpleNamespace(bucket=bucket))  # what a launch lays out (the rest of the context unused)
    hook.iteration = options.start_iter
    return [hook.wire_nbytes(bucket) for bucket in plan.buckets]


def test_the_bucket_size_tune_prices_what_each_candidate_sends_compressed_and_its_compute() -> None:
    import collective_ops as co
    from collective_ops.bucketing import plan_buckets
    from collective_ops.bucketing.compression.powersgd import PowerSGDHook, bucket_layout, layout_flops
    from collective_ops.bucketing.cost import BackwardProfile, CostModel, predict

    shapes, specs = _square_layers()
    order = list(range(len(specs)))[::-1]  # backward: the last layer first, a layer every 10 ms
    ready = {i: (len(specs) - 1 - i) // 2 * 0.01 for i in range(len(specs))}
    options = co.PowerSGD(rank=4)
    hook = PowerSGDHook(options)
    hook.bind_shapes(shapes)
    # a slow link: a 4 MiB layer in fp32 takes 17 ms, longer than its backward
    cost = CostModel(5e-4, 4e-9)
    fp32 = predict(specs, BackwardProfile(ready, 0.151, 1.0), cost, order=order)
    compressed = BackwardProfile(ready, 0.151, 1.0, bucket_wire=hook.planned_wire, flops_per_s=1e10)
    powersgd = predict(specs, compressed, cost, order=order)
    for p in powersgd:
        plan = plan_buckets(specs, p.bucket_size_mb, p.first_bucket_mb, order=order)
        assert list(p.nbytes) == _sent_by_the_hook(shapes, plan, options), (p.bucket_size_mb, p.first_bucket_mb)
        # a bucket with a compressed matrix issues two allreduces (uncompressed gradients and P, then Q)
        issued = [len(hook.planned_wire(b)[0]) for b in plan.buckets]
        assert p.collectives == sum(issued) > len(plan.buckets) and max(issued) == 2
    # two matmuls and an orthogonalisation per compressed weight (and the reconstruction), whatever the buckets
    flops = layout_flops(bucket_layout([0], [(1024, 1024)], 4, 2.0)) * 16
    assert all(p.compression_s == pytest.approx(flops / 1e10) for p in powersgd)
    assert all(p.step_s == pytest.approx(1.0 + p.compression_s + p.exposed_comm_s) for p in powersgd)  # in the step
    # fp32 starts early in small buckets; compressed, latency dominates (two collectives per bucket): fewer
    assert fp32[0].bucket_size_mb == 1.0 and powersgd[0].bucket_size_mb >= 10.0
    assert powersgd[0].collectives < fp32[0].collectives
    by_size = {(p.bucket_size_mb, p.first_bucket_mb): p for p in fp32}
    for p in powersgd:  # what the candidate sends shrinks by the compression ratio
        plain = sum(by_size[(p.bucket_size_mb, p.first_bucket_mb)].nbytes)
        assert sum(p.nbytes) * 50 < plain


def test_the_launch_order_planner_prices_what_each_bucket_sends_compressed() -> None:
    import time
    from types import SimpleNamespace

    import collective_ops as co
    from collective_ops.bucketing import plan_buckets
    from collective_ops.bucketing.compression.powersgd import PowerSGDHook
    from collective_ops.bucketing.cost import CostModel
    from collective_ops.bucketing.update.planner import planner_inputs
    from collective_ops.bucketing.update.timeline import ForwardTimeline

    shapes, specs = _square_layers(count=4, side=256)
    options = co.PowerSGD(rank=2)
    hook = PowerSGDHook(options)
    hook.bind_shapes(shapes)
    manager = SimpleNamespace(comm_hook=hook, wire_shares=lambda plan: {}, wire_itemsize=None)
    timeline = ForwardTimeline()  # one timed step: the forward before the backward ended, then this forward
    timeline.settled()
    now = time.perf_counter()
    stats = SimpleNamespace(backward_start=now, finalize_start=now, ready_times={i: now for i in range(len(specs))})
    timeline.forward_started(follows_backward=True)
    timeline.needed(list(range(len(specs))))
    timeline.forward_ended()
    for mb in (0.25, 1.0, 25.0):  # the live plan or a candidate the bucket-size tune weighs
        plan = plan_buckets(specs, mb, mb)
        profile, price = planner_inputs(timeline, manager, stats, plan, CostModel(1e-3, 1e-9))
        assert list(profile.nbytes) == _sent_by_the_hook(shapes, plan, options), mb
        assert sum(profile.nbytes) * 10 < sum(bucket.nbytes for bucket in plan.buckets)


def test_the_offline_tune_prices_compressed_buckets_and_counts_compute_once() -> None:
    """co.tune's profile (measured steps) gets the hook's price of each candidate; the compression's compute is
    added at the device's rate only where the profiled steps ran before start_iter (once started, it is measured)."""
    import collective_ops as co
    from collective_ops.bucketing.compression.powersgd import PowerSGDHook
    from collective_ops.bucketing.cost import BackwardProfile
    from collective_ops.tuning import with_compression_priced

    shapes, _ = _square_layers()
    hook = PowerSGDHook(co.PowerSGD(rank=4, start_iter=10))
    hook.bind_shapes(shapes)
    profile = BackwardProfile({0: 0.01}, 0.1, 0.2)
    assert with_compression_priced(profile, None, "cpu") is profile  # no compressing hook: as measured
    before = with_compression_priced(profile, hook, "cpu")
    assert before.bucket_wire == hook.planned_wire and before.flops_per_s == 1e10
    hook.iteration = 10  # compressing: the profiled steps' compute holds the compression's
    started = with_compression_priced(profile, hook, "cuda")
    assert started.bucket_wire == hook.planned_wire and started.flops_per_s == float("inf")


def test_a_checkpoint_gathers_every_ranks_compression_state_onto_the_rank_that_writes_it(two_ranks) -> None:
    """The writing rank alone receives every rank's PowerSGD state (gradient-sized per rank); where every rank
    writes (Accelerate's save_on_each_node), every rank receives them."""
    for results in two_ranks:
        held = results["states_for_a_checkpoint"]
        writes = {key: value for key, value in held.items() if key.endswith("writes")}
        assert writes == {"rank 1 writes": 2 if results.rank == 1 else None, "every rank writes": 2}, held


def test_a_ranks_compression_state_loaded_on_another_rank_warns(two_ranks) -> None:
    """Each rank's error-feedback memory is its own: rank 0's checkpoint loaded on every rank (a DDP habit: rank 0
    saves everything) trained on silently with rank 0's memory on rank 1."""
    for results in two_ranks:
        held = results["states_for_a_checkpoint"]
        assert not held["warned loading own"] and held["warned loading another rank's"], held


def test_a_checkpoint_gather_of_the_compression_state_fails_on_every_rank_where_one_cannot_give_it(two_ranks) -> None:
    """A rank whose state_dict() raises before the gather would leave its peers waiting in it (until the process
    group's timeout): every rank raises instead, naming that rank."""
    for rank, out in enumerate(two_ranks):
        said = out["state_refused_on_one_rank"]
        assert "could not be saved on every rank: rank 0: RuntimeError" in said, (rank, said)
