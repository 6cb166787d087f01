"""The framework-free update core: reads learnt from the forward, the order trial's bookkeeping."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from collective_ops.bucketing.update.overlap import ForwardReads, buckets_read
from collective_ops.bucketing.update.planner import LaunchOrderPlanner, trial_step_seconds
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


def test_a_trial_step_counts_the_backward_to_its_launch_or_its_end() -> None:
    stats = SimpleNamespace(backward_start=10.0, finalize_start=10.5, finalize_end=10.8)
    # deferred: backward returned once the last bucket was launched (finalize_start)
    assert trial_step_seconds(stats, True, None, 9.0, 11.0, 0.25) == pytest.approx(2.0 + 0.5 + 0.25)
    # every bucket finished in backward: until it finished them; from where it reached the outputs, if earlier
    assert trial_step_seconds(stats, False, 9.9, 9.0, 11.0, 0.25) == pytest.approx(2.0 + 0.9 + 0.25)
