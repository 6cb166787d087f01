"""The sharded step sequence (ZeRO-1), framework-free: reduce-scatter -> update -> all-gather, per bucket.

Gradients are reduce-scattered per bucket in backward; ``step()`` updates each bucket's shard once its
reduction has landed, and launches the all-gathers of the updated shards in one fixed order (the
reverse of the plan: the buckets the next forward needs first), each once every bucket before it in
that order is updated. How far the all-gathers get before the next forward depends on timing, never
their order, so every rank issues them alike. :class:`ShardStep` keeps that bookkeeping: the gather
order, how far it got, the all-gathers in flight, and which reduction the last step consumed; the
optimizer issues the collectives and applies the updates.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from ..update.schedule import OrderPrediction, StepProfile, best_first, held_cuts, held_order, simulate_sharded


def reduction_of(steps_synced: int, deferred_pending: bool) -> int:
    """The number of the model's synchronised step whose gradients are (being) reduced."""
    return steps_synced + (1 if deferred_pending else 0)


class ShardStep:
    """One model's sharded step bookkeeping over ``bucket_count`` buckets."""

    def __init__(self, bucket_count: int = 0) -> None:
        self.gather_order: list[int] = []
        self.next_gather = 0  # position in the gather order
        self.gathers: dict[int, Any] = {}  # bucket -> all-gather in flight (its handle)
        self.steps_applied = 0  # the model's synchronised step whose gradients were last applied
        self.lay_out(bucket_count)

    def lay_out(self, bucket_count: int) -> None:
        """A new bucket plan: the forward needs the last buckets first, so they are gathered first."""
        self.gather_order = list(reversed(range(bucket_count)))

    def consumed(self, reduction: int) -> bool:
        """True where a step (or a skip) already consumed the gradients of ``reduction``."""
        return self.steps_applied == reduction

    def start(self, reduction: int) -> None:
        """``step()`` consumes ``reduction``'s gradients: every all-gather of its updates is still to launch."""
        self.steps_applied = reduction
        self.next_gather = 0

    def skip(self, reduction: int) -> None:
        """``reduction``'s gradients are consumed without a step (skipped, dropped)."""
        self.steps_applied = reduction

    def regather(self) -> None:
        """Every bucket's all-gather to launch again (a step on cleared gradients rewrote the shards)."""
        self.next_gather = 0

    def to_update(self, block: bool, until: int | None, deferred: bool, ready: Callable[[int], bool]) -> list[int]:
        """The buckets to update now, in the gather order: those whose reduction landed (``ready``; all where
        nothing is ``deferred``) and, with ``block``, every bucket up to ``until`` in the gather order (all: None)."""
        stop = len(self.gather_order) if until is None else self.gather_order.index(until) + 1
        return [
            bucket
            for position, bucket in enumerate(self.gather_order)
            if (block and position < stop) or not deferred or ready(bucket)
        ]

    def first_to_gather(self) -> int | None:
        """The gather order's next bucket (None: every all-gather launched). At ``step()`` it is updated alone,
        and its all-gather launched, before any other bucket's update: it is the next forward's first, and the
        others' updates then run while it is on the wire (updated first, they held it back by all their time)."""
        return self.gather_order[self.next_gather] if self.next_gather < len(self.gather_order) else None

    def next_to_gather(self, update_owed: Callable[[int], bool]) -> int | None:
        """The next bucket whose all-gather may launch: the gather order's next, once its update is applied
        (None: all launched, or the next still owes its update)."""
        if self.next_gather >= len(self.gather_order):
            return None
        bucket = self.gather_order[self.next_gather]
        return None if update_owed(bucket) else bucket

    def launched(self, bucket: int, handle: Any) -> None:
        """The all-gather of ``bucket`` (the one :meth:`next_to_gather` named) is in flight."""
        self.gathers[bucket] = handle
        self.next_gather += 1

    def take_gather(self, bucket: int) -> Any:
        """The all-gather of ``bucket`` in flight (None: none), no longer tracked: the caller waits for it."""
        return self.gathers.pop(bucket, None)

    def ungathered(self, bucket: int) -> bool:
        """True while the all-gather of ``bucket`` is still to launch in this step's gather order."""
        return bucket in self.gather_order[self.next_gather :]

    def read_order(self, buckets: Iterable[int]) -> list[int]:
        """``buckets`` in the gather order: a forward waits for them as they were launched."""
        return sorted(buckets, key=self.gather_order.index)

    def owed(self, updates_owed: Iterable[int], reduction: int) -> list[int]:
        """Buckets whose update or all-gather (in flight, or not launched yet) this step still owes."""
        owed = set(updates_owed) | set(self.gathers)
        if self.consumed(reduction):
            owed |= set(self.gather_order[self.next_gather :])
        return sorted(owed)

    def write_owed(self, bucket: int, update_owed: bool, reduction: int) -> bool:
        """``bucket`` is among :meth:`owed` (without listing them: asked once per parameter read)."""
        if update_owed or bucket in self.gathers:
            return True
        return self.consumed(reduction) and self.ungathered(bucket)


def sharded_costs(
    profile: StepProfile,
    plan: Any,
    shares: Mapping[int, float],
    wire: str | None,
    cost: Callable[..., float],
    itemsize: Callable[[str], int],
) -> tuple[list[float], list[float]]:
    """Each bucket's reduce-scatter and all-gather seconds for :func:`simulate_sharded`.

    A reduce-scatter or all-gather of a bucket of X bytes sends (N-1)/N of X per rank, what an allreduce
    of X/2 sends: each costs the fitted allreduce cost of X/2 (``cost(nbytes, queued=...)``; a row-sparse
    table's rows, ``shares``, are allreduced), with the queued latency for all but the first of each kind: the
    all-gathers go back to back at ``step()``, and the reduce-scatters of a communication-bound step queue
    behind each other. ``wire``: the dtype gradients are reduced in (None: the buckets'); ``itemsize``: a
    dtype name's bytes per element."""
    reduce_s, gather_s = [], []
    first_gathered = profile.needs()[0]
    for index, (bucket, sent) in enumerate(zip(plan.buckets, profile.nbytes)):
        ratio = itemsize(wire or bucket.dtype) / itemsize(bucket.dtype)  # bytes on the wire per byte
        by_rows = len(bucket.param_indices) == 1 and bucket.param_indices[0] in shares
        reduced = int(sent * ratio) if by_rows else int(bucket.nbytes * ratio / 2)
        reduce_s.append(cost(reduced, queued=index > 0))
        gather_s.append(cost(bucket.nbytes // 2, queued=index != first_gathered))
    return reduce_s, gather_s


def update_shares(plan: Any, update_s: float) -> list[float]:
    """``update_s`` (the seconds a step's updates took, every bucket's) split over ``plan``'s buckets by their
    elements: what :func:`simulate_sharded` charges ``step()`` per bucket (an elementwise optimizer's work)."""
    if not update_s:
        return [0.0] * len(plan.buckets)
    total = sum(bucket.numel for bucket in plan.buckets)
    return [update_s * bucket.numel / total for bucket in plan.buckets]


def sharded_prediction(profile: StepProfile, *priced: Any, update_s: float = 0.0) -> OrderPrediction:
    """The sharded step simulated for a plan in plan order, from the timed step's ``profile``; ``priced``:
    the plan and the rest of :func:`sharded_costs`'s arguments; ``update_s``: the step's update seconds."""
    return simulate_sharded(profile, *sharded_costs(profile, *priced), update_s=update_shares(priced[0], update_s))


def sharded_score(profile: StepProfile, *priced: Any, planned: bool, update_s: float = 0.0) -> OrderPrediction:
    """The online tune's score of a plan: the best reduce-scatter order's simulated step (``planned``:
    ``schedule="auto"``), else plan order's."""
    if planned:
        return sharded_orders(profile, *priced, update_s=update_s)[0]
    return sharded_prediction(profile, *priced, update_s=update_s)


def sharded_orders(
    profile: StepProfile, *priced: Any, max_cuts: int = 48, update_s: float = 0.0
) -> list[OrderPrediction]:
    """Every ``(deferred, held_from)`` reduce-scatter launch order (:func:`held_order`, as ``plan_order``
    weighs allreduce orders) of the sharded step simulated, best first (ties: the fewest buckets held).

    Whole buckets only: a bucket's reduce-scatter is one collective whichever order launches it, so every
    order sums alike at any world size (the weights never depend on which order a timed trial keeps)."""
    reduce_s, gather_s = sharded_costs(profile, *priced)
    updates = update_shares(priced[0], update_s)
    count = len(profile.ready_s)
    out = []
    for held_from, deferred in held_cuts(count, max_cuts):
        order = held_order(count, held_from, deferred, profile.needs())
        out.append(simulate_sharded(profile, reduce_s, gather_s, order, held_from, deferred, updates))
    return best_first(out)


__all__ = [
    "ShardStep",
    "reduction_of",
    "sharded_costs",
    "sharded_orders",
    "sharded_prediction",
    "sharded_score",
    "update_shares",
]
