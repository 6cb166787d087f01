"""torch.distributed engine (Gloo, NCCL, HCCL): the only place torch collectives are called."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ..bucketing.interfaces import CompletedHandle, ThenHandle, call_with_deadline, wait_with_timeout
from ..ops import parse_reduce_op
from .base import Engine, finish

_TORCH_OPS = {
    "sum": dist.ReduceOp.SUM,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
    "prod": dist.ReduceOp.PRODUCT,
}


# torch 2.13 renamed the tensor-in/tensor-out collectives; older releases only have the old names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


# Gloo moves a large buffer in one all-to-all or all-gather far below the link's rate (21.3 MiB over
# the emulated 1gbit link: 168 / 105 ms; in pieces of 1 MiB per rank: 93 / 92 ms, against its allreduce's
# 186: benchmarks/shard_collectives.py --link 1gbit --mib 21.3).
_GLOO_SHARD_PIECE_BYTES = 1 << 20
_REDUCE_SCATTER_TAG, _ALL_GATHER_TAG = 0x5253, 0x4147  # point-to-point tags of the sharded collectives
# How long the rendezvous store may take to answer a stall diagnosis's reads, beyond its waits for the peers.
STORE_DEADLINE_S = 5.0
_ABANDONED: list = []  # process groups left behind after a stall (TorchEngine.mark_stalled)


class StoreUnansweredError(TimeoutError):
    """The rendezvous store did not answer in time: the rank hosting it is stopped."""


class StoreGoneError(ConnectionError):
    """The rendezvous store refused a read or write: the rank hosting it is gone."""


def _written_by_transport(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor a collective writes its result through: the same memory, with a version counter of its own.

    Gloo lands a device tensor's result with an in-place copy from a host copy, made on its worker thread
    whenever the collective ends. Made through the caller's tensor, that copy moves the version counter the
    library's in-place guards read (collective_ops/torch/inplace.py), so a bucket whose reduction landed while the
    loop ran between backward() and step() looked changed by the loop. NCCL and Gloo on host tensors write
    below autograd and move no counter; through this alias no transport does."""
    return tensor.data


def _nonzero_rows(buffer: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """The rows of the ``rows`` x ``cols`` table at the start of ``buffer`` that hold a non-zero (NaN != 0: sent).

    From each row's largest and smallest element (NaN where the row has one): 0.14 ms for a 5000 x 256
    table on this 2-core VM's CPU, where ``ne(0).any(dim=1)`` takes 1.1 ms at the end of backward.
    """
    table = buffer[: rows * cols].view(rows, cols)
    return table.amax(dim=1).ne(0).logical_or_(table.amin(dim=1).ne(0))


def _sum_in_rank_order(parts: list[torch.Tensor], rank: int) -> torch.Tensor:
    """Every rank's copy of this rank's shard (``parts[rank]``, the shard itself, written in place) summed left to
    right in rank order, as Gloo's allreduce sums (bit-equal at 2 ranks, where a + b == b + a)."""
    shard = parts[rank]
    if rank <= 1:  # p0 + p1 in place (addition commutes), then the rest in order
        for part in parts[1 - rank : 2 - rank] + parts[2:]:  # (at 1 rank: nothing to add)
            shard.add_(part)
        return shard
    total = parts[0].add_(parts[1])  # rank 0's received copy, no longer needed, holds the running sum
    for part in parts[2:]:
        total.add_(part)
    return shard.copy_(total)


def _gram_schmidt_(matrices: torch.Tensor, epsilon: float) -> None:
    """Gram-Schmidt over the columns of a batch of matrices, in place (torch's powerSGD_hook's arithmetic)."""
    columns = matrices.shape[2]
    for i in range(columns):
        col = matrices[:, :, i : i + 1]
        if epsilon == 0:
            col /= torch.norm(col, dim=1, keepdim=True)
        else:
            col /= torch.norm(col, dim=1, keepdim=True) + epsilon
        if i + 1 < columns:
            rest = matrices[:, :, i + 1 :]
            rest -= torch.sum(col * rest, dim=1, keepdim=True) * col


class _Works:
    """Several collectives waited for as one."""

    def __init__(self, works: list) -> None:
        self._works = works

    def wait(self, timeout: Any = None) -> None:
        for work in self._works:
            work.wait() if timeout is None else work.wait(timeout=timeout)

    def is_completed(self) -> bool:
        return all(work.is_completed() for work in self._works)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class TorchEngine(Engine):
    framework = "torch"

    def __init__(self, backend: str, device: torch.device, owns_group: bool = True) -> None:
        self.backend = backend
        self.device = device
        # False for a process group the user created and the library adopted: shutdown leaves it alone.
        self.owns_group = owns_group
        # Debug mode: agree on shape and dtype before every primitive (one small extra collective),
        # so a mismatch is an error naming the ranks instead of a transport abort or a hang.
        self.check_shapes = os.environ.get("COLLECTIVE_OPS_CHECK_SHAPES", "") == "1"
        # Fixed for the life of the process group (an engine is made per init); asked on every
        # gradient hook, where dist.get_world_size()'s lookups add up.
        self._rank = dist.get_rank()
        self._world_size = dist.get_world_size()
        self.stalled = False  # a collective never completed (mark_stalled): its groups cannot be destroyed
        self._blocking_timeout_s: float | None = None  # set by bounded(): the blocking collectives' limit
        # who serves the rendezvous store (the side channel of stall diagnosis), named when it does not answer
        self.store_host = "rank 0"
        self.store_rank: int | None = 0  # None where a launcher's agent hosts it

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world_size

    def owns(self, tensor: Any) -> bool:
        return isinstance(tensor, (torch.Tensor, np.ndarray))

    # -- validation ---------------------------------------------------------------
    def _as_torch(self, tensor: Any, what: str) -> torch.Tensor:
        if isinstance(tensor, np.ndarray) and not tensor.flags.c_contiguous:
            raise ValueError(f"{what}: numpy array is not C-contiguous; pass np.ascontiguousarray(a)")
        try:
            tensor = self.as_native(tensor)  # numpy arrays share memory: in-place results land in the array
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"{what}: {exc}") from None
        if not tensor.is_contiguous():
            raise ValueError(f"{what}: tensor is not contiguous; pass tensor.contiguous() (and copy the result back)")
        if self.backend in ("nccl", "hccl") and tensor.device.type != self.device.type:
            raise ValueError(
                f"{what}: tensor is on {tensor.device}, but backend {self.backend!r} reduces "
                f"{self.device.type} tensors; move it with tensor.to({str(self.device)!r})"
            )
        if self.check_shapes:
            self._check_same_everywhere(tensor, what)
        return _written_by_transport(tensor)

    def _check_same_everywhere(self, tensor: torch.Tensor, what: str) -> None:
        mine = f"{tuple(tensor.shape)} {dtype_name(tensor.dtype)}".encode()
        everyone = self.allgather_bytes(mine)
        if len(set(everyone)) > 1:
            listing = ", ".join(f"rank {r}: {b.decode()}" for r, b in enumerate(everyone))
            raise ValueError(
                f"{what}: ranks passed different tensors ({listing}); every rank must pass the same shape and dtype"
            )

    @staticmethod
    def _back(result: torch.Tensor, like: Any) -> Any:
        return result.numpy() if isinstance(like, np.ndarray) else result

    # -- primitives ---------------------------------------------------------------
    def allreduce(self, tensor: Any, op: Any = "sum", async_op: bool = False, group: Any = None) -> Any:
        op = parse_reduce_op(op)
        t = self._as_torch(tensor, "allreduce")
        if op == "avg":
            if not (t.is_floating_point() or t.is_complex()):
                raise ValueError(
                    f"allreduce(op='avg') of a {dtype_name(t.dtype)} tensor cannot hold the mean; "
                    "use op='sum' and divide, or cast to a floating dtype"
                )
            world = dist.get_world_size(group)
            work = dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group, async_op=True)

            def done() -> Any:
                t.div_(world)  # sum then divide: the same arithmetic on every backend
                return tensor

            return finish(ThenHandle(work, done), async_op)
        if not async_op:  # the latency-critical path: no handle objects (unless bounded)
            self._blocking(dist.all_reduce, t, op=_TORCH_OPS[op], group=group)
            return tensor
        work = dist.all_reduce(t, op=_TORCH_OPS[op], group=group, async_op=True)
        return ThenHandle(work, lambda: tensor)

    def broadcast(self, tensor: Any, src: int = 0, async_op: bool = False, group: Any = None) -> Any:
        t = self._as_torch(tensor, "broadcast")
        self._check_rank(src, group, "src")
        work = dist.broadcast(t, src=src, group=group, async_op=True)
        return finish(ThenHandle(work, lambda: tensor), async_op)

    def allgather(self, tensor: Any, async_op: bool = False, group: Any = None) -> Any:
        t = self._as_torch(tensor, "allgather")
        world = dist.get_world_size(group)
        out = torch.empty((world * t.shape[0], *t.shape[1:]) if t.dim() else (world,), dtype=t.dtype, device=t.device)
        work = _all_gather_single(out, t, group=group, async_op=True)
        return finish(ThenHandle(work, lambda: self._back(out, tensor)), async_op)

    def reduce_scatter(self, tensor: Any, op: Any = "sum", async_op: bool = False, group: Any = None) -> Any:
        op = parse_reduce_op(op)
        t = self._as_torch(tensor, "reduce_scatter")
        world = dist.get_world_size(group)
        if t.dim() == 0 or t.shape[0] % world:
            raise ValueError(
                f"reduce_scatter: the first dimension ({tuple(t.shape)}) must be a multiple of the world size "
                f"({world}); each rank receives one equal chunk"
            )
        if op == "avg" and not t.is_floating_point():
            raise ValueError("reduce_scatter(op='avg') needs a floating dtype; use op='sum' and divide")
        out = torch.empty((t.shape[0] // world, *t.shape[1:]), dtype=t.dtype, device=t.device)
        torch_op = _TORCH_OPS["sum" if op == "avg" else op]
        work = _reduce_scatter_single(out, t, op=torch_op, group=group, async_op=True)

        def done() -> Any:
            if op == "avg":
                out.div_(world)
            return self._back(out, tensor)

        return finish(ThenHandle(work, done), async_op)

    def barrier(self) -> None:
        self._blocking(dist.barrier)

    @contextlib.contextmanager
    def bounded(self, seconds: float | None) -> Iterator[None]:
        """Inside, each blocking collective (``barrier``, ``reduce_floats``, ``broadcast_ints``, ``allgather_bytes``,
        ``gather_bytes``, a blocking ``allreduce``) raises ``TimeoutError`` after ``seconds`` (None: the process
        group's own timeout) instead of waiting on for a peer that is not coming."""
        previous, self._blocking_timeout_s = self._blocking_timeout_s, seconds
        try:
            yield
        finally:
            self._blocking_timeout_s = previous

    @property
    def blocking_timeout_s(self) -> float | None:
        """The limit :meth:`bounded` sets for blocking waits (None: none set)."""
        return self._blocking_timeout_s

    def _blocking(self, collective: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        """``collective(*args, **kwargs)`` waited for, within :meth:`bounded`'s limit where one is set."""
        if self._blocking_timeout_s is None:
            collective(*args, **kwargs)
            return
        wait_with_timeout(collective(*args, async_op=True, **kwargs), self._blocking_timeout_s)

    def shutdown(self, timeout: float | None = None) -> None:
        """Destroy the process group if this library created it (an adopted one stays the user's); after a
        stall, leave the groups behind (``mark_stalled``)."""
        if self.stalled:
            self._abandon_groups(min(timeout or 2.0, 2.0))
            return
        if self.owns_group and dist.is_initialized():
            call_with_deadline(dist.destroy_process_group, timeout, "destroying the process group")

    @staticmethod
    def is_transport_error(exc: BaseException) -> bool:
        """True for failures of the collective itself (a peer gone, the network), not of our own code."""
        if isinstance(exc, (dist.DistError, ConnectionError)):
            return True
        text = str(exc).lower()
        return isinstance(exc, RuntimeError) and any(
            word in text for word in ("gloo", "nccl", "hccl", "connection", "socket", "peer", "timed out", "timeout")
        )

    def synchronize(self) -> None:
        """Wait for the device's queued work (nothing to wait for on the CPU)."""
        if self.device.type != "cpu":
            accelerator = getattr(torch, "accelerator", None)  # torch >= 2.6; the device module before that
            sync = accelerator.synchronize if hasattr(accelerator, "synchronize") else None
            (sync or getattr(torch, self.device.type).synchronize)()

    def reduce_floats(self, values: Sequence[float], op: str = "max") -> list[float]:
        """``values`` reduced over ranks (small bookkeeping, e.g. the slowest rank's time), on this engine's device."""
        t = torch.tensor(list(values), dtype=torch.float64, device=self.device)
        self._blocking(dist.all_reduce, t, op=_TORCH_OPS[op])
        return t.tolist()

    @staticmethod
    def _check_rank(rank: int, group: Any, what: str) -> None:
        world = dist.get_world_size(group)
        if not isinstance(rank, int) or not 0 <= rank < world:
            raise ValueError(f"{what}={rank!r} is not a rank of this group (0..{world - 1})")

    # -- BucketEngine (flat buffers for the bucketing core) -------------------------
    def as_native(self, tensor: Any) -> torch.Tensor:
        """A torch view of ``tensor`` (numpy arrays share memory), refused if it cannot be reduced."""
        if isinstance(tensor, np.ndarray):
            if not tensor.flags.writeable:
                raise ValueError("numpy array is read-only; pass a writeable copy (a.copy())")
            tensor = torch.from_numpy(tensor)
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"expected a torch.Tensor or numpy.ndarray, got {type(tensor).__name__}")
        if tensor.is_sparse or tensor.layout != torch.strided:
            raise ValueError("sparse tensors are not supported; pass tensor.to_dense()")
        return tensor

    def describe(self, tensor: torch.Tensor) -> tuple[int, str, str]:
        return tensor.numel(), dtype_name(tensor.dtype), str(tensor.device)

    def itemsize(self, tensor: torch.Tensor) -> int:
        return tensor.element_size()

    def is_contiguous(self, tensor: Any) -> bool:
        return isinstance(tensor, torch.Tensor) and tensor.is_contiguous()

    def zeros(self, numel: int, dtype: str, device: str) -> torch.Tensor:
        return torch.zeros(numel, dtype=getattr(torch, dtype), device=device)

    def segment(
        self, buffer: torch.Tensor, offset: int, numel: int, shape: Sequence[int] | None = None
    ) -> torch.Tensor:
        view = buffer.narrow(0, offset, numel)
        return view if shape is None else view.view(tuple(shape))

    def write(self, buffer: torch.Tensor, offset: int, tensor: torch.Tensor) -> None:
        # a segment written back onto its own place: copy_ sees the same memory, strides and sizes and returns at
        # once (measured: 6 us for a 32 MB segment, against 3.9 ms for a copy elsewhere)
        buffer.narrow(0, offset, tensor.numel()).view_as(tensor).copy_(tensor)

    def write_back(self, tensor: torch.Tensor, buffer: torch.Tensor, offset: int) -> None:
        tensor.copy_(buffer.narrow(0, offset, tensor.numel()).view_as(tensor))

    def fill_zero(self, buffer: torch.Tensor, offset: int, numel: int) -> None:
        buffer.narrow(0, offset, numel).zero_()

    def int_tensor(self, values: Sequence[int], device: str) -> torch.Tensor:
        return torch.tensor(list(values), dtype=torch.int32, device=device)

    def to_list(self, tensor: torch.Tensor) -> list:
        return tensor.tolist()

    def scale_(self, buffer: torch.Tensor, factor: float) -> None:
        buffer.mul_(factor)

    def cast(self, buffer: torch.Tensor, dtype: str) -> torch.Tensor:
        return buffer.to(getattr(torch, dtype))

    def copy_(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src)

    # -- low-rank compression (bucketing/compression/powersgd.py): torch's powerSGD_hook's own operations ---------
    def divide_(self, tensor: torch.Tensor, divisor: int) -> None:
        tensor.div_(divisor)

    def add_(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.add_(src)

    def sub_into(self, buffer: torch.Tensor, offset: int, a: torch.Tensor, b: torch.Tensor) -> None:
        torch.sub(a, b, out=buffer.narrow(0, offset, a.numel()).view_as(a))  # (``a`` there already: in place)

    def bmm_(
        self, out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, transpose_a: bool = False, transpose_b: bool = False
    ) -> None:
        """``out = a @ b`` on batches of matrices (either operand transposed), written into ``out``.

        With a thin ``b`` (a PowerSGD factor: few columns) the product is formed so that BLAS streams the large
        operand once in its stored order: ``M Q`` as ``M (Q^T)^T`` with ``Q^T`` made contiguous, ``M^T P`` as
        ``(P^T M)^T``. On one CPU core that is 2.9-3.6x faster at rank 4 (``benchmarks/powersgd_compare.py
        --factor-products``); the sums run in another order than torch's ``powerSGD_hook``'s
        ``bmm``, so the results agree with it to fp32 rounding, not bit for bit."""
        thin = not transpose_b and b.shape[2] < b.shape[1]
        if thin and transpose_a:
            out.copy_(torch.bmm(b.transpose(1, 2), a).transpose(1, 2))
            return
        if thin:
            b = b.transpose(1, 2).contiguous().transpose(1, 2)
        torch.bmm(a.transpose(1, 2) if transpose_a else a, b.transpose(1, 2) if transpose_b else b, out=out)

    def bmm_into(
        self,
        buffer: torch.Tensor,
        offset: int,
        a: torch.Tensor,
        b: torch.Tensor,
        transpose_a: bool = False,
        transpose_b: bool = False,
    ) -> torch.Tensor:
        rows = a.shape[2] if transpose_a else a.shape[1]
        cols = b.shape[1] if transpose_b else b.shape[2]
        out = buffer.narrow(0, offset, a.shape[0] * rows * cols).view(a.shape[0], rows, cols)
        self.bmm_(out, a, b, transpose_a, transpose_b)
        return out

    def orthogonalize_(self, matrices: torch.Tensor, epsilon: float = 0.0) -> None:
        """Orthonormal columns, in place, for a batch of matrices (batch, rows, rank), as torch's hook does:
        Gram-Schmidt at rank 1-2 or in half precision, else a QR factorisation (``epsilon`` then unused)."""
        batch, _, rank = matrices.shape
        if rank <= 2 or matrices.dtype in (torch.float16, torch.bfloat16):
            _gram_schmidt_(matrices, epsilon)
        else:
            r = torch.empty(batch, rank, rank, device=matrices.device, dtype=matrices.dtype)
            torch.linalg.qr(matrices, out=(matrices, r))

    def fill_normal_(self, tensors: Sequence[torch.Tensor], seed: int) -> None:
        """Standard normal draws into ``tensors``, one after another from ``seed`` (drawn on the CPU, as torch's
        hook, so every device gets the same values), the global random state left as it was."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            for tensor in tensors:
                tensor.copy_(torch.randn(*tensor.shape, device="cpu", dtype=tensor.dtype))

    # -- sharded buckets -------------------------------------------------------------
    def shard_of(self, buffer: torch.Tensor) -> torch.Tensor:
        shard = buffer.numel() // self._world_size
        return buffer.narrow(0, self._rank * shard, shard)

    def new_group(self) -> Any:
        """A process group of all ranks of its own, on this engine's backend (a collective: every rank calls it)."""
        return dist.new_group(backend=dist.get_backend())

    def host_group(self) -> tuple[Any, str]:
        """(group, device) for small bookkeeping collectives on host tensors, whose results the host reads at
        once: the default group on Gloo; beside NCCL/HCCL a Gloo group of its own (a collective: every rank
        calls it), so that reading them never waits for the device's queued work (a D2H copy would)."""
        if self.device.type == "cpu":
            return None, "cpu"
        return dist.new_group(backend="gloo"), "cpu"

    def nonzero_rows(self, buffer: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
        """The mask of the rows of ``buffer`` (a ``rows`` x ``cols`` table) that hold a non-zero (or a NaN)."""
        return _nonzero_rows(buffer, rows, cols)

    def rows_union(self, mask: torch.Tensor, group: Any = None) -> ThenHandle:
        """Every rank's boolean ``mask`` of rows all-gathered (async); waiting gives the union's row indices."""
        rows = mask.numel()
        masks = torch.empty(self._world_size * rows, dtype=torch.uint8, device=mask.device)
        work = _all_gather_single(masks, mask.to(torch.uint8), group=group, async_op=True)
        return ThenHandle(work, lambda: masks.view(self._world_size, rows).any(dim=0).nonzero().squeeze(1))

    def rows_outside(self, buffer: torch.Tensor, rows: int, cols: int, mask: torch.Tensor) -> bool:
        """True if the table in ``buffer`` has a non-zero row that ``mask`` leaves out."""
        return bool(_nonzero_rows(buffer, rows, cols).logical_and_(mask.logical_not()).any())

    def allreduce_rows(
        self,
        buffer: torch.Tensor,
        rows: int,
        cols: int,
        union: torch.Tensor,
        factor: float | None,
        group: Any = None,
        wire_dtype: str | None = None,
        outside: bool | None = None,
        if_outside: Callable[[], Any] | None = None,
    ) -> Any:
        """Sum only the rows ``union`` of ``buffer`` (a table; every other row is zero on every rank) into it,
        scaled by ``factor`` first, sent as ``wire_dtype`` where given (then cast back).

        With ``outside`` (this rank's gradient has rows outside the union) one element more carries it,
        summed with the rows: where it comes back non-zero, waiting calls ``if_outside()`` instead of
        writing the rows back (which are then still every rank's own gradient).
        """
        table = buffer[: rows * cols].view(rows, cols)
        checked = outside is not None
        if union.numel() == 0 and not checked:
            return CompletedHandle(buffer)
        count = union.numel() * cols
        wire = torch.empty(
            count + checked, dtype=getattr(torch, wire_dtype) if wire_dtype else table.dtype, device=table.device
        )
        packed = wire[:count].view(-1, cols)
        if wire_dtype is None:
            torch.index_select(table, 0, union, out=packed)
        else:
            packed.copy_(table.index_select(0, union))
        if factor is not None:
            packed.mul_(factor)
        if checked:
            wire[count] = float(outside)
        work = dist.all_reduce(wire, op=dist.ReduceOp.SUM, group=group, async_op=True)

        def unpack() -> torch.Tensor:
            if checked and wire[count].item() != 0:
                return if_outside()
            table.index_copy_(0, union, packed.to(table.dtype))
            return buffer

        return ThenHandle(work, unpack)

    def reduce_scatter_shard(self, buffer: torch.Tensor, async_op: bool = False) -> Any:
        """The sum of every rank's ``buffer`` into this rank's shard of it (``buffer``'s other shards unchanged).

        Gloo's reduce-scatter moves the whole buffer (emulated 1gbit link, 4 MiB: 32.9 ms, as much
        as an allreduce's 34.6 ms; benchmarks/shard_collectives.py), so on Gloo each shard is sent to
        its owner ((N-1)/N of the buffer, as a reduce-scatter should: 17.5 ms there), point-to-point in
        pieces of at most 1 MiB per rank (see _send_pieces), then summed here in rank order. The other ranks'
        copies of this rank's shard arrive in a receive buffer of (N-1) shards made for this call and freed
        once summed: none is kept between steps (an all-to-all, one call for a one-piece shard, needs one as
        large as the whole buffer). A device buffer goes through a host copy (see _staged_on_host). Other
        backends reduce-scatter in place.
        """
        shard = self.shard_of(buffer)
        if self.backend != "gloo":
            work = _reduce_scatter_single(_written_by_transport(shard), buffer, op=dist.ReduceOp.SUM, async_op=True)
            return finish(ThenHandle(work, lambda: shard), async_op)
        if self._staged_on_host(buffer):
            return self._through_host(buffer, self._reduce_scatter_pieces, self.shard_of, async_op)
        return finish(self._reduce_scatter_pieces(buffer), async_op)

    def _reduce_scatter_pieces(self, buffer: torch.Tensor) -> ThenHandle:
        """reduce_scatter_shard on Gloo, point-to-point: each rank's shard summed into it when waited for."""
        shard = self.shard_of(buffer)
        numel, world, rank = shard.numel(), self._world_size, self._rank
        received = torch.empty((world - 1) * numel, dtype=buffer.dtype, device=buffer.device)
        works = self._send_pieces(buffer, received, _REDUCE_SCATTER_TAG, owner_sends=False, group=None)
        slots = iter(received.split(numel))
        parts = [shard if r == rank else next(slots) for r in range(world)]
        # ThenHandle drops the works and this closure once waited: the receive buffer goes with them
        return ThenHandle(_Works(works), lambda: _sum_in_rank_order(parts, rank))

    def all_gather_shard(self, buffer: torch.Tensor, async_op: bool = False, group: Any = None) -> Any:
        """Every rank's shard of ``buffer`` into ``buffer`` (on Gloo point-to-point in pieces of at most 1 MiB per rank).

        On Gloo point-to-point also where the shard is one piece: its sends are posted at once, in the order the
        calls come, and reach the wire in that order (a pair's messages go out as the peer's receives arrive, and
        those are posted in the same order), whereas Gloo's all-gather queues for a worker thread of the group:
        a bucket of several pieces, launched later, then went out beside the earlier ones' and delayed them."""
        shard = self.shard_of(buffer)
        if self.backend != "gloo":
            work = _all_gather_single(_written_by_transport(buffer), shard, group=group, async_op=True)
            return finish(ThenHandle(work, lambda: buffer), async_op)
        gather = partial(self._all_gather_pieces, group=group)
        if self._staged_on_host(buffer):
            return self._through_host(buffer, gather, lambda whole: whole, async_op)
        return finish(gather(buffer), async_op)

    def _all_gather_pieces(self, buffer: torch.Tensor, group: Any) -> ThenHandle:
        works = self._send_pieces(buffer, buffer, _ALL_GATHER_TAG, owner_sends=True, group=group)
        return ThenHandle(_Works(works), lambda: buffer)

    @staticmethod
    def _staged_on_host(buffer: torch.Tensor) -> bool:
        """Gloo's point-to-point calls read and write host memory only: a device buffer's pointer fails in the
        socket's write ('writev: Bad address', seen on an H200), so a device buffer goes through a host copy."""
        return buffer.device.type != "cpu"

    @staticmethod
    def _through_host(buffer: torch.Tensor, collective: Callable, part: Callable, async_op: bool) -> Any:
        """``collective`` run on a host copy of ``buffer``; when waited for, the ``part`` of it that the collective
        writes (``part(buffer)``: a view) copied back, and returned."""
        host = buffer.to("cpu", copy=True)
        handle = collective(host)

        def land() -> Any:
            _written_by_transport(part(buffer)).copy_(part(host))
            return part(buffer)

        return finish(ThenHandle(handle, land), async_op)

    def _send_pieces(self, source: torch.Tensor, target: torch.Tensor, tag: int, owner_sends: bool, group: Any) -> list:
        """Point-to-point exchange of shards between every pair of ranks, piece by piece (Gloo).

        ``owner_sends`` (all-gather): this rank's shard of ``source`` goes to every other rank, whose
        shard arrives in its place in ``target``; else (reduce-scatter) each other rank's shard of
        ``source`` goes to it, and each other rank's copy of this rank's shard arrives in ``target``, which
        holds (N-1) shards: the other ranks' copies in rank order. Against Gloo's list all-to-all / all-gather in the same pieces, no copies into and
        out of lists: 21.3 MiB on loopback, reduce-scatter / all-gather 7.5 / 8.6 ms (6.4 / 7.4 ms of CPU)
        against 19.5 / 13.1 (18.2 / 10.9); on the emulated 1gbit link 93.0 / 95.7 against 91.4 / 92.6 ms
        (benchmarks/shard_collectives.py). Every rank posts the same pieces in the same order, and Gloo
        matches the messages of one pair and tag in the order they were posted.
        """
        shard, target = source.numel() // self._world_size, _written_by_transport(target)
        works = []
        for start, length in self._shard_chunks(source):
            for peer in range(self._world_size):
                if peer == self._rank:
                    continue
                sent = source.narrow(0, (self._rank if owner_sends else peer) * shard + start, length)
                slot = peer if owner_sends else peer - (peer > self._rank)  # (the reduce-scatter's has no own slot)
                works.append(dist.isend(sent, dst=peer, group=group, tag=tag))
                works.append(dist.irecv(target.narrow(0, slot * shard + start, length), src=peer, group=group, tag=tag))
        return works

    def _shard_chunks(self, buffer: torch.Tensor) -> list[tuple[int, int]]:
        """(start, length) pieces of a shard, at most _GLOO_SHARD_PIECE_BYTES each."""
        shard = buffer.numel() // self._world_size
        step = max(_GLOO_SHARD_PIECE_BYTES // buffer.element_size(), 1)
        return [(start, min(step, shard - start)) for start in range(0, shard, step)]

    def broadcast_ints(self, values: Sequence[int], src: int = 0) -> list[int]:
        t = torch.tensor(list(values), dtype=torch.int64, device=self.device)
        self._blocking(dist.broadcast, t, src=src)
        return t.tolist()

    def exchange_progress(self, mine: dict, grace_s: float = 2.0) -> dict[int, dict | None]:
        """Publish this rank's progress on the rendezvous store and read the peers' (None: no report).

        Only used once a wait has timed out: the store is a side channel that works while
        the collectives are stuck. Values are JSON, never pickles. Bounded: where the store does
        not answer within STORE_DEADLINE_S beyond the two grace periods (its host is stopped, not
        gone: a TCPStore read has no limit of its own then), ``StoreUnansweredError`` names the host.
        """
        try:
            from ..torch._compat import default_store  # (the torch package imports this engine)

            store = default_store()
        except Exception:  # no store (a user-made group without one): no peer view
            return {}
        try:
            return call_with_deadline(
                lambda: self._exchange_on(store, mine, grace_s),
                2 * grace_s + STORE_DEADLINE_S,
                "reading the peers' progress from the rendezvous store",
            )
        except TimeoutError:
            raise StoreUnansweredError(
                f"the rendezvous store, hosted by {self.store_host}, did not answer within "
                f"{2 * grace_s + STORE_DEADLINE_S:g} s: {self.store_host} is stopped or frozen, not exited (a "
                "SIGSTOP, a debugger, swapping), or the network to it is down; look at that process and its host"
            ) from None

    def _exchange_on(self, store: Any, mine: dict, grace_s: float) -> dict[int, dict | None]:
        import json
        import time as _time

        prefix = "collective_ops/progress/"
        own_key = f"{prefix}{self.rank}"
        peers: dict[int, dict | None] = {}
        try:
            store.set(own_key, json.dumps(mine))
            _time.sleep(grace_s)  # peers stalled on the same bucket time out at about the same moment
            for peer in range(self.world_size):
                if peer != self.rank:
                    key = f"{prefix}{peer}"
                    peers[peer] = json.loads(store.get(key)) if store.check([key]) else None
            _time.sleep(grace_s)  # peers that timed out a little later still read this rank's report
            store.delete_key(own_key)  # a later stall must not read this one's report
        except Exception as exc:  # a dead store: the stall is still reported, naming the store's host
            raise StoreGoneError(
                f"the rendezvous store, hosted by {self.store_host}, is gone ({type(exc).__name__}: "
                f"{str(exc).splitlines()[0] if str(exc) else ''}): {self.store_host} exited or crashed "
                "(its own log says why)"
            ) from exc
        return peers

    def mark_stalled(self) -> None:
        """A collective of this engine's groups never completed: at shutdown or exit its groups are left behind.

        Destroying a Gloo group joins its worker threads, and the worker still inside the stalled collective
        returns only at the group's timeout (10 minutes by default; ``abort()`` does not end it on Gloo):
        the process could not exit before. The groups are kept alive instead, so their threads end with it.
        """
        self.stalled = True

    def _abandon_groups(self, timeout: float | None) -> None:
        """Every process group made in this process, held for good (never destroyed), then unregistered."""
        import ctypes

        from ..torch._compat import every_process_group

        for group in every_process_group():
            _ABANDONED.append(group)
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(group))  # survives the interpreter's teardown too
        if dist.is_initialized():
            with contextlib.suppress(Exception):
                call_with_deadline(dist.destroy_process_group, timeout, "unregistering the stalled process group")

    def allgather_bytes(self, data: bytes) -> list[bytes]:
        """Small metadata (e.g. JSON model signatures) from every rank. Bytes, never pickles."""
        lengths, payload = self._padded_bytes(data)
        gathered = torch.empty(self.world_size * payload.numel(), dtype=torch.uint8, device=self.device)
        self._blocking(_all_gather_single, gathered, payload)
        rows = gathered.view(self.world_size, payload.numel()).cpu()
        return [rows[r, : lengths[r]].numpy().tobytes() for r in range(self.world_size)]

    def gather_bytes(self, data: bytes, dst: int) -> list[bytes] | None:
        """Every rank's ``data`` on rank ``dst`` alone (None on the others, which hold only their own)."""
        lengths, payload = self._padded_bytes(data)
        rows = [torch.empty_like(payload) for _ in range(self.world_size)] if self.rank == dst else None
        self._blocking(dist.gather, payload, rows, dst=dst)
        if rows is None:
            return None
        return [row[: lengths[r]].cpu().numpy().tobytes() for r, row in enumerate(rows)]

    def _padded_bytes(self, data: bytes) -> tuple[list[int], torch.Tensor]:
        """Every rank's length (one small all-gather) and ``data`` in a uint8 tensor of the longest's length."""
        length = torch.tensor([len(data)], dtype=torch.int64, device=self.device)
        lengths = torch.empty(self.world_size, dtype=torch.int64, device=self.device)
        self._blocking(_all_gather_single, lengths, length)
        lengths = lengths.tolist()
        payload = torch.zeros(max(lengths), dtype=torch.uint8, device=self.device)
        payload[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else 0
        return lengths, payload
