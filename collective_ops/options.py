"""Option checks shared by the framework adapters (framework-free)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .bucketing import CommHook, hook_for_compression, validate_bucket_mb
from .ops import parse_reduce_op


def resolve_options(
    bucket_size_mb: float,
    first_bucket_mb: float | None,
    reduce_op: Any,
    compression: str | None,
    comm_hook: CommHook | None,
) -> tuple[float, float | None, str, CommHook]:
    """Validated (bucket_size_mb, first_bucket_mb, reduce_op, comm_hook), or a clear error."""
    bucket_size_mb = validate_bucket_mb(bucket_size_mb, "bucket_size_mb")
    if first_bucket_mb is not None:  # None: the adapter chooses
        first_bucket_mb = validate_bucket_mb(first_bucket_mb, "first_bucket_mb")
    reduce_op = parse_reduce_op(reduce_op)
    if reduce_op not in ("avg", "sum"):
        raise ValueError(f"reduce_op for gradients must be 'avg' or 'sum', got {reduce_op!r}")
    if comm_hook is not None and compression is not None:
        raise ValueError("give either compression or comm_hook, not both (compression is a built-in comm_hook)")
    return bucket_size_mb, first_bucket_mb, reduce_op, comm_hook or hook_for_compression(compression)


def names_text(names: Sequence[str], limit: int = 5) -> str:
    """Parameter names for an error message: the first ``limit``, quoted, then "..." if there are more."""
    return ", ".join(repr(n) for n in names[:limit]) + (" ..." if len(names) > limit else "")
