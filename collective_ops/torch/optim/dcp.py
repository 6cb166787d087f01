"""The sharded optimizer's state as torch.distributed.checkpoint saves sharded state: each rank writes its own.

``get_state_dict()`` / ``get_optimizer_state_dict()`` with ``full_state_dict=False`` (DCP's default) ask for
state each rank can save without gathering it: every element-wise value (``exp_avg``, the fp32 masters) is
given as a ``ShardedTensor`` of the parameter's full shape whose local shards are this rank's pieces, as boxes
(:func:`collective_ops.bucketing.shard.layout.flat_range_boxes`: a piece is a flat range of the parameter in its memory
order), views of the optimizer's own state, so ``dcp.load`` writes into them as it writes into a plain
optimizer's tensors. DCP's planner then saves each rank's boxes and, at load, reads whatever boxes the loading
layout needs: other world sizes, and plain optimizers' full tensors, both ways.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ...bucketing.shard.layout import Box, ShardPiece, flat_range_boxes
from .._compat import (
    EnumerableShardingSpec,
    Shard,
    ShardedTensor,
    ShardedTensorMetadata,
    ShardMetadata,
    TensorProperties,
    custom_sharding_spec_op,
    sharded_tensor,
)


class CollectiveOpsPieceBoxes(EnumerableShardingSpec):
    """How the sharded optimizer's state values in DCP's state dicts are cut: each rank's pieces, as boxes. A
    class of its own so that the ops torch registers for it (below) reach these tensors only."""


@custom_sharding_spec_op(CollectiveOpsPieceBoxes, torch.Tensor.data_ptr)
def _refuse_staging(types: Any, args: Any, kwargs: Any, process_group: Any) -> None:
    """torch's ``dcp.async_save`` with its default stager copies a state dict's tensors through their storage
    (``data_ptr`` first), which a ShardedTensor does not have; its own error named neither the tensor nor a way
    out. Its ``BlockingAsyncStager`` copies ShardedTensors (their local shards, to the host) before returning."""
    raise RuntimeError(
        "this state dict holds a sharded optimizer state (collective_ops DistributedOptimizer(shard=True): each "
        "rank's shards, as ShardedTensors), which the default stager of torch.distributed.checkpoint's async_save "
        "cannot copy. Pass async_stager=torch.distributed.checkpoint.staging.BlockingAsyncStager() to async_save "
        "(it copies each rank's shards to the host before returning), save with dcp.save, or take the full state "
        "with get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))"
    )


def memory_order(p: torch.Tensor) -> list[int]:
    """``p``'s dimensions from outermost to innermost in memory (how it lies in its bucket: dense, maybe
    permuted, as channels_last); ``p.permute(order)`` is then contiguous in that layout."""
    strides = torch.empty_like(p, device="meta").stride()
    return sorted(range(p.dim()), key=lambda dim: -strides[dim])


def piece_boxes(p: torch.Tensor, piece: ShardPiece, order: list[int]) -> list[tuple[Box, list[int], list[int]]]:
    """The piece's boxes: (box in memory order, its offsets and sizes in ``p``'s own dimensions); ``order``:
    :func:`memory_order` of ``p``."""
    shape = tuple(p.shape[dim] for dim in order)
    boxes = []
    for box in flat_range_boxes(shape, piece.param_start, piece.param_end):
        offsets, sizes = [0] * p.dim(), [1] * p.dim()
        for position, dim in enumerate(order):
            offsets[dim], sizes[dim] = box.offsets[position], box.sizes[position]
        boxes.append((box, offsets, sizes))
    return boxes


def _box_view(flat: torch.Tensor, piece: ShardPiece, box: Box, order: list[int]) -> torch.Tensor:
    """The box's elements of a piece's flat values, shaped in the parameter's dimensions: a view, or for a
    parameter laid out permuted (channels_last) whose box is not contiguous so, a copy (ShardedTensor takes
    contiguous shards only; DCP's loaded values then reach the state through ``set_state_dict``)."""
    inverse = sorted(range(len(order)), key=lambda position: order[position])
    box_values = flat.narrow(0, box.start - piece.param_start, box.numel).view(box.sizes).permute(inverse)
    return box_values if box_values.is_contiguous() else box_values.contiguous()


def sharded_state_tensor(
    p: torch.Tensor,
    owners: list[tuple[int, ShardPiece]],
    local: dict[ShardPiece, torch.Tensor],
    dtype: torch.dtype,
    device: torch.device,
) -> ShardedTensor:
    """A state value of parameter ``p`` (its shape) whose shards are every owner's pieces, as boxes; this rank's
    are views of ``local`` (piece -> its flat values). Built alike on every rank from the layout, no collective."""
    rank, order = dist.get_rank(), memory_order(p)
    shards, local_shards = [], []
    for owner, piece in owners:
        for box, offsets, sizes in piece_boxes(p, piece, order):
            metadata = ShardMetadata(shard_offsets=offsets, shard_sizes=sizes, placement=f"rank:{owner}/{device}")
            shards.append(metadata)
            if owner == rank:
                local_shards.append(Shard(_box_view(local[piece], piece, box, order), metadata))
    # A rank holding none of it still needs the key: DCP's load drops a ShardedTensor with no local shard, and a
    # key missing there makes it read the checkpoint as one of torch 2.3's, failing on another key. An empty box
    # (no elements: nothing written or read) keeps it, placed past the last row: DCP's save keeps one write item
    # per offset, so at a real box's offset it would replace that box.
    for holder in sorted(set(range(dist.get_world_size())) - {owner for owner, _ in owners}):
        offsets, sizes = [p.shape[0]] + [0] * (p.dim() - 1), [0] + list(p.shape[1:])
        metadata = ShardMetadata(shard_offsets=offsets, shard_sizes=sizes, placement=f"rank:{holder}/{device}")
        shards.append(metadata)
        if holder == rank:
            local_shards.append(Shard(torch.empty(sizes, dtype=dtype, device=device), metadata))
    properties = TensorProperties(dtype=dtype, layout=torch.strided, requires_grad=False)
    metadata = ShardedTensorMetadata(shards_metadata=shards, size=p.shape, tensor_properties=properties)
    spec = CollectiveOpsPieceBoxes(shards)
    return sharded_tensor(local_shards, metadata, spec)


def piece_values(value: ShardedTensor, p: torch.Tensor, piece: ShardPiece) -> torch.Tensor:
    """A piece's flat values from a sharded state value whose local shards hold its boxes (the layout it was
    taken from, or one ``dcp.load`` filled for this optimizer)."""
    by_offsets = {tuple(shard.metadata.shard_offsets): shard for shard in value.local_shards()}
    order, parts = memory_order(p), []
    for _box, offsets, sizes in piece_boxes(p, piece, order):
        shard = by_offsets.get(tuple(offsets))
        if shard is None or list(shard.metadata.shard_sizes) != sizes:
            raise ValueError(
                "this sharded optimizer state (torch.distributed.checkpoint's, full_state_dict=False) holds other "
                "elements on this rank than its shards here: it was taken at another world size or bucket layout. "
                "Load it as DCP reshards: state = get_state_dict(model, opt); dcp.load(state, checkpoint_id=...); "
                "set_state_dict(model, opt, ...); or take it with StateDictOptions(full_state_dict=True)"
            )
        parts.append(shard.tensor.permute(order).reshape(-1))  # its elements in memory order, as the piece's
    return torch.cat(parts) if len(parts) != 1 else parts[0]


def is_sharded(value: Any) -> bool:
    return isinstance(value, ShardedTensor)


class ModelParamsGroup(dict):
    """One of the sharded optimizer's groups with the model's parameters as ``"params"``, for
    torch.distributed.checkpoint; its other keys are written through to the group."""

    def __init__(self, group: dict[str, Any], params: list[torch.Tensor]) -> None:
        super().__init__(group)
        super().__setitem__("params", list(params))
        self._group = group

    def __setitem__(self, key: str, value: Any) -> None:
        super().__setitem__(key, value)
        if key != "params":
            self._group[key] = value
