"""``torch.amp.GradScaler`` with a DistributedOptimizer: its record of a step, its verdict, the unscale.

``GradScaler.step(opt)`` hands itself to ``opt.step(grad_scaler=...)`` (the optimizer's
``_step_supports_amp_scaling``), so the optimizer finishes every reduction before the scaler reads the
gradients: unscaled while their reductions are still in flight, they would be read half averaged.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from .. import _compat


def scaler_record(scaler: Any, optimizer: Any) -> dict[Any, torch.Tensor]:
    """GradScaler's per-device record of non-finite gradients for ``optimizer``'s step, unscaling the gradients
    first where nothing has (``scaler.unscale_(opt)`` before clipping already did)."""
    from torch.amp.grad_scaler import OptState

    state = _compat.scaler_state_of(scaler, optimizer)
    if state["stage"] is OptState.READY:
        scaler.unscale_(optimizer)  # records found_inf for scaler.update()
    return state["found_inf_per_device"]


def found_inf_here(found_inf_per_device: dict[Any, torch.Tensor]) -> bool:
    """The verdict of this rank's record (unscale_ recorded it per device)."""
    return any(float(v.item()) for v in found_inf_per_device.values())


def found_inf_on_any_rank(found_inf_per_device: dict[Any, torch.Tensor], device: torch.device) -> bool:
    """The verdict agreed over the ranks (one small allreduce, as Megatron's distributed optimizer does) and
    written back into the scaler's record, so that every rank skips the step and ``scaler.update()`` backs off
    alike: sharded, each rank checked only its shards, and an overflow is seen where its element lives."""
    agreed = torch.tensor([float(found_inf_here(found_inf_per_device))], device=device)
    if dist.get_world_size() > 1:
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
    verdict = agreed.item()
    for value in found_inf_per_device.values():
        value.fill_(verdict)
    if not found_inf_per_device:  # no piece of this rank had a gradient: scaler.update() still needs a record
        found_inf_per_device[device] = agreed[0].clone()
    return bool(verdict)


def unscale_(params: list[torch.Tensor], grad_scale: torch.Tensor) -> None:
    """The gradients of ``params`` unscaled as ``GradScaler.unscale_`` does (the same reciprocal, the same
    kernel)."""
    inv_scale = grad_scale.double().reciprocal().float()
    by_kind: dict[tuple, list[torch.Tensor]] = {}
    for p in params:
        if p.grad is not None:
            by_kind.setdefault((p.grad.device, p.grad.dtype), []).append(p.grad)
    for (device, _), grads in by_kind.items():
        found = torch.zeros((), dtype=torch.float32, device=device)
        _compat.non_finite_check_and_unscale_(grads, found, inv_scale.to(device))


SHARDED_SCALER_ATTRIBUTES = (
    "shard=True under a GradScaler that sets grad_scale and found_inf on the optimizer instead of handing "
    "itself to step() (torch's newer protocol): each rank's inf check saw only its own shards, and the "
    "scaler keeps that per-rank verdict for update(), so an overflow in one shard would part the ranks' "
    "scales and their training. Not supported: use shard=False with a GradScaler, or bf16 autocast, "
    "which needs no loss scaling"
)
