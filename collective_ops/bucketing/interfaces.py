"""What the bucketing core needs from a framework, and nothing more.

Each framework engine (``collective_ops.comm.torch_engine``, ``...mindspore_engine``)
implements :class:`BucketEngine`; the core only ever calls these methods, which keeps
``collective_ops.bucketing`` free of any framework import.
"""

from __future__ import annotations

import datetime
import math
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class Handle(Protocol):
    """An in-flight collective."""

    def wait(self) -> Any: ...

    def is_completed(self) -> bool: ...


class BucketEngine(Protocol):
    """Flat-buffer tensor operations plus the collectives the core launches."""

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    # -- tensors ------------------------------------------------------------------
    def as_native(self, tensor: Any) -> Any:
        """This framework's tensor sharing ``tensor``'s memory (e.g. a numpy array), or an error."""

    def describe(self, tensor: Any) -> tuple[int, str, str]:
        """(number of elements, dtype name, device name) of ``tensor``."""

    def itemsize(self, tensor: Any) -> int:
        """Bytes per element of ``tensor``."""

    def is_contiguous(self, tensor: Any) -> bool: ...

    def zeros(self, numel: int, dtype: str, device: str) -> Any:
        """A new flat, contiguous, zero-filled buffer."""

    def segment(self, buffer: Any, offset: int, numel: int, shape: Sequence[int] | None = None) -> Any:
        """``buffer[offset:offset+numel]``, reshaped: a view where the framework has views (torch), else a copy
        (MindSpore). The core treats it as either: a change made to a segment is written back with
        :meth:`write`, and a segment taken before a collective reduced ``buffer`` is taken again after it."""

    def write(self, buffer: Any, offset: int, tensor: Any) -> None:
        """Copy ``tensor`` (any shape) into ``buffer[offset:offset+tensor.numel]``. Writing a segment back onto
        the place it was taken from costs nothing where segments are views (torch's ``copy_`` of a tensor onto
        itself returns at once)."""

    def write_back(self, tensor: Any, buffer: Any, offset: int) -> None:
        """Copy ``buffer[offset:offset+tensor.numel]`` into ``tensor`` in place."""

    def fill_zero(self, buffer: Any, offset: int, numel: int) -> None: ...

    # Optional, for engines that set ``assembles_buckets = True`` (no cheap flat views):
    # the manager then keeps each gradient until its bucket is complete and packs them at once.
    def pack(self, tensors: Sequence[Any]) -> Any:
        """One new flat buffer holding ``tensors`` (flattened) in order."""

    def unpack(self, buffer: Any, numels: Sequence[int]) -> list[Any]:
        """``buffer`` split into flat pieces of ``numels``."""

    def int_tensor(self, values: Sequence[int], device: str) -> Any:
        """A new int32 tensor holding ``values``."""

    def to_list(self, tensor: Any) -> list:
        """The values of ``tensor`` as a Python list (synchronising with the device)."""

    def scale_(self, buffer: Any, factor: float) -> None:
        """Multiply ``buffer`` in place."""

    def cast(self, buffer: Any, dtype: str) -> Any:
        """A new buffer with ``buffer``'s values in ``dtype``."""

    def copy_(self, dst: Any, src: Any) -> None:
        """``dst[:] = src`` (converting dtype if they differ)."""

    # -- low-rank compression (compression/powersgd.py; only engines that offer PowerSGD) --------------------
    def divide_(self, tensor: Any, divisor: int) -> None:
        """Divide ``tensor`` in place."""

    def add_(self, dst: Any, src: Any) -> None:
        """``dst += src``."""

    def sub_into(self, buffer: Any, offset: int, a: Any, b: Any) -> None:
        """``a - b`` written into ``buffer[offset:offset+a.numel]`` (``a`` may be a segment of that very place)."""

    def bmm_into(
        self, buffer: Any, offset: int, a: Any, b: Any, transpose_a: bool = False, transpose_b: bool = False
    ) -> Any:
        """``a @ b`` on batches of matrices (batch, rows, cols), either operand transposed, written into ``buffer``
        from ``offset``, flattened; returns the product as it lies there (a view where the framework has views)
        or as computed (a tensor the buffer got a copy of)."""

    def orthogonalize_(self, matrices: Any, epsilon: float = 0.0) -> None:
        """Orthonormal columns, in place, for a batch of (batch, rows, rank) matrices."""

    def fill_normal_(self, tensors: Sequence[Any], seed: int) -> None:
        """Standard normal draws into ``tensors`` in turn, from ``seed``, the same on every rank and device."""

    # -- collectives --------------------------------------------------------------
    def allreduce(self, buffer: Any, op: str = "sum", async_op: bool = False, group: Any = None) -> Handle | None:
        """In-place allreduce of a flat buffer; a handle when ``async_op``; on ``group`` (None: the default one)."""

    def broadcast_ints(self, values: Sequence[int], src: int = 0) -> list[int]:
        """``values`` of rank ``src`` on every rank (same length on every rank)."""

    # Optional, for sharded data parallel (buffers padded to a multiple of the world size):
    def shard_of(self, buffer: Any) -> Any:
        """This rank's equal, contiguous part of ``buffer`` (a view)."""

    def reduce_scatter_shard(self, buffer: Any, async_op: bool = False) -> Handle | None:
        """Sum ``buffer`` over ranks into this rank's shard of it (the rest is left undefined); whatever it
        receives into is freed once the handle is waited for (sharded data parallel keeps no full-size copy)."""

    def all_gather_shard(self, buffer: Any, async_op: bool = False, group: Any = None) -> Handle | None:
        """Every rank's shard of ``buffer`` into ``buffer`` on every rank (over ``group``: default, all)."""

    # Optional: small bookkeeping on host tensors (step alignment); without it, the buckets' group and device.
    def host_group(self) -> tuple[Any, str]:
        """(group, device) whose collectives take host tensors (a collective where it makes a group)."""

    # Optional, for row-sparse tables (row_sparse.py; an adapter enables them only where its engine has these):
    def new_group(self) -> Any:
        """A process group of all ranks of its own (a collective: every rank calls it)."""

    def nonzero_rows(self, buffer: Any, rows: int, cols: int) -> Any:
        """The mask of the rows of ``buffer`` (a ``rows`` x ``cols`` table) that hold a non-zero (or a NaN)."""

    def rows_union(self, mask: Any, group: Any = None) -> Handle:
        """Every rank's boolean ``mask`` of rows all-gathered (async); waiting gives the union's row indices."""

    def rows_outside(self, buffer: Any, rows: int, cols: int, mask: Any) -> bool:
        """True if the table in ``buffer`` has a non-zero row that ``mask`` leaves out."""

    def allreduce_rows(
        self,
        buffer: Any,
        rows: int,
        cols: int,
        union: Any,
        factor: float | None,
        group: Any = None,
        wire_dtype: str | None = None,
        outside: bool | None = None,
        if_outside: Callable[[], Any] | None = None,
    ) -> Handle | None:
        """Sum only the rows ``union`` of the table in ``buffer`` into it (scaled by ``factor``, sent as
        ``wire_dtype``); every other row is zero on every rank. With ``outside`` (this rank's gradient has
        rows outside the union) one more element carries it in the sum: where any rank's was True, waiting
        calls ``if_outside()`` instead of writing the rows back."""


class CompletedHandle:
    """A handle for work that finished synchronously."""

    def __init__(self, result: Any = None) -> None:
        self._result = result

    def wait(self) -> Any:
        return self._result

    def is_completed(self) -> bool:
        return True


def wait_with_timeout(handle: Any, timeout: float | None) -> Any:
    """``handle.wait()``, raising ``TimeoutError`` after ``timeout`` seconds where the engine can.

    torch's ``Work.wait`` takes a timeout; engines whose handles cannot (MindSpore's) just wait.
    """
    if timeout is None:
        return handle.wait()
    if isinstance(handle, (ThenHandle, ChunkedHandle)):
        return handle.wait(timeout)
    try:
        return handle.wait(timeout=datetime.timedelta(seconds=timeout))
    except TypeError:  # this handle's wait() takes no timeout
        return handle.wait()
    except RuntimeError as exc:
        if "timed out" in str(exc).lower():
            raise TimeoutError(str(exc)) from exc
        raise


def env_seconds(name: str, default: float | None) -> float | None:
    """Seconds from environment variable ``name``: ``default`` when unset, None for 0 (no limit)."""
    value = os.environ.get(name, "").strip()
    if not value:
        return default
    try:
        seconds = float(value)
    except ValueError:
        raise ValueError(f"{name}={value!r} is not a number of seconds") from None
    if not math.isfinite(seconds) or seconds < 0:  # nan/inf broke the waits later; a negative one meant "forever"
        raise ValueError(f"{name}={value!r} is not a number of seconds >= 0 (0: no limit)")
    return None if seconds == 0 else seconds


def call_with_deadline(fn: Callable[[], Any], timeout: float | None, what: str) -> Any:
    """``fn()``, or ``TimeoutError`` once ``timeout`` seconds pass (None: no limit).

    For blocking framework calls that take no timeout of their own (a MindSpore barrier, a
    collective during shutdown): ``fn`` runs in a daemon thread, which is left behind if it
    never returns, so the caller always gets control back.
    """
    if timeout is None:
        return fn()
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["value"] = fn()
        except BaseException as exc:  # handed to the caller
            outcome["error"] = exc

    thread = threading.Thread(target=run, name=f"collective_ops: {what}", daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        raise TimeoutError(f"{what} did not finish within {timeout:g} s")
    if "error" in outcome:
        raise outcome["error"]
    return outcome.get("value")


class ThenHandle:
    """Runs ``then`` once, after ``handle`` completes, on the first ``wait()``."""

    def __init__(self, handle: Handle | None, then: Callable[[], Any]) -> None:
        self._handle = handle
        self._then: Callable[[], Any] | None = then
        self._result: Any = None

    def wait(self, timeout: float | None = None) -> Any:
        if self._handle is not None:
            wait_with_timeout(self._handle, timeout)
            self._handle = None  # done: what it holds (a collective's buffers) is freed with it
        if self._then is not None:
            then, self._then = self._then, None
            self._result = then()
        return self._result

    def is_completed(self) -> bool:
        return self._handle is None or self._handle.is_completed()


class ChunkedHandle:
    """One bucket reduced as several collectives (its chunks, launched at different times).

    Complete once all ``count`` chunks were launched (:meth:`add`) and each completed.
    """

    def __init__(self, count: int) -> None:
        self.count = count
        self.handles: list[Handle | None] = []

    def add(self, handle: Handle | None) -> None:
        self.handles.append(handle)

    def wait(self, timeout: float | None = None) -> None:
        if len(self.handles) < self.count:
            raise RuntimeError(f"only {len(self.handles)} of the bucket's {self.count} chunks were launched")
        for handle in self.handles:
            if handle is not None:
                wait_with_timeout(handle, timeout)

    def is_completed(self) -> bool:
        return len(self.handles) == self.count and all(h is None or h.is_completed() for h in self.handles)
