"""MindSpore under msrun (2 workers, CPU/MCCL): primitives against numpy."""

from __future__ import annotations

import numpy as np
import pytest

from collective_ops.tools.heatmap import analyze, load_events
from tests.msrun_harness import SuiteRun, requires_mindspore, run_msrun_suite
from tests.reference import OPS, assert_identical, check_allreduce, check_gather_and_scatter

# the first test that reads a (mode, world) suite pays for its whole msrun start
pytestmark = [requires_mindspore, pytest.mark.timeout(900)]

# One msrun start per suite (its mode, world size), each running these worker scripts in order
# (ms_workers/suite.py): a start costs ~10-20 s here. The PyNative adapter runs last: it starts the trace its test reads. The
# GRAPH adapter sets MindSpore's data-parallel context (for nn.TrainOneStepCell's own reducer) and leaves it.
SUITES = {
    ("pynative", 2): (
        "primitives",
        "bench",
        "join",
        "model_train",
        "loss_scale",
        "alignment",
        "sharded",
        "auto_tune",
        "dist_opt_overlap",
        "powersgd",
        "model_wrap",
        "adapter",
        "after_shutdown",
    ),
    ("pynative", 3): ("join", "sharded", "adapter:1e-06"),
    ("graph", 2): ("model_train", "loss_scale", "adapter"),
    # GRAPH's Model over the wrapper apart: it traces (its test reads the trace), and a trace once started is
    # joined by every later wrapper of the process
    ("graph-model", 2): ("model_wrap",),
}
SUITE_TIMEOUT_S = 800  # one start runs every part of its suite (pynative-2: ~2.5 min here)


def suite_run(suite: str, world: int) -> SuiteRun:
    """The (suite, world) suite's one msrun start (the suite names its mode first)."""
    return run_msrun_suite(suite.split("-")[0], world, SUITES[(suite, world)], SUITE_TIMEOUT_S)


def model_wrap_run(mode: str) -> SuiteRun:
    """ms_workers/model_wrap.py (Model over the wrapper) at 2 workers: in PyNative's suite, GRAPH's apart."""
    return suite_run("pynative" if mode == "pynative" else "graph-model", 2)


def results_of(mode: str, world: int, part: str) -> list[dict]:
    """Every rank's result of one worker script, from its (mode, world) suite's one msrun start."""
    return suite_run(mode, world).part(part)


def test_primitives_match_numpy() -> None:
    results = results_of("pynative", 2, "primitives")
    world = 2
    for rank, out in enumerate(results):
        assert (out["framework"], out["backend"], out["world"]) == ("mindspore", "mccl", world)
        for dtype in ("float32", "float16", "bfloat16", "int64"):
            for op in OPS:
                if op == "avg" and dtype == "int64":
                    continue
                check_allreduce(np.array(out[f"allreduce/{dtype}/{op}"]), world, dtype, op)
                assert out[f"inplace/{dtype}/{op}"], "allreduce must return the tensor it reduced in place"
        assert out["async"] == [1.5] * 3 and out["async_completed"]
        np.testing.assert_array_equal(out["broadcast"], np.full((4, 2), 10.0))
        check_gather_and_scatter(out, rank, world)
        np.testing.assert_array_equal(
            out["reduce_scatter_max"], (np.arange(world * 4) * world)[rank * 4 : rank * 4 + 4]
        )
        assert out["numpy_inplace"] == [True, [[3.0, 3.0], [3.0, 3.0]]]
        assert out["bucket_equal"], "fused GradientBucket result differs from per-tensor allreduce"
        # fp32 in add order at 100 KiB: [40 B + 8 KB], [120 KB alone: over the cap], [20 B]; fp16: one
        assert out["bucket_collectives"] == 4
        errors = out["errors"]
        assert "median" in errors["unknown_op"]
        assert "floating" in errors["int_avg"]
        assert "multiple of the world size" in errors["reduce_scatter_shape"]
        assert "0..1" in errors["bad_src"]


# 3 workers: the average must be DistributedGradReducer's (sum, then times float32(1/3)), which a sum then
# a division misses in the last bit (powers of two cannot tell them apart). The eager paths (hooks, after
# backward) and the compiled one all run in PyNative. Buckets hold one gradient each there (a tiny size):
# MCCL's ring sums a fused bucket in another order than DGR's per-gradient calls (see the worker).
@pytest.mark.parametrize(
    ("mode", "world", "bucket_mb"), [("pynative", 2, None), ("graph", 2, None), ("pynative", 3, 1e-6)]
)
def test_wrap_equals_distributed_grad_reducer(mode: str, world: int, bucket_mb: float | None) -> None:
    part = "adapter" if bucket_mb is None else f"adapter:{bucket_mb}"
    results = results_of(mode, world, part)
    if mode == "pynative":  # the same trace as the torch adapter's, merged from every msrun worker
        analysis = analyze(load_events([suite_run(mode, world).trace_file]))
        assert analysis.ranks == list(range(world)) and len(analysis.steps) >= 3
        assert analysis.comm_ms.shape[1] == max(r["stats"]["buckets"] for r in results)
    for out in results:
        assert_identical(out["ours_grads"], out["dgr_grads"], "first-step gradients vs DistributedGradReducer")
        assert_identical(out["ours"], out["dgr"], "parameters after 3 steps vs DistributedGradReducer")
        stats = out["stats"]
        assert stats["mode"] == ("overlap" if mode == "pynative" else "fused-after-backward (compiled)")
        assert stats["buckets"] > 1 and stats["collectives_per_step"] == stats["buckets"]
        assert stats["backend"] == "mccl"
        if mode == "pynative":  # GRAPH's main run is the compiled after-backward path already (see the worker)
            _assert_after_backward_paths(out, world)
        if world == 2:  # other routes to the same reduction, and bad input (the worker runs them at 2 only)
            _assert_other_routes_and_errors(out, mode)
    assert len({r["stats"]["plan_fingerprint"] for r in results}) == 1


def _assert_after_backward_paths(out: dict, world: int) -> None:
    if world == 2:  # two operands: any summation order gives the same bits
        assert_identical(out["fused"], out["dgr"], "fused buckets vs DistributedGradReducer")
    else:  # within the rounding of a different summation order (3 steps of momentum SGD)
        for name, value in out["dgr"].items():
            np.testing.assert_allclose(out["fused"][name], value, rtol=1e-5, atol=1e-7, err_msg=name)
    assert_identical(out["after_compiled"], out["dgr"], "after backward, compiled, vs DistributedGradReducer")
    assert_identical(out["after_eager"], out["dgr"], "after backward, eager, vs DistributedGradReducer")
    assert out["after_compiled_stats"]["mode"] == "fused-after-backward (compiled)"
    assert out["after_eager_stats"]["mode"] == "fused-after-backward"
    for stats in (out["after_compiled_stats"], out["after_eager_stats"]):
        assert stats["buckets"] > 1 and stats["collectives_per_step"] == stats["buckets"]
    assert_identical(out["fp16_compiled"], out["fp16_eager"], "fp16 compression: compiled vs eager hook")
    assert (out["fp16_compiled_mode"], out["fp16_eager_mode"]) == (
        "fused-after-backward (compiled)",
        "fused-after-backward",
    )
    drift = max(np.abs(np.array(out["fp16_compiled"][k]) - np.array(out["dgr"][k])).max() for k in out["dgr"])
    assert 0 < drift < 1e-2, f"fp16 on the wire should differ from fp32 DGR only in rounding, not {drift}"


def _assert_other_routes_and_errors(out: dict, mode: str) -> None:
    if mode == "pynative":  # GRAPH runs TrainOneStepCell's in-graph reduction and bad input only (see the worker)
        assert_identical(out["unused_ours"], out["unused_dgr"], "unused parameter on one rank")
        assert_identical(out["accum_ours"], out["accum_dgr"], "gradient accumulation")
        assert_identical(out["grouped_ours"], out["grouped_dgr"], "parameter groups, params=optimizer.parameters")
    assert_identical(out["train_one_step"], out["dgr"], f"TrainOneStepCell ({mode})")
    if mode == "graph":
        assert_identical(
            out["train_one_step_dgr"], out["dgr"], "nn.TrainOneStepCell with its own DGR, data-parallel mode"
        )
    errors = out["errors"]
    assert "ModelMismatchError" in errors["mismatch"] and "rank 1" in errors["mismatch"]
    differ = errors["options_differ"]
    assert "ModelMismatchError" in differ and "wrap options" in differ, differ
    assert "find_unused_parameters False" in differ and "find_unused_parameters True" in differ, differ
    assert "bucket_size_mb" in errors["bucket_zero"]
    assert "already wrapped" in errors["already_wrapped"]
    assert "got 1 gradients for" in errors["wrong_count"]
    assert "not in the order of the parameters" in errors["wrong_order"], errors["wrong_order"]
    assert "params=optimizer.parameters" in errors["wrong_order"]
    assert "use reduce() from PyNative mode" in errors["graph_reducer_eager_only"]
    assert "every trainable parameter" in errors["graph_reducer_some_params"]


@pytest.mark.parametrize(("world", "part"), [(2, "adapter"), (3, "adapter:1e-06")])
def test_overlap_refuses_gradients_changed_between_backward_and_reduce(world: int, part: str) -> None:
    """PyNative with overlap=True (the default on Ascend/GPU): the buckets reduce the gradients the hooks saw,
    so gradients unscaled out of place before reduce() were silently dropped (the reduction of the unscaled
    ones came back). Now reduce() raises saying what to do, and the next step reduces as the reducer does."""
    for rank, out in enumerate(results_of("pynative", world, part)):
        error = out["changed_grads_error"]
        assert error is not None, f"rank {rank}: gradients changed before reduce() were silently dropped"
        assert "not those backward produced" in error and "overlap=False" in error and "no_sync" in error, error
        assert_identical(out["after_changed"], out["after_changed_dgr"], f"the next step, rank {rank}")


def test_benchmark_sweep_under_msrun() -> None:
    from collective_ops.tools.bench import OPS

    for rows in results_of("pynative", 2, "bench"):
        for op in OPS:
            assert [r["impl"] for r in rows[op]] == ["raw", "collective_ops"] * 2
            assert all(r["wrong"] == 0 and r["time_us"] > 0 for r in rows[op]), rows[op]


@pytest.mark.parametrize("mode", ["pynative", "graph"])
def test_model_train_equals_model_under_mindspores_data_parallel(mode: str) -> None:
    """mindspore.train.Model.train with our TrainOneStepCell: bit-equal to Model(net, loss, opt) under
    parallel_mode=DATA_PARALLEL (its DistributedGradReducer); rank 0 alone checkpoints, MindSpore loads it."""
    results = results_of(mode, 2, "model_train")
    for rank, out in enumerate(results):
        assert_identical(out["ours"], out["reference"], f"Model.train ({mode}), rank {rank}")
        assert_identical(out["fit"], out["reference"], f"Model.fit with evaluation ({mode}), rank {rank}")
        # our reduction, not MindSpore's: eager buckets in PyNative, the compiled plan inside the GRAPH step
        assert out["reducer"] == ("_EagerReducer" if mode == "pynative" else "CompiledReduction")
        if mode == "pynative":
            assert out["steps_reduced"] == 3
        if rank == 0:
            assert out["checkpoint_files"] == ["net-1_3.ckpt"] and out["not_loaded"] == []
            assert_identical(out["loaded"], out["ours"], "checkpoint loaded into a plain network")
        else:
            assert out["checkpoint_files"] == []


def test_shutdown_leaves_every_mindspore_class_as_before_the_first_wrap() -> None:
    """The wrappers replace MindSpore's training cells' constructors, ``amp.build_train_network`` and
    ``Cell.parameters_and_names`` while they live (Model over a wrapper reduces through it: the Model tests);
    after the suite's parts (every kind of wrapper, Model, DistributedOptimizer) and ``co.shutdown()``, each
    is MindSpore's own object again."""
    for result in results_of("pynative", 2, "after_shutdown"):
        assert result["changed"] == [], result


@pytest.mark.parametrize("mode", ["pynative", "graph"])
def test_model_over_the_wrapper_equals_model_under_mindspores_data_parallel(mode: str) -> None:
    """Model(co.wrap(net), loss_fn, opt), the one-line form: the wrapper is a Cell, Model's TrainOneStepCell reduces
    through it, bit-equal to Model(net, loss_fn, opt) under DATA_PARALLEL; so do nn.TrainOneStepCell built by hand,
    amp_level="O2" with a static loss scale, and a dynamic loss scale (MindSpore's CPU build refuses it; our
    loss-scale cell trains it). Checkpoints of the wrapper load into the plain network and back."""
    for rank, out in enumerate(model_wrap_run(mode).part("model_wrap")):
        what = f"({mode}), rank {rank}"
        assert out["wrapped_is_cell"] and out["names"], "the wrapper is a Cell, its parameters named as the network's"
        assert_identical(out["sink"], out["reference"], f"Model.train(dataset_sink_mode=True) {what}")
        assert_identical(out["ours"], out["reference"], f"Model(co.wrap(net), loss_fn, opt) {what}")
        assert out["reducer"] == ("_EagerReducer" if mode == "pynative" else "CompiledReduction")
        assert out["steps_reduced"] == (3 if mode == "pynative" else 2)  # GRAPH: the first call compiles
        assert_identical(out["train_one_step"], out["reference"], f"nn.TrainOneStepCell over the wrapper {what}")
        assert out["sink_steps"] == out["steps_reduced"], "dataset_sink_mode=True counts the steps as without it"
        assert_identical(out["o2"], out["reference_o2"], f'amp_level="O2", static loss scale {what}')
        assert out["dynamic_cell"] == "TrainOneStepWithLossScaleCell"
        assert_identical(out["dynamic"], out["dynamic_by_hand"], f"dynamic loss scale vs our cell by hand {what}")
        assert_identical(out["dynamic"], out["reference"], f"dynamic loss scale 2**10, no overflow {what}")
        assert out["mindspores_cell"] == "TrainOneStepWithLossScaleCell"  # nn's, built over the wrapper: ours now
        assert out["mindspores_cell_module"] == "collective_ops.mindspore.data_parallel"
        assert_identical(out["dynamic_mindspores_cell"], out["dynamic_by_hand"], f"nn's loss-scale cell {what}")
        assert out["plain_not_loaded"] == [] and out["wrapper_not_loaded"] == []
        assert_identical(out["plain_loaded"], out["ours"], f"save_checkpoint(wrapped) into a plain network {what}")
        assert_identical(out["wrapper_loaded"], out["ours"], f"the checkpoint into a new wrapper {what}")


@pytest.mark.parametrize("mode", ["pynative", "graph"])
def test_model_steps_with_the_distributed_optimizer_equal_mindspores_data_parallel(mode: str) -> None:
    """co.DistributedOptimizer is an nn.Optimizer: Model(wrapped, loss_fn, DistributedOptimizer(wrapped, nn.Adam))
    is bit-equal to Model(net, loss_fn, nn.Adam) under DATA_PARALLEL (Momentum too; shard=True in PyNative), and
    nn.TrainOneStepCell over it reduces once per step, the optimizer's reduction (not a second one before it)."""
    steps = 3 if mode == "pynative" else 2  # GRAPH: the first call compiles
    for rank, out in enumerate(model_wrap_run(mode).part("model_wrap")):
        what = f"({mode}), rank {rank}"
        assert_identical(out["dist_opt_momentum"], out["reference"], f"Model + DistributedOptimizer(Momentum) {what}")
        assert_identical(out["dist_opt_adam"], out["reference_adam"], f"Model + DistributedOptimizer(Adam) {what}")
        assert_identical(out["dist_opt_cell"], out["reference"], f"nn.TrainOneStepCell + DistributedOptimizer {what}")
        for form in ("momentum", "adam", "cell"):
            assert out[f"dist_opt_{form}_steps"] == steps, f"{form}: reduced more than once a step {what}"
        if mode == "pynative":
            assert_identical(
                out["dist_opt_shard"], out["reference"], f"Model + DistributedOptimizer(shard=True) {what}"
            )


def test_graph_mode_steps_of_model_are_in_comm_stats_and_the_trace_and_compilation_is_not_wait_skew() -> None:
    """GRAPH mode: Model's step is one compiled graph with our reduction inside. Each call after the one that
    compiled is a step of comm_stats and of the trace (a step event, one per bucket), so the heatmap reads GRAPH
    runs; the compiling call is a "compile" event of its own, not a step whose seconds would read as wait skew."""
    run = model_wrap_run("graph")
    results = run.part("model_wrap")
    events = load_events([run.trace_file])
    analysis = analyze(events)
    stats = results[0]["traced_stats"]
    assert stats["mode"] == "in-graph (compiled)" and stats["buckets"] > 1
    # (the worker sends gradients of 64+ elements alone: more allreduces than buckets, each counted)
    assert stats["collectives_per_step"] > stats["buckets"], stats
    assert stats["steps"] == 2 * 4 - 1, "two epochs of 4 steps, the first call compiled"
    assert analysis.ranks == [0, 1] and len(analysis.steps) == stats["steps"]
    assert analysis.comm_ms.shape[1] == stats["buckets"]
    compiles = [e for e in events if e.get("cat") == "compile"]
    assert sorted(e["pid"] for e in compiles) == [0, 1], "one compilation per rank, traced apart"
    shortest_compile_ms = min(e["dur"] for e in compiles) / 1e3
    assert analysis.wait_skew_ms.max() < shortest_compile_ms / 4, (analysis.wait_skew_ms, shortest_compile_ms)


@pytest.mark.parametrize("mode", ["pynative", "graph"])
def test_training_the_bare_network_is_refused_and_graph_join_around_model_before_any_step(mode: str) -> None:
    """Model(wrapped.network, ...) trained each rank on its own gradients, silently: refused at construction, as is
    nn.TrainOneStepCell over it. GRAPH mode: join() around Model.train is refused before any collective."""
    for rank, out in enumerate(model_wrap_run(mode).part("model_wrap")):
        failure = model_wrap_run(mode).failure
        assert "errors" in out, f"the refusals did not finish (a join() that goes ahead crashes): {failure}"
        errors = out["errors"]
        for form in ("bare_model", "bare_cell"):
            assert errors[form] is not None, f"{form}: trains without a reduction ({mode}, rank {rank})"
            assert f"rank {rank}:" in errors[form] and "Model(wrapped, loss_fn, optimizer)" in errors[form]
        if mode == "graph":
            assert errors["join"] is not None and "needs PyNative mode" in errors["join"], errors["join"]
            assert out["uneven_untouched"], "join() around Model.train changed the weights before refusing"


@pytest.mark.parametrize("mode", ["pynative", "graph"])
def test_loss_scaled_steps_equal_mindspores_cell_and_an_overflow_is_skipped_on_every_rank(mode: str) -> None:
    """Our TrainOneStepWithLossScaleCell (dynamic scale 2**10) on each path against MindSpore's under
    DATA_PARALLEL: losses, overflow flags, scales and weights to the bit; the last rank's inf at step 2
    makes every rank skip it and halve the scale."""
    results = results_of(mode, 2, "loss_scale")
    paths = {"hooks": "overlap", "after backward": "fused-after-backward (compiled)"}
    if mode == "graph":
        paths = {"in graph": "in-graph (compiled)"}
    for rank, out in enumerate(results):
        reference = out["reference"]["steps"]
        assert [overflow for _loss, overflow, _scale in reference] == [step == 2 for step in range(6)]
        scales = [scale for _loss, _overflow, scale in reference]
        assert scales[1] == 2 * scales[0] and scales[2] == scales[1] / 2, scales  # grown after 2 steps, then halved
        for path, reduced_by in paths.items():
            assert out[path]["mode"] == reduced_by
            assert out[path]["steps"] == reference, f"{path}, rank {rank}"
            assert_identical(out[path]["weights"], out["reference"]["weights"], f"{path} ({mode}), rank {rank}")


def test_a_rank_that_skips_a_reduction_makes_every_rank_raise_before_mixing_iterations() -> None:
    """The last rank skips net.reduce() at step 1: every rank raises StepMisalignedError at the reduction that
    would average its step-2 gradients with its peers' step-1 ones, on the compiled and the eager path."""
    for rank, out in enumerate(results_of("pynative", 2, "alignment")):
        for path, reduced_by in (("compiled", "fused-after-backward (compiled)"), ("eager", "fused-after-backward")):
            result = out[path]
            step = 2 if rank == 1 else 1  # the skipper's next reduction, its peer's step-1 one
            assert [s for s, _ in result["raised"]] == [step], (path, rank, result)
            assert "rank 0: 1, rank 1: 2" in result["raised"][0][1]
            assert result["updated"] == [0], (path, rank)  # nothing of the mixed step applied
            assert result["mode"] == reduced_by


@pytest.mark.parametrize("world", [2, 3])
def test_join_with_uneven_batches_equals_the_hand_computed_average(world: int) -> None:
    """Ranks with 3/5(/4) batches inside net.join(): the longest rank's steps averaged over the initial world, in a
    functional loop and under mindspore.train.Model (PyNative)."""
    results = results_of("pynative", world, "join")
    for rank, out in enumerate(results):
        assert out["steps"] == 5, "every rank takes part in every step of the longest rank"
        # Model(wrapped, loss_fn, opt).train inside join(): the functional path's steps and bits
        assert out["model_steps"] == 5, f"rank {rank}: Model's steps inside join()"
        assert_identical(out["model"], out["ours"], f"Model.train inside join() vs the functional loop, rank {rank}")
        if world == 2:  # two operands: MCCL's sum and the hand-computed one agree to the bit
            assert_identical(out["ours"], out["reference"], f"rank {rank}")
        else:
            for name, value in out["reference"].items():
                np.testing.assert_allclose(out["ours"][name], value, rtol=1e-5, atol=1e-7, err_msg=name)
    for name in results[0]["ours"]:  # every rank ends with the last joiner's parameters
        assert all(r["ours"][name] == results[0]["ours"][name] for r in results)


def test_a_copy_of_a_gradient_passes_and_a_changed_one_does_not() -> None:
    """The check behind the refusal above: one memory, or equal values (NaN equal to NaN), passes; a backend
    that hands reduce() copies of what the hooks saw must not be refused."""
    import mindspore as ms

    from collective_ops.mindspore.data_parallel import _same_values

    grad = ms.Tensor(np.array([1.0, np.nan, -3.0], np.float32))
    copy = ms.Tensor(np.array([1.0, np.nan, -3.0], np.float32))
    assert _same_values(grad, grad) and _same_values(grad, copy)
    assert not _same_values(grad, grad * 0.5)
    assert not _same_values(grad, ms.Tensor(np.array([1.0, 2.0, -3.0], np.float32)))


def test_the_training_cells_refuse_a_network_that_is_not_wrapped() -> None:
    import mindspore as ms
    from mindspore import nn

    from collective_ops.mindspore import TrainOneStepCell, TrainOneStepWithLossScaleCell

    net = nn.Dense(4, 2)
    with_loss = nn.WithLossCell(net, nn.MSELoss())
    optimizer = nn.Momentum(net.trainable_params(), 0.1, 0.9)
    with pytest.raises(TypeError, match=r"collective_ops.wrap\(\) returned, got a Dense"):
        TrainOneStepCell(with_loss, optimizer, net)
    with pytest.raises(TypeError, match=r"collective_ops.wrap\(\) returned, got a Dense"):
        TrainOneStepWithLossScaleCell(with_loss, optimizer, net, scale_sense=ms.Tensor([1024.0], ms.float32))


def _assert_close(ours: dict, reference: dict, what: str) -> None:
    assert ours.keys() == reference.keys(), what
    for name, value in reference.items():
        np.testing.assert_allclose(ours[name], value, rtol=1e-5, atol=1e-7, err_msg=f"{what}: {name}")


@pytest.mark.parametrize("world", [2, 3])
def test_sharded_optimizer_trains_as_distributed_grad_reducer_with_the_same_optimizer(world: int) -> None:
    """DistributedOptimizer(net, cls, shard=True): 3 steps against DGR + cls over the whole network. Momentum is
    bit-equal at 2 workers. Adam is within fp32 rounding: MindSpore's CPU Adam kernel computes a tensor's last
    (size mod 8) elements in a scalar loop that rounds differently from its vector body (single process: one
    1000-element tensor against two pieces of it, Adam without weight decay, 4 steps: element 329 of 333, the
    first piece's tail, off by 3e-8), so an element at a piece's end may differ in the last bit. At 3 workers the
    padded buckets are summed in another order than DGR's per-gradient calls: within rounding too; there a plain
    Adam's state, resharded over 3, is trained on (the 3-worker start is costly: the other checks run at 2)."""
    results = results_of("pynative", world, "sharded")
    for rank, out in enumerate(results):
        what = f"rank {rank} of {world}"
        _assert_close(out["resharded_ours"], out["resharded_ref"], f"a plain Adam state resharded, {what}")
        state = out["resharded_state"]
        assert state["sharded"] == 2 * state["pieces"], state  # two moments of this rank's pieces, nothing more
    # every element's state on exactly one rank, in equal shards (padding at bucket ends): 1/N of plain + padding
    states = [out["resharded_state"] for out in results]
    assert sum(s["sharded"] for s in states) == states[0]["plain"] == 2 * states[0]["params"], states
    assert len({s["pieces"] + s["padding"] for s in states}) == 1, states
    if world == 2:
        for rank, out in enumerate(results):
            _assert_close(out["adam_ours"], out["adam_ref"], f"Adam, rank {rank}")
            _assert_close(out["adam_ours_state"], out["adam_ref_state"], f"Adam's gathered state, rank {rank}")
            assert out["adam_state"] == out["resharded_state"], "the state's size is the same however it began"
            assert_identical(out["momentum_ours"], out["momentum_ref"], "Momentum, 2 workers")
            assert_identical(out["momentum_ours_state"], out["momentum_ref_state"], "Momentum's gathered state")
            assert_identical(out["unsharded_ours"], out["adam_ref"], "shard=False: net.reduce + Adam")
            assert_identical(out["replanned_ours"], out["momentum_ref"], "Momentum, the wrapper replanned")
            _assert_close(out["grouped_ours"], out["grouped_ref"], "parameter groups (weight decay, lr)")


def test_sharded_optimizer_checkpoint_loads_into_a_plain_optimizer_and_back() -> None:
    """gathered_state() after 2 steps is a plain Adam's state by name: loaded into nn.Adam (strict) or into a new
    sharded optimizer (the network's weights loaded before it was built, or after), training continues as in the
    optimizer that saved it."""
    for rank, out in enumerate(results_of("pynative", 2, "sharded")):
        assert out["plain_not_loaded"] == [], out["plain_not_loaded"]
        assert_identical(out["resumed_sharded"], out["resumed_ours"], f"resumed sharded, rank {rank}")
        for how in ("load_param_into_net", "copy_", "assign_then_reload"):
            resumed = out[f"resumed_late_{how}"]
            assert_identical(resumed, out["resumed_ours"], f"weights written after the optimizer ({how}), rank {rank}")
        _assert_close(out["resumed_plain"], out["resumed_ours"], f"resumed into a plain nn.Adam, rank {rank}")


def test_sharded_optimizer_refuses_what_it_cannot_do() -> None:
    for out in results_of("pynative", 2, "sharded"):
        errors = out["errors"]
        assert "overlap=False" in errors["overlap"]
        assert "Lamb" in errors["lamb"] and "assume_elementwise=True" in errors["lamb"]
        assert "grad_centralization" in errors["centralized"]
        assert "every trainable parameter" in errors["some_params"]
        assert errors["not_wrapped"].startswith("TypeError") and "collective_ops.wrap(net" in errors["not_wrapped"]
        assert "mindspore.nn.Optimizer subclass" in errors["not_an_optimizer"]
        assert "got 1 gradients for" in errors["wrong_count"]
        assert "not in the order of the parameters" in errors["wrong_order"], errors["wrong_order"]
        assert errors["bad_state"].startswith("KeyError") and "moment1." in errors["bad_state"]
        assert "join() with DistributedOptimizer(shard=True) is not supported" in errors["join"]


def test_the_torch_wrappers_keywords_name_what_mindspore_does_instead() -> None:
    """check_finite, broadcast_buffers, bucket_size_mb="auto" and tune() on a MindSpore network: a message saying
    what to do on MindSpore, before anything is initialised or run, not a raw TypeError from the signature."""
    from mindspore import nn

    import collective_ops as co

    net = nn.Dense(4, 2)
    with pytest.raises(
        TypeError, match=r"'check_finite' is a torch option.*loss_scale_manager=DynamicLossScaleManager"
    ):
        co.wrap(net, check_finite=True)
    with pytest.raises(TypeError, match=r"'broadcast_buffers' is a torch option.*broadcast_parameters=True"):
        co.wrap(net, broadcast_buffers=False)
    import mindspore as ms

    wrapper = type("DataParallel", (), {"__module__": "collective_ops.mindspore.data_parallel"})()
    mode = ms.get_context("mode")
    ms.set_context(mode=ms.GRAPH_MODE)
    try:  # "auto" and tune() replan between steps: GRAPH mode compiles the plan into the step
        with pytest.raises(ValueError, match=r"bucket_size_mb='auto' needs PyNative mode on MindSpore"):
            co.wrap(net, bucket_size_mb="auto")
        with pytest.raises(ValueError, match=r"tune\(\) on MindSpore needs PyNative mode"):
            co.tune(wrapper, lambda: pytest.fail("tune ran a step before refusing"))
    finally:
        ms.set_context(mode=mode)


def test_auto_bucket_size_settles_on_rank_0s_choice_everywhere_and_trains_as_that_size_from_the_start() -> None:
    """bucket_size_mb="auto" (PyNative, functional loop): pending until the profiled step's reduce(), then every
    rank on rank 0's cost-model best (rank 0's ranking reversed, so it differs from the others' own best and the
    default), the weights bit-equal to a run wrapped at that size; co.tune leaves every rank on its result."""
    results = results_of("pynative", 2, "auto_tune")
    chosen = results[0]["own_best"]
    assert chosen != [25.0, 25.0], "the test needs rank 0's choice to differ from the default"
    for rank, out in enumerate(results):
        assert out["pending_before"] and not out["pending_after"], rank
        assert out["settled"] == chosen, f"rank {rank} settled on {out['settled']}, rank 0 chose {chosen}"
        assert_identical(out["auto"], out["fixed"], f"'auto' vs wrapped at {chosen} from the start, rank {rank}")
        assert out["tune_plan"] == out["tune_result"] == results[0]["tune_result"], rank
    assert results[1]["own_best"] != chosen, "rank 1's own ranking should differ from rank 0's"


# one start of their own (~30 s, ~50 s): the pynative-2 suite is near pytest's 300 s limit


def test_distributed_optimizer_owes_bucket_updates_to_the_next_forward_and_equals_distributed_grad_reducer() -> None:
    """PyNative, the wrapper reducing bucket by bucket (overlap=True): a step owes its buckets' updates, the next
    forward applies them cell by cell. Over 4 steps with an evaluation on rank 0 between steps and a checkpoint
    saved (and loaded back) right after a step, then Model.eval on rank 0 with the last step's updates owed, every
    rank's evaluations, checkpoint and weights are bit-equal to
    DistributedGradReducer + the same optimizer (Momentum, Adam); Model.train with it equals Model under
    MindSpore's DATA_PARALLEL, one reduction a step."""
    for rank, out in enumerate(results_of("pynative", 2, "dist_opt_overlap")):
        for name in ("momentum", "adam"):
            what = f"{name}, rank {rank}"
            reference, ours = out[f"{name}_reference"], out[name]
            assert_identical(ours["evals"], reference["evals"], f"evaluations on rank 0 between steps ({what})")
            assert_identical(ours["checkpoint"], reference["checkpoint"], f"checkpoint saved after a step ({what})")
            assert_identical(ours["weights"], reference["weights"], f"weights at the end ({what})")
            evaluated = (ours.get("model_eval"), ours.get("hand_loss"))
            assert evaluated == (reference.get("hand_loss"),) * 2, f"Model.eval after the last step ({what})"
            applied = out[f"{name}_applied"]
            # the first step (its rebuild) updates at once; later ones owe every bucket (MindSpore's handles cannot
            # be polled), which a forward applied over several of its cells, or a parameter read (the checkpoint)
            assert applied["step"] == out[f"{name}_buckets"], (what, applied)
            assert applied["forward"] > 0 and applied["forward cells"] > 1 and applied["read"] > 0, (what, applied)
            assert_identical(out[f"model_{name}"], out[f"model_{name}_reference"], f"Model.train ({what})")
            assert out[f"model_{name}_steps"] == 4, f"Model.train reduced more than once a step ({what})"
        # parameter groups: weight decay in one (narrowed per bucket), learning rates of their own (at the step)
        for name in ("groups", "group_lrs"):
            assert_identical(out[name], out[f"{name}_reference"], f"Momentum with {name}, rank {rank}")
        assert out["groups_applied"]["forward"] > 0 and out["group_lrs_applied"]["forward"] == 0, rank


def powersgd_results() -> list[dict]:
    """ms_workers/powersgd.py's results, from the start it shares with dist_opt_overlap."""
    return results_of("pynative", 2, "powersgd")


class _NumpyNormals:
    """torch, as torch's powerSGD_hook module sees it, but with its Q factors' draws the MindSpore engine's: after
    ``manual_seed(s)``, ``randn`` draws from numpy's ``RandomState(s).standard_normal`` in turn."""

    def __init__(self, torch) -> None:
        self._torch, self._state = torch, None

    def __getattr__(self, name: str):
        return getattr(self._torch, name)

    def manual_seed(self, seed: int) -> None:
        self._state = np.random.RandomState(seed)

    def randn(self, *shape, device=None, dtype=None):
        return self._torch.from_numpy(self._state.standard_normal(shape).astype(np.float32)).to(dtype)


def _torch_powersgd(rank: int, world: int, shapes: list, local: list, matrix_rank: int, start: int, seed: int) -> dict:
    """DDP (one bucket) + torch's powerSGD_hook fed this rank's MindSpore gradients: a module whose parameters are
    shaped as the MindSpore network's and whose loss is sum(p * G), so that p.grad is G. Each step's reduced
    gradients and the bucket's parameter order (indices) as the hook saw it."""
    import torch
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as hook_module

    class Params(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ps = torch.nn.ParameterList([torch.nn.Parameter(torch.zeros(shape)) for shape in shapes])

        def forward(self, *grads):
            return sum((p * g).sum() for p, g in zip(self.ps, grads))

    module = Params()
    params = list(module.parameters())
    index = {id(p): i for i, p in enumerate(params)}
    ddp = torch.nn.parallel.DistributedDataParallel(module, bucket_cap_mb=25)
    state = hook_module.PowerSGDState(
        None, matrix_approximation_rank=matrix_rank, start_powerSGD_iter=start, random_seed=seed
    )
    hook_module.torch = _NumpyNormals(torch)  # (this process's copy of the module only)
    orders = []

    def serial(state, bucket):  # waited for inside: its later allreduces must not cross a next bucket's (Gloo)
        orders.append([index[id(p)] for p in bucket.parameters()])
        future = hook_module.powerSGD_hook(state, bucket)
        future.wait()
        return future

    ddp.register_comm_hook(state, serial)
    reduced = []
    for grads in local:
        ddp.zero_grad()
        ddp(*(torch.tensor(g, dtype=torch.float32) for g in grads)).backward()
        reduced.append([p.grad.numpy().copy() for p in params])
    return {"reduced": reduced, "orders": orders}


# fp32 rounding, relative to each gradient's largest element (as tests/test_powersgd.py against the same hook: an
# element-wise rtol would fail on elements near zero, an atol alone would say nothing of the small gradients).
# MindSpore sums the factor products and norms in other orders than torch's bmm and norm (rank 2, Gram-Schmidt on
# both sides: 1.5e-6 measured over the 6 steps), and at rank 4 factorises by MindSpore's QR where torch's hook
# takes its own (3.9e-6 measured). A wrong algorithm (a lost write-back, stale factors, no error feedback) misses by
# orders of magnitude more.
MS_POWERSGD_AGREEMENT = {2: 1e-5, 4: 2e-5}


@pytest.mark.parametrize("matrix_rank", [2, 4])
def test_powersgd_reduces_as_ddp_powersgd_hook_fed_the_same_gradients(matrix_rank: int) -> None:
    """compression=co.PowerSGD(rank, start_iter=2) at 2 MindSpore workers (PyNative, one bucket, SGD over 6 steps,
    each rank its own batches): each step's net.reduce(grads) equals DDP + torch's powerSGD_hook on 2 Gloo ranks
    fed the same local gradients, to fp32 rounding, its Q factors drawn as the MindSpore engine draws them
    (numpy's RandomState: MindSpore cannot reproduce torch.randn). Two plain steps, then four compressed: warm
    start and error feedback carried over three times; the bucket laid out alike (DDP's rebuilt order is ours)."""
    from tests.harness import run_ranks

    results = [out[f"rank{matrix_rank}"] for out in powersgd_results()]
    shapes = [tuple(s) for s in results[0]["shapes"]]
    assert results[0]["compressing"], "the run never reached PowerSGD's start_iter"
    references = run_ranks(
        2,
        _dispatch_torch_powersgd,
        [[[np.asarray(g, dtype=np.float32) for g in step] for step in out["local"]] for out in results],
        shapes,
        matrix_rank,
        timeout=120,
    )
    for rank, (ours, reference) in enumerate(zip(results, references, strict=True)):
        # one bucket, in the same member order at every compressed step (the hook's grouping and draws follow it;
        # DDP's plain first step runs before its rebuild, in parameter order)
        theirs, mine = reference["orders"][2:], [order[0] for order in ours["bucket_order"]][2:]
        assert theirs == mine, (theirs, mine)
        worst = 0.0
        for step, (theirs, mine) in enumerate(zip(reference["reduced"], ours["reduced"], strict=True)):
            for i, (x, y) in enumerate(zip(theirs, mine, strict=True)):
                x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
                scale = max(np.abs(x).max(), 1e-30)
                worst = max(worst, np.abs(x - y).max() / scale)
                assert np.abs(x - y).max() <= MS_POWERSGD_AGREEMENT[matrix_rank] * scale, (
                    f"rank {rank}, step {step}, gradient #{i} {shapes[i]}: max |ddp - ours| = "
                    f"{np.abs(x - y).max():.3g}, {np.abs(x - y).max() / scale:.3g} of its largest"
                )
        print(f"PowerSGD rank {matrix_rank}, worker {rank}: largest difference {worst:.3g} of a gradient's largest")
    # compressed steps are not the plain average: the comparison holds PowerSGD's arithmetic, not an allreduce's
    local = [[np.asarray(g) for g in out["local"][-1]] for out in results]
    mean = [(a + b) / 2 for a, b in zip(*local)]
    assert not np.allclose(mean[0], results[0]["reduced"][-1][0], rtol=1e-3, atol=1e-5)


def test_powersgd_keeps_a_zero_gradient_matrix_finite_above_rank_2() -> None:
    """A weight whose gradient is zero on every rank, compressed at rank 4: its reduced gradient is zero and no
    reduced gradient is NaN, as torch's hook (a QR factorisation above rank 2; Gram-Schmidt divides 0 by 0)."""
    for rank, out in enumerate(powersgd_results()):
        result = out["zero_gradient_matrix"]
        assert result["compressing"], "the run never reached PowerSGD's start_iter"
        assert result["finite"], f"worker {rank}: a reduced gradient is not finite"
        assert result["fc0_weight_zero"], f"worker {rank}: the zero gradient did not reduce to zero"


def _dispatch_torch_powersgd(rank: int, world: int, local_by_rank: list, shapes: list, matrix_rank: int) -> dict:
    return _torch_powersgd(rank, world, shapes, local_by_rank[rank], matrix_rank, 2, 3)


def test_powersgd_resumes_from_its_checkpoint_and_composes_with_the_distributed_optimizer() -> None:
    """compression_state_dict() after step 3 loaded into a new wrapper (other weights, loaded from the
    checkpoint): its next 3 steps equal the uninterrupted run's bit for bit. co.DistributedOptimizer (unsharded)
    over the same compression equals net.reduce + the same optimizer (Momentum) bit for bit."""
    for rank, out in enumerate(powersgd_results()):
        uninterrupted, resumed = out["resumed"]
        assert_identical(uninterrupted, resumed, f"resumed from compression_state_dict, rank {rank}")
        plain, distributed = out["distributed_optimizer"]
        assert_identical(plain, distributed, f"DistributedOptimizer + PowerSGD, rank {rank}")


def test_powersgd_under_model_trains_as_the_functional_loop() -> None:
    """mindspore.train.Model(co.wrap(net, compression=co.PowerSGD(...)), loss_fn, nn.SGD).train (PyNative) over 6
    batches equals net.reduce + nn.SGD in a functional loop on the same batches, bit for bit: Model's training
    cell reduces through the wrapper, compressed from start_iter on as the loop."""
    for rank, out in enumerate(powersgd_results()):
        functional, model = out["model"]
        assert_identical(functional, model, f"Model + PowerSGD, rank {rank}")


def test_powersgd_launched_during_backward_reduces_as_after_it() -> None:
    """overlap=True (each bucket's first allreduce launched from the parameter hooks during backward) trains as
    overlap=False, bit for bit, and comm_stats says which mode ran."""
    for rank, out in enumerate(powersgd_results()):
        after, after_mode, during, during_mode = out["overlap"]
        assert (after_mode, during_mode) == ("fused-after-backward", "overlap"), (after_mode, during_mode)
        assert_identical(after, during, f"PowerSGD with overlap=True, rank {rank}")


def test_powersgd_reduces_gradients_from_a_compiled_function_as_from_pynative() -> None:
    """net.reduce(grads) under PowerSGD from a Python loop whose gradients come from a GRAPH-mode value_and_grad
    trains as the PyNative loop, to fp32 rounding (the compiled gradients may round differently), compressing."""
    for rank, out in enumerate(powersgd_results()):
        assert not isinstance(out["compiled_gradients"], str), out["compiled_gradients"]
        pynative, pynative_compressing, graph, graph_compressing = out["compiled_gradients"]
        assert pynative_compressing and graph_compressing, "the runs never reached PowerSGD's start_iter"
        for name, value in pynative.items():
            np.testing.assert_allclose(graph[name], value, rtol=1e-5, atol=1e-6, err_msg=f"{name}, rank {rank}")


def test_powersgd_refuses_a_compiled_step_a_sum_and_sharding_with_what_to_do() -> None:
    errors = powersgd_results()[0]["errors"]
    assert "cannot reduce inside a compiled GRAPH-mode training step" in errors["graph"], errors["graph"]
    assert "PYNATIVE_MODE" in errors["graph"] and "net.reduce(grads)" in errors["graph"]
    assert "reduce_op='avg'" in errors["sum"], errors["sum"]
    assert "leave compression and comm_hook unset" in errors["shard"], errors["shard"]
