"""Check that every rank holds the same model before any gradient is communicated.

A model that differs across ranks (an extra layer, another shape or dtype) would make
ranks issue different collectives and hang; instead every rank raises the same error
naming the first difference and the ranks involved. Signatures travel as JSON bytes.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any


class ModelMismatchError(RuntimeError):
    """The wrapped model is not the same on every rank."""


Entry = tuple  # (kind, name, {detail: value}): e.g. ("parameter", "fc.weight", {"shape": [4, 2], ...})


def encode_signature(entries: Sequence[Entry]) -> bytes:
    return json.dumps([list(e) for e in entries], separators=(",", ":")).encode()


def _describe(entry: list) -> str:
    kind, name, details = entry
    shown = ", ".join(f"{key} {tuple(value) if isinstance(value, list) else value}" for key, value in details.items())
    return f"{kind} {name!r} ({shown})"


def plan_entry(plan: Any) -> Entry:
    """A bucket plan's settings and fingerprint (device types only, so multi-GPU ranks agree) as an entry."""
    details = {"bucket_size_mb": plan.bucket_size_mb, "first_bucket_mb": plan.first_bucket_mb}
    return ("bucket plan", "buckets", {**details, "fingerprint": plan.fingerprint()[:16]})


def options_entry(options: dict[str, Any]) -> Entry:
    """The wrap options that decide which collectives a step issues, as an entry (a callable by its name)."""
    shown = {key: getattr(v, "__qualname__", type(v).__name__) if callable(v) else v for key, v in options.items()}
    return ("wrap options", "wrap", shown)


class OptimizerMismatchError(ModelMismatchError):
    """A DistributedOptimizer's settings are not the same on every rank."""


MODEL_ADVICE = (
    "the model is not the same on every rank; build it identically everywhere (same layers, order, "
    "shapes, dtypes and requires_grad, and the same wrap options) before wrapping"
)


def check_same_on_all_ranks(
    local: Sequence[Entry],
    allgather_bytes: Callable[[bytes], list[bytes]],
    error: type[ModelMismatchError] = ModelMismatchError,
    advice: str = MODEL_ADVICE,
) -> None:
    """Raise ``error`` (``advice``, then each difference) on every rank unless all ranks' ``local`` agree."""
    gathered = [json.loads(blob) for blob in allgather_bytes(encode_signature(local))]
    reference = gathered[0]
    problems = []
    for rank, entries in enumerate(gathered[1:], start=1):
        if entries == reference:
            continue
        for position in range(max(len(entries), len(reference))):
            ours = entries[position] if position < len(entries) else None
            theirs = reference[position] if position < len(reference) else None
            if ours != theirs:
                break
        if ours is None:
            what = f"rank 0 has {_describe(theirs)} where rank {rank} has nothing more"
        elif theirs is None:
            what = f"rank {rank} has an extra {_describe(ours)}"
        else:
            what = f"rank 0 has {_describe(theirs)} where rank {rank} has {_describe(ours)}"
        problems.append(f"  - entry {position}: {what}")
    if problems:
        raise error(advice + ":\n" + "\n".join(problems))
