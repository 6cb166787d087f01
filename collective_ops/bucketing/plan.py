"""Bucket planning: which parameters share a fused buffer, and in what launch order.

Framework-free: parameters are described by :class:`ParamSpec` (name, element count,
dtype name, device name, element size). The plan is a pure function of its inputs,
so every rank that feeds it the same inputs gets the same plan; its fingerprint lets
ranks check that cheaply.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

MIB = 1 << 20


@dataclass(frozen=True)
class ParamSpec:
    """What the planner needs to know of one trainable parameter."""

    name: str
    numel: int
    dtype: str
    device: str
    itemsize: int
    # The row count of a table whose gradient may be row-sparse (an embedding): such a parameter gets a
    # bucket of its own, reduced by rows (bucketing/row_sparse.py). 0: a dense gradient.
    rows: int = 0

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize


@dataclass(frozen=True)
class BucketSpec:
    """One bucket: parameters (indices into the plan's params) and their offsets in the flat buffer."""

    index: int
    dtype: str
    device: str
    param_indices: tuple[int, ...]
    offsets: tuple[int, ...]
    numel: int
    nbytes: int


@dataclass(frozen=True)
class BucketPlan:
    params: tuple[ParamSpec, ...]
    buckets: tuple[BucketSpec, ...]
    bucket_size_mb: float
    first_bucket_mb: float
    order: tuple[int, ...]  # the ready order the plan was built from
    # param index -> (bucket index, position inside the bucket)
    location: dict[int, tuple[int, int]] = field(compare=False, repr=False, default_factory=dict)

    def describe(self) -> str:
        total = sum(b.nbytes for b in self.buckets)
        lines = [
            f"BucketPlan: {len(self.buckets)} bucket(s), {len(self.params)} parameter(s), "
            f"{total / MIB:.2f} MiB (bucket_size_mb={self.bucket_size_mb:g}, "
            f"first_bucket_mb={self.first_bucket_mb:g}, fingerprint {self.fingerprint()[:12]})"
        ]
        for bucket in self.buckets:
            names = ", ".join(self.params[i].name for i in bucket.param_indices)
            lines.append(
                f"  bucket {bucket.index}: {bucket.nbytes / MIB:8.3f} MiB  {bucket.dtype:<9} "
                f"{bucket.device:<7} {len(bucket.param_indices):4d} param(s): {names}"
            )
        return "\n".join(lines)

    def fingerprint(self) -> str:
        """A hash of everything that must agree across ranks (params, grouping, order).

        Devices enter by type only: on a multi-GPU node rank 1's ``cuda:1`` plays the part of
        rank 0's ``cuda:0``, and the plans must hash alike.
        """
        payload = {
            "params": [[p.name, p.numel, p.dtype, device_type(p.device), p.itemsize, p.rows] for p in self.params],
            "buckets": [list(b.param_indices) for b in self.buckets],
        }
        return hashlib.sha256(json.dumps(payload, separators=(",", ":")).encode()).hexdigest()

    def same_as(self, other: BucketPlan) -> bool:
        """The same buckets (:meth:`fingerprint`) planned with the same size settings."""
        settings = (self.bucket_size_mb, self.first_bucket_mb, self.fingerprint())
        return settings == (other.bucket_size_mb, other.first_bucket_mb, other.fingerprint())

    def rebuild(self, observed_order: Sequence[int]) -> BucketPlan:
        """A new plan from the order gradients actually became ready.

        Parameters never observed (unused this iteration) keep their relative place after
        the observed ones, in reverse registration order.
        """
        return plan_buckets(
            self.params,
            bucket_size_mb=self.bucket_size_mb,
            first_bucket_mb=self.first_bucket_mb,
            order=complete_order(observed_order, len(self.params)),
        )


def device_type(device: str) -> str:
    """``"cuda:1"`` -> ``"cuda"``: the part of a device name that is the same on every rank."""
    return device.split(":", 1)[0]


def complete_order(observed: Sequence[int], num_params: int) -> list[int]:
    """``observed`` (deduplicated, validated) followed by the missing indices, reversed."""
    seen: set[int] = set()
    order: list[int] = []
    for index in observed:
        if not isinstance(index, int) or not 0 <= index < num_params:
            raise ValueError(f"observed order holds {index!r}, not a parameter index in [0, {num_params})")
        if index not in seen:
            seen.add(index)
            order.append(index)
    order.extend(i for i in reversed(range(num_params)) if i not in seen)
    return order


def chunk_bounds(numel: int, chunks: int) -> list[tuple[int, int]]:
    """(start, numel) of each of ``chunks`` contiguous, near-equal slices of a bucket of ``numel`` elements."""
    if not 1 <= chunks <= max(numel, 1):
        raise ValueError(f"cannot cut {numel} elements into {chunks} chunks")
    edges = [numel * k // chunks for k in range(chunks + 1)]
    return [(edges[k], edges[k + 1] - edges[k]) for k in range(chunks)]


# The default bucket size (MiB), DDP's: written here once, the lowest layer that takes it; the options
# (collective_ops.options.WrapOptions) and every signature that takes a bucket size refer to it.
DEFAULT_BUCKET_MB = 25.0
# The first bucket's default (MiB), DDP's: a small first bucket starts communication early in backward.
DEFAULT_FIRST_BUCKET_MB = 1.0


def validate_bucket_mb(value: float, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{what} must be a number of MiB (e.g. 25), got {value!r}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{what} must be a positive, finite number of MiB (e.g. 25), got {value!r}")
    if value > 1 << 20:  # 1 TiB: no device holds a bucket that size; a unit mix-up (bytes for MiB?)
        raise ValueError(f"{what}={value!r} MiB is absurdly large; it is in MiB, not bytes (try 25)")
    return float(value)


def plan_buckets(
    params: Sequence[ParamSpec],
    bucket_size_mb: float = DEFAULT_BUCKET_MB,
    first_bucket_mb: float = DEFAULT_FIRST_BUCKET_MB,
    order: Sequence[int] | None = None,
) -> BucketPlan:
    """Group ``params`` into buckets.

    ``order`` is the expected ready order (indices into ``params``); by default the
    reverse of registration order, since backward produces the last layer's gradients
    first. Buckets never mix dtype or device, close once they reach their cap (the first
    bucket of each dtype/device uses ``first_bucket_mb`` so communication starts early),
    never exceed it unless they hold a single oversized parameter, and are numbered in
    the order their first parameter is expected to become ready.
    """
    bucket_size_mb = validate_bucket_mb(bucket_size_mb, "bucket_size_mb")
    first_bucket_mb = validate_bucket_mb(first_bucket_mb, "first_bucket_mb")
    params = tuple(params)
    if not params:
        raise ValueError("nothing to plan: no trainable parameters were given")
    names = [p.name for p in params]
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise ValueError(f"parameter name {dup!r} appears twice; each parameter must be listed once")
    for p in params:
        if p.numel < 0 or p.itemsize <= 0:
            raise ValueError(f"parameter {p.name!r} has numel={p.numel}, itemsize={p.itemsize}")
        if p.rows < 0 or (p.rows and p.numel % p.rows):
            raise ValueError(f"parameter {p.name!r}: rows={p.rows} does not divide numel={p.numel}")
    order = list(range(len(params)))[::-1] if order is None else complete_order(order, len(params))
    if len(order) != len(params):
        raise ValueError("order must list every parameter exactly once")

    bucket_cap = int(bucket_size_mb * MIB)
    first_cap = min(int(first_bucket_mb * MIB), bucket_cap)
    open_buckets: dict[tuple[str, str], list[int]] = {}
    open_bytes: dict[tuple[str, str], int] = {}
    closed_per_key: dict[tuple[str, str], int] = {}
    groups: list[list[int]] = []

    def close(key: tuple[str, str]) -> None:
        members = open_buckets.pop(key, None)
        if members:
            groups.append(members)
            closed_per_key[key] = closed_per_key.get(key, 0) + 1
        open_bytes.pop(key, None)

    for index in order:
        p = params[index]
        if p.rows:
            groups.append([index])
            continue
        key = (p.dtype, p.device)
        cap = first_cap if closed_per_key.get(key, 0) == 0 else bucket_cap
        if open_buckets.get(key) and open_bytes[key] + p.nbytes > cap:
            close(key)
            cap = bucket_cap
        open_buckets.setdefault(key, []).append(index)
        open_bytes[key] = open_bytes.get(key, 0) + p.nbytes
        if open_bytes[key] >= cap:
            close(key)
    for key in list(open_buckets):
        close(key)

    position = {index: pos for pos, index in enumerate(order)}
    groups.sort(key=lambda members: position[members[0]])
    buckets = []
    location: dict[int, tuple[int, int]] = {}
    for bucket_index, members in enumerate(groups):
        offsets, numel = [], 0
        for slot, index in enumerate(members):
            offsets.append(numel)
            numel += params[index].numel
            location[index] = (bucket_index, slot)
        first = params[members[0]]
        buckets.append(
            BucketSpec(
                index=bucket_index,
                dtype=first.dtype,
                device=first.device,
                param_indices=tuple(members),
                offsets=tuple(offsets),
                numel=numel,
                nbytes=numel * first.itemsize,
            )
        )
    return BucketPlan(
        params=params,
        buckets=tuple(buckets),
        bucket_size_mb=bucket_size_mb,
        first_bucket_mb=first_bucket_mb,
        order=tuple(order),
        location=location,
    )


def chunk_counts(order: tuple[int, ...], plan: BucketPlan, chunkable: Callable[[int], bool]) -> list[int]:
    """How many chunks launch order ``order`` sends each bucket of ``plan`` as; ValueError where it cannot be a
    launch order (a bucket missing or unknown, or cut where ``chunkable(bucket)`` says it may not be)."""
    count = len(plan.buckets)
    chunks = [0] * count
    for bucket in order:
        if not 0 <= bucket < count:
            raise ValueError(f"launch order {order} names bucket {bucket}; the plan has buckets 0..{count - 1}")
        chunks[bucket] += 1
    missing = [b for b, k in enumerate(chunks) if k == 0]
    if missing:
        raise ValueError(f"launch order {order} does not list bucket(s) {missing}: list each of the {count} buckets")
    unsplittable = [b for b, k in enumerate(chunks) if k > 1 and not chunkable(b)]
    if unsplittable:
        raise ValueError(
            f"launch order {order} lists bucket(s) {unsplittable} more than once, i.e. sends them in chunks; "
            "only dense buckets reduced by the default allreduce hook can be (not a row-sparse table, a "
            "custom or compressing hook, or an engine that assembles buckets): list them once"
        )
    too_many = [b for b, k in enumerate(chunks) if k > plan.buckets[b].numel]
    if too_many:
        raise ValueError(f"launch order {order} cuts bucket(s) {too_many} into more chunks than elements")
    return chunks
