"""Gradient compressions that keep state between steps (framework-free: the tensor math is the engine's)."""

from .powersgd import PowerSGD, PowerSGDHook

__all__ = ["PowerSGD", "PowerSGDHook"]
