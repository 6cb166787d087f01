"""Optimizer state values as JSON, for exchanging them between ranks without pickles.

``dist.all_gather_object`` unpickles what peers send, and an unpickle runs whatever code the bytes
name. The few state values the sharded optimizer exchanges (``step``, a 0-d parameter's state, the
keys each rank holds) travel instead as JSON: a tensor as its dtype, shape and raw bytes (base64,
so every dtype, complex and bfloat16 included, arrives bit for bit), a Python number or string as
itself. Anything else is refused with the type's name, never pickled.
"""

from __future__ import annotations

import base64
import json
from typing import Any

import torch

_TENSOR, _TUPLE = "__tensor__", "__tuple__"


def encode(value: Any) -> Any:
    """``value`` as JSON-ready data (tensors, tuples, lists, dicts with str/int keys, numbers, str, None)."""
    if isinstance(value, torch.Tensor):
        flat = value.detach().contiguous().cpu().reshape(-1)
        raw = flat.view(torch.uint8) if flat.numel() else torch.empty(0, dtype=torch.uint8)
        return {
            _TENSOR: base64.b64encode(raw.numpy().tobytes()).decode("ascii"),
            "dtype": str(value.dtype).removeprefix("torch."),
            "shape": list(value.shape),
            "cpu": value.device.type == "cpu",
        }
    if isinstance(value, tuple):
        return {_TUPLE: [encode(v) for v in value]}
    if isinstance(value, list):
        return [encode(v) for v in value]
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):
            return {"__items__": [[encode(k), encode(v)] for k, v in value.items()]}
        return {k: encode(v) for k, v in value.items()}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(
        f"optimizer state value of type {type(value).__module__}.{type(value).__name__} cannot be exchanged "
        "between ranks (only tensors, numbers, strings and lists/tuples/dicts of them; nothing is pickled)"
    )


def decode(data: Any, device: torch.device) -> Any:
    """What :func:`encode` gave, rebuilt; tensors that were not on the CPU go to ``device`` (this rank's)."""
    if isinstance(data, list):
        return [decode(v, device) for v in data]
    if not isinstance(data, dict):
        return data
    if _TENSOR in data:
        dtype = getattr(torch, data["dtype"])
        raw = bytearray(base64.b64decode(data[_TENSOR]))
        flat = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
        tensor = flat.view(dtype).reshape(data["shape"]).clone()
        return tensor if data["cpu"] else tensor.to(device)
    if _TUPLE in data:
        return tuple(decode(v, device) for v in data[_TUPLE])
    if "__items__" in data:
        return {decode(k, device): decode(v, device) for k, v in data["__items__"]}
    return {k: decode(v, device) for k, v in data.items()}


def to_bytes(value: Any) -> bytes:
    """``value`` as the JSON bytes that travel between ranks."""
    return json.dumps(encode(value)).encode()


def from_bytes(blob: bytes, device: torch.device) -> Any:
    """What :func:`to_bytes` made, tensors that were not on the CPU rebuilt on ``device``."""
    return decode(json.loads(blob), device)


def allgather(engine: Any, value: Any) -> list[Any]:
    """``value`` from every rank (a collective), as JSON bytes in uint8 tensors: sizes, then the padded bytes;
    tensors that were not on the CPU rebuilt on this rank's device."""
    return [from_bytes(blob, engine.device) for blob in engine.allgather_bytes(to_bytes(value))]
