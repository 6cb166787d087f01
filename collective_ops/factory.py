"""The type of a factory class: ``isinstance`` and ``issubclass`` answer for the classes it builds.

``collective_ops.DistributedOptimizer(...)`` builds torch's or MindSpore's optimizer, and
``collective_ops.torch.DistributedOptimizer(...)`` the per-bucket or the sharded one; neither factory is a base
class of what it returns, so ``isinstance(opt, DistributedOptimizer)`` asks this metaclass instead.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any


def factory_type(built: Callable[[], Iterable[type]]) -> type:
    """A metaclass whose classes are, for ``isinstance``/``issubclass``, any of ``built()`` (asked at each check:
    a framework's classes count once its module is loaded)."""

    class FactoryType(type):
        def __instancecheck__(cls, instance: Any) -> bool:
            return any(isinstance(instance, made) for made in built())

        def __subclasscheck__(cls, subclass: type) -> bool:
            return any(issubclass(subclass, made) for made in built())

    return FactoryType
