"""Rank 0's model on every rank: the signature every rank compares at wrap (parameters, buffers, plan, options),
and the fused broadcasts of parameters and buffers."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..bucketing import fused_collective
from ..bucketing.interfaces import wait_with_timeout
from ..comm.torch_engine import dtype_name

BROADCAST_BUCKET_MB = 250.0  # as DDP: parameters and buffers are broadcast in large fused chunks


def model_signature(module: nn.Module) -> list[tuple]:
    """What every rank's model must agree on: each parameter's and buffer's name, shape and dtype."""
    signature = [
        ("parameter", n, {"shape": list(p.shape), "dtype": dtype_name(p.dtype), "requires_grad": p.requires_grad})
        for n, p in module.named_parameters()
    ]
    return signature + [
        ("buffer", n, {"shape": list(b.shape), "dtype": dtype_name(b.dtype)}) for n, b in module.named_buffers()
    ]


def broadcast_tensors(engine: Any, tensors: list[torch.Tensor], src: int = 0, group: Any = None) -> None:
    """Rank ``src``'s ``tensors`` to every rank, in few fused collectives."""
    handle, _ = fused_collective(
        engine, tensors, BROADCAST_BUCKET_MB, lambda buffer: engine.broadcast(buffer, src, async_op=True, group=group)
    )
    wait_with_timeout(handle, getattr(engine, "blocking_timeout_s", None))  # (inside engine.bounded(): its limit)


def highest_rank_where(engine: Any, condition: bool) -> int:
    """The highest rank for which ``condition`` holds (-1 if none): one small collective every rank joins."""
    return int(engine.reduce_floats([engine.rank if condition else -1], "max")[0])


def sync_buffers(engine: Any, module: nn.Module, active: bool, joining: bool, group: Any = None) -> None:
    """Rank 0's buffers (running statistics) to every rank; inside ``join()`` (``joining``) the source is the
    highest rank still ``active`` (a joined rank's buffers are stale), agreed on by one small collective that
    joined ranks shadow. Nothing where the module has no buffers."""
    buffers = list(module.buffers())
    if not buffers:
        return
    src = highest_rank_where(engine, active) if joining else 0
    with torch.no_grad():
        broadcast_tensors(engine, buffers, src, group)
