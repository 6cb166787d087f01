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


def load_hook_state(hook: CommHook, state: dict[str, Any], engine: Any) -> None:
    """Restore a compression hook's ``state_dict()`` (what a wrapper's ``load_compression_state_dict`` takes); a
    non-empty state for a hook that keeps none is refused (a checkpoint of another compression)."""
    if hasattr(hook, "load_state_dict"):
        hook.load_state_dict(state, engine)
    elif state:
        raise ValueError("this network's compression keeps no state: the checkpoint's is for another one")


__all__ = ["PowerSGD", "PowerSGDHook", "hook_for_compression", "load_hook_state"]
