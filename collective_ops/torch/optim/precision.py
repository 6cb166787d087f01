"""Mixed precision of a DistributedOptimizer: the dtype gradients are kept and averaged in, and fp32 masters.

A bf16/fp16 model can keep fp32 main gradients (``grad_dtype=torch.float32``): the wrapper's bucket buffers are
fp32, each gradient autograd makes in bf16 is added into them as it arrives (across ``no_sync()`` micro-steps
too) and the buffers are averaged in fp32. With ``master_weights=True`` the optimizer class updates fp32 masters
of the parameters from those gradients and rounds them into the parameters after each step (Megatron-core's
``main_grad`` and fp32 main params, DeepSpeed's BF16_Optimizer). ``shard=True`` always keeps fp32 masters of
its low-precision pieces; unsharded, masters are asked for.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import torch

LOW_PRECISION = (torch.float16, torch.bfloat16)
MASTER_KEY = "master_param"  # fp32 master values of a low-precision parameter, in state_dict()
DTYPE_NAMES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


@dataclass(frozen=True)
class Precision:
    """What a DistributedOptimizer keeps in which dtype."""

    grad_dtype: torch.dtype | None = None
    """The dtype of the gradient buffers (main gradients), where it is not the parameters'; None: theirs."""

    master_weights: bool = False
    """fp32 masters of the low-precision parameters, updated by the optimizer class and rounded into them."""


def as_dtype(value: Any, option: str) -> torch.dtype | None:
    """``value`` (a torch dtype, or a name such as ``"float32"``/``"bf16"``) as a torch dtype; None stays None."""
    if value is None or isinstance(value, torch.dtype) and value in DTYPE_NAMES.values():
        return value
    dtype = DTYPE_NAMES.get(str(value).removeprefix("torch.")) if isinstance(value, str) else None
    if dtype is None:
        raise ValueError(
            f"{option}={value!r} is not a dtype this optimizer keeps gradients in: pass torch.float32 (or "
            "'float32'), or leave it None for the parameters' own dtype"
        )
    return dtype


def renamed_grad_reduce_dtype(grad_dtype: Any, grad_reduce_dtype: Any) -> Any:
    """``grad_reduce_dtype`` (``shard=True``'s deprecated alias) as ``grad_dtype``, with a DeprecationWarning."""
    if grad_reduce_dtype is None:
        return grad_dtype
    warnings.warn(
        "grad_reduce_dtype is deprecated: pass grad_dtype (gradients are accumulated in it too, as main gradients)",
        DeprecationWarning,
        stacklevel=4,
    )
    if grad_dtype is not None and as_dtype(grad_dtype, "grad_dtype") != as_dtype(grad_reduce_dtype, "grad_dtype"):
        raise ValueError("pass grad_dtype alone (grad_reduce_dtype is its deprecated alias), not both")
    return grad_reduce_dtype


def resolve_precision(
    params: list[torch.Tensor], shard: bool, grad_dtype: Any, master_weights: bool | None
) -> Precision:
    """The precision asked for, checked against the model's parameter dtypes (a clear ``ValueError`` where it does
    not fit)."""
    dtype = as_dtype(grad_dtype, "grad_dtype")
    own = {p.dtype for p in params}
    low = own & set(LOW_PRECISION)
    if master_weights and not low:
        raise ValueError(
            f"master_weights=True keeps fp32 masters of bf16/fp16 parameters, and this model's are {_names(own)}: "
            "leave master_weights off (cast the model with model.to(torch.bfloat16) first for bf16 training)"
        )
    if shard and master_weights is False and low:
        raise ValueError(
            "shard=True always keeps fp32 masters of bf16/fp16 parameters (only its shard, 1/N of them): leave "
            "master_weights at its default"
        )
    masters = bool(low) if shard else bool(master_weights)
    if master_weights and dtype is None:
        dtype = torch.float32  # masters asked for are updated from fp32 main gradients
    if master_weights and not shard and dtype != torch.float32:
        raise ValueError(
            f"master_weights=True updates the fp32 masters from fp32 main gradients; grad_dtype={_names({dtype})} "
            "does not fit: leave grad_dtype at its default (float32)"
        )
    if dtype is not None and dtype != torch.float32 and own != {dtype}:
        raise ValueError(
            f"grad_dtype={_names({dtype})}: gradients are kept in float32 (main gradients) or in the parameters' "
            f"own dtype ({_names(own)}); to send them narrower, wrap with compression='bf16' or 'fp16'"
        )
    if own == {dtype}:
        dtype = None  # (the parameters' own: nothing to add in)
    if dtype is not None and not masters and not shard:
        raise ValueError(
            f"grad_dtype={_names({dtype})} on a {_names(own)} model: the optimizer would update low-precision "
            "parameters from fp32 gradients; pass master_weights=True too (fp32 masters, updated from them)"
        )
    return Precision(dtype, masters)


def _names(dtypes: set[torch.dtype]) -> str:
    return "/".join(sorted(str(d).removeprefix("torch.") for d in dtypes))
