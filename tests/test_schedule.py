"""Launch-order planning for the DistributedOptimizer (framework-free): the simulator and the planner."""

from __future__ import annotations

import pytest

from collective_ops.bucketing.schedule import StepProfile, held_tail_order, plan_order, simulate_order


def test_held_tail_orders() -> None:
    assert held_tail_order(4, 4) == (0, 1, 2, 3) and held_tail_order(4, 3) == (0, 1, 2, 3)
    assert held_tail_order(4, 1) == (0, 3, 2, 1) and held_tail_order(4, 0) == (3, 2, 1, 0)
    with pytest.raises(ValueError, match="between 0 and 4"):
        held_tail_order(4, 5)


def _profile(forward: float = 10.0) -> StepProfile:
    # 4 buckets of 10 units ready every 10 ms of backward; the forward needs bucket 3 first
    return StepProfile(
        ready_s=[10.0, 20.0, 30.0, 40.0], nbytes=[10, 10, 10, 10], backward_end_s=40.0, forward_s=[forward] * 4
    )


def test_simulation_by_hand() -> None:
    cost = lambda nbytes: 2.0 * nbytes  # noqa: E731  (20 ms per bucket: the channel is the bottleneck)
    # plan order: done at 30, 50, 70, 90; forward waits for bucket 3 (90), then runs 4 x 10 ms
    assert simulate_order((0, 1, 2, 3), _profile(), cost) == (130.0, 50.0)
    # hold 2 and 3, send 3 first: done 0:30, 1:50, 3:70, 2:90 -> forward 70+10, waits for 2 until 90, +10, +10, +10
    assert simulate_order((0, 1, 3, 2), _profile(), cost) == (120.0, 40.0)


def test_planner_holds_the_tail_when_the_link_is_the_bottleneck() -> None:
    best = plan_order(_profile(), lambda nbytes: 2.0 * nbytes)[0]
    assert best.order[-1] != 3 and best.forward_end_s < 130.0
    assert best.order == held_tail_order(4, best.held_from)


def test_planner_keeps_ready_order_when_communication_is_free() -> None:
    best = plan_order(_profile(), lambda nbytes: 0.0)[0]
    assert best.order == (0, 1, 2, 3) and best.forward_wait_s == 0.0


def test_a_profile_must_describe_every_bucket() -> None:
    with pytest.raises(ValueError, match="every bucket"):
        plan_order(StepProfile([1.0], [1, 2], 1.0, [0.5]), lambda n: 0.0)
