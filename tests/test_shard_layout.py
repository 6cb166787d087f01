"""The shard layout of sharded data parallel (framework-free): properties over random plans."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from collective_ops.bucketing import ParamSpec, plan_buckets
from collective_ops.bucketing.shard.layout import ShardLayout, flat_range_boxes, padded_numel


def _plan(numels: list[int], bucket_mb: float):
    specs = [ParamSpec(f"p{i}", n, "float32", "cpu", 4) for i, n in enumerate(numels)]
    return plan_buckets(specs, bucket_size_mb=bucket_mb, first_bucket_mb=bucket_mb)


plans = st.tuples(
    st.lists(st.integers(min_value=0, max_value=5000), min_size=1, max_size=30),
    st.sampled_from([0.001, 0.004, 0.02, 1.0]),
    st.integers(min_value=1, max_value=9),
)


@settings(max_examples=200, deadline=None)
@given(plans)
def test_every_element_owned_exactly_once(case):
    numels, bucket_mb, world = case
    plan = _plan(numels, bucket_mb)
    layout = ShardLayout(plan, world)
    owned = [[0] * n for n in numels]
    for rank in range(world):
        for piece in layout.pieces(rank):
            assert piece.numel > 0
            for element in range(piece.param_start, piece.param_end):
                owned[piece.param_index][element] += 1
    assert all(count == 1 for counts in owned for count in counts)


@settings(max_examples=200, deadline=None)
@given(plans)
def test_shards_equal_and_padding_only_at_bucket_ends(case):
    numels, bucket_mb, world = case
    plan = _plan(numels, bucket_mb)
    layout = ShardLayout(plan, world)
    for spec, shards in zip(plan.buckets, layout.buckets):
        assert shards.padded_numel % world == 0 and shards.shard_numel * world == shards.padded_numel
        assert spec.numel <= shards.padded_numel < spec.numel + world or spec.numel == 0
        covered = []  # (start, end) in the bucket of every piece, every rank
        for rank in range(world):
            for piece in layout.bucket_pieces(spec.index, rank):
                start = shards.shard_start(rank) + piece.shard_offset
                slot = spec.param_indices.index(piece.param_index)
                assert start == spec.offsets[slot] + piece.param_start  # the plan's offsets are kept
                assert piece.shard_offset + piece.numel <= shards.shard_numel
                covered.append((start, start + piece.numel))
        covered.sort()
        # contiguous from 0 to the parameters' end: padding only after the last parameter
        assert [c[0] for c in covered[1:]] == [c[1] for c in covered[:-1]]
        assert (covered[0][0] if covered else 0) == 0 and (covered[-1][1] if covered else 0) == spec.numel


@settings(max_examples=100, deadline=None)
@given(plans)
def test_owners_and_padding_agree_with_pieces(case):
    numels, bucket_mb, world = case
    plan = _plan(numels, bucket_mb)
    layout = ShardLayout(plan, world)
    for index, numel in enumerate(numels):
        owners = layout.owners(index)
        assert sum(piece.numel for _, piece in owners) == numel
        assert [piece.param_start for _, piece in owners] == sorted(piece.param_start for _, piece in owners)
    total_padding = sum(layout.padding(rank) for rank in range(world))
    assert total_padding == sum(b.padded_numel - b.numel for b in layout.buckets)


def test_a_pure_function_of_plan_and_world():
    plan = _plan([10, 7, 300, 1], 0.001)
    assert [ShardLayout(plan, 3).pieces(r) for r in range(3)] == [ShardLayout(plan, 3).pieces(r) for r in range(3)]


def test_bad_world_and_rank_refused():
    plan = _plan([10], 1.0)
    with pytest.raises(ValueError, match="world_size"):
        ShardLayout(plan, 0)
    with pytest.raises(ValueError, match="outside the world"):
        ShardLayout(plan, 2).pieces(2)
    assert padded_numel(0, 4) == 4 and padded_numel(9, 4) == 12


shapes_and_ranges = st.lists(st.integers(min_value=1, max_value=5), min_size=0, max_size=4).flatmap(
    lambda shape: st.tuples(
        st.just(tuple(shape)),
        st.integers(min_value=0, max_value=int(np.prod(shape))),
        st.integers(min_value=0, max_value=int(np.prod(shape))),
    )
)


@settings(max_examples=300, deadline=None)
@given(shapes_and_ranges)
def test_a_flat_range_is_tiled_by_its_boxes_in_element_order(case):
    """What a checkpoint stores by blocks (torch.distributed.checkpoint) gets for a shard piece: boxes that hold
    exactly the piece's elements, each a contiguous run of them, in order; at most 2 * ndim - 1 of them."""
    shape, a, b = case
    start, stop = min(a, b), max(a, b)
    elements = np.arange(int(np.prod(shape))).reshape(shape)
    covered = []
    boxes = flat_range_boxes(shape, start, stop)
    for box in boxes:
        block = elements[tuple(slice(o, o + n) for o, n in zip(box.offsets, box.sizes))].ravel()
        assert list(block) == list(range(box.start, box.start + box.numel)), (box, shape)
        covered += list(block)
    assert covered == list(range(start, stop))
    assert len(boxes) <= max(2 * len(shape) - 1, 1)


def test_a_range_outside_the_tensor_is_refused():
    with pytest.raises(ValueError, match="not a range"):
        flat_range_boxes((3, 4), 5, 13)
