"""MindSpore communication engine (HCCL on Ascend, NCCL on GPU, MCCL on CPU), launched by msrun.

Measured on CPU with mindspore 2.10 (MCCL): ``mint.distributed.all_reduce`` (every op,
async too), ``broadcast``, list-form ``all_gather`` and ``barrier`` work;
``all_gather_into_tensor`` and ``reduce_scatter_tensor`` have no CPU kernel, so on MCCL
allgather uses the list form and reduce_scatter is composed from an allreduce and a
slice (correct, but moves the whole tensor: documented in docs/mindspore.md).
``CommHandle.wait()`` returns at once on CPU; results are read through ``asnumpy()``,
which synchronises. ``Tensor.mul_`` is not in place on this build: in-place updates go
through ``copy_`` and slice assignment, which are.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Sequence
from typing import Any

import mindspore as ms
import mindspore.mint.distributed as mdist
import numpy as np
from mindspore import mint, nn, ops

from ..bucketing.interfaces import ThenHandle, call_with_deadline
from ..ops import parse_reduce_op
from .base import Engine, finish

_BACKEND_BY_TARGET = {"ascend": "hccl", "gpu": "nccl", "cpu": "mccl"}


def fresh_copy(tensor: ms.Tensor) -> ms.Tensor:
    """``tensor``'s values in memory of their own. ``mint.cat`` of the one tensor, not ``Tensor.copy()``: on
    CPU (mindspore 2.10, one process) 49 copies of 80 KB took 33-215 ms in PyNative and 84-114 ms in GRAPH
    mode, the concatenations 12-18 ms."""
    return mint.cat([tensor])


def dtype_name(dtype: Any) -> str:
    return str(dtype).lower()  # Float32 -> float32, BFloat16 -> bfloat16


class _MindSporeHandle:
    """``CommHandle`` with the ``is_completed()`` the rest of the library expects."""

    def __init__(self, handle: Any) -> None:
        self._handle = handle
        self._done = handle is None

    def wait(self) -> None:
        if not self._done:
            self._handle.wait()
            self._done = True

    def is_completed(self) -> bool:
        # MindSpore's handle cannot be polled; report completion once waited on.
        return self._done


class MindSporeEngine(Engine):
    framework = "mindspore"
    # Slice assignment costs ~10 ms per MiB on CPU; one mint.cat per bucket costs ~1 ms.
    assembles_buckets = True
    # Averages as nn.DistributedGradReducer does: sum, then times float32(1/world) in the gradient's
    # dtype. A native op="avg" (sum then divide) differs in the last bit unless world is a power of two.
    average_after_sum = True

    def __init__(self, backend: str, device: str) -> None:
        self.backend = backend
        self.device = device
        self._rank = mdist.get_rank()
        self._world = mdist.get_world_size()
        # Buffers this engine made (contiguous by construction). Asking a tensor whether it is
        # contiguous waits for MindSpore's async pipeline, which would stall every bucket launch.
        self._own_buffers: weakref.WeakValueDictionary = (
            weakref.WeakValueDictionary()
        )  # by id: Tensor == is elementwise

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world

    def owns(self, tensor: Any) -> bool:
        return isinstance(tensor, (ms.Tensor, np.ndarray))

    def _native(self, tensor: Any, what: str) -> tuple[ms.Tensor, Any]:
        """(MindSpore tensor, write-back) for a MindSpore tensor or a numpy array."""
        if isinstance(tensor, np.ndarray):
            if not tensor.flags.writeable:
                raise ValueError(f"{what}: numpy array is read-only; pass a writeable copy (a.copy())")
            array = tensor
            return ms.Tensor(np.ascontiguousarray(array)), lambda result: np.copyto(array, result.asnumpy())
        if not isinstance(tensor, ms.Tensor):
            raise TypeError(f"{what} takes a mindspore.Tensor or numpy.ndarray, got {type(tensor).__name__}")
        if self._own_buffers.get(id(tensor)) is not tensor and not tensor.is_contiguous():
            raise ValueError(f"{what}: tensor is not contiguous; pass tensor.contiguous()")
        return tensor, None

    def as_native(self, tensor: Any) -> ms.Tensor:
        native, write_back = self._native(tensor, "GradientBucket.add")
        if write_back is not None:
            raise TypeError("numpy arrays go through the torch engine; with MindSpore alone, add mindspore Tensors")
        return native

    def _call(self, what: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except RuntimeError as exc:
            raise RuntimeError(f"{what} failed on MindSpore backend {self.backend!r}: {exc}") from exc

    # -- primitives ---------------------------------------------------------------
    def allreduce(self, tensor: Any, op: Any = "sum", async_op: bool = False, group: Any = None) -> Any:
        op = parse_reduce_op(op)
        t, write_back = self._native(tensor, "allreduce")
        own = self._own_buffers.get(id(t)) is t  # our buffers hold gradients: floating, no dtype query
        if op == "avg" and not own and not t.is_floating_point():
            raise ValueError(
                f"allreduce(op='avg') of a {dtype_name(t.dtype)} tensor cannot hold the mean; "
                "use op='sum' and divide, or cast to a floating dtype"
            )
        kwargs = {"group": group} if group is not None else {}
        handle = self._call("allreduce", mdist.all_reduce, t, op=op, async_op=True, **kwargs)

        def done() -> Any:
            if write_back is not None:
                write_back(t)
            return tensor

        return finish(ThenHandle(_MindSporeHandle(handle), done), async_op)

    def broadcast(self, tensor: Any, src: int = 0, async_op: bool = False, group: Any = None) -> Any:
        if not isinstance(src, int) or not 0 <= src < self._world:
            raise ValueError(f"src={src!r} is not a rank of this group (0..{self._world - 1})")
        t, write_back = self._native(tensor, "broadcast")
        kwargs = {"group": group} if group is not None else {}
        handle = self._call("broadcast", mdist.broadcast, t, src, async_op=True, **kwargs)

        def done() -> Any:
            if write_back is not None:
                write_back(t)
            return tensor

        return finish(ThenHandle(_MindSporeHandle(handle), done), async_op)

    def allgather(self, tensor: Any, async_op: bool = False, group: Any = None) -> Any:
        t, write_back = self._native(tensor, "allgather")
        parts = [mint.zeros(t.shape, dtype=t.dtype) for _ in range(self._world)]
        kwargs = {"group": group} if group is not None else {}
        handle = self._call("allgather", mdist.all_gather, parts, t, async_op=True, **kwargs)

        def done() -> Any:
            result = mint.cat([p.reshape((1,)) if p.ndim == 0 else p for p in parts])
            return result.asnumpy() if write_back is not None else result

        return finish(ThenHandle(_MindSporeHandle(handle), done), async_op)

    def reduce_scatter(self, tensor: Any, op: Any = "sum", async_op: bool = False, group: Any = None) -> Any:
        op = parse_reduce_op(op)
        t, write_back = self._native(tensor, "reduce_scatter")
        if t.ndim == 0 or t.shape[0] % self._world:
            raise ValueError(
                f"reduce_scatter: the first dimension ({tuple(t.shape)}) must be a multiple of the world size "
                f"({self._world}); each rank receives one equal chunk"
            )
        # MCCL has no reduce-scatter kernel: reduce a copy, keep this rank's chunk.
        work = fresh_copy(t)
        handle = self.allreduce(work, op, async_op=True, group=group)
        chunk = t.shape[0] // self._world

        def done() -> Any:
            handle.wait()
            result = self._piece(work, self._rank * chunk, chunk)
            return result.asnumpy() if write_back is not None else result

        return finish(ThenHandle(None, done), async_op)

    def barrier(self) -> None:
        mdist.barrier()

    def compiled_reduction(
        self,
        buckets: Sequence[Sequence[int]],
        numels: Sequence[int],
        shapes: Sequence[Sequence[int]],
        dtypes: Sequence[str],
        reduce_op: str,
        wire_dtype: str | None = None,
    ) -> CompiledReduction | None:
        """A compiled whole-plan reduction, or None where ops.AllReduce cannot do what was asked.

        ``wire_dtype``: communicate in this dtype (compression); gradients already in it are not cast.
        """
        supported = _COMPILED_DTYPES.get(self.backend, _COMPILED_DTYPES_DEFAULT)
        if len(set(dtypes)) != 1:
            return None  # mixed-precision plans: the eager path handles each bucket's dtype
        dtype = dtypes[0]
        if wire_dtype == dtype:
            wire_dtype = None
        if reduce_op not in ("sum", "avg") or (wire_dtype or dtype) not in supported:
            return None
        scale = self._average_scale(reduce_op)
        return CompiledReduction(buckets, numels, shapes, scale, getattr(ms, wire_dtype) if wire_dtype else None)

    def compiled_shard_step(
        self,
        params: Sequence[Any],
        buckets: Sequence[Sequence[int]],
        padding: Sequence[int],
        shard_numel: Sequence[int],
        pieces: Sequence[Sequence[Any]],
        reduce_op: str,
    ) -> tuple[CompiledShardReduction, CompiledShardGather]:
        """A sharded step's reduction and all-gather, each one compiled graph (:class:`CompiledShardReduction`,
        :class:`CompiledShardGather`). ``pieces``: this rank's piece Parameters of each bucket, in buffer order;
        ``reduce_op``: "avg" (times ``1/world``, as ``DistributedGradReducer(mean=True)``) or "sum"."""
        if reduce_op not in ("sum", "avg"):
            raise ValueError(f"a sharded step reduces by 'sum' or 'avg', got {reduce_op!r}")
        scale = self._average_scale(reduce_op)
        sizes = [[int(p.size) for p in of_bucket] for of_bucket in pieces]
        reduction = CompiledShardReduction(buckets, padding, shard_numel, sizes, self._rank, scale)
        gather = CompiledShardGather(
            params,
            buckets,
            [p for of_bucket in pieces for p in of_bucket],
            [len(of_bucket) for of_bucket in pieces],
            [int(n) - sum(of_bucket) for n, of_bucket in zip(shard_numel, sizes)],
        )
        return reduction, gather

    def _average_scale(self, reduce_op: str) -> float | None:
        """What a compiled reduction multiplies the sum by: ``1/world`` to average (None: a sum, or one rank)."""
        return 1.0 / self._world if reduce_op == "avg" and self._world > 1 else None

    def shutdown(self, timeout: float | None = None) -> None:
        # Peers that exit while others still send fail after ~30 s: meet at a barrier first. The barrier
        # takes no timeout, and a dead peer would hold it forever: bounded here.
        call_with_deadline(mdist.barrier, timeout, "the closing MindSpore barrier (is a peer rank gone?)")

    # -- BucketEngine ---------------------------------------------------------------
    def describe(self, tensor: ms.Tensor) -> tuple[int, str, str]:
        return int(tensor.size), dtype_name(tensor.dtype), self.device

    def itemsize(self, tensor: ms.Tensor) -> int:
        return int(tensor.itemsize)

    def is_contiguous(self, tensor: Any) -> bool:
        return isinstance(tensor, ms.Tensor) and tensor.is_contiguous()

    def _own(self, tensor: ms.Tensor) -> ms.Tensor:
        self._own_buffers[id(tensor)] = tensor
        return tensor

    def zeros(self, numel: int, dtype: str, device: str) -> ms.Tensor:
        return self._own(mint.zeros(numel, dtype=getattr(ms, dtype)))

    @staticmethod
    def _piece(buffer: ms.Tensor, offset: int, numel: int) -> ms.Tensor:
        # a copy: a view (a slice, mint.narrow) does not write through copy_ and one starting at 0 breaks it
        # (mindspore 2.10, CPU). Copied from mint.narrow: 0.35 ms for 1 MiB of a 22 MiB buffer on CPU, against
        # 2.8 ms from a slice (item access goes through MindSpore's index machinery).
        return fresh_copy(mint.narrow(buffer, 0, offset, numel))

    def segment(self, buffer: ms.Tensor, offset: int, numel: int, shape: Sequence[int] | None = None) -> ms.Tensor:
        piece = self._piece(buffer, offset, numel)  # a copy: MindSpore has no flat views to hand out
        return piece if shape is None else piece.reshape(tuple(shape))

    def write(self, buffer: ms.Tensor, offset: int, tensor: ms.Tensor) -> None:
        buffer[offset : offset + int(tensor.size)] = tensor.reshape(-1).astype(buffer.dtype)

    def write_back(self, tensor: ms.Tensor, buffer: ms.Tensor, offset: int) -> None:
        tensor.copy_(self._piece(buffer, offset, int(tensor.size)).reshape(tensor.shape))

    def pack(self, tensors: Sequence[ms.Tensor]) -> ms.Tensor:
        """One flat buffer holding ``tensors`` in order."""
        return self._own(mint.cat([t.reshape(-1) for t in tensors]))

    def unpack(self, buffer: ms.Tensor, numels: Sequence[int]) -> list[ms.Tensor]:
        return list(mint.split(buffer, list(numels)))

    def fill_zero(self, buffer: ms.Tensor, offset: int, numel: int) -> None:
        buffer[offset : offset + numel] = 0

    def int_tensor(self, values: Sequence[int], device: str) -> ms.Tensor:
        return ms.Tensor(np.asarray(list(values), dtype=np.int32))

    def to_list(self, tensor: ms.Tensor) -> list:
        return tensor.asnumpy().tolist()

    def scale_(self, buffer: ms.Tensor, factor: float) -> None:
        # the factor as DistributedGradReducer holds it: a float32 tensor cast to the buffer's dtype
        buffer.copy_(buffer * ms.Tensor(factor, ms.float32).astype(buffer.dtype))

    def cast(self, buffer: ms.Tensor, dtype: str) -> ms.Tensor:
        return self._own(buffer.astype(getattr(ms, dtype)))

    def copy_(self, dst: ms.Tensor, src: ms.Tensor) -> None:
        dst.copy_(src.reshape(dst.shape).astype(dst.dtype))

    # -- low-rank compression (bucketing/compression/powersgd.py): eager, in place through copy_ ------------------
    def divide_(self, tensor: ms.Tensor, divisor: int) -> None:
        tensor.copy_(tensor / divisor)

    def add_(self, dst: ms.Tensor, src: ms.Tensor) -> None:
        dst.copy_(mint.add(dst, src.reshape(dst.shape)))

    def sub_into(self, buffer: ms.Tensor, offset: int, a: ms.Tensor, b: ms.Tensor) -> None:
        self.write(buffer, offset, mint.sub(a, b.reshape(a.shape)))

    def bmm_into(
        self,
        buffer: ms.Tensor,
        offset: int,
        a: ms.Tensor,
        b: ms.Tensor,
        transpose_a: bool = False,
        transpose_b: bool = False,
    ) -> ms.Tensor:
        """The product written into ``buffer`` as computed: no segment copied out only to be overwritten."""
        product = _batched_product(a, b, transpose_a, transpose_b)
        self.write(buffer, offset, product)
        return product

    def orthogonalize_(self, matrices: ms.Tensor, epsilon: float = 0.0) -> None:
        """Orthonormal columns, in place, for a batch of (batch, rows, rank) matrices, as torch's hook does:
        Gram-Schmidt at rank 1-2 or in half precision, else a QR factorisation (``ops.qr``; ``epsilon`` then
        unused), which keeps a zero matrix's columns finite. A QR factorisation may flip a column's sign against
        torch's, but the sign flips its P and its Q factor alike, so P Q^T, the result, agrees with torch's to
        fp32 rounding (the stored factors may differ in sign)."""
        rank = int(matrices.shape[2])
        if rank > 2 and matrices.dtype not in (ms.float16, ms.bfloat16):
            matrices.copy_(ops.qr(matrices)[0])
            return
        rest, columns = matrices, []
        for i in range(rank):
            col = rest[:, :, 0:1]
            norm = mint.sqrt(mint.sum(col * col, dim=1, keepdim=True))
            col = col / (norm + epsilon) if epsilon else col / norm
            columns.append(col)
            if i + 1 < rank:
                rest = rest[:, :, 1:]
                rest = rest - mint.sum(col * rest, dim=1, keepdim=True) * col
        matrices.copy_(mint.cat(columns, dim=2))

    def fill_normal_(self, tensors: Sequence[ms.Tensor], seed: int) -> None:
        """Standard normal draws into ``tensors``, one after another from numpy's ``RandomState(seed)`` (the same on
        every rank and device). Not torch's draws: torch's hook seeds ``torch.randn``, whose generator MindSpore
        cannot reproduce, so the first compressed step's Q factors differ from a torch run's with the same seed."""
        state = np.random.RandomState(seed)
        for tensor in tensors:
            draws = state.standard_normal(tuple(int(d) for d in tensor.shape)).astype(np.float32)
            tensor.copy_(ms.Tensor(draws).astype(tensor.dtype))

    def synchronize(self) -> None:
        """Wait for MindSpore's queue (its collectives' handles return before the work is done on the CPU)."""
        ms.runtime.synchronize()

    def reduce_floats(self, values: Sequence[float], op: str = "max") -> list[float]:
        """``values`` reduced over ranks (small bookkeeping, e.g. the slowest rank's time), in float32."""
        reduced = self.allreduce(ms.Tensor(np.asarray(values, dtype=np.float32)), op)
        return [float(v) for v in reduced.asnumpy()]

    def broadcast_ints(self, values: Sequence[int], src: int = 0) -> list[int]:
        t = ms.Tensor(np.asarray(list(values), dtype=np.int32))
        mdist.broadcast(t, src)
        return t.asnumpy().tolist()

    def allgather_bytes(self, data: bytes) -> list[bytes]:
        """Small metadata from every rank, as int32 words (widely supported by every backend)."""
        lengths = self.allgather(ms.Tensor(np.asarray([len(data)], dtype=np.int32))).asnumpy()
        longest = int(lengths.max())
        payload = np.zeros(longest, dtype=np.int32)
        payload[: len(data)] = np.frombuffer(data, dtype=np.uint8)
        rows = self.allgather(ms.Tensor(payload.reshape(1, -1) if longest else np.zeros((1, 1), np.int32)))
        rows = rows.asnumpy()
        return [bytes(rows[r, : int(lengths[r])].astype(np.uint8).tolist()) for r in range(self._world)]


# ops.AllReduce's dtypes (sum): MCCL measured fp32/fp16 only; HCCL/NCCL take bfloat16 too.
_COMPILED_DTYPES = {"mccl": {"float32", "float16"}}
_COMPILED_DTYPES_DEFAULT = {"float32", "float16", "bfloat16"}


# A gradient of this many elements or more is reduced on its own inside its bucket, not concatenated with the
# others: its allreduce is bandwidth-bound, so fusing it gains nothing (MCCL runs one large fused allreduce behind
# several separate ones), while every concatenated member costs the graph compiler time. Small gradients still
# fuse, where one collective beats many. benchmarks/mindspore_compare.py --graph --train-cell, transformer-5m on
# the emulated link: 0.97-1.02x DistributedGradReducer's step with this, 1.11x fully fused (mindspore_compare.json).
ALONE_NUMEL = 1 << 18


def _batched_product(a: ms.Tensor, b: ms.Tensor, transpose_a: bool, transpose_b: bool) -> ms.Tensor:
    """``a @ b`` on batches of matrices, either operand transposed (a new tensor)."""
    a = mint.transpose(a, 1, 2) if transpose_a else a
    b = mint.transpose(b, 1, 2) if transpose_b else b
    return mint.bmm(a, b)


class CompiledReduction(nn.Cell):
    """Every bucket of a plan reduced in one compiled MindSpore graph: concatenate, sum, scale, slice apart; a
    gradient of :data:`ALONE_NUMEL` elements or more is summed and scaled on its own, in its bucket's turn.

    What ``nn.DistributedGradReducer`` gets from ``@jit`` and comm fusion, with our bucket plan:
    one launch per step for the whole reduction, no Python between the kernels, and the graph
    runs asynchronously like any other MindSpore call. Averaging multiplies the sum by
    ``1/world`` as ``DistributedGradReducer(mean=True)`` does. With a ``wire_dtype``
    (compression) a bucket is cast, scaled, summed and cast back, the arithmetic of the
    eager compression hook. Compiled once per plan.
    """

    def __init__(
        self,
        buckets: Sequence[Sequence[int]],
        numels: Sequence[int],
        shapes: Sequence[Sequence[int]],
        scale: float | None,
        wire_dtype: Any = None,
    ) -> None:
        super().__init__(auto_prefix=False)
        self.wire_dtype = wire_dtype
        self.buckets = tuple(tuple(b) for b in buckets)
        self.numels = tuple(int(n) for n in numels)
        self.shapes = tuple(tuple(int(d) for d in shape) for shape in shapes)
        self.count = len(self.numels)
        # per bucket: its large gradients (reduced alone) and the rest (concatenated)
        self.alone = tuple(tuple(i for i in b if self.numels[i] >= ALONE_NUMEL) for b in self.buckets)
        self.fused = tuple(tuple(i for i in b if self.numels[i] < ALONE_NUMEL) for b in self.buckets)
        # a step's allreduces: one per gradient sent alone, one per bucket's concatenated rest
        self.collectives = sum(len(alone) + bool(fused) for alone, fused in zip(self.alone, self.fused))
        self.allreduce = ops.AllReduce()  # sum
        self.scale = ms.Tensor(scale, ms.float32) if scale is not None else None
        self.enable_tuple_broaden = True  # gradients are inputs, not constants: one compilation

    @ms.jit(backend="ms_backend")
    def construct(self, grads):
        out = [None] * self.count
        for alone, fused in zip(self.alone, self.fused):
            for i in alone:
                out[i] = self.reduce(grads[i])
            if len(fused) == 1:
                out[fused[0]] = self.reduce(grads[fused[0]])
            elif fused:
                flat = self.reduce(ops.concat([ops.reshape(grads[i], (-1,)) for i in fused]))
                start = 0
                for i in fused:
                    out[i] = ops.reshape(flat[start : start + self.numels[i]], self.shapes[i])
                    start += self.numels[i]
        return tuple(out)

    def reduce(self, tensor):
        """Summed over the ranks and scaled; with a ``wire_dtype``, cast to it and scaled before the sum."""
        if self.wire_dtype is not None:
            grad_dtype = tensor.dtype
            tensor = ops.cast(tensor, self.wire_dtype)
            if self.scale is not None:
                tensor = tensor * ops.cast(self.scale, self.wire_dtype)
            return ops.cast(self.allreduce(tensor), grad_dtype)
        tensor = self.allreduce(tensor)
        if self.scale is not None:
            tensor = tensor * ops.cast(self.scale, tensor.dtype)
        return tensor


class CompiledShardReduction(nn.Cell):
    """A sharded step's reduction in one compiled graph: per bucket, the gradients concatenated (zeros to the
    padded size), summed over the ranks, this rank's shard kept, scaled by ``1/world`` as
    ``DistributedGradReducer(mean=True)`` averages, and cut into this rank's pieces (returned bucket by bucket,
    in buffer order). The sum is an all-reduce and a slice, as the eager ``reduce_scatter`` composes it (MCCL
    has no ReduceScatter kernel). In eager PyNative the same ops cost ~250 ms a step for a 1.6M-parameter MLP on
    CPU, op by op (mindspore 2.10).

    ``buckets``: each bucket's parameter indices; ``padding``: zeros after them; ``shard_numel``: each shard's
    length; ``pieces``: the lengths of this rank's pieces of each bucket (they fill its shard from the start)."""

    def __init__(
        self,
        buckets: Sequence[Sequence[int]],
        padding: Sequence[int],
        shard_numel: Sequence[int],
        pieces: Sequence[Sequence[int]],
        rank: int,
        scale: float | None,
    ) -> None:
        super().__init__(auto_prefix=False)
        self.buckets = tuple(tuple(b) for b in buckets)
        self.padding = tuple(int(n) for n in padding)
        self.bounds = tuple((rank * int(n), (rank + 1) * int(n)) for n in shard_numel)
        self.pieces = tuple(tuple(int(n) for n in sizes) for sizes in pieces)  # the shard's padding follows them
        self.allreduce = ops.AllReduce()  # sum
        self.scale = ms.Tensor(scale, ms.float32) if scale is not None else None
        self.enable_tuple_broaden = True  # gradients are inputs, not constants: one compilation

    @ms.jit(backend="ms_backend")
    def construct(self, grads):
        out = ()
        previous = None
        for b in range(len(self.buckets)):
            parts = [ops.reshape(grads[i], (-1,)) for i in self.buckets[b]]
            if self.padding[b]:
                parts.append(ops.zeros(self.padding[b], parts[0].dtype))
            flat = ops.concat(parts) if len(parts) > 1 else parts[0]
            if previous is not None:  # in plan order on every rank: the graphs differ by rank (their slices)
                flat = ops.depend(flat, previous)
            flat = self.allreduce(flat)
            previous = flat
            shard = flat[self.bounds[b][0] : self.bounds[b][1]]
            if self.scale is not None:
                shard = shard * ops.cast(self.scale, shard.dtype)
            start = 0
            for size in self.pieces[b]:  # slices: ops.split costs the compiler more
                out = out + (shard[start : start + size],)
                start += size
        return out


class CompiledShardGather(nn.Cell):
    """A sharded step's all-gather in one compiled graph: per bucket, this rank's updated pieces concatenated
    (zeros for its shard's padding), all-gathered, cut into the bucket's parameters and assigned to them in
    place. In eager PyNative (concatenate, all-gather, split, copy, ``set_data`` per parameter) it cost ~350 ms
    a step for a 1.6M-parameter MLP on CPU (mindspore 2.10).

    ``params``: the network's parameters (plan indices); ``pieces``: this rank's piece Parameters, bucket by
    bucket in buffer order; ``counts``: how many of them each bucket has; ``shard_padding``: zeros after them in
    each shard (the bucket's own padding, after its parameters, is gathered and left unread)."""

    def __init__(
        self,
        params: Sequence[Any],
        buckets: Sequence[Sequence[int]],
        pieces: Sequence[Any],
        counts: Sequence[int],
        shard_padding: Sequence[int],
    ) -> None:
        super().__init__(auto_prefix=False)  # the network's parameter names stay as they are
        self.params = ms.ParameterTuple(params)
        self.pieces = ms.ParameterTuple(pieces)
        self.buckets = tuple(tuple(b) for b in buckets)
        self.counts = tuple(int(n) for n in counts)
        self.shard_padding = tuple(int(n) for n in shard_padding)
        self.sizes = tuple(int(p.size) for p in params)
        self.shapes = tuple(tuple(p.shape) for p in params)
        self.allgather = ops.AllGather()

    @ms.jit(backend="ms_backend")
    def construct(self):
        done = ()
        first = 0
        previous = None
        for b in range(len(self.buckets)):
            parts = [ops.reshape(self.pieces[k], (-1,)) for k in range(first, first + self.counts[b])]
            first = first + self.counts[b]
            if self.shard_padding[b]:
                parts.append(ops.zeros(self.shard_padding[b], ms.float32))
            shard = ops.concat(parts) if len(parts) > 1 else parts[0]
            if previous is not None:  # in plan order on every rank: the graphs differ by rank (their pieces)
                shard = ops.depend(shard, previous)
            full = self.allgather(shard)
            previous = full
            start = 0
            for i in self.buckets[b]:  # slices: ops.split costs the compiler more
                value = full[start : start + self.sizes[i]]
                done = done + (ops.assign(self.params[i], ops.reshape(value, self.shapes[i])),)
                start += self.sizes[i]
        return done


def init_mindspore(backend: str | None, *, device_id: int | None = None, algorithm: str | None = None):
    """Start MindSpore communication as launched by msrun; returns (engine, local rank, device target).

    The runtime builds its context from these: engines never reach back into the runtime.
    """
    from mindspore.communication import init as ms_init

    target = str(ms.get_context("device_target")).lower()
    native = _BACKEND_BY_TARGET.get(target, "mccl")
    if backend is not None and backend.lower() not in (native, None):
        raise ValueError(f"MindSpore on {target} uses {native!r}; backend={backend!r} is not available here")
    if algorithm:
        os.environ["HCCL_ALGO" if native == "hccl" else "NCCL_ALGO"] = algorithm
    if device_id is None:
        device_id = int(os.environ.get("DEVICE_ID", os.environ.get("MS_LOCAL_RANK", "0")) or 0)
    if target in ("ascend", "gpu"):
        ms.set_device(target.capitalize() if target == "ascend" else "GPU", device_id)
    if not mdist.is_initialized():
        ms_init()
    engine = MindSporeEngine(native, target)
    local_rank = int(os.environ.get("MS_LOCAL_RANK", engine.rank))
    return engine, local_rank, target
