"""DDP's constructor keywords that concern torch only: ``device_ids``/``output_device`` (inputs moved onto the
model's device, as DDP moves them), ``process_group`` (the whole world only) and the flags that ask nothing of
us (``static_graph``, ``check_reduction``, ``dim``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from . import _compat


def input_device(
    params: Sequence[torch.Tensor], device_ids: Sequence[Any] | None, output_device: Any
) -> torch.device | None:
    """Where each forward moves its inputs: DDP's ``device_ids[0]``, for a model on one accelerator; None for a CPU
    model or no ``device_ids`` (inputs left as given). Raises ValueError where DDP would, and where the ids name
    another device than the model's (DDP would move the inputs there and the forward fail on mixed devices)."""
    device = params[0].device
    if not device_ids or device.type == "cpu":
        if device_ids or output_device:  # (DDP's own test: output_device=0 passes it)
            raise ValueError(
                f"device_ids={device_ids!r} / output_device={output_device!r} given for a model on {device}: as for "
                "DDP, they only name the one accelerator a model is on. Leave them out for a CPU model"
            )
        return None
    if len(device_ids) != 1:
        raise ValueError(
            f"device_ids={list(device_ids)!r}: one device per process, as DDP takes it (device_ids=[local_rank]); "
            "start one process per device"
        )
    target = torch.device(device.type, _index(device_ids[0], device))
    if target != device:
        raise ValueError(
            f"device_ids={list(device_ids)!r}, but the model's parameters are on {device}: move the model to "
            f"{target} before wrap(), or pass device_ids=[{device.index}]"
        )
    if output_device is not None and _index(output_device, device) != device.index:
        raise ValueError(
            f"output_device={output_device!r}: the outputs stay on the model's device ({device}), as DDP leaves them "
            "for a model on one device; leave output_device out or give the same device"
        )
    return target


def inputs_to(device: torch.device, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The forward's tensors moved onto ``device`` (nested in tuples, lists, dicts, dataclasses, as DDP does)."""
    moved_args, moved_kwargs = _compat.move_forward_inputs(args, kwargs, device)
    return moved_args[0], moved_kwargs[0]


def check_process_group(group: Any, world_size: int) -> None:
    """``process_group`` may only be the whole world (None, ``dist.group.WORLD`` or a group of every rank)."""
    if group is None:
        return
    outside = group is dist.GroupMember.NON_GROUP_MEMBER  # (what new_group() gives a rank it leaves out)
    if not outside and not isinstance(group, dist.ProcessGroup):
        raise TypeError(
            f"process_group must be a torch.distributed process group (or None), got {type(group).__name__}: "
            "leave it out, as wrap() reduces over every rank of the default group"
        )
    size = -1 if outside else dist.get_world_size(group)
    if size != world_size:
        raise ValueError(
            f"process_group of {size if size > 0 else 'not this rank:'} ranks: wrap() reduces over every rank of "
            f"the default process group ({world_size}); data parallel over a subset of them (beside tensor or "
            "pipeline parallel) is not supported. Leave process_group out"
        )


def check_ddp_keywords(options: Any, params: Sequence[torch.Tensor], world_size: int) -> torch.device | None:
    """DDP's keywords in ``options`` (a ``WrapOptions``), for code ported from DDP: checked as DDP checks them;
    where each forward moves its inputs (:func:`input_device`). ``static_graph`` and ``check_reduction`` ask
    nothing of the buckets (a model whose graph changes trains either way), ``dim`` matters only to the
    multi-device DDP of old."""
    check_flags(
        dim=options.dim,
        init_sync=options.init_sync,
        static_graph=options.static_graph,
        check_reduction=options.check_reduction,
    )
    check_process_group(options.process_group, world_size)
    return input_device(params, options.device_ids, options.output_device)


def check_flags(**flags: Any) -> None:
    """DDP's flags that change nothing here must still be what DDP takes (a typo'd value is not ignored)."""
    for name, value in flags.items():
        expected = int if name == "dim" else bool
        if not isinstance(value, expected) or (expected is int and isinstance(value, bool)):
            raise TypeError(f"{name} must be {'an int' if expected is int else 'True or False'}, got {value!r}")


def _index(device: Any, model_device: torch.device) -> int | None:
    if isinstance(device, int):
        return device
    index = torch.device(device).index
    return model_device.index if index is None else index
