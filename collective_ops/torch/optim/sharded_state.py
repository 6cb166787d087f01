"""The sharded optimizer's state across ranks: gathered whole, as torch.distributed.checkpoint's sharded state,
or moved to another shard layout (collectives, in the same order on every rank).

:class:`ShardedState` reads one layout's pieces: each rank holds, per parameter piece inside its shards, the
wrapped class's state for that piece (and, for fp16/bf16 parameters, its fp32 master). The full state is in
the plain optimizer's format (:func:`in_plain_format`): loadable into it, and from it at any world size.
"""

from __future__ import annotations

from typing import Any

import torch

from ...bucketing.shard.layout import ShardLayout, ShardPiece
from . import state_json as _state_json
from .dcp import is_sharded, piece_values, sharded_state_tensor
from .precision import LOW_PRECISION, MASTER_KEY


class ShardedState:
    """The state of this rank's pieces of ``layout``: ``pieces`` (piece, tensor the class steps: a view of the
    parameter buffers, or an fp32 master), by bucket in ``bucket_pieces``; ``inner_state``: the wrapped class's
    state by tensor; ``params``: the model's parameters by index; ``engine``: the collectives."""

    def __init__(
        self,
        engine: Any,
        layout: ShardLayout,
        pieces: list[tuple[ShardPiece, torch.Tensor]],
        bucket_pieces: list[list[tuple[ShardPiece, torch.Tensor]]],
        param_buffers: list[torch.Tensor],
        inner_state: Any,
        params: list[torch.Tensor],
    ) -> None:
        self.engine = engine
        self.layout = layout
        self.pieces = pieces
        self.bucket_pieces = bucket_pieces
        self.param_buffers = param_buffers
        self.inner_state = inner_state
        self.params = params

    def slice(self, state: dict[str, Any], piece: ShardPiece) -> dict[str, Any]:
        """A piece's part of a parameter's state: full values, or torch.distributed.checkpoint's sharded ones
        (taken in this layout, or filled by ``dcp.load`` for it); copies, the fp32 masters among them."""
        p = self.params[piece.param_index]
        sliced = {}
        for key, value in state.items():
            if is_sharded(value):
                sliced[key] = piece_values(value, p, piece).clone()
            elif key == MASTER_KEY or _elementwise(key, value, p):
                sliced[key] = _flat_like(value, p)[piece.param_start : piece.param_end].clone()
            else:  # a scalar (step): each piece its own, as the class's load_state_dict would not copy it
                sliced[key] = value.clone() if isinstance(value, torch.Tensor) else value
        return sliced

    def moved_to(self, layout: ShardLayout) -> dict[ShardPiece, dict[str, Any]]:
        """This rank's pieces in ``layout`` (a replan's), each with its slice of the state (copies), gathered from
        the current layout one bucket and key at a time (collectives), each key's old values dropped once
        gathered: at most one bucket's values of one key are whole at once, against the whole state that
        :meth:`full` gathers (the process's peak RSS: transformer-5m at 2 ranks, +107 MiB at the online
        tune's replan)."""
        plan, inner_state = self.layout.plan, self.inner_state
        scalars, keys = self.scalars()
        moved: dict[int, list[ShardPiece]] = {}
        for piece in layout.pieces(self.engine.rank):
            moved.setdefault(piece.param_index, []).append(piece)
        slices = {
            piece: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in scalars[index].items()}
            for index, pieces in moved.items()
            if index in scalars
            for piece in pieces
        }
        for bucket, key, flat in self.bucket_states(keys):
            for _, tensor in self.bucket_pieces[bucket]:
                inner_state.get(tensor, {}).pop(key, None)  # (a master stays: the piece is the parameter's)
            spec = plan.buckets[bucket]
            for index, offset in zip(spec.param_indices, spec.offsets):
                for piece in moved.get(index, []) if index in scalars else []:
                    slices[piece][key] = flat.narrow(0, offset + piece.param_start, piece.numel).clone()
        return slices

    def bucket_states(self, keys: list[str]) -> Any:
        """Each bucket's whole flat value of each per-element key, gathered from every rank's shard (collectives,
        in the same order on every rank), one at a time: (bucket, key, flat)."""
        plan = self.layout.plan
        for bucket, shards in enumerate(self.layout.buckets):
            for key in keys:
                if key == MASTER_KEY and getattr(torch, plan.buckets[bucket].dtype) not in LOW_PRECISION:
                    continue  # fp32 parameters are their own masters
                yield bucket, key, self._gather_bucket(bucket, key, shards.shard_numel)

    def full(self, keep: bool = True, device: torch.device | None = None) -> dict[int, dict[str, Any]]:
        """Every parameter's state (model index -> {key: value}), gathered per bucket (collectives). ``keep``
        False: this rank takes part only (an empty result); ``device``: where the values go, bucket by bucket
        (default: where the state is)."""
        plan = self.layout.plan
        full, keys = self.scalars(device)
        for bucket, key, flat in self.bucket_states(keys):
            if not keep:
                continue
            flat = flat if device is None else flat.to(device)
            spec = plan.buckets[bucket]
            for index, offset in zip(spec.param_indices, spec.offsets):
                if index in full:
                    p = self.params[index]
                    full[index][key] = _unflat_like(flat.narrow(0, offset, p.numel()), p)
        return full if keep else {}

    def scalars(self, device: torch.device | None = None) -> tuple[dict[int, dict[str, Any]], list[str]]:
        """(every stepped parameter's values that are not per element (``step``; all of a 0-d parameter's), from
        the rank holding its first element; the per-element keys any rank holds): one small all-gather."""
        inner_state = self.inner_state
        scalars, keys = {}, set()
        for piece, tensor in self.pieces:
            state = inner_state.get(tensor, {})
            keys |= {k for k, v in state.items() if _piecewise(v, piece)}
            if piece.param_start == 0 and state:
                scalars[piece.param_index] = self._scalar_state(piece, tensor, state)
        if any(is_master(pc, t, self.param_buffers) for pc, t in self.pieces):
            keys.add(MASTER_KEY)
        gathered = _state_json.allgather(self.engine, (scalars, sorted(keys)))  # JSON: nothing unpickled
        state: dict[int, dict[str, Any]] = {}
        for rank_scalars, _ in gathered:
            state.update({index: _moved(dict(values), device) for index, values in rank_scalars.items()})
        return state, sorted({k for _, rank_keys in gathered for k in rank_keys})

    def _scalar_state(self, piece: ShardPiece, tensor: torch.Tensor, state: dict[str, Any]) -> dict[str, Any]:
        """What of a piece's state is not per element (``step``); of a 0-d parameter (one piece: CLIP's
        ``logit_scale``), all of it, shaped as the parameter, its fp32 master too."""
        if self.params[piece.param_index].dim() != 0:
            return {k: v for k, v in state.items() if not _piecewise(v, piece)}
        whole = {k: v.reshape(()) if _piecewise(v, piece) else v for k, v in state.items()}
        if is_master(piece, tensor, self.param_buffers):
            whole[MASTER_KEY] = tensor.detach().reshape(())
        return whole

    def sharded(self) -> dict[int, dict[str, Any]]:
        """Every parameter's state as torch.distributed.checkpoint saves sharded state (``full_state_dict=False``):
        each per-element value a ``ShardedTensor`` whose local shards view this rank's pieces of it (nothing
        gathered: 1/N of the state per rank), the rest (``step``) from :meth:`scalars`."""
        state, keys = self.scalars()
        inner_state = self.inner_state
        mine: dict[int, list[tuple[ShardPiece, torch.Tensor]]] = {}
        for piece, tensor in self.pieces:
            mine.setdefault(piece.param_index, []).append((piece, tensor))
        for index, values in state.items():
            p = self.params[index]
            if p.dim() == 0:
                continue  # (gathered whole with the scalars)
            dtype = torch.float32 if p.dtype in LOW_PRECISION else p.dtype
            owners = self.layout.owners(index)
            for key in keys:
                if key == MASTER_KEY and p.dtype not in LOW_PRECISION:
                    continue
                local = {}
                for piece, tensor in mine.get(index, []):
                    value = tensor.detach() if key == MASTER_KEY else inner_state.get(tensor, {}).get(key)
                    local[piece] = value if value is not None else torch.zeros_like(tensor, dtype=dtype)
                values[key] = sharded_state_tensor(p, owners, local, dtype, p.device)
        return state

    def _gather_bucket(self, bucket: int, key: str, shard_numel: int) -> torch.Tensor:
        """Every rank's values of ``key`` in ``bucket``, flat as the bucket lies (zeros where a piece has none).

        Gathered in place (the engine's all-gather of shards: on Gloo point-to-point in 1 MiB pieces), so the
        bucket's values exist once: Gloo's own all-gather copied them once more, +68 MiB of peak RSS in a replan
        of transformer-5m at 2 ranks."""
        engine = self.engine
        dtype = _master_dtype(self.layout.plan.buckets[bucket].dtype)  # the layout being read (a replan: the old)
        flat = torch.zeros(shard_numel * engine.world_size, dtype=dtype, device=self.param_buffers[bucket].device)
        local = engine.shard_of(flat)
        for piece, tensor in self.bucket_pieces[bucket]:
            value = tensor.detach() if key == MASTER_KEY else self.inner_state.get(tensor, {}).get(key)
            if value is not None:
                local.narrow(0, piece.shard_offset, piece.numel).copy_(value.reshape(-1))
        return engine.all_gather_shard(flat)


def in_plain_format(
    full: dict[int, dict[str, Any]], inner_groups: list[dict], model_groups: list[list], index_of: dict[int, int]
) -> dict[str, Any]:
    """Every parameter's state (model index -> {key: value}) as the plain optimizer's state_dict; ``index_of``:
    id(parameter) -> its model index."""
    state, groups, number = {}, [], 0
    for inner_group, params in zip(inner_groups, model_groups):
        ids = []
        for p in params:
            index = index_of.get(id(p))  # None: frozen (requires_grad=False), never stepped, no state
            if index in full:
                state[number] = full[index]
            ids.append(number)
            number += 1
        groups.append({**settings_of(inner_group), "params": ids})
    return {"state": state, "param_groups": groups}


def _moved(state: dict[str, Any], device: torch.device | None) -> dict[str, Any]:
    """A state's tensor values on ``device`` (None: where they are)."""
    if device is None:
        return state
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in state.items()}


def settings_of(group: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in group.items() if k != "params"}


def is_master(piece: ShardPiece, tensor: torch.Tensor, param_buffers: list[torch.Tensor]) -> bool:
    """True when the piece's tensor is an fp32 copy (of low-precision parameters), not a view of them."""
    return tensor.dtype != param_buffers[piece.bucket].dtype


def _master_dtype(dtype: str) -> torch.dtype:
    """The dtype the optimizer works in for a bucket of ``dtype``: fp32 for fp16/bf16, else its own."""
    torch_dtype = getattr(torch, dtype)
    return torch.float32 if torch_dtype in LOW_PRECISION else torch_dtype


def _piecewise(value: Any, piece: ShardPiece) -> bool:
    """A piece's state value with one entry per element (exp_avg), not a scalar (step)."""
    return isinstance(value, torch.Tensor) and value.dim() == 1 and value.numel() == piece.numel


def _elementwise(key: str, value: Any, p: torch.Tensor) -> bool:
    """A full state value with one entry per element of ``p``."""
    return isinstance(value, torch.Tensor) and value.shape == p.shape and not (p.dim() == 0 and key == "step")


def _flat_like(value: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """``value``'s elements in ``p``'s memory order (how ``p`` lies in its bucket), flat."""
    laid_out = torch.empty_like(p, dtype=value.dtype).copy_(value)
    return laid_out.as_strided((p.numel(),), (1,), 0)


def _unflat_like(flat: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`_flat_like`: a tensor shaped (and strided) as ``p``, where ``flat`` is."""
    out = torch.empty_like(p, dtype=flat.dtype, device=flat.device)
    out.as_strided((p.numel(),), (1,), 0).copy_(flat)
    return out


def pieces_of(pieces: list[ShardPiece], param_shard: Any) -> list[tuple[ShardPiece, torch.Tensor]]:
    """Each of this rank's pieces with the tensor the optimizer class steps: a view of its parameters' shard
    (``param_shard(bucket)``), or for fp16/bf16 parameters an fp32 master copy of it."""
    out = []
    for piece in pieces:
        source = param_shard(piece.bucket).narrow(0, piece.shard_offset, piece.numel)
        master = source.detach().float().clone() if source.dtype in LOW_PRECISION else source
        out.append((piece, master))
    return out


def inner_state_dict(groups: list[dict[str, Any]], slices: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """The state_dict that loads ``slices`` (id(piece tensor) -> its slice of the state) into an optimizer over
    the pieces grouped as ``groups``; each fp32 master among them copied into its piece first."""
    inner_state, number, numbered = {}, 0, []
    for group in groups:
        numbered.append({**settings_of(group), "params": list(range(number, number + len(group["params"])))})
        for tensor in group["params"]:
            sliced = slices.get(id(tensor))
            if sliced is not None:
                master = sliced.pop(MASTER_KEY, None)
                if master is not None:
                    tensor.detach().copy_(master)
                inner_state[number] = sliced
            number += 1
    return {"state": inner_state, "param_groups": numbered}


def take_params_into_masters(
    pieces: list[tuple[ShardPiece, torch.Tensor]],
    param_buffers: list[torch.Tensor],
    param_shard: Any,
    only_changed: bool,
) -> None:
    """Each fp32 master among ``pieces`` from its low-precision parameter elements (``param_shard(bucket)``:
    this rank's shard of the bucket's parameter buffer); ``only_changed``: only the elements the parameters no
    longer round the master to."""
    with torch.no_grad():
        for piece, tensor in pieces:
            if is_master(piece, tensor, param_buffers):
                param = param_shard(piece.bucket).narrow(0, piece.shard_offset, piece.numel)
                values = param.to(tensor.dtype)
                if only_changed:
                    values = torch.where(param != tensor.to(param.dtype), values, tensor)
                tensor.copy_(values)


def return_freed_memory() -> None:
    """Hand the host memory a relayout freed back to the system (glibc's ``malloc_trim``; elsewhere nothing).

    The old buffers and the gathered state, freed, stay in the C heap's free lists, which the next backward's
    allocations, of other sizes, do not fill: transformer-5m at 2 ranks, 3 steps with ``bucket_size_mb="auto"``
    (a replan at the second), peak RSS 512 MiB untrimmed, 497 trimmed (one run each)."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    trim = getattr(ctypes.CDLL(name), "malloc_trim", None) if name else None
    if trim is not None:
        trim(0)
