"""Launch-order planning for updates overlapped with the next forward (framework-free).

Backward makes gradients ready in roughly the reverse of the order the next forward needs the
parameters: the first layers' buckets (needed first) are ready last. Launched in ready order on
one channel (collectives complete in the order they are issued), the bucket the forward needs
first queues behind every other one. ByteScheduler's remedy, with a strict in-order launcher:
send the first ``k`` buckets as they become ready (they overlap backward), then hold the rest
until the last is ready and send them in the order the forward needs them. :func:`plan_order`
simulates every ``k`` on one serial channel (``cost(nbytes)`` seconds per collective) and a
forward that waits, bucket by bucket, for the ones it needs, and keeps the best; ``k = n`` is
plain ready order. The result depends only on its inputs, so one rank plans and broadcasts.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class StepProfile:
    """One step's timing per bucket (seconds from the start of backward), in plan order."""

    ready_s: Sequence[float]  # when each bucket was full
    nbytes: Sequence[int]
    backward_end_s: float
    forward_s: Sequence[float]  # forward compute spent on each bucket's parameters


@dataclass(frozen=True)
class OrderPrediction:
    order: tuple[int, ...]
    held_from: int  # k: buckets from this position on are held and sent in forward order
    forward_end_s: float  # when the next forward ends, from the start of backward
    forward_wait_s: float  # time that forward spent waiting for buckets


def held_tail_order(bucket_count: int, k: int) -> tuple[int, ...]:
    """Buckets ``0..k-1`` in plan order, then ``n-1 .. k`` (the forward's order: last planned, first needed)."""
    if not 0 <= k <= bucket_count:
        raise ValueError(f"k must be between 0 and {bucket_count}, got {k}")
    return tuple(range(k)) + tuple(range(bucket_count - 1, k - 1, -1))


def simulate_order(order: Sequence[int], profile: StepProfile, cost: Callable[[int], float]) -> tuple[float, float]:
    """(forward end, forward wait) for buckets launched strictly in ``order`` on one serial channel.

    A bucket launches once it is full and every bucket before it in ``order`` has launched; the
    forward starts at the end of backward and needs buckets from the last planned to the first.
    """
    done: dict[int, float] = {}
    launched = channel_free = 0.0
    for bucket in order:
        launched = max(launched, profile.ready_s[bucket])
        start = max(launched, channel_free)
        channel_free = start + cost(profile.nbytes[bucket])
        done[bucket] = channel_free
    clock, waited = profile.backward_end_s, 0.0
    for bucket in reversed(range(len(profile.ready_s))):
        waited += max(0.0, done[bucket] - clock)
        clock = max(clock, done[bucket]) + profile.forward_s[bucket]
    return clock, waited


def plan_order(profile: StepProfile, cost: Callable[[int], float]) -> list[OrderPrediction]:
    """Every held-tail order, best first (ties keep more buckets in ready order)."""
    count = len(profile.ready_s)
    if not (len(profile.nbytes) == len(profile.forward_s) == count and count > 0):
        raise ValueError("a step profile needs ready time, bytes and forward time for every bucket")
    out = []
    for k in range(count + 1):
        order = held_tail_order(count, k)
        forward_end, waited = simulate_order(order, profile, cost)
        out.append(OrderPrediction(order, k, forward_end, waited))
    return sorted(out, key=lambda p: (round(p.forward_end_s, 6), -p.held_from))
