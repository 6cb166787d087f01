"""Choosing the launch order of a per-bucket optimizer's step (``schedule="auto"``), framework-free.

Once per bucket plan, at the end of a forward on every rank, rank 0 simulates every candidate
launch order from the timed step (:class:`~collective_ops.bucketing.update.timeline.ForwardTimeline`
and the manager's ``StepStats``) and broadcasts its shortlist; the shortlist then runs in turn
with plan order and with every bucket finished in backward (:class:`OrderTrial`), and the fastest
measured is kept. :class:`LaunchOrderPlanner` holds that state; its inputs (the manager, the
engine, the timeline, the measured cost) are passed to each call.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from ..diagnosis import agreeing
from ..plan import MIB
from .schedule import OrderPrediction, OrderTrial, Price, StepProfile, best_first, chunk_counts, plan_order, step_bound
from .timeline import ForwardTimeline

logger = logging.getLogger("collective_ops")
SCHEDULE_AFTER_STEPS = 3  # after the first-step rebuild and bucket_size_mb="auto" settling (step 2)
TRIAL_CANDIDATES = 2  # the simulator's best orders run against plan order and against finishing in backward
# Chunk sizes the launch-order planner weighs for buckets larger than them (one chunked order joins the trial)
CHUNK_CANDIDATES_MIB = (4.0, 2.0, 1.0, 0.5)
TRIAL_BLOCK_STEPS = 3
TRIAL_ROUNDS = 2


def chunk_sizes_mib(sizes: Any) -> tuple[float, ...]:
    """``sizes`` as chunk sizes in MiB the planner weighs (``()``: whole buckets only), each positive and
    finite; else a ValueError saying what is taken."""
    sizes = tuple(sizes)
    if not all(isinstance(m, (int, float)) and not isinstance(m, bool) and 0 < m < float("inf") for m in sizes):
        raise ValueError(
            f"chunk_candidates_mib must be chunk sizes in MiB, each positive and finite (e.g. (2, 0.5)), or () "
            f"for whole buckets only; got {sizes!r}"
        )
    return tuple(float(m) for m in sizes)


class LaunchOrderPlanner:
    """The launch order of one model's steps: planned once per bucket plan, then tried, then kept."""

    def __init__(self) -> None:
        self.report: list[OrderPrediction] | None = None  # every simulated order of the last planning, best first
        # the step no launch order beats, from the profile and cost the planner used (schedule.step_bound)
        self.bound_s: float | None = None
        self.planned_for: Any = None  # the bucket plan the launch order was planned for
        self.trial: OrderTrial | None = None  # the shortlisted orders being run in turn
        self.trial_defers: tuple[bool, ...] = ()  # per trial candidate: overlapped (or finished in backward)
        self.defers_now = True  # False: the trial runs, or kept, every bucket finished in backward
        self.kept: dict[str, Any] | None = None  # what the last trial measured and kept

    def plans(self, plan: Any) -> bool:
        """True while no launch order was planned for ``plan``."""
        return self.planned_for is not plan

    def plan(
        self,
        manager: Any,
        engine: Any,
        timeline: ForwardTimeline,
        compiled: bool,
        chunk_candidates_mib: Sequence[float],
        measure_cost: Callable[[], Any],
        sharded: Callable[[Any], list[OrderPrediction]] | None = None,
    ) -> None:
        """Rank 0's simulated best order (where its timeline is complete), set on every rank (collectives).
        ``compiled``: the forward ran under torch.compile (no per-module timeline: plan order kept);
        ``measure_cost``: the fitted alpha/beta of the channel (a collective); ``sharded``: the sharded step's
        reduce-scatter orders simulated for a fitted cost, best first (None: allreduce orders, unsharded)."""
        stats = manager.last_stats
        complete = timeline.complete(stats.backward_start)
        with agreeing(manager, "the launch-order plan (rank 0's decision, the fitted cost and the orders, shared)"):
            # rank 0's timeline decides, on every rank: 1 plan from it, 0 not complete yet, 2 never (compiled forwards)
            decision = engine.broadcast_ints([2 if compiled else int(complete)])[0]
            if decision == 2:
                self.planned_for = manager.plan  # plan order, overlapped: nothing to plan from
                logger.info("collective_ops: DistributedOptimizer keeps plan order (the forward is compiled)")
            if decision != 1:
                return
            cost = measure_cost()  # a collective: every rank is here
            count = len(manager.plan.buckets)
            predictions = None
            if complete and sharded is not None:
                predictions = sharded(cost)
            elif complete:
                inputs = planner_inputs(timeline, manager, stats, manager.plan, cost)
                predictions = ranked_orders(
                    inputs, manager, manager.plan, engine.world_size, chunk_candidates_mib, chunked=True
                )
                self.bound_s = step_bound(*inputs)
            orders = broadcast_orders(engine, shortlist(predictions or [], TRIAL_CANDIDATES, count))  # rank 0's
        self.report, self.planned_for = predictions, manager.plan
        self._start_trial(manager, orders, finished_first=sharded is None)
        if predictions:
            plain = next(p for p in predictions if p.is_plan_order)
            logger.info(
                "collective_ops: DistributedOptimizer shortlisted launch orders %s (simulated %s ms) against plan "
                "order (%.1f ms)%s; each runs %d x %d steps, the fastest kept",
                orders,
                [round(p.step_s * 1e3, 1) for p in predictions if p.order in orders],
                plain.step_s * 1e3,
                "" if sharded else " and every bucket finished in backward",
                TRIAL_ROUNDS,
                TRIAL_BLOCK_STEPS,
            )

    def _start_trial(self, manager: Any, orders: list[tuple[int, ...]], finished_first: bool) -> None:
        """The trial of ``orders`` against plan order, from the next step. ``finished_first``: finishing every
        bucket in backward (as a plain optimizer sees it) is the first candidate: overlapping updates with the
        forward costs hooks and per-bucket updates, and is kept only where it measures faster. (The sharded
        step has no such baseline: plan order, overlapped, is its first; with no other order, no trial.)"""
        plan = tuple(range(len(manager.plan.buckets)))
        candidates = (plan, plan, *orders) if finished_first else (plan, *orders)
        if len(candidates) < 2:
            return
        self.trial = OrderTrial(candidates, TRIAL_BLOCK_STEPS, TRIAL_ROUNDS)
        self.trial_defers = (not finished_first, *(True for _ in candidates[1:]))
        self.defers_now = self.trial_defers[0]
        manager.set_launch_order(None)

    def advance(self, manager: Any, engine: Any, step_s: float) -> None:
        """One step of the trial measured (``step_s``: :func:`trial_step_seconds`); the next order set, or,
        once over, the fastest kept (the slowest rank's medians: alike on every rank, a collective)."""
        trial = self.trial
        trial.record(step_s)
        if not trial.done:
            manager.set_launch_order(trial.orders[trial.current])
            self.defers_now = self.trial_defers[trial.current]
            return
        with agreeing(manager, "the end of the launch-order trial (the slowest rank's step times, all-reduced)"):
            medians = engine.reduce_floats(trial.medians(), "max")  # the slowest rank's: alike everywhere
        kept = trial.pick(medians)
        manager.set_launch_order(trial.orders[kept])
        self.defers_now = self.trial_defers[kept]
        self.trial = None
        self.kept = {"orders": trial.orders, "overlapped": list(self.trial_defers), "median_s": medians, "kept": kept}
        logger.info(
            "collective_ops: DistributedOptimizer kept %s; median steps (ms; every bucket finished in backward, "
            "then plan order, then the shortlist): %s",
            f"launch order {trial.orders[kept]}" if self.defers_now else "every bucket finished in backward",
            [round(m * 1e3, 1) for m in medians],
        )

    def advance_timed(
        self,
        manager: Any,
        engine: Any,
        stats: Any,
        backward_began: float | None,
        forward_start: float | None,
        step_seconds: float,
    ) -> None:
        """At the end of a trial step's forward: the step measured up to now (:func:`trial_step_seconds`), then
        :meth:`advance`."""
        now = time.perf_counter()
        measured = trial_step_seconds(stats, self.defers_now, backward_began, forward_start, now, step_seconds)
        self.advance(manager, engine, measured)

    def on_plan_change(self) -> None:
        """The model's buckets were replanned: a trial of the old plan's orders ends."""
        self.trial = None
        self.defers_now = True


def planning_due(manager: Any, joined: bool) -> bool:
    """Whether the end of this forward plans the launch order (for a plan not yet planned): from the
    ``SCHEDULE_AFTER_STEPS``-th synchronised step, in plan order unless the user set one, after a backward
    that timed every bucket, and not in a joined rank's shadow steps (they run without forwards)."""
    stats, buckets = manager.last_stats, len(manager.plan.buckets)
    return (
        manager.steps_synced >= SCHEDULE_AFTER_STEPS
        and manager.launch_order == tuple(range(buckets))  # (else set by the user)
        and len(stats.buckets) == buckets
        and stats.backward_start is not None
        and not joined
    )


def trial_step_seconds(
    stats: Any,
    defers: bool,
    backward_began: float | None,
    forward_start: float | None,
    now: float,
    step_seconds: float,
) -> float:
    """One trial step's own time: its forward (from ``forward_start`` to ``now``), its backward and its step()
    (``step_seconds``), so other work between steps does not count. The backward runs from where it reached
    the model's outputs (the output layer's backward, before the first gradient, is the step's too) until it
    returned: at its end where it finished every bucket, as it launched the last if ``defers``."""
    ended = stats.finalize_start if defers else (stats.finalize_end or stats.finalize_start)
    began = stats.backward_start or 0.0
    if backward_began is not None:
        began = min(began, backward_began)
    backward = (ended or 0.0) - began
    forward = now - forward_start if forward_start is not None else 0.0
    return forward + max(backward, 0.0) + step_seconds


def planner_inputs(
    timeline: ForwardTimeline, manager: Any, stats: Any, plan: Any, cost: Any
) -> tuple[StepProfile, Price]:
    """The timed step as the planner sees it for ``plan``, and the channel's price of a collective. A hook that
    prices buckets itself (PowerSGD) gives each bucket's bytes: what its compressed reduction sends."""
    bucket_wire = getattr(manager.comm_hook, "planned_wire", None)
    profile = timeline.profile(stats, plan, manager.wire_shares(plan), manager.wire_itemsize, bucket_wire)

    def price(nbytes: int, queued: bool) -> float:
        return cost.cost(nbytes, queued=queued)

    return profile, price


def ranked_orders(
    inputs: tuple[StepProfile, Price],
    manager: Any,
    plan: Any,
    world_size: int,
    chunk_candidates_mib: Sequence[float],
    chunked: bool = False,
) -> list[OrderPrediction]:
    """Every candidate launch order of ``plan``, simulated from the timed step (:func:`planner_inputs`), best
    first; with ``chunked`` also those sending its chunkable buckets in chunks of each of
    ``chunk_candidates_mib`` (slower to plan: not for the bucket-size tune, which weighs many plans)."""
    profile, price = inputs
    ranked = plan_order(profile, price)
    if not chunked or world_size > 2:
        # Beyond 2 ranks a bucket's sum depends on how it is cut (Gloo's ring adds each element in an order
        # set by its place in the buffer sent): chunked orders would make the weights depend on which order
        # the timed trial keeps. A sum of two is the same in any order, so at 2 ranks any chunking may win.
        return ranked
    chunkable = [manager.chunkable(b, plan) for b in range(len(plan.buckets))]
    nbytes = [bucket.nbytes for bucket in plan.buckets]
    tried = set()
    for mib in chunk_candidates_mib:
        chunks = tuple(chunk_counts(nbytes, chunkable, int(mib * MIB)))
        if max(chunks) > 1 and chunks not in tried:
            tried.add(chunks)
            ranked += plan_order(profile, price, chunks=chunks)
    return best_first(ranked)


def shortlist(predictions: list[OrderPrediction], count: int, buckets: int) -> list[tuple[int, ...]]:
    """The ``count`` best simulated whole-bucket orders other than plan order, distinct, best first; then the
    best order that sends some bucket in chunks, where one is simulated faster than all of those."""
    out: list[tuple[int, ...]] = []
    for prediction in predictions:
        if len(out) == count:
            break
        if not prediction.is_plan_order and len(prediction.order) == buckets and prediction.order not in out:
            out.append(prediction.order)
    best_whole = next((p.step_s for p in predictions if len(p.order) == buckets), None)
    chunked = next((p for p in predictions if len(p.order) > buckets), None)
    if chunked is not None and (best_whole is None or chunked.step_s < best_whole):
        out.append(chunked.order)
    return out


def broadcast_orders(engine: Any, orders: list[tuple[int, ...]]) -> list[tuple[int, ...]]:
    """Rank 0's ``orders`` on every rank (their lengths first: a chunked order lists a bucket once per chunk)."""
    slots = TRIAL_CANDIDATES + 1  # the shortlist's most
    header = engine.broadcast_ints([len(orders), *(len(o) for o in orders)] + [0] * (slots - len(orders)))
    lengths = header[1 : 1 + header[0]]
    if not lengths:
        return []
    mine = [b for order in orders for b in order]
    flat = engine.broadcast_ints(mine if len(mine) == sum(lengths) else [0] * sum(lengths))
    starts = [sum(lengths[:k]) for k in range(len(lengths))]
    return [tuple(flat[start : start + length]) for start, length in zip(starts, lengths)]


__all__ = [
    "CHUNK_CANDIDATES_MIB",
    "SCHEDULE_AFTER_STEPS",
    "TRIAL_BLOCK_STEPS",
    "TRIAL_CANDIDATES",
    "TRIAL_ROUNDS",
    "LaunchOrderPlanner",
    "broadcast_orders",
    "chunk_sizes_mib",
    "planning_due",
    "planner_inputs",
    "ranked_orders",
    "shortlist",
    "trial_step_seconds",
]
