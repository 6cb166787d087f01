"""Shard layout: which rank owns which elements of each bucket (sharded data parallel, ZeRO-1).

Framework-free. Every bucket's flat buffer is padded to a multiple of the world size and cut
into equal contiguous shards, rank ``r`` owning ``[r * shard, (r + 1) * shard)``, as in
Megatron-core's distributed optimizer. A shard boundary may split a parameter: each rank
holds a :class:`ShardPiece` for every parameter (part) inside its shard, and runs the
optimizer on those pieces only. Padding lies only at a bucket's end, never between its
parameters, so a bucket's parameters keep the offsets the plan gave them.

The layout is a pure function of the plan and the world size: every rank that holds the same
plan (checked at wrap) computes the same layout without communicating.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

from ..plan import BucketPlan


@dataclass(frozen=True)
class ShardPiece:
    """The part of one parameter inside one rank's shard of its bucket."""

    param_index: int
    bucket: int
    param_start: int  # first element of the parameter (flattened) in the piece
    numel: int
    shard_offset: int  # where the piece starts inside the rank's shard

    @property
    def param_end(self) -> int:
        return self.param_start + self.numel


@dataclass(frozen=True)
class BucketShards:
    """One bucket cut into ``world_size`` equal shards (the last ones may hold padding)."""

    bucket: int
    numel: int  # the parameters' elements
    padded_numel: int  # a multiple of the world size
    shard_numel: int

    def shard_start(self, rank: int) -> int:
        return rank * self.shard_numel


def padded_numel(numel: int, world_size: int) -> int:
    """``numel`` rounded up to a multiple of ``world_size`` (at least one element per rank)."""
    return max(-(-numel // world_size), 1) * world_size


class ShardLayout:
    """The shards of every bucket of ``plan`` over ``world_size`` ranks."""

    def __init__(self, plan: BucketPlan, world_size: int) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.plan = plan
        self.world_size = world_size
        self.buckets = tuple(
            BucketShards(
                b.index, b.numel, padded_numel(b.numel, world_size), padded_numel(b.numel, world_size) // world_size
            )
            for b in plan.buckets
        )

    def pieces(self, rank: int) -> list[ShardPiece]:
        """Rank ``rank``'s pieces, bucket by bucket, in buffer order."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside the world of {self.world_size}")
        return [piece for bucket in range(len(self.buckets)) for piece in self.bucket_pieces(bucket, rank)]

    def bucket_pieces(self, bucket: int, rank: int) -> list[ShardPiece]:
        """Rank ``rank``'s pieces of one bucket, in buffer order."""
        shards = self.buckets[bucket]
        spec = self.plan.buckets[bucket]
        start, end = shards.shard_start(rank), shards.shard_start(rank) + shards.shard_numel
        pieces = []
        for param_index, offset in zip(spec.param_indices, spec.offsets):
            numel = self.plan.params[param_index].numel
            lo, hi = max(offset, start), min(offset + numel, end)
            if lo < hi:
                pieces.append(ShardPiece(param_index, bucket, lo - offset, hi - lo, lo - start))
        return pieces

    def owners(self, param_index: int) -> list[tuple[int, ShardPiece]]:
        """Every (rank, piece) holding part of parameter ``param_index``, in element order."""
        bucket, _slot = self.plan.location[param_index]
        return [
            (rank, piece)
            for rank in range(self.world_size)
            for piece in self.bucket_pieces(bucket, rank)
            if piece.param_index == param_index
        ]

    def padding(self, rank: int) -> int:
        """Elements of rank ``rank``'s shards that hold no parameter."""
        total = sum(b.shard_numel for b in self.buckets)
        return total - sum(p.numel for p in self.pieces(rank))


@dataclass(frozen=True)
class Box:
    """A rectangular block of a tensor: ``sizes`` elements per dimension from ``offsets``, holding the elements
    ``[start, start + numel)`` of the tensor flattened in row-major order (a box of a flat range is contiguous)."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    start: int

    @property
    def numel(self) -> int:
        return prod(self.sizes)


def flat_range_boxes(shape: tuple[int, ...], start: int, stop: int) -> list[Box]:
    """The elements ``[start, stop)`` of a row-major tensor of ``shape`` as boxes, in element order: a partial
    first row, whole rows, a partial last row, each partial row split the same way one dimension down (at most
    ``2 * len(shape) - 1`` boxes). A shard piece is a flat range of its parameter; checkpoint formats that store
    tensors by blocks (torch.distributed.checkpoint) take it as these boxes."""
    shape = tuple(shape)
    if not 0 <= start <= stop <= prod(shape):
        raise ValueError(f"[{start}, {stop}) is not a range of the {prod(shape)} elements of shape {shape}")
    return _boxes(shape, start, stop)


def _boxes(shape: tuple[int, ...], start: int, stop: int) -> list[Box]:
    if start == stop:
        return []
    if not shape:
        return [Box((), (), start)]  # a 0-d tensor's one element
    row = prod(shape[1:])
    first, last = start // row, stop // row  # the first row touched; the row where the range ends
    boxes = []
    if start % row:  # a partial first row
        end = min(stop, (first + 1) * row)
        boxes += _in_row(shape, first, start, end)
        first += 1
        if end == stop:
            return boxes
    if last > first:
        boxes.append(Box((first,) + (0,) * (len(shape) - 1), (last - first,) + shape[1:], first * row))
    if stop % row:
        boxes += _in_row(shape, last, last * row, stop)
    return boxes


def _in_row(shape: tuple[int, ...], row: int, start: int, stop: int) -> list[Box]:
    """The boxes of ``[start, stop)``, which lies inside row ``row`` of dimension 0."""
    base = row * prod(shape[1:])
    return [
        Box((row,) + box.offsets, (1,) + box.sizes, base + box.start)
        for box in _boxes(shape[1:], start - base, stop - base)
    ]
