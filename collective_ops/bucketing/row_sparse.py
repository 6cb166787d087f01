"""Row-sparse buckets: an embedding table's gradient is non-zero only in the rows its batch looked up.

A batch of 640 tokens touches at most 640 rows of a 5000-row table, yet a dense allreduce sends
all 5000. A row-sparse candidate (a parameter planned with ``ParamSpec.rows``) gets a bucket of its
own, and its reduction goes in two rounds: every rank's mask of non-zero rows is all-gathered
(``rows`` bytes, on a process group of its own so it never queues behind the buckets in flight),
then only the union of those rows is allreduced. The union is the same on every rank, so every
rank sends the same collective, and each element is the same sum as in the dense allreduce (rows
outside the union are zero on every rank, and stay zero): bit-equal to it at 2 ranks.

Where the union is dense (a tied embedding whose gradient also comes from the output layer), the
bucket is allreduced densely; after ``give_up_after`` such steps in a row the mask round is no
longer paid. Every decision is taken from the union, which every rank holds: never from timing.

Where the adapter records the rows each forward looks up (``RowSparseReduction.lookups``), the masks
need not wait for the gradient: they are all-gathered as the step's first gradient arrives
(:meth:`RowSparseReduction.start_exchanges`), while backward still runs, and the table's reduction
finds its union there. A gradient can have rows no forward looked up (the weight used outside the
module, gradients kept from an earlier step): each rank checks its gradient against its own
mask, and the check travels as one more element of the rows' allreduce. Where any rank's check
failed, every rank sees it in the sum, the bucket is reduced densely instead, and the table's
masks come from its gradient from then on (:attr:`RowSparseReduction.untrusted`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Protocol

from .plan import BucketPlan, BucketSpec

logger = logging.getLogger(__name__)


class LookedUpRows(Protocol):
    """An adapter's record of the rows of one table its forwards looked up (a framework mask of ``rows``)."""

    def take(self) -> Any:
        """The rows looked up since the last call (a boolean mask); recording starts afresh."""


@dataclass(frozen=True)
class RowExchange:
    """The masks of one table's looked-up rows, all-gathered ahead of its gradient."""

    union: Any  # a handle: waiting gives the indices of the rows some rank looked up
    local: Any  # this rank's mask in that exchange: its gradient must have no row outside it


@dataclass(frozen=True)
class RowSparseBucket:
    """What a hook needs to reduce one bucket by rows: the table's shape and where the masks go."""

    name: str
    rows: int
    cols: int
    max_rows: int  # above this many rows in the union, a dense allreduce is cheaper
    mask_group: Any
    reduction: RowSparseReduction
    exchange: RowExchange | None = None  # None: the union is found from the gradient, once it is ready

    def record(self, union_rows: int) -> bool:
        """Note the union's size; True when the rows are to be sent (else the whole bucket)."""
        sparse = union_rows <= self.max_rows
        self.reduction.record(self.name, union_rows / self.rows if self.rows else 1.0, sparse)
        return sparse

    def sent_share(self) -> float:
        """The share of the bucket's bytes its last reduction sent."""
        return self.reduction.sent_share.get(self.name, 1.0)

    def distrust_lookups(self) -> None:
        """Some rank's gradient had rows its forwards did not look up: masks from the gradient from now on."""
        self.reduction.distrust(self.name)


@dataclass
class RowSparseReduction:
    """Which buckets are reduced by rows, and the rows each sent last (for stats and the trace)."""

    mask_group: Any
    max_density: float = 0.5
    give_up_after: int = 3
    dense_streak: dict[str, int] = field(default_factory=dict)
    last_density: dict[str, float] = field(default_factory=dict)  # rows in the union / rows
    sent_share: dict[str, float] = field(default_factory=dict)  # the share of bytes sent (1.0: densely)
    lookups: dict[str, LookedUpRows] = field(default_factory=dict)  # tables whose forwards record their rows
    untrusted: set[str] = field(default_factory=set)  # their lookups once missed a gradient row (every rank alike)
    exchanges: dict[str, RowExchange] = field(default_factory=dict)  # started this step, not yet reduced

    def __post_init__(self) -> None:
        if not 0.0 < self.max_density <= 1.0:
            raise ValueError(f"max_density must be in (0, 1], got {self.max_density!r}")

    def for_bucket(self, plan: BucketPlan, bucket_index: int) -> RowSparseBucket | None:
        """The row-sparse view of this bucket, or None where it is reduced densely."""
        members = plan.buckets[bucket_index].param_indices
        if len(members) != 1:
            return None
        spec = plan.params[members[0]]
        if spec.rows <= 0 or self.given_up(spec.name):
            return None
        return RowSparseBucket(
            spec.name,
            spec.rows,
            spec.numel // spec.rows,
            int(self.max_density * spec.rows),
            self.mask_group,
            self,
            self.exchanges.pop(spec.name, None),
        )

    def start_exchanges(self, engine: Any) -> None:
        """All-gather the looked-up rows of every table that records them (on every rank at the same point of
        a synchronised step: its first gradient), so each table's union is there before its gradient is."""
        self.exchanges.clear()  # an abandoned step's: launched on every rank, so the group stays in step
        for name, looked_up in self.lookups.items():
            if name not in self.untrusted and not self.given_up(name):
                local = looked_up.take()
                self.exchanges[name] = RowExchange(engine.rows_union(local, group=self.mask_group), local)

    def distrust(self, name: str) -> None:
        if name not in self.untrusted:
            logger.warning(
                "row-sparse table %r had gradient rows its forward did not look up (the weight used outside its "
                "module, or gradients kept from an earlier step); that step was reduced densely, and the rows "
                "are found from the gradient from now on",
                name,
            )
        self.untrusted.add(name)

    def shares(self, plan: BucketPlan) -> dict[int, float]:
        """parameter index -> the share of its bytes its bucket last sent (tables reduced by rows only)."""
        by_name = {spec.name: i for i, spec in enumerate(plan.params)}
        return {
            by_name[name]: share
            for name, share in self.sent_share.items()
            if name in by_name and not self.given_up(name) and share < 1.0
        }

    def given_up(self, name: str) -> bool:
        return self.dense_streak.get(name, 0) >= self.give_up_after

    def record(self, name: str, density: float, sparse: bool) -> None:
        self.last_density[name] = density
        self.sent_share[name] = density if sparse else 1.0
        self.dense_streak[name] = 0 if sparse else self.dense_streak.get(name, 0) + 1


def wire_nbytes(bucket: BucketSpec, shares: dict[int, float], itemsize: int | None = None) -> int:
    """The bytes ``bucket`` puts on the wire: all of them, or a row-sparse table's measured share (its
    mask round, ``rows`` bytes on a group of its own, left out: a latency, ~1 ms on the emulated link).
    ``itemsize``: a compressing hook's element size on the wire (None: the bucket's own)."""
    nbytes = bucket.nbytes if itemsize is None else bucket.numel * itemsize
    if len(bucket.param_indices) == 1 and bucket.param_indices[0] in shares:
        return int(nbytes * shares[bucket.param_indices[0]])
    return nbytes
