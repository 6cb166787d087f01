"""The framework-free update core: reads learnt from the forward, the order trial's bookkeeping."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from collective_ops.bucketing.shard.step import ShardStep, reduction_of
from collective_ops.bucketing.update.overlap import ForwardReads, buckets_read
from collective_ops.bucketing.update.pending import PendingUpdates, groups_narrowed
from collective_ops.bucketing.update.planner import (
    SCHEDULE_AFTER_STEPS,
    LaunchOrderPlanner,
    chunk_sizes_mib,
    planning_due,
    trial_step_seconds,
)
from collective_ops.bucketing.update.schedule import OrderTrial

# A model as a tree of named modules, each with its own parameters (indices into the model's list):
# "net" runs "attn" and "head"; "attn" reads "out_proj"'s weight itself (out_proj never runs).
TREE = {"net": ["attn", "head"], "attn": ["out_proj"], "out_proj": [], "head": []}
OWN = {"net": [], "attn": [0, 1], "out_proj": [2], "head": [3]}


def first_forward(reads: ForwardReads, ran: list[str]) -> None:
    for module in ran:
        reads.module_runs(module)
    reads.first_forward_ended(lambda m: list(OWN[m]), lambda m: TREE[m])


def test_a_module_reads_its_own_parameters_and_those_of_submodules_that_never_ran() -> None:
    reads = ForwardReads()
    first_forward(reads, ["net", "attn", "head"])
    assert reads.reads_of("attn", lambda: OWN["attn"]) == [0, 1, 2]  # out_proj's weight, read by attn itself
    assert reads.reads_of("head", lambda: OWN["head"]) == [3]
    assert reads.reads_of("net", lambda: []) == []  # its children ran: their reads are theirs


def test_a_read_caught_is_learnt_once_and_kept_after_the_first_forward_ends() -> None:
    reads = ForwardReads()
    for module in ["net", "attn", "head"]:
        reads.module_runs(module)
    reads.caught("net", 3, lambda: OWN["net"])  # net's forward read head's parameter before head ran
    reads.caught("net", 3, lambda: OWN["net"])
    reads.first_forward_ended(lambda m: list(OWN[m]), lambda m: TREE[m])
    assert reads.reads_of("net", lambda: []) == [3]
    reads.module_runs("other")  # after the first forward nothing more is learnt from what runs
    assert reads.ran is None
    reads.caught("head", 0, lambda: OWN["head"])  # a read caught later joins the module's own
    assert reads.reads_of("head", lambda: OWN["head"]) == [3, 0]


@given(st.lists(st.integers(0, 5), min_size=1, max_size=12), st.lists(st.integers(0, 19), max_size=20))
def test_the_buckets_read_are_each_bucket_once_in_plan_order(bucket_of: list[int], indices: list[int]) -> None:
    location = [(bucket, 0) for bucket in bucket_of]
    indices = [i % len(bucket_of) for i in indices]
    got = buckets_read(indices, location)
    assert got == sorted(set(got))
    assert set(got) == {bucket_of[i] for i in indices}


class _Manager:
    def __init__(self) -> None:
        self.orders: list = []
        self.engine, self.steps_synced, self.stall_timeout_s = SimpleNamespace(), 0, None  # (for agreeing)

    def set_launch_order(self, order: tuple | None) -> None:
        self.orders.append(order)


def test_the_trial_runs_each_order_in_turn_and_keeps_the_fastest_with_its_overlap() -> None:
    planner, manager = LaunchOrderPlanner(), _Manager()
    engine = SimpleNamespace(reduce_floats=lambda values, op: values)  # one rank: its medians are everyone's
    plan, held = (0, 1, 2), (2, 0, 1)
    planner.trial = OrderTrial((plan, plan, held), block=2, rounds=1)
    planner.trial_defers = (False, True, True)
    planner.defers_now = False
    step_s = {0: 1.0, 1: 1.0, 2: 0.9, 3: 0.9, 4: 0.5, 5: 0.5}  # the held order (third) is fastest
    for step in range(6):
        planner.advance(manager, engine, step_s[step])
    assert manager.orders[:5] == [plan, plan, plan, held, held]  # each order set before the steps it runs
    assert manager.orders[-1] == held and planner.defers_now is True and planner.trial is None
    assert planner.kept == {
        "orders": (plan, plan, held),
        "overlapped": [False, True, True],
        "median_s": [1.0, 0.9, 0.5],
        "kept": 2,
    }
    planner.on_plan_change()
    assert planner.defers_now is True and planner.trial is None


def test_the_sharded_trial_starts_from_plan_order_overlapped_and_needs_another_order() -> None:
    manager = _Manager()
    manager.plan = SimpleNamespace(buckets=[0, 1, 2])
    sharded = LaunchOrderPlanner()
    sharded._start_trial(manager, [(2, 1, 0)], finished_first=False)  # no baseline that finishes in backward
    assert sharded.trial.orders == ((0, 1, 2), (2, 1, 0)) and sharded.trial_defers == (True, True)
    assert sharded.defers_now is True and manager.orders == [None]
    unsharded = LaunchOrderPlanner()
    unsharded._start_trial(manager, [(2, 1, 0)], finished_first=True)
    assert unsharded.trial.orders == ((0, 1, 2), (0, 1, 2), (2, 1, 0)) and unsharded.trial_defers == (False, True, True)
    assert unsharded.defers_now is False
    alone = LaunchOrderPlanner()
    alone._start_trial(manager, [], finished_first=False)  # nothing to try against plan order: no trial
    assert alone.trial is None and alone.defers_now is True


def test_a_trial_step_counts_the_backward_to_its_launch_or_its_end() -> None:
    stats = SimpleNamespace(backward_start=10.0, finalize_start=10.5, finalize_end=10.8)
    # deferred: backward returned once the last bucket was launched (finalize_start)
    assert trial_step_seconds(stats, True, None, 9.0, 11.0, 0.25) == pytest.approx(2.0 + 0.5 + 0.25)
    # every bucket finished in backward: until it finished them; from where it reached the outputs, if earlier
    assert trial_step_seconds(stats, False, 9.9, 9.0, 11.0, 0.25) == pytest.approx(2.0 + 0.9 + 0.25)


# -- the sharded step sequence (bucketing.shard.step) ---------------------------------------------------


def test_a_shard_step_updates_what_landed_and_with_block_every_bucket_up_to_the_one_read() -> None:
    step = ShardStep(4)
    assert step.gather_order == [3, 2, 1, 0]  # the forward needs the last buckets first
    landed = {1}.__contains__
    assert step.to_update(block=False, until=None, deferred=True, ready=landed) == [1]
    assert step.to_update(block=True, until=2, deferred=True, ready=landed) == [3, 2, 1]
    assert step.to_update(block=True, until=2, deferred=True, ready=lambda bucket: False) == [3, 2]
    assert step.to_update(block=False, until=None, deferred=False, ready=landed) == [3, 2, 1, 0]
    assert step.read_order([0, 3, 1]) == [3, 1, 0]


@given(st.integers(1, 6), st.data())
def test_all_gathers_launch_in_the_gather_order_whatever_order_the_updates_land_in(buckets: int, data) -> None:
    step = ShardStep(buckets)
    step.start(reduction=1)
    owed = set(range(buckets))
    launched: list[int] = []
    for bucket in data.draw(st.permutations(range(buckets))):
        owed.discard(bucket)  # this bucket's update applied
        while (next_bucket := step.next_to_gather(owed.__contains__)) is not None:
            step.launched(next_bucket, handle=f"gather {next_bucket}")
            launched.append(next_bucket)
        assert launched == step.gather_order[: len(launched)]  # a prefix of the fixed order, every rank alike
        assert not owed & set(launched)  # each once its update is applied, as soon as every one before it is
        assert len(launched) == len(buckets_before(step.gather_order, owed))
        for b in range(buckets):  # what a forward would still wait for, listed or asked one by one
            assert step.write_owed(b, b in owed, reduction=1) == (b in step.owed(owed, reduction=1))
    assert launched == step.gather_order and step.take_gather(0) == "gather 0" and step.take_gather(0) is None


def buckets_before(order: list[int], owed: set[int]) -> list[int]:
    """The longest prefix of ``order`` holding no owed bucket."""
    prefix = []
    for bucket in order:
        if bucket in owed:
            break
        prefix.append(bucket)
    return prefix


def test_a_consumed_reduction_owes_its_all_gathers_until_they_launch() -> None:
    step = ShardStep(3)
    assert step.owed([], reduction=1) == []  # gradients not stepped on: nothing to gather
    step.start(reduction=1)
    assert step.consumed(1) and not step.consumed(2)
    assert step.owed([], reduction=1) == [0, 1, 2]
    step.launched(2, handle=None)
    assert step.owed([], reduction=1) == [0, 1, 2] and not step.ungathered(2) and step.ungathered(1)
    step.take_gather(2)
    assert step.owed([], reduction=1) == [0, 1]
    step.skip(2)
    assert step.consumed(2) and reduction_of(1, True) == 2 and reduction_of(2, False) == 2
    step.regather()
    assert step.ungathered(2)


# -- the settings a per-bucket step runs with (bucketing.update.pending) ----------------------------------


def test_a_bucket_step_sees_its_parameters_with_the_settings_of_step_time_and_the_groups_come_back() -> None:
    a, b, c = object(), object(), object()
    groups = [{"params": [a, b], "lr": 0.1}, {"params": [c], "lr": 0.2}]
    pending = PendingUpdates.start(2, groups)
    groups[0]["lr"] = 0.05  # a scheduler stepped after step(): the owed update keeps step()'s lr
    added = {"params": [object()], "lr": 0.3}  # a group added since: its own settings
    groups.append(added)
    seen = []
    with pytest.raises(RuntimeError), groups_narrowed(groups, {id(b), id(c)}, pending):
        seen = [(list(g["params"]), g["lr"]) for g in groups]
        groups[1]["lr"] = 9.0  # the class step changed a setting, then raised
        raise RuntimeError("the class step failed")
    assert seen == [([b], 0.1), ([c], 0.2), ([], 0.3)]
    assert groups[0] == {"params": [a, b], "lr": 0.05} and groups[1] == {"params": [c], "lr": 0.2}
    assert added["params"] and added["lr"] == 0.3


def test_the_launch_order_is_planned_once_its_inputs_are_there() -> None:
    stats = SimpleNamespace(buckets=[0, 1, 2], backward_start=1.0)
    manager = SimpleNamespace(last_stats=stats, plan=SimpleNamespace(buckets=[0, 1, 2]), launch_order=(0, 1, 2))
    manager.steps_synced = SCHEDULE_AFTER_STEPS
    assert planning_due(manager, joined=False)
    assert not planning_due(manager, joined=True)  # a joined rank's shadow steps run no forward
    manager.steps_synced -= 1
    assert not planning_due(manager, joined=False)
    manager.steps_synced, manager.launch_order = SCHEDULE_AFTER_STEPS, (2, 1, 0)  # the user's order stays
    assert not planning_due(manager, joined=False)
    manager.launch_order, stats.backward_start = (0, 1, 2), None  # no timed backward
    assert not planning_due(manager, joined=False)
    assert chunk_sizes_mib([2, 0.5]) == (2.0, 0.5) and chunk_sizes_mib(()) == ()
    for bad in ([0], [True], [float("inf")], ["1"]):
        with pytest.raises(ValueError, match="chunk_candidates_mib"):
            chunk_sizes_mib(bad)
