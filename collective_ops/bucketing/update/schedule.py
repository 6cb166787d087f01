"""Launch-order planning for updates overlapped with the next forward (framework-free).

Backward makes gradients ready in roughly the reverse of the order the next forward needs the
parameters: the first layers' buckets (needed first) are ready last, the last layers' (needed
last) first. Launched in ready order on one channel (collectives complete in the order they are
issued), the bucket the forward needs first queues behind every other one. ByteScheduler's
remedy, within a strict in-order launcher: send the middle of the plan as it becomes ready (it
overlaps backward), hold the rest until its turn in the forward's order. Here a candidate
order is two cuts ``(deferred, held_from)``: plan positions ``deferred .. held_from-1`` go in
ready order; the last ``n - held_from`` buckets (ready last, needed first) and the first
``deferred`` ones (ready first, needed last: their transfer can overlap most of the forward)
are held and sent in the forward's order. ``(0, n)`` is plain ready order.

:func:`plan_order` simulates every candidate on one serial channel (``cost(nbytes, queued)`` seconds
per collective, :data:`Price`) and a forward that waits, bucket by bucket, for the ones it needs, and ranks
them by the simulated step. With ``chunks`` it plans chunks instead of whole buckets (a bucket
sent as several collectives, :func:`chunked_profile`), so a large bucket can be part sent in
backward and part held. The result depends only on its inputs, so one rank plans and
broadcasts. The simulator shortlists well but cannot pick between orders a few percent apart
(its step is within ~10% on the emulated link): :class:`OrderTrial` runs the shortlist and
plan order in turn and keeps the one measured fastest.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from ..plan import chunk_bounds


@dataclass(frozen=True)
class StepProfile:
    """One step's timing per bucket, in plan order; times in seconds from the first gradient ready.

    ``forward_order``: the buckets in the order the forward first needs them (default: reverse
    plan order); ``forward_s[b]``: forward compute from bucket ``b``'s first need to the next
    bucket's (waits excluded); ``forward_start_s``: when the next forward starts (default: at
    the end of backward); ``lead_s``: the step's time outside this window, from a forward's
    end to the next backward's first gradient (loss, the last layer's backward).
    """

    ready_s: Sequence[float]  # when each bucket was full
    nbytes: Sequence[int]
    backward_end_s: float
    forward_s: Sequence[float]
    forward_order: Sequence[int] | None = None
    forward_start_s: float | None = None
    lead_s: float = 0.0

    def forward_start(self) -> float:
        """When the next forward starts (at the end of backward unless measured)."""
        return self.backward_end_s if self.forward_start_s is None else self.forward_start_s

    def needs(self) -> tuple[int, ...]:
        """The buckets in the order the forward first needs them."""
        count = len(self.ready_s)
        return tuple(self.forward_order) if self.forward_order is not None else tuple(range(count - 1, -1, -1))


@dataclass(frozen=True)
class OrderPrediction:
    order: tuple[int, ...]
    held_from: int  # plan positions from here on are held and sent in forward order
    forward_end_s: float  # when the next forward ends, from the first gradient ready
    forward_wait_s: float  # time that forward spent waiting for buckets
    deferred: int = 0  # the first ``deferred`` plan positions are held too (sent last, needed last)
    step_s: float = 0.0  # the predicted step: lead + forward end

    @property
    def is_plan_order(self) -> bool:
        return self.order == tuple(range(len(self.order)))


@dataclass(frozen=True)
class TimedStep:
    """One timed step, per parameter (any bucketing of it), in seconds from its backward's first gradient:
    when each gradient was ready, when backward ended, when the next forward first needed each parameter (on a
    clock of its compute that ends at ``forward_end_s``), when that forward started (None: not measured) and
    the lead before the backward (from a forward's end to its first gradient). ``step``: which synchronised
    step's backward it timed."""

    step: int
    ready_s: Mapping[int, float]
    backward_end_s: float
    need_s: Mapping[int, float]
    forward_end_s: float
    forward_start_s: float | None
    lead_s: float

    def profile(self, buckets: Sequence[Sequence[int]], nbytes: Sequence[int]) -> StepProfile:
        """This step as the planner sees it bucketed as ``buckets`` (:func:`step_profile`)."""
        return step_profile(
            buckets,
            nbytes,
            self.ready_s,
            self.backward_end_s,
            self.need_s,
            self.forward_end_s,
            self.forward_start_s,
            self.lead_s,
        )


def median_step(steps: Sequence[TimedStep]) -> TimedStep:
    """Each time the median over ``steps`` (a parameter's over the steps that timed it), so one slow step (a
    late thread, a noisy neighbour) does not decide the plan alone; with two steps, their mean. Order-preserving:
    times ordered alike in every step keep that order."""
    if not steps:
        raise ValueError("median_step needs at least one timed step")
    median = statistics.median

    def per_key(maps: Sequence[Mapping[int, float]]) -> dict[int, float]:
        keys = {k for m in maps for k in m}
        return {k: median([m[k] for m in maps if k in m]) for k in keys}

    starts = [s.forward_start_s for s in steps if s.forward_start_s is not None]
    return TimedStep(
        step=max(s.step for s in steps),
        ready_s=per_key([s.ready_s for s in steps]),
        backward_end_s=median([s.backward_end_s for s in steps]),
        need_s=per_key([s.need_s for s in steps]),
        forward_end_s=median([s.forward_end_s for s in steps]),
        forward_start_s=median(starts) if starts else None,
        lead_s=median([s.lead_s for s in steps]),
    )


def step_profile(
    buckets: Sequence[Sequence[int]],
    nbytes: Sequence[int],
    ready_s: Mapping[int, float],
    backward_end_s: float,
    need_s: Mapping[int, float],
    forward_end_s: float,
    forward_start_s: float | None = None,
    lead_s: float = 0.0,
) -> StepProfile:
    """A :class:`StepProfile` for any bucketing of the same step, from per-parameter times.

    ``buckets``: each bucket's parameter indices, in plan order; ``ready_s``: when each
    parameter's gradient was ready; ``need_s``: when the forward first needed each parameter
    (on a clock of forward compute that ends at ``forward_end_s``). A bucket is ready with its
    last gradient and needed with its first parameter; buckets the forward never needed are
    finished at its end. So a tuner can weigh candidate bucket sizes by the overlapped step.
    """
    count = len(buckets)
    ready = [max((ready_s.get(i, backward_end_s) for i in members), default=backward_end_s) for members in buckets]
    need = {}
    for bucket, members in enumerate(buckets):
        times = [need_s[i] for i in members if i in need_s]
        if times:
            need[bucket] = min(times)
    order = sorted(need, key=lambda b: (need[b], -b)) + [b for b in range(count - 1, -1, -1) if b not in need]
    marks = [need.get(b, forward_end_s) for b in order] + [forward_end_s]
    forward = [0.0] * count
    for position, bucket in enumerate(order):
        forward[bucket] = max(marks[position + 1] - marks[position], 0.0)
    return StepProfile(ready, list(nbytes), backward_end_s, forward, order, forward_start_s, lead_s)


def held_order(
    bucket_count: int, held_from: int, deferred: int = 0, needs: Sequence[int] | None = None
) -> tuple[int, ...]:
    """Plan positions ``deferred .. held_from-1`` in ready order, then every other bucket in ``needs`` order.

    ``needs`` (the forward's order) defaults to reverse plan order: ``held_order(4, 2, 1)`` is
    ``(1, 3, 2, 0)``.
    """
    if not 0 <= deferred <= held_from <= bucket_count:
        raise ValueError(
            f"need 0 <= deferred <= held_from <= {bucket_count}, got deferred={deferred}, held_from={held_from}"
        )
    needs = tuple(needs) if needs is not None else tuple(range(bucket_count - 1, -1, -1))
    sent = tuple(range(deferred, held_from))
    return sent + tuple(b for b in needs if not deferred <= b < held_from)


def held_cuts(count: int, max_cuts: int) -> list[tuple[int, int]]:
    """Every ``(held_from, deferred)`` pair the order planners weigh over ``count`` launch units: cuts at most
    ``max_cuts`` apart (and the end), ``deferred`` never past ``held_from``."""
    stride = -(-count // max_cuts)
    cuts = sorted(set(range(0, count + 1, stride)) | {count})
    return [(held_from, deferred) for held_from in cuts for deferred in cuts if deferred <= held_from]


def held_order_in_chunks(chunks: Sequence[int], held_from: int, deferred: int = 0) -> tuple[int, ...]:
    """:func:`held_order` over chunk positions, as a launch order: bucket ``b`` listed ``chunks[b]`` times.

    The cuts count chunks in plan order; held chunks go in the forward's order (reverse plan order,
    a bucket's chunks together). ``held_order_in_chunks([2, 1], 2, 1)`` is ``(0, 1, 0)``.
    """
    bucket_of = [bucket for bucket, count in enumerate(chunks) for _ in range(count)]
    needs = [unit for bucket in reversed(range(len(chunks))) for unit, of in enumerate(bucket_of) if of == bucket]
    return tuple(bucket_of[unit] for unit in held_order(len(bucket_of), held_from, deferred, needs))


Price = Callable[[int, bool], float]
"""Seconds for one collective of ``nbytes``; ``queued``: launched while the one before it was still on the
channel (a backend that progresses several at once, as Gloo does, overlaps its latency with that transfer:
:meth:`collective_ops.tuning.CostModel.cost`)."""


def simulate_order(order: Sequence[int], profile: StepProfile, cost: Price) -> tuple[float, float]:
    """(forward end, forward wait) for buckets launched strictly in ``order`` on one serial channel.

    A bucket launches once it is full and every bucket before it in ``order`` has launched; one
    launched while the channel is busy is priced as queued. The forward starts at
    ``profile.forward_start_s`` and needs buckets in ``profile.needs()``.
    """
    done: dict[int, float] = {}
    launched = channel_free = 0.0
    for bucket in order:
        launched = max(launched, profile.ready_s[bucket])
        start = max(launched, channel_free)
        channel_free = start + cost(profile.nbytes[bucket], launched < channel_free)
        done[bucket] = channel_free
    clock, waited = profile.forward_start(), 0.0
    for bucket in profile.needs():
        waited += max(0.0, done[bucket] - clock)
        clock = max(clock, done[bucket]) + profile.forward_s[bucket]
    return clock, waited


def step_bound(profile: StepProfile, cost: Price) -> float:
    """A step no launch order (whole buckets or chunks) beats, for the profile's compute and this channel.

    The channel carries no byte of a bucket before the bucket is ready, and at best back to back
    (every collective priced as queued) from then on: it cannot finish before the latest, over
    the buckets, of a bucket's ready time plus the time of every byte ready no earlier. After the
    last byte lands the forward still computes at least the last-needed bucket's part; the forward
    cannot end before its start plus its compute either; the lead follows. (So the link's idle
    start of backward, where little is ready, counts: ``lead + link time`` alone does not.)
    """
    by_ready = sorted(range(len(profile.ready_s)), key=lambda b: profile.ready_s[b])
    channel_end, after = 0.0, 0.0
    for bucket in reversed(by_ready):
        after += cost(profile.nbytes[bucket], True)
        channel_end = max(channel_end, profile.ready_s[bucket] + after)
    forward_end = max(
        channel_end + profile.forward_s[profile.needs()[-1]], profile.forward_start() + sum(profile.forward_s)
    )
    return profile.lead_s + forward_end


def simulate_sharded(
    profile: StepProfile,
    reduce_s: Sequence[float],
    gather_s: Sequence[float],
    order: Sequence[int] | None = None,
    held_from: int | None = None,
    deferred: int = 0,
    update_s: Sequence[float] | None = None,
) -> OrderPrediction:
    """The sharded step (ZeRO-1) of :mod:`collective_ops.torch.optim.sharded`, its reduce-scatters launched
    strictly in ``order`` (default: plan order; ``held_from``/``deferred``: the cuts it was made by).

    Each bucket's reduce-scatter (``reduce_s[b]`` seconds) launches once it is full and every one before it in
    ``order`` has launched, on one serial channel. ``step()`` starts at the end of backward: once the
    forward's first bucket's reduction lands it updates that bucket alone (``update_s[b]`` seconds each;
    default 0) and launches its all-gather; then the others, and returns once every reduction has landed and
    every update is applied. The all-gathers (``gather_s[b]``) go
    in the forward's order on the same link, after every reduce-scatter; the forward, starting as ``step()``
    returns, waits for each bucket's. ``forward_wait_s`` counts the time ``step()`` spends past backward too:
    communication left exposed, and the updates no reduction hides.
    """
    count = len(profile.ready_s)
    if not len(reduce_s) == len(gather_s) == count:
        raise ValueError("simulate_sharded needs a reduce-scatter and an all-gather time for every bucket")
    updates = [0.0] * count if update_s is None else list(update_s)
    order = tuple(range(count)) if order is None else tuple(order)
    reduced, launched, channel_free = {}, 0.0, 0.0
    for bucket in order:
        launched = max(launched, profile.ready_s[bucket])
        channel_free = max(channel_free, launched) + reduce_s[bucket]
        reduced[bucket] = channel_free
    needs = profile.needs()
    first, backward_end = needs[0], profile.backward_end_s
    first_updated = max(backward_end, reduced[first]) + updates[first]
    stepped = max(first_updated + sum(updates) - updates[first], channel_free)
    gathered, gather_free = {}, max(first_updated, channel_free)
    for bucket in needs:
        gather_free += gather_s[bucket]
        gathered[bucket] = gather_free
    clock, waited = stepped, stepped - backward_end
    for bucket in needs:
        waited += max(0.0, gathered[bucket] - clock)
        clock = max(clock, gathered[bucket]) + profile.forward_s[bucket]
    held = count if held_from is None else held_from
    return OrderPrediction(order, held, clock, waited, deferred, profile.lead_s + clock)


def chunk_counts(nbytes: Sequence[int], chunkable: Sequence[bool], chunk_bytes: int) -> list[int]:
    """How many chunks of at most about ``chunk_bytes`` each bucket is sent as (1 where not ``chunkable``)."""
    if chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
    return [max(1, -(-n // chunk_bytes)) if can else 1 for n, can in zip(nbytes, chunkable)]


def chunked_profile(profile: StepProfile, chunks: Sequence[int]) -> tuple[StepProfile, tuple[int, ...]]:
    """The same step with bucket ``b`` sent as ``chunks[b]`` collectives, and each chunk's bucket.

    Each chunk is a unit of its own for :func:`simulate_order`: ready with its bucket, with its share of
    the bytes; the forward needs a bucket's chunks together (its compute after the last of them).
    """
    if len(chunks) != len(profile.ready_s) or min(chunks, default=1) < 1:
        raise ValueError(
            f"chunks {list(chunks)} must give at least 1 chunk for each of the {len(profile.ready_s)} buckets"
        )
    units_of: list[list[int]] = []
    bucket_of: list[int] = []
    nbytes: list[int] = []
    for bucket, (size, count) in enumerate(zip(profile.nbytes, chunks)):
        units_of.append(list(range(len(bucket_of), len(bucket_of) + count)))
        bucket_of += [bucket] * count
        nbytes += [part for _, part in chunk_bounds(size, count)]  # the manager's cut, in bytes
    forward_s = [0.0] * len(bucket_of)
    needs: list[int] = []
    for bucket in profile.needs():
        needs += units_of[bucket]
        forward_s[units_of[bucket][-1]] = profile.forward_s[bucket]
    ready_s = [profile.ready_s[b] for b in bucket_of]
    units = StepProfile(
        ready_s, nbytes, profile.backward_end_s, forward_s, needs, profile.forward_start_s, profile.lead_s
    )
    return units, tuple(bucket_of)


def best_first(predictions: Sequence[OrderPrediction]) -> list[OrderPrediction]:
    """Shortest simulated step first; ties: the fewest units held."""
    return sorted(predictions, key=lambda p: (round(p.step_s, 6), p.deferred - p.held_from))


def plan_order(
    profile: StepProfile, cost: Price, max_cuts: int = 48, chunks: Sequence[int] | None = None
) -> list[OrderPrediction]:
    """Every ``(deferred, held_from)`` order, best first (ties: the fewest buckets held).

    With more than ``max_cuts`` buckets the cuts are taken on an even grid of about
    ``max_cuts`` positions (the candidates grow with its square, each simulated in O(n)).
    With ``chunks`` (per bucket, :func:`chunk_counts`) the cuts fall between chunks, and each
    order lists a bucket once per chunk (a launch order for ``BucketManager.set_launch_order``).
    """
    count = len(profile.ready_s)
    if not (len(profile.nbytes) == len(profile.forward_s) == count and count > 0):
        raise ValueError("a step profile needs ready time, bytes and forward time for every bucket")
    if sorted(profile.needs()) != list(range(count)):
        raise ValueError(f"forward_order {profile.forward_order} is not a permutation of the {count} buckets")
    bucket_of = tuple(range(count))
    if chunks is not None:
        profile, bucket_of = chunked_profile(profile, chunks)
        count = len(bucket_of)
    out = []
    for held_from, deferred in held_cuts(count, max_cuts):
        units = held_order(count, held_from, deferred, profile.needs())
        forward_end, waited = simulate_order(units, profile, cost)
        order = tuple(bucket_of[u] for u in units)
        out.append(OrderPrediction(order, held_from, forward_end, waited, deferred, profile.lead_s + forward_end))
    return best_first(out)


@dataclass
class OrderTrial:
    """Launch orders run in turn, ``block`` steps each, ``rounds`` times round-robin; the fastest kept.

    ``orders[0]`` is the baseline (the DistributedOptimizer's: plan order with every bucket
    finished in backward), the rest the candidates (plan order overlapped, the simulator's
    shortlist); the caller says what else each entry means. The caller records every step
    (``record``: its time, this rank's) and sets ``orders[current]`` before the next one; which
    entry runs depends only on the count of steps, so it is the same on every rank. Once
    ``done``, ``pick`` takes the medians (reduced over ranks by the caller, so every rank picks
    alike) and returns the index of the shortest, if it beats the baseline by more than a margin.
    """

    orders: tuple[tuple[int, ...], ...]
    block: int = 3
    rounds: int = 2
    seconds: list[list[float]] = field(default_factory=list)
    steps: int = 0

    def __post_init__(self) -> None:
        if len(self.orders) < 2 or self.block < 1 or self.rounds < 1:
            raise ValueError("an order trial needs plan order and at least one other, block >= 1 and rounds >= 1")
        self.seconds = [[] for _ in self.orders]

    @property
    def current(self) -> int:
        """The index of the order the next step runs."""
        return (self.steps // self.block) % len(self.orders)

    @property
    def done(self) -> bool:
        return self.steps >= self.block * self.rounds * len(self.orders)

    def record(self, seconds: float) -> None:
        """The step just run (under ``orders[current]``) took ``seconds``."""
        if self.done:
            raise RuntimeError("the order trial is over")
        self.seconds[self.current].append(seconds)
        self.steps += 1

    def medians(self) -> list[float]:
        return [statistics.median(times) for times in self.seconds]

    @staticmethod
    def pick(medians: Sequence[float], margin: float = 0.02) -> int:
        """The shortest median's index; the baseline (0) unless another is shorter by more than ``margin``.

        The margin is the noise of a few steps' median (loopback Gloo, where overlap gains nothing: a held
        order measured 1% faster in its trial ran 3% slower in the race after it)."""
        best = min(range(len(medians)), key=lambda i: (medians[i], i))
        return best if medians[best] < medians[0] * (1.0 - margin) else 0
