"""The hooks the torch wrapper puts on autograd, each holding the wrapper weakly (deleting the wrapper detaches
them): a parameter's gradient ready, a backward reaching the forward's outputs; and the gradient views into the
bucket buffers they accumulate into."""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch


def view_like(p: torch.Tensor, buffer: torch.Tensor, offset: int) -> torch.Tensor:
    """A view of ``buffer`` from ``offset`` shaped as ``p``, with ``p``'s strides where ``p`` is dense."""
    strides = torch.empty_like(p, device="meta").stride()
    return buffer.as_strided(p.shape, strides, buffer.storage_offset() + offset)


def weak_grad_hook(wrapper_ref: weakref.ref, index: int) -> Callable[[torch.Tensor], None]:
    """A post-accumulate-grad hook calling ``wrapper._grad_ready(index, param)`` while the wrapper lives."""

    def hook(param: torch.Tensor) -> None:
        wrapper = wrapper_ref()
        if wrapper is not None:
            wrapper._grad_ready(index, param)

    return hook


def output_tensors(output: Any) -> Iterator[torch.Tensor]:
    """The tensors of a forward's output, in tuples, lists, dicts (model output classes subclass dict) and
    dataclasses, where DDP looks for them."""
    if isinstance(output, torch.Tensor):
        yield output
    elif isinstance(output, (list, tuple)):
        for item in output:
            yield from output_tensors(item)
    elif isinstance(output, dict):
        for item in output.values():
            yield from output_tensors(item)
    elif dataclasses.is_dataclass(output) and not isinstance(output, type):
        for field in dataclasses.fields(output):
            yield from output_tensors(getattr(output, field.name))


def outputs_reached(wrapper_ref: weakref.ref, grad: torch.Tensor) -> None:
    """A tensor hook on a forward's output: a backward reached it."""
    wrapper = wrapper_ref()
    if wrapper is not None:
        wrapper._outputs_reached()


def remove_all(handles: list) -> None:
    for handle in handles:
        handle.remove()
    handles.clear()
