"""Reduction operators by name, shared by every engine (framework-free)."""

from __future__ import annotations

from typing import Any, Literal

ReduceOpName = Literal["sum", "avg", "max", "min", "prod"]
REDUCE_OPS: tuple[str, ...] = ("sum", "avg", "max", "min", "prod")

_ALIASES = {"product": "prod", "mean": "avg", "average": "avg"}


def parse_reduce_op(op: Any) -> str:
    """Normalise ``op`` (a name, or an enum such as ``torch.distributed.ReduceOp.SUM``).

    Raises ``ValueError`` naming the accepted operators for anything else.
    """
    name = getattr(op, "name", op)  # torch ReduceOp members and Python enums carry .name
    if isinstance(name, str):
        key = name.strip().lower()
        key = _ALIASES.get(key, key)
        if key in REDUCE_OPS:
            return key
    raise ValueError(
        f"unknown reduce op {op!r}; use one of {', '.join(REDUCE_OPS)} "
        "(or the matching torch.distributed.ReduceOp value)"
    )
