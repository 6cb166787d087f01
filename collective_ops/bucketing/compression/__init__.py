"""Gradient compressions: the built-in hook for each ``compression`` option; those that keep state between
steps (framework-free: the tensor math is the engine's)."""

from __future__ import annotations

from typing import Any

from ..hooks import COMPRESSIONS, CommHook, allreduce_hook, compression_hook
from .powersgd import PowerSGD, PowerSGDHook


def hook_for_compression(compression: Any) -> CommHook:
    """The built-in hook for ``compression`` (None, "fp16", "bf16" or a :class:`PowerSGD`)."""
    if compression is None or compression == "none":
        return allreduce_hook
    if isinstance(compression, str) and compression.lower() in COMPRESSIONS:
        return compression_hook(COMPRESSIONS[compression.lower()])
    if isinstance(compression, PowerSGD):
        return PowerSGDHook(compression)
    raise ValueError(f"unknown compression {compression!r}; use None, 'fp16', 'bf16' or co.PowerSGD(...)")


__all__ = ["PowerSGD", "PowerSGDHook", "hook_for_compression"]
