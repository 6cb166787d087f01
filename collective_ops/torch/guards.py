"""What the torch wrapper refuses, and the checks behind its refusals: parameters it cannot reduce (sparse, on
several devices, on meta), and how a parameter's storage is compared after a conversion."""

from __future__ import annotations

import torch
from torch import nn


def storage_layout(p: torch.Tensor) -> tuple:
    """What a parameter's bucket and shard views were built for: dtype, device, strides, storage."""
    return p.dtype, p.device, p.stride(), p.data_ptr()


def same_memory_order(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors of one shape lay out their elements alike (strides of size-1 dims say nothing)."""
    return all(size == 1 or x == y for size, x, y in zip(a.shape, a.stride(), b.stride()))


def refuse_unsupported(module: nn.Module, named: list[tuple[str, torch.Tensor]]) -> None:
    """Sparse gradients, parameters on several devices or on the meta device: refused before anything is
    communicated (several devices first: a model half on meta is one to move, not to materialise)."""
    devices = sorted({str(p.device) for _, p in named})
    if len(devices) > 1:
        raise ValueError(
            f"the model's trainable parameters live on {len(devices)} devices ({', '.join(devices)}); collective_ops "
            "reduces one device per process (autograd runs one hook thread per device). Move the model to one "
            "device, and launch one process per device (torchrun --nproc-per-node)."
        )
    for name, p in named:
        if p.is_meta:  # its gradients would land in the meta buckets planned for it, never averaged
            raise ValueError(
                f"parameter {name!r} is on the meta device (no storage); materialise the model first "
                "(model.to_empty(device=...), then initialise it, e.g. each module's reset_parameters()), then wrap it"
            )
        if p.is_sparse or p.layout != torch.strided:
            raise ValueError(f"parameter {name!r} is sparse; collective_ops reduces dense gradients only")
    for module_name, sub in module.named_modules():
        if isinstance(sub, (nn.Embedding, nn.EmbeddingBag)) and sub.sparse and sub.weight.requires_grad:
            raise ValueError(
                f"{module_name or 'the model'} is an {type(sub).__name__}(sparse=True): its gradient is sparse, and "
                "collective_ops reduces dense gradients only. Build it with sparse=False (collective_ops then sends "
                "only the rows the ranks looked up: row_sparse_embeddings), or freeze it (requires_grad=False)."
            )
