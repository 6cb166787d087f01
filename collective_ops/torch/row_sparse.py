"""Row-sparse embedding tables on torch: which tables' gradients are reduced by rows, and the rows each forward
looked up (the framework-free reduction is :mod:`collective_ops.bucketing.row_sparse`)."""

from __future__ import annotations

import collections
from typing import Any

import torch
from torch import nn

from ..bucketing import BucketPlan, ParamSpec, RowSparseReduction, plan_buckets
from ..comm.torch_engine import TorchEngine, dtype_name


def row_sparse_tables(
    module: nn.Module, named: list[tuple[str, torch.Tensor]], option: bool | str, engine: TorchEngine
) -> dict[str, nn.Module]:
    """name -> embedding module, for the tables whose gradients are reduced by rows (bucketing/row_sparse.py).

    ``"auto"``: the weights of ``nn.Embedding``/``nn.EmbeddingBag`` modules (``sparse=False``) on the CPU that no
    other module shares (a tied weight also gets the output layer's dense gradient); ``True``: on any
    device (not yet run on an accelerator; finding the rows synchronises the device); ``False``: none.
    """
    if option not in (True, False, "auto"):
        raise ValueError(f"row_sparse_embeddings must be True, False or 'auto', got {option!r}")
    if option is False or engine.world_size == 1:
        return {}
    owners = collections.Counter(id(p) for _, p in module.named_parameters(remove_duplicate=False))
    names = {id(p): n for n, p in named}
    tables = {}
    for sub in module.modules():
        if isinstance(sub, (nn.Embedding, nn.EmbeddingBag)) and not sub.sparse:
            weight = sub.weight
            shared = owners[id(weight)] > 1
            if id(weight) in names and not shared and (option is True or weight.device.type == "cpu"):
                tables[names[id(weight)]] = sub
    return tables


def table_rows(table: nn.Module | None) -> int:
    return 0 if table is None else table.weight.shape[0]


class LookedUpRows:
    """The rows of one embedding table its forwards looked up since the last exchange (row_sparse.LookedUpRows).

    Recorded after the module ran (its indices are checked by then), only where a gradient can follow.
    """

    def __init__(self, table: nn.Module) -> None:
        self._mask = torch.zeros(table.weight.shape[0], dtype=torch.bool, device=table.weight.device)

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        indices = kwargs.get("input", args[0] if args else None)
        if isinstance(indices, torch.Tensor) and torch.is_grad_enabled() and module.weight.requires_grad:
            self._mask.index_fill_(0, indices.reshape(-1).long(), True)  # int32 indices too, as the module takes

    def take(self) -> torch.Tensor:
        taken, self._mask = self._mask, torch.zeros_like(self._mask)
        return taken


def record_lookups(tables: dict[str, nn.Module], reduction: RowSparseReduction) -> list:
    """A forward hook on each table's module feeding ``reduction.lookups``; the hooks' handles."""
    handles = []
    for name, table in tables.items():
        looked_up = reduction.lookups[name] = LookedUpRows(table)
        handles.append(table.register_forward_hook(looked_up, with_kwargs=True))
    return handles


def plan_with_rows(
    named: list[tuple[str, torch.Tensor]], tables: dict[str, nn.Module], bucket_size_mb: float, first_bucket_mb: float
) -> BucketPlan:
    """The trainable parameters planned into buckets (a row-sparse table's rows counted, for its cost)."""
    specs = [
        ParamSpec(n, p.numel(), dtype_name(p.dtype), str(p.device), p.element_size(), rows=table_rows(tables.get(n)))
        for n, p in named
    ]
    return plan_buckets(specs, bucket_size_mb, first_bucket_mb)
