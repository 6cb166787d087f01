"""The forward's use of buckets over time, on a clock of its compute: the launch-order planner's input.

Framework-free: the optimizer reports when a forward starts, which parameters (indices into the
model's parameter list) each module is about to read, how long it waited for reductions, and when
the forward ends; with the last backward's timings (the manager's ``StepStats``) that is the
planner's :class:`~collective_ops.bucketing.update.schedule.StepProfile`.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

from ..row_sparse import wire_nbytes
from .schedule import StepProfile, TimedStep, median_step


class ForwardTimeline:
    """When each forward first needs each bucket, on a clock of its compute (waits for reductions excluded).

    With the end of the forward before the last backward and that backward's timings, that is
    the planner's :class:`StepProfile`: the simulated step then charges the forward what it
    really costs. The planner takes the median of the last few such steps (:func:`median_step`):
    one step's times swing by ±10-15% on a busy host (a scratch run, loopback, 2 ranks: backward 163-218 ms
    in 16 consecutive steps), and a profile from a slow one set a step bound that the race then beat.
    """

    REMEMBERED = 3  # timed steps the profile is the median of
    RECENT = 4  # ... taken within this many synchronised steps of the latest

    def __init__(self) -> None:
        self._start: float | None = None
        self._waited = 0.0
        self._need_s: dict[int, float] = {}
        self._end_s: float | None = None  # compute from start to end
        # when the latest forwards returned, with what their end settled (a rebuild, an auto-tune): wall clock
        self._ends: deque[float] = deque(maxlen=4)
        self._follows_backward = False
        self._timed: deque[TimedStep] = deque(maxlen=self.REMEMBERED)

    def forward_started(self, follows_backward: bool) -> None:
        """``follows_backward``: the last backward's reductions are still in flight, so nothing else (another
        model's steps, a synchronize()) ran between them and this forward: its start is part of the step."""
        self._follows_backward = follows_backward
        self._start, self._waited, self._need_s, self._end_s = time.perf_counter(), 0.0, {}, None

    def needed(self, params: list[int]) -> None:
        """The forward is about to read these parameters (indices into the model's parameter list)."""
        if self._start is None or self._end_s is not None:
            return
        now = time.perf_counter() - self._start - self._waited
        for index in params:
            self._need_s.setdefault(index, now)

    def waited(self, seconds: float) -> None:
        if self._start is not None and self._end_s is None:
            self._waited += seconds

    def forward_ended(self) -> None:
        if self._start is not None and self._end_s is None:
            self._end_s = time.perf_counter() - self._start - self._waited

    def settled(self) -> None:
        """The end of a forward's settling: what follows until the next backward's first gradient is the lead."""
        self._ends.append(time.perf_counter())

    def complete(self, backward_start: float) -> bool:
        """True when a whole forward was timed after the backward that started at ``backward_start``, and the
        end of the forward before that backward is known."""
        return (
            self._end_s is not None
            and bool(self._need_s)
            and self._start > backward_start
            and any(end <= backward_start for end in self._ends)
        )

    def profile(
        self,
        stats: Any,
        plan: Any,
        shares: dict[int, float] | None = None,
        itemsize: int | None = None,
        bucket_wire: Any = None,
    ) -> StepProfile:
        """The planner's input for ``plan`` (the current bucket plan, or a candidate): the backward of ``stats``
        (which ran before this forward) and this forward; ``shares``: the row-sparse tables' sent share;
        ``itemsize``: a compressing hook's element size on the wire; ``bucket_wire``: a hook that prices
        buckets itself (PowerSGD's ``planned_wire``: each bucket's bytes are its collectives' sum)."""
        shares = shares or {}
        newest = max((t.step for t in self._timed), default=0)
        recent = [t for t in self._timed if t.step >= newest - self.RECENT]
        timed = median_step(recent) if recent else self._timed_step(stats, step=-1)
        return timed.profile(
            [bucket.param_indices for bucket in plan.buckets],
            [
                sum(bucket_wire(bucket)[0]) if bucket_wire is not None else wire_nbytes(bucket, shares, itemsize)
                for bucket in plan.buckets
            ],
        )

    def remember(self, stats: Any, step: int) -> None:
        """Keep the step just timed (the backward of ``stats``, synchronised step ``step``, and this forward)
        among the last :attr:`REMEMBERED`, where it is complete; a later forward after the same backward
        replaces it."""
        if stats.backward_start is None or not self.complete(stats.backward_start):
            return
        if self._timed and self._timed[-1].step == step:
            self._timed.pop()
        self._timed.append(self._timed_step(stats, step))

    def _timed_step(self, stats: Any, step: int) -> TimedStep:
        origin = stats.backward_start
        end = stats.finalize_start or origin
        return TimedStep(
            step,
            {i: t - origin for i, t in stats.ready_times.items()},
            end - origin,
            dict(self._need_s),
            self._end_s,
            # measured where nothing else ran since backward; else (a synchronize(), another model's steps) at its end
            self._start - origin if self._follows_backward else None,
            origin - max(end for end in self._ends if end <= origin),
        )


__all__ = ["ForwardTimeline"]
