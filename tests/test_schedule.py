"""Launch-order planning for the DistributedOptimizer (framework-free): the simulator and the planner."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from collective_ops.bucketing.update.schedule import (
    OrderTrial,
    StepProfile,
    TimedStep,
    chunk_counts,
    chunked_profile,
    held_order,
    held_order_in_chunks,
    median_step,
    plan_order,
    simulate_order,
    simulate_sharded,
    step_bound,
    step_profile,
)


def test_held_tail_orders() -> None:
    assert held_order(4, 4) == (0, 1, 2, 3) and held_order(4, 3) == (0, 1, 2, 3)
    assert held_order(4, 1) == (0, 3, 2, 1) and held_order(4, 0) == (3, 2, 1, 0)
    with pytest.raises(ValueError, match="held_from <= 4"):
        held_order(4, 5)


def test_held_orders_defer_the_first_ready_buckets_to_the_end() -> None:
    assert held_order(4, 2, 1) == (1, 3, 2, 0) and held_order(4, 4, 0) == (0, 1, 2, 3)
    assert held_order(4, 4, 2) == (2, 3, 1, 0) and held_order(4, 0, 0) == (3, 2, 1, 0)
    assert held_order(4, 3, 1, needs=(3, 0, 1, 2)) == (1, 2, 3, 0)  # held ones in the forward's own order
    with pytest.raises(ValueError, match="deferred <= held_from"):
        held_order(4, 1, 2)


def _profile(forward: float = 10.0) -> StepProfile:
    # 4 buckets of 10 units ready every 10 ms of backward; the forward needs bucket 3 first
    return StepProfile(
        ready_s=[10.0, 20.0, 30.0, 40.0], nbytes=[10, 10, 10, 10], backward_end_s=40.0, forward_s=[forward] * 4
    )


def test_simulation_by_hand() -> None:
    cost = lambda nbytes, queued: 2.0 * nbytes  # noqa: E731  (20 ms per bucket: the channel is the bottleneck)
    # plan order: done at 30, 50, 70, 90; forward waits for bucket 3 (90), then runs 4 x 10 ms
    assert simulate_order((0, 1, 2, 3), _profile(), cost) == (130.0, 50.0)
    # hold 2 and 3, send 3 first: done 0:30, 1:50, 3:70, 2:90 -> forward 70+10, waits for 2 until 90, +10, +10, +10
    assert simulate_order((0, 1, 3, 2), _profile(), cost) == (120.0, 40.0)


def test_a_collective_launched_behind_a_busy_channel_is_priced_as_queued() -> None:
    cost = lambda nbytes, queued: (0.0 if queued else 1.0) + nbytes  # noqa: E731  (latency 1 s, overlapped if queued)
    # bucket 1 launched at 0.5 while bucket 0 is on the wire (0..11): 10 s more, done at 21; the forward (from 0.5,
    # no compute) waits for it
    busy = StepProfile(ready_s=[0.0, 0.5], nbytes=[10, 10], backward_end_s=0.5, forward_s=[0.0, 0.0])
    assert simulate_order((0, 1), busy, cost) == (21.0, 20.5)
    # bucket 1 ready at 12, after the channel went idle at 11: its latency too, done at 23
    idle = StepProfile(ready_s=[0.0, 12.0], nbytes=[10, 10], backward_end_s=12.0, forward_s=[0.0, 0.0])
    assert simulate_order((0, 1), idle, cost) == (23.0, 11.0)


def test_the_step_bound_counts_the_link_idle_before_the_first_buckets_are_ready() -> None:
    cost = lambda nbytes, queued: 2.0 * nbytes  # noqa: E731
    # nothing to send before 10; from bucket 0's ready time all 4 x 20 go back to back: the link ends at 90 at the
    # earliest, then the forward computes at least bucket 0's 10 (needed last); the forward alone would end at 80
    assert step_bound(_profile(), cost) == 100.0
    assert step_bound(_profile(forward=40.0), cost) == 40.0 + 4 * 40.0  # a forward longer than the link
    lead = StepProfile([10.0, 20.0, 30.0, 40.0], [10, 10, 10, 10], 40.0, [10.0] * 4, lead_s=7.0)
    assert step_bound(lead, cost) == 107.0


@st.composite
def _profiles_and_costs(draw):
    count = draw(st.integers(1, 5))
    ready = sorted(draw(st.lists(st.floats(0, 50), min_size=count, max_size=count)))
    profile = StepProfile(
        ready_s=ready,
        nbytes=draw(st.lists(st.integers(3, 40), min_size=count, max_size=count)),  # cut into up to 3 chunks
        backward_end_s=ready[-1] + draw(st.floats(0, 10)),
        forward_s=draw(st.lists(st.floats(0, 20), min_size=count, max_size=count)),
        forward_order=draw(st.permutations(range(count))),
        lead_s=draw(st.floats(0, 10)),
    )
    alpha, beta = draw(st.floats(0, 5)), draw(st.floats(0, 3))
    alpha_queued = draw(st.floats(0, 1)) * alpha
    chunks = draw(st.lists(st.integers(1, 3), min_size=count, max_size=count))
    return profile, (lambda nbytes, queued: (alpha_queued if queued else alpha) + beta * nbytes), chunks


@settings(max_examples=200, deadline=None)
@given(_profiles_and_costs())
def test_no_simulated_order_beats_the_step_bound(case) -> None:
    profile, cost, chunks = case
    bound = step_bound(profile, cost)
    for prediction in plan_order(profile, cost) + plan_order(profile, cost, chunks=chunks):
        assert prediction.step_s >= bound - 1e-9, (prediction, bound)


def test_sharded_simulation_by_hand() -> None:
    # reduce-scatters 5 ms each: done 15, 25, 35, 45 -> step() returns at 45 (5 ms after backward's end);
    # all-gathers 8 ms each in the forward's order 3, 2, 1, 0: done 53, 61, 69, 77; the forward (10 ms per
    # bucket) waits 8 for bucket 3 -> 63, 2 is there -> 73, 1 -> 83, 0 -> 93; exposed: 5 in step() + 8
    prediction = simulate_sharded(_profile(), [5.0] * 4, [8.0] * 4)
    assert (prediction.forward_end_s, prediction.forward_wait_s) == (93.0, 13.0)
    assert prediction.is_plan_order and prediction.step_s == 93.0
    # a slow reduce-scatter of the first bucket delays step(), and every all-gather behind it
    slow = simulate_sharded(_profile(), [30.0, 5.0, 5.0, 5.0], [8.0] * 4)
    assert (slow.forward_end_s, slow.forward_wait_s) == (103.0, 23.0)  # RS done 40, 45, 50, 55; AG 63, 71, 79, 87
    with pytest.raises(ValueError, match="every bucket"):
        simulate_sharded(_profile(), [5.0] * 3, [8.0] * 4)


def test_sharded_simulation_with_update_times_by_hand() -> None:
    from types import SimpleNamespace

    from collective_ops.bucketing.shard.step import sharded_prediction, update_shares

    # reduce-scatters 5 ms each: done 15, 25, 35, 45; updates 2 ms each. step() updates bucket 3 (the forward's
    # first) alone once it lands: 47, and launches its all-gather, then updates the others: returns at 53.
    # All-gathers 8 ms each from 47: 3 at 55, 2 at 63, 1 at 71, 0 at 79; the forward from 53 waits 2 for bucket 3
    # -> 65, 75, 85, 95; exposed: 13 in step() + 2 (every update first, as before: the forward ended at 101)
    prediction = simulate_sharded(_profile(), [5.0] * 4, [8.0] * 4, update_s=[2.0] * 4)
    assert (prediction.forward_end_s, prediction.forward_wait_s) == (95.0, 15.0)
    # a step's update seconds split by the buckets' elements; zero where none were timed
    plan = SimpleNamespace(
        buckets=[
            SimpleNamespace(numel=n, dtype="float32", nbytes=4 * n, param_indices=[b])
            for b, n in enumerate((1, 1, 1, 5))
        ]
    )
    assert update_shares(plan, 8.0) == [1.0, 1.0, 1.0, 5.0] and update_shares(plan, 0.0) == [0.0] * 4
    priced = (plan, {}, None, lambda nbytes, queued: 5.0, lambda dtype: 4)
    timed = sharded_prediction(_profile(), *priced, update_s=8.0)
    assert timed == simulate_sharded(_profile(), [5.0] * 4, [5.0] * 4, update_s=[1.0, 1.0, 1.0, 5.0])


def test_sharded_simulation_of_a_launch_order_by_hand() -> None:
    # reduce-scatters in the order 0, 1, 3, 2: bucket 3 (ready at 40) launches before 2 (ready at 30), which
    # waits for it: done 15, 25, 45 (3), 50 (2) -> step() at 50; all-gathers 58, 66, 74, 82; the forward waits 8
    # for bucket 3 -> 68, 78, 88, 98; exposed: 10 in step() + 8
    prediction = simulate_sharded(_profile(), [5.0] * 4, [8.0] * 4, (0, 1, 3, 2), held_from=2)
    assert (prediction.forward_end_s, prediction.forward_wait_s, prediction.order) == (98.0, 18.0, (0, 1, 3, 2))
    assert not prediction.is_plan_order and prediction.held_from == 2


def test_every_sharded_launch_order_is_simulated_and_plan_order_priced_as_the_plain_prediction() -> None:
    from types import SimpleNamespace

    from collective_ops.bucketing.shard.step import sharded_orders, sharded_prediction

    profile = _profile()
    buckets = [SimpleNamespace(dtype="float32", nbytes=10, param_indices=[b]) for b in range(4)]
    priced = (SimpleNamespace(buckets=buckets), {}, None, lambda nbytes, queued: 1.0 + nbytes, lambda dtype: 4)
    predictions = sharded_orders(profile, *priced)
    assert len(predictions) == 15 and len({p.order for p in predictions}) > 1  # every (deferred, held_from)
    assert all(sorted(p.order) == [0, 1, 2, 3] for p in predictions)
    assert predictions == sorted(predictions, key=lambda p: p.step_s)
    plain = next(p for p in predictions if p.is_plan_order and p.held_from == 4)
    assert plain == sharded_prediction(profile, *priced)
    # a bucket's reduce-scatter launched before one ready earlier holds that one back: plan order is never beaten
    assert predictions[0].step_s == plain.step_s


def test_simulation_with_a_measured_forward_by_hand() -> None:
    # the forward starts 5 ms after backward, needs 3 then 2 at once (0 ms apart), then 1 and 0; lead 7 ms
    profile = StepProfile(
        ready_s=[10.0, 20.0, 30.0, 40.0],
        nbytes=[10, 10, 10, 10],
        backward_end_s=40.0,
        forward_s=[1.0, 4.0, 6.0, 0.0],
        forward_order=[3, 2, 1, 0],
        forward_start_s=45.0,
        lead_s=7.0,
    )
    cost = lambda nbytes, queued: 1.0 * nbytes  # noqa: E731
    # done 0:20 1:30 2:40 3:50; clock 45 -> waits 5 for 3 -> 50, 2 done -> 56, 1 -> 60, 0 -> 61
    assert simulate_order((0, 1, 2, 3), profile, cost) == (61.0, 5.0)
    plain = next(p for p in plan_order(profile, cost) if p.is_plan_order)
    assert plain.step_s == 68.0 and plain.deferred == 0


def test_planner_holds_the_tail_when_the_link_is_the_bottleneck() -> None:
    best = plan_order(_profile(), lambda nbytes, queued: 2.0 * nbytes)[0]
    assert best.order[-1] != 3 and best.forward_end_s < 130.0
    assert best.order == held_order(4, best.held_from, best.deferred)


def test_planner_defers_a_big_first_ready_bucket_the_forward_needs_last() -> None:
    # bucket 0 (the output layer: ready first, needed last) is the largest and the link is backlogged:
    # sent last, its transfer overlaps the forward of layers 3..1 (by hand: order 1, 2, 3, 0 ends the
    # forward at 100; plan order at 111; the best order without deferring, 0, 1, 3, 2, at 101)
    profile = StepProfile(
        ready_s=[1.0, 15.0, 30.0, 40.0], nbytes=[25, 15, 15, 15], backward_end_s=40.0, forward_s=[10.0] * 4
    )
    ranked = plan_order(profile, lambda nbytes, queued: 1.0 * nbytes)
    best, plain = ranked[0], next(p for p in ranked if p.is_plan_order)
    assert (best.order, best.forward_end_s, plain.forward_end_s) == ((1, 2, 3, 0), 100.0, 111.0)
    assert min(p.forward_end_s for p in ranked if p.deferred == 0) == 101.0


def test_planner_keeps_ready_order_when_communication_is_free() -> None:
    best = plan_order(_profile(), lambda nbytes, queued: 0.0)[0]
    assert best.order == (0, 1, 2, 3) and best.forward_wait_s == 0.0


def test_a_profile_must_describe_every_bucket() -> None:
    with pytest.raises(ValueError, match="every bucket"):
        plan_order(StepProfile([1.0], [1, 2], 1.0, [0.5]), lambda nbytes, queued: 0.0)
    with pytest.raises(ValueError, match="not a permutation"):
        plan_order(StepProfile([1.0, 2.0], [1, 2], 2.0, [0.5, 0.5], forward_order=[1, 1]), lambda nbytes, queued: 0.0)


def test_the_forward_timeline_pairs_a_backward_with_the_forward_around_it() -> None:
    import time
    from types import SimpleNamespace

    from collective_ops.bucketing.update.timeline import ForwardTimeline

    timeline = ForwardTimeline()
    timeline.forward_started(follows_backward=False)
    timeline.needed([1])
    timeline.forward_ended()
    time.sleep(0.05)  # the end of this forward settling (a rebuild, an auto-tune): not the step's lead
    timeline.settled()
    time.sleep(0.01)  # loss and the last layer's backward: the lead
    now = time.perf_counter()
    stats = SimpleNamespace(backward_start=now, finalize_start=now, ready_times={0: now, 1: now})
    assert not timeline.complete(stats.backward_start)  # the forward timed so far ran before that backward
    timeline.forward_started(follows_backward=True)
    timeline.needed([1])
    time.sleep(0.03)
    timeline.waited(0.03)  # waiting for a reduction is not forward compute
    time.sleep(0.02)
    timeline.needed([0, 1])
    timeline.forward_ended()
    timeline.settled()
    assert timeline.complete(stats.backward_start)
    plan = SimpleNamespace(
        buckets=[SimpleNamespace(param_indices=(i,), nbytes=4, numel=1) for i in (0, 1)]  # one float32 each
    )
    profile = timeline.profile(stats, plan)
    assert list(profile.nbytes) == [4, 4]
    assert list(timeline.profile(stats, plan, itemsize=2).nbytes) == [2, 2]  # fp16 compression: 2 bytes on the wire
    assert 0.01 <= profile.lead_s < 0.05
    assert (
        list(profile.forward_order) == [1, 0] and 0.02 <= profile.forward_s[1] < 0.03 and profile.forward_start_s >= 0.0
    )


def test_the_forward_timeline_profiles_the_median_of_its_recent_training_steps() -> None:
    """One slow step (the latest, here) no longer sets the planner's profile alone: the median of the last three
    steps timed. Before, the latest step was the profile: a slow one set a step bound the race then beat."""
    import time
    from types import SimpleNamespace

    from collective_ops.bucketing.update.timeline import ForwardTimeline

    timeline = ForwardTimeline()
    timeline.forward_started(follows_backward=False)
    timeline.forward_ended()
    timeline.settled()
    for step, between in ((1, 0.01), (2, 0.01), (3, 0.06)):  # the forward's compute from bucket 1's need to 0's
        now = time.perf_counter()
        stats = SimpleNamespace(backward_start=now, finalize_start=now, ready_times={0: now, 1: now})
        timeline.forward_started(follows_backward=True)
        timeline.needed([1])
        time.sleep(between)
        timeline.needed([0])
        timeline.forward_ended()
        timeline.remember(stats, step)
        timeline.settled()
    plan = SimpleNamespace(buckets=[SimpleNamespace(param_indices=(i,), nbytes=4, numel=1) for i in (0, 1)])
    profile = timeline.profile(stats, plan)
    assert list(profile.forward_order) == [1, 0] and 0.01 <= profile.forward_s[1] < 0.04, profile.forward_s


def _timed(step: int, scale: float) -> TimedStep:
    """A step whose every time is ``scale`` times a base step's (a slower or faster run of the same step)."""
    ready = {0: 1.0 * scale, 1: 2.0 * scale, 2: 3.0 * scale, 3: 4.0 * scale}
    need = {3: 0.0, 2: 5.0 * scale, 1: 6.0 * scale, 0: 9.0 * scale}
    return TimedStep(step, ready, 4.0 * scale, need, 12.0 * scale, None, 1.0 * scale)


def test_the_median_of_timed_steps_takes_each_times_middle_value() -> None:
    assert median_step([_timed(2, 1.0)]) == _timed(2, 1.0)
    assert median_step([_timed(1, 1.5), _timed(2, 1.0), _timed(3, 0.9)]) == _timed(3, 1.0)  # the slow one left out
    partly = TimedStep(4, {0: 2.0}, 4.0, {}, 12.0, 0.5, 1.0)  # parameter 0's gradient alone timed; a start measured
    median = median_step([_timed(1, 1.0), _timed(2, 1.0), partly])
    assert median.ready_s == _timed(1, 1.0).ready_s and median.forward_start_s == 0.5
    with pytest.raises(ValueError, match="at least one"):
        median_step([])


@settings(max_examples=50, deadline=None)
@given(st.lists(st.lists(st.floats(0.001, 1.0), min_size=5, max_size=5), min_size=1, max_size=5))
def test_times_ordered_alike_in_every_step_keep_that_order_in_the_median(gaps: list[list[float]]) -> None:
    steps = []
    for step, row in enumerate(gaps):
        times = [sum(row[: k + 1]) for k in range(5)]  # increasing within each step
        steps.append(TimedStep(step, dict(enumerate(times[:4])), times[4], {}, 1.0, None, 0.0))
    median = median_step(steps)
    ready = [median.ready_s[i] for i in range(4)]
    assert ready == sorted(ready) and median.backward_end_s >= ready[-1]


def test_a_step_profile_for_any_bucketing_from_per_parameter_times() -> None:
    # 4 parameters: gradients ready at 1, 2, 3, 4 (parameter 3, the first layer, last); the forward
    # needs 3 at 0, 2 at 5, 1 at 6, 0 at 9 and ends at 12
    ready, need = {0: 1.0, 1: 2.0, 2: 3.0, 3: 4.0}, {3: 0.0, 2: 5.0, 1: 6.0, 0: 9.0}
    two = step_profile([(0, 1), (2, 3)], [8, 8], ready, 4.0, need, 12.0, lead_s=1.0)
    assert list(two.ready_s) == [2.0, 4.0] and list(two.forward_order) == [1, 0]
    assert list(two.forward_s) == [6.0, 6.0] and two.lead_s == 1.0  # bucket 1 needed at 0, bucket 0 at 6
    four = step_profile([(0,), (1,), (2,), (3,)], [4] * 4, ready, 4.0, need, 12.0)
    assert list(four.forward_order) == [3, 2, 1, 0] and list(four.forward_s) == [3.0, 3.0, 1.0, 5.0]
    # a parameter the forward never needed: its bucket is finished at the forward's end
    unused = step_profile([(0,), (1,)], [4, 4], ready, 4.0, {1: 2.0}, 12.0)
    assert list(unused.forward_order) == [1, 0] and list(unused.forward_s) == [0.0, 10.0]


def test_an_order_trial_runs_each_order_in_blocks_and_keeps_the_fastest() -> None:
    plan, held, other = (0, 1, 2), (1, 2, 0), (2, 1, 0)
    trial = OrderTrial((plan, held, other), block=2, rounds=2)
    seconds = {0: 0.30, 1: 0.25, 2: 0.28}
    ran = []
    while not trial.done:
        ran.append(trial.current)
        trial.record(seconds[trial.current] + 0.001 * len(ran))  # drift: hits every order alike
    assert ran == [0, 0, 1, 1, 2, 2, 0, 0, 1, 1, 2, 2]
    assert OrderTrial.pick(trial.medians()) == 1
    assert OrderTrial.pick([0.3, 0.3, 0.4]) == 0  # a tie keeps plan order
    assert OrderTrial.pick([0.3, 0.295, 0.4]) == 0  # and so does a gain within the noise (2%)
    assert OrderTrial.pick([0.3, 0.29, 0.28], margin=0.05) == 2
    with pytest.raises(RuntimeError, match="over"):
        trial.record(0.1)
    with pytest.raises(ValueError, match="plan order and at least one other"):
        OrderTrial((plan,))


def test_a_chunked_profile_keeps_each_buckets_bytes_ready_time_and_forward() -> None:
    profile = StepProfile([0.0, 2.0], [10, 3], 2.0, [0.5, 1.0], lead_s=0.25)
    units, bucket_of = chunked_profile(profile, [3, 1])
    assert bucket_of == (0, 0, 0, 1)
    assert list(units.nbytes) == [3, 3, 4, 3] and list(units.ready_s) == [0.0, 0.0, 0.0, 2.0]
    assert units.needs() == (3, 0, 1, 2)  # bucket 1 first (reverse plan order), then bucket 0's chunks together
    assert list(units.forward_s) == [0.0, 0.0, 0.5, 1.0] and units.lead_s == 0.25
    assert chunk_counts([10, 3, 4], [True, True, False], 4) == [3, 1, 1]
    assert held_order_in_chunks([2, 1], 2, 1) == (0, 1, 0) and held_order_in_chunks([1, 1], 2) == (0, 1)
    with pytest.raises(ValueError, match="at least 1 chunk"):
        chunked_profile(profile, [0, 1])


def test_chunks_let_a_large_bucket_ready_first_share_the_link_with_one_needed_first() -> None:
    # bucket 0: 4 s of transfer, ready first, needed last; bucket 1: 2 s, ready at 1 s, needed first.
    profile = StepProfile([0.0, 1.0], [4, 2], 1.5, [0.5, 1.0])
    whole = plan_order(profile, lambda nbytes, queued: float(nbytes))[0]
    chunked = plan_order(profile, lambda nbytes, queued: float(nbytes), chunks=[2, 1])[0]
    assert whole.step_s == 7.5  # either whole bucket keeps the other waiting
    assert chunked.order == (0, 1, 0) and chunked.step_s == 6.5  # half of bucket 0 before bucket 1, half after
