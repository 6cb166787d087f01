"""The one small interface every communication engine implements.

An engine wraps one framework's own collective library (torch.distributed,
MindSpore communication) and serves both the primitives (:mod:`collective_ops.primitives`)
and the bucketing core (:class:`collective_ops.bucketing.BucketEngine`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

from ..bucketing.interfaces import Handle


class Engine(ABC):
    framework: str = ""
    backend: str = ""

    @property
    @abstractmethod
    def rank(self) -> int: ...

    @property
    @abstractmethod
    def world_size(self) -> int: ...

    @abstractmethod
    def owns(self, tensor: Any) -> bool:
        """True if ``tensor`` is of this engine's framework."""

    # primitives: in place where the op allows, else the result; a handle when async_op
    @abstractmethod
    def allreduce(self, tensor: Any, op: str = "sum", async_op: bool = False, group: Any = None) -> Any: ...

    @abstractmethod
    def broadcast(self, tensor: Any, src: int = 0, async_op: bool = False, group: Any = None) -> Any: ...

    @abstractmethod
    def allgather(self, tensor: Any, async_op: bool = False, group: Any = None) -> Any: ...

    @abstractmethod
    def reduce_scatter(self, tensor: Any, op: str = "sum", async_op: bool = False, group: Any = None) -> Any: ...

    @abstractmethod
    def barrier(self) -> None: ...

    def synchronize(self) -> None:
        """Wait until the work this process queued on its device is done (timing: a collective's call may return
        before its transfer ends)."""
        raise NotImplementedError(f"{type(self).__name__} cannot wait for its device (synchronize)")

    def reduce_floats(self, values: Sequence[float], op: str = "max") -> list[float]:
        """``values`` reduced over ranks (small bookkeeping, e.g. the slowest rank's time)."""
        raise NotImplementedError(f"{type(self).__name__} cannot reduce bookkeeping values (reduce_floats)")

    @abstractmethod
    def shutdown(self, timeout: float | None = None) -> None:
        """Leave what this engine joined, within ``timeout`` seconds or with ``TimeoutError``."""


def finish(handle: Handle, async_op: bool) -> Any:
    """Return ``handle`` for async calls, else wait and return its result."""
    return handle if async_op else handle.wait()
