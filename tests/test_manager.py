"""BucketManager on a real single-process Gloo group: ordering, modes and every error."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import collective_ops as co
from collective_ops.bucketing import BucketManager, ParamSpec, hook_for_compression, plan_buckets
from collective_ops.comm.torch_engine import TorchEngine
from tests.harness import free_port


@pytest.fixture(scope="module")
def engine():
    co.init("gloo", rank=0, world_size=1, master_port=free_port())
    yield co.runtime.get_engine("torch")
    co.shutdown()


class Recorder:
    def __init__(self) -> None:
        self.launched: list[int] = []
        self.steps = 0

    def bucket_launched(self, manager, index) -> None:
        self.launched.append(index)

    def bucket_completed(self, manager, index) -> None:
        pass

    def step_finished(self, manager, stats) -> None:
        self.steps += 1


def make(engine: TorchEngine, n: int = 6, numel: int = 1000, **kw) -> tuple[BucketManager, Recorder]:
    # 4 KB per parameter, 8 KB buckets: params pair up in reverse registration order
    params = [ParamSpec(f"p{i}", numel, "float32", "cpu", 4) for i in range(n)]
    plan = plan_buckets(params, bucket_size_mb=8000 / 2**20, first_bucket_mb=8000 / 2**20)
    recorder = Recorder()
    kw.setdefault("rebuild_after_first_step", False)
    return BucketManager(plan, engine, observer=recorder, **kw), recorder


def test_a_compressing_hook_counts_the_bytes_it_puts_on_the_wire(engine) -> None:
    manager, _ = make(engine, comm_hook=hook_for_compression("fp16"))
    for index in range(6):
        manager.mark_ready(index)
    manager.finalize()
    assert manager.last_stats.bytes_communicated == 6 * 1000 * 2  # float16 on the wire, not the float32 buffers


def test_buckets_launch_in_plan_order_as_soon_as_possible(engine) -> None:
    manager, rec = make(engine)
    assert [list(b.param_indices) for b in manager.plan.buckets] == [[5, 4], [3, 2], [1, 0]]
    manager.mark_ready(0)
    manager.mark_ready(1)  # bucket 2 complete, but buckets 0 and 1 are not: must wait
    assert rec.launched == []
    manager.mark_ready(5)
    manager.mark_ready(4)
    assert rec.launched == [0]
    manager.mark_ready(3)
    manager.mark_ready(2)
    assert rec.launched == [0, 1, 2]
    manager.finalize()
    assert manager.last_stats.collectives == 3 and manager.last_stats.bytes_communicated == 6 * 4000
    assert rec.steps == 1 and not manager.in_progress


def test_a_launch_order_holds_buckets_back_and_a_deferred_step_finishes_in_any_order(engine) -> None:
    manager, rec = make(engine)
    manager.set_launch_order([1, 2, 0])  # bucket 0 (ready first) held until bucket 2 is out
    for i in (5, 4, 3, 2):
        manager.mark_ready(i)
    assert rec.launched == [1]  # 0 is full but comes last; 2 is not full yet
    manager.mark_ready(1)
    manager.mark_ready(0)
    assert rec.launched == [1, 2, 0]
    manager.finalize(defer=True)
    assert manager.deferred_pending and not manager.in_progress
    with pytest.raises(RuntimeError, match="still being finished"):
        manager.mark_ready(0)
    with pytest.raises(RuntimeError, match="in flight"):
        manager.set_launch_order(None)
    for bucket in (2, 0):  # any order, e.g. the next forward's
        manager.wait_bucket(bucket)
        assert manager.bucket_finished(bucket) and manager.deferred_pending and rec.steps == 0
    manager.wait_bucket(1)  # the last one ends the step
    assert not manager.deferred_pending and rec.steps == 1
    assert manager.launch_order == (1, 2, 0)  # kept for the next steps of this plan
    with pytest.raises(ValueError, match="does not list bucket"):
        manager.set_launch_order([0, 0, 1])
    manager.replan(4000 / 2**20)  # a new plan starts in plan order again
    assert manager.launch_order == tuple(range(len(manager.plan.buckets)))


def test_a_launch_order_sends_a_bucket_in_chunks_at_its_places(engine, monkeypatch) -> None:
    manager, rec = make(engine)
    sizes: list[int] = []
    allreduce = engine.allreduce
    monkeypatch.setattr(engine, "allreduce", lambda t, *a, **k: sizes.append(t.numel()) or allreduce(t, *a, **k))
    grads = {i: torch.arange(1000, dtype=torch.float32) + 1000 * i for i in range(6)}
    sent = {i: g.clone() for i, g in grads.items()}
    manager.set_launch_order([0, 1, 0, 2, 0])  # bucket 0 (params 5, 4: 2000 elements) in 3 chunks
    for i in (5, 4):
        manager.mark_ready(i, grads[i])
    assert sizes == [666]  # its first chunk; the second waits for bucket 1
    for i in (3, 2):
        manager.mark_ready(i, grads[i])
    assert sizes == [666, 2000, 667] and not manager.bucket_ready(0)  # a chunk is still to go
    for i in (1, 0):
        manager.mark_ready(i, grads[i])
    assert sizes == [666, 2000, 667, 2000, 667]
    assert rec.launched == [0, 1, 2]  # the trace sees a bucket launched at its first chunk
    manager.finalize()
    assert all(torch.equal(grads[i], sent[i]) for i in grads)  # one rank: every chunk written back whole
    assert manager.last_stats.collectives == 5 and manager.last_stats.bytes_communicated == 6 * 4000
    with pytest.raises(ValueError, match="more chunks than elements"):
        manager.set_launch_order([0] * 2001 + [1, 2])
    manager.set_launch_order([0, 1, 0, 2])
    manager.set_comm_hook(hook_for_compression("fp16"))  # it reduces whole buckets: back to plan order
    assert manager.launch_order == (0, 1, 2)
    compressed, _ = make(engine, comm_hook=hook_for_compression("fp16"))
    with pytest.raises(ValueError, match=r"bucket\(s\) \[0\] more than once"):
        compressed.set_launch_order([0, 1, 0, 2])


def test_gradients_as_views_and_copies(engine) -> None:
    manager, _ = make(engine, reduce_op="sum")
    grads = [torch.full((10, 100), float(i)) for i in range(6)]
    for i in (5, 4, 3):
        buffer, offset, numel = manager.param_segment(i)
        engine.segment(buffer, offset, numel).copy_(grads[i].view(-1))  # a view-mode gradient
        manager.mark_ready(i)
    for i in (2, 1, 0):
        manager.mark_ready(i, grads[i])  # copy mode
    manager.finalize()
    for i in range(6):
        buffer, offset, numel = manager.param_segment(i)
        assert torch.equal(engine.segment(buffer, offset, numel), torch.full((numel,), float(i)))
    assert torch.equal(grads[0], torch.zeros(10, 100))


def test_a_compiled_step_is_accounted_like_a_finalized_one(engine) -> None:
    # engines that reduce the whole plan in one compiled call (MindSpore) only report the step
    manager, rec = make(engine, rebuild_after_first_step=True)
    manager.record_compiled_step(10.0, 10.5)
    stats = manager.last_stats
    assert (stats.collectives, stats.bytes_communicated) == (3, 6 * 4000)
    assert stats.exposed_comm_s == pytest.approx(0.5) and [b.completed for b in stats.buckets] == [10.5] * 3
    assert manager.steps_synced == 1 and rec.steps == 1 and not manager.in_progress
    summary = manager.stats_summary()
    assert summary["collectives_per_step"] == 3 and summary["steps"] == 1
    manager.mark_ready(5)  # a step whose gradients arrive one by one cannot be finished that way
    with pytest.raises(RuntimeError, match="marked one by one"):
        manager.record_compiled_step(11.0, 11.1)


def test_no_sync_accumulates_without_communicating(engine) -> None:
    manager, rec = make(engine)
    manager.set_sync(False)
    for i in range(6):
        manager.mark_ready(i)
    manager.finalize()
    assert rec.launched == [] and rec.steps == 0
    manager.set_sync(True)
    for i in range(6):
        manager.mark_ready(i)
    manager.finalize()
    assert rec.launched == [0, 1, 2]


def test_unused_parameters(engine) -> None:
    manager, _ = make(engine)
    for i in (5, 4, 3, 1, 0):
        manager.mark_ready(i)
    with pytest.raises(RuntimeError, match=r"received no gradient this iteration: 'p2'.*find_unused_parameters=True"):
        manager.finalize()
    assert not manager.in_progress  # reset: the next iteration starts clean

    manager, _ = make(engine, find_unused_parameters=True, reduce_op="sum")
    buffer, offset, numel = manager.param_segment(2)
    engine.segment(buffer, offset, numel).fill_(7.0)  # a stale value must not leak into the reduction
    for i in (5, 4, 3, 1, 0):
        manager.mark_ready(i)
    manager.finalize()
    assert torch.count_nonzero(engine.segment(buffer, offset, numel)) == 0
    assert manager.globally_unused == frozenset({2})


def test_errors_name_the_parameter(engine) -> None:
    manager, _ = make(engine)
    manager.mark_ready(5)
    with pytest.raises(RuntimeError, match="'p5' was marked ready twice"):
        manager.mark_ready(5)
    with pytest.raises(ValueError, match=r"'p4' has numel=999.*expects numel=1000"):
        manager.mark_ready(4, torch.zeros(999))
    with pytest.raises(ValueError, match=r"'p4' has .*dtype=float64"):
        manager.mark_ready(4, torch.zeros(1000, dtype=torch.float64))
    with pytest.raises(IndexError):
        manager.mark_ready(17)
    with pytest.raises(RuntimeError, match="middle of a backward"):
        manager.set_sync(False)
    with pytest.raises(ValueError, match="reduce_op"):
        make(engine, reduce_op="max")


def test_rebuild_from_observed_order_keeps_values(engine) -> None:
    rebuilt = []
    manager, _ = make(engine, rebuild_after_first_step=True, reduce_op="sum", on_rebuild=rebuilt.append)
    for i in range(6):  # registration order: the opposite of what the plan expected
        buffer, offset, numel = manager.param_segment(i)
        engine.segment(buffer, offset, numel).fill_(float(i))
        manager.mark_ready(i)
    manager.finalize()
    assert rebuilt and [list(b.param_indices) for b in manager.plan.buckets] == [[0, 1], [2, 3], [4, 5]]
    for i in range(6):
        buffer, offset, numel = manager.param_segment(i)
        assert torch.equal(engine.segment(buffer, offset, numel), torch.full((numel,), float(i)))


def test_compression_round_trip(engine) -> None:
    manager, _ = make(engine, comm_hook=hook_for_compression("bf16"))
    for i in range(6):
        buffer, offset, numel = manager.param_segment(i)
        engine.segment(buffer, offset, numel).copy_(torch.linspace(0, 1, numel))
        manager.mark_ready(i)
    manager.finalize()
    buffer, offset, numel = manager.param_segment(3)
    got = engine.segment(buffer, offset, numel)
    assert got.dtype == torch.float32
    assert torch.allclose(got, torch.linspace(0, 1, numel), atol=2**-8)
    assert not torch.equal(got, torch.linspace(0, 1, numel)), "bf16 must actually be used on the wire"
    with pytest.raises(ValueError, match="unknown compression 'int4'"):
        hook_for_compression("int4")


def test_gradient_bucket_refuses_bad_input(engine) -> None:
    bucket = co.GradientBucket(bucket_size_mb=1)
    with pytest.raises(ValueError, match="no gradient"):
        bucket.add(None)
    bucket.add(torch.ones(3))
    with pytest.raises(ValueError, match="one GradientBucket per device"):
        bucket.add(torch.ones(3, device="meta"))
    with pytest.raises(ValueError, match="bucket_size_mb"):
        co.GradientBucket(bucket_size_mb=0)
    with pytest.raises(ValueError, match="unknown reduce op"):
        co.GradientBucket(reduce_op="mode")
    assert len(bucket) == 1
    bucket.clear()
    assert bucket.allreduce() is None and bucket.num_collectives == 0


tensor_lists = st.lists(
    st.tuples(
        st.sampled_from(["float32", "float16", "bfloat16", "float64", "int64"]),
        st.lists(st.integers(1, 40), min_size=0, max_size=3),
        st.booleans(),
    ),
    min_size=1,
    max_size=25,
)


@settings(max_examples=60, deadline=None)
@given(rows=tensor_lists, cap_kib=st.sampled_from([1, 4, 64, 1024]), data=st.data())
def test_gradient_bucket_fuzz(engine, rows, cap_kib, data) -> None:
    """Any mix of dtypes, shapes and layouts: values come back intact, one collective per bucket."""
    tensors = []
    for dtype, shape, transpose in rows:
        t = (torch.arange(int(torch.tensor(shape).prod()) if shape else 1) % 7).to(getattr(torch, dtype)).reshape(shape)
        if transpose and t.dim() >= 2:
            t = t.transpose(0, 1)  # non-contiguous: copied in, written back in place
        tensors.append(t)
    expected = [t.clone() for t in tensors]
    op = data.draw(st.sampled_from(["sum", "max", "min"]))
    bucket = co.GradientBucket(bucket_size_mb=cap_kib / 1024, reduce_op=op)
    for t in tensors:
        bucket.add(t)
    bucket.allreduce()
    for got, want in zip(tensors, expected):
        assert torch.equal(got, want)
    specs = [ParamSpec(f"t{i}", t.numel(), str(t.dtype), "cpu", t.element_size()) for i, t in enumerate(tensors)]
    plan = plan_buckets(specs, cap_kib / 1024, cap_kib / 1024, order=range(len(specs)))
    assert bucket.num_collectives == len(plan.buckets)
