"""Gradients after their reduction: cleared as torch's ``zero_grad`` clears them; and, held in shards
(``shard=True``), what is computed from them across ranks.

Sharded, each rank holds the averaged gradient only in its own shard of every bucket, bound to its
pieces' ``.grad``; a global norm, a non-finite check or the whole gradients need every rank's shards.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ...bucketing.interfaces import wait_with_timeout
from ...bucketing.shard.layout import ShardPiece


def clear_grad(p: torch.Tensor, set_to_none: bool) -> None:
    """``p``'s gradient cleared as ``torch.optim.Optimizer.zero_grad`` clears it."""
    if p.grad is None:
        return
    if set_to_none:
        p.grad = None
    else:  # as torch.optim.Optimizer.zero_grad: a gradient that is a bucket view cannot be detached in place
        if p.grad.grad_fn is not None:
            p.grad.detach_()
        else:
            p.grad.requires_grad_(False)
        p.grad.zero_()


def clip_norm_(grads: list[torch.Tensor], max_norm: float, norm_type: float) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_``'s arithmetic on gradient tensors themselves (main gradients, which no
    ``p.grad`` holds): the total norm, returned, and each scaled in place by ``max_norm / (norm + 1e-6)`` where
    that is below 1."""
    norm_type = float(norm_type)
    if not grads:
        return torch.zeros(())
    norms = torch.stack([torch.linalg.vector_norm(g, norm_type) for g in grads])
    total = torch.linalg.vector_norm(norms, norm_type)
    coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coefficient.to(g.dtype))
    return total


def clip_global_norm_(grads: list[torch.Tensor], max_norm: float, norm_type: float, device: Any) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` over every rank's ``grads`` (this rank's shards; one small allreduce):
    the global norm, returned, and each gradient scaled in place. Equal to torch's up to summation order (each
    rank sums its shards first)."""
    norm_type = float(norm_type)
    if grads:
        norms = torch.stack([torch.linalg.vector_norm(g, norm_type) for g in grads])
        local = norms.max() if norm_type == float("inf") else norms.pow(norm_type).sum()
    else:
        local = torch.zeros((), device=device)
    total = local.to(torch.float32).reshape(1).clone()
    op = dist.ReduceOp.MAX if norm_type == float("inf") else dist.ReduceOp.SUM
    dist.all_reduce(total, op=op)
    total = total[0] if norm_type == float("inf") else total[0].pow(1.0 / norm_type)
    coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coefficient.to(g.dtype))
    return total


def nonfinite_params(pieces: list[tuple[ShardPiece, torch.Tensor]], count: int, device: Any) -> list[int]:
    """The parameters (indices of ``count``) whose averaged gradient holds a NaN or Inf on any rank: each rank
    flags those its pieces found (one small allreduce)."""
    flags = torch.zeros(count, dtype=torch.int32, device=device)
    for piece, tensor in pieces:
        if tensor.grad is not None and not bool(torch.isfinite(tensor.grad).all()):
            flags[piece.param_index] = 1
    if dist.get_world_size() > 1:
        dist.all_reduce(flags)
    return flags.nonzero().flatten().tolist()


def gather_gradients_whole(
    manager: Any, engine: Any, bucket_pieces: list[list[tuple[ShardPiece, torch.Tensor]]], group: Any
) -> None:
    """Gradients bound to the pieces (``param_groups`` read, GradScaler's unscale in place) written back into
    this rank's shard of the buffers and unbound (step() binds them again, with any change made meanwhile);
    then every bucket's shard all-gathered on ``group`` (the all-gathers' own), so every buffer holds them whole."""
    handles = []
    for bucket, buffer in enumerate(manager.buffers):
        source = engine.shard_of(buffer)
        for piece, tensor in bucket_pieces[bucket]:
            if tensor.grad is not None:
                source.narrow(0, piece.shard_offset, piece.numel).copy_(tensor.grad)
                tensor.grad = None
        handles.append(engine.all_gather_shard(buffer, async_op=True, group=group))
    for bucket, handle in enumerate(handles):
        try:
            wait_with_timeout(handle, manager.stall_timeout_s)
        except Exception as exc:
            raise manager.explain_failure(bucket, exc, "the all-gather of averaged gradients") from exc
