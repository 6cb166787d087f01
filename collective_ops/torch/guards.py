"""What the torch wrapper refuses, and the checks behind its refusals: parameters it cannot reduce (sparse, on
several devices, on meta), and how a parameter's storage is compared after a conversion."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def storage_layout(p: torch.Tensor) -> tuple:
    """What a parameter's bucket and shard views were built for: dtype, device, strides, storage."""
    return p.dtype, p.device, p.stride(), p.data_ptr()


def converted_names(module: nn.Module, names: list[str], params: list[torch.Tensor], before: list[tuple]) -> list[str]:
    """The planned parameters a conversion changed: replaced (torch's overwrite-on-conversion mode makes new ones),
    or with another :func:`storage_layout` than ``before``."""
    now = dict(module.named_parameters())
    return [name for name, p, old in zip(names, params, before) if now.get(name) is not p or storage_layout(p) != old]


def same_memory_order(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors of one shape lay out their elements alike (strides of size-1 dims say nothing)."""
    return all(size == 1 or x == y for size, x, y in zip(a.shape, a.stride(), b.stride()))


def refuse_unsupported(module: nn.Module, named: list[tuple[str, torch.Tensor]]) -> None:
    """Sparse gradients, parameters on several devices or on the meta device: refused before anything is
    communicated (several devices first: a model half on meta is one to move, not to materialise)."""
    devices = sorted({str(p.device) for _, p in named})
    if len(devices) > 1:
        raise ValueError(
            f"the model's trainable parameters live on {len(devices)} devices ({', '.join(devices)}); collective_ops "
            "reduces one device per process (autograd runs one hook thread per device). Move the model to one "
            "device, and launch one process per device (torchrun --nproc-per-node)."
        )
    for name, p in named:
        if p.is_meta:  # its gradients would land in the meta buckets planned for it, never averaged
            raise ValueError(
                f"parameter {name!r} is on the meta device (no storage); materialise the model first "
                "(model.to_empty(device=...), then initialise it, e.g. each module's reset_parameters()), then wrap it"
            )
        if p.is_sparse or p.layout != torch.strided:
            raise ValueError(f"parameter {name!r} is sparse; collective_ops reduces dense gradients only")
    for module_name, sub in module.named_modules():
        if isinstance(sub, (nn.Embedding, nn.EmbeddingBag)) and sub.sparse and sub.weight.requires_grad:
            raise ValueError(
                f"{module_name or 'the model'} is an {type(sub).__name__}(sparse=True): its gradient is sparse, and "
                "collective_ops reduces dense gradients only. Build it with sparse=False (collective_ops then sends "
                "only the rows the ranks looked up: row_sparse_embeddings), or freeze it (requires_grad=False)."
            )


def refuse_unwrappable(module: Any, wrapper_class: type, live_wrappers: Any) -> None:
    """A model wrapped already (by us: a ``wrapper_class``, or by torch's DDP), with a live wrapper of ours
    (``live_wrappers``: model -> weak reference to its wrapper), or not a Module."""
    if isinstance(module, wrapper_class):
        raise ValueError("this model is already wrapped by collective_ops; wrap the original model once")
    if isinstance(module, nn.parallel.DistributedDataParallel):
        raise ValueError("this model is wrapped by torch DistributedDataParallel; pass its .module instead")
    if not isinstance(module, nn.Module):
        raise TypeError(f"wrap() takes a torch.nn.Module, got {type(module).__name__}")
    previous = live_wrappers.get(module)
    if previous is not None and previous() is not None and previous()._hook_handles:
        raise ValueError(
            "this model already has a live collective_ops wrapper (its gradients would be reduced twice); "
            "use that wrapper, or call its remove_hooks() (or delete it) before wrapping again"
        )


def view_moved_error(name: str) -> RuntimeError:
    """A parameter's gradient view no longer in its bucket: the inner module was converted after wrap()."""
    return RuntimeError(
        f"the gradient view of parameter {name!r} no longer lies in its bucket: "
        "the model was converted after wrap() through the inner module (net.to(...) re-points the "
        "gradients it holds), so its gradients would not be averaged. Cast and move the model before "
        "wrapping it"
    )


def relaid_out_error(name: str, grad: torch.Tensor, view: torch.Tensor) -> RuntimeError:
    """A fresh gradient laid out otherwise than its planned view: the inner module was re-laid out after wrap()."""
    return RuntimeError(
        f"parameter {name!r} was re-laid out after wrap() through the inner module "
        f"(strides {tuple(grad.stride())}, planned {tuple(view.stride())}: net.to(memory_format=...)): "
        "its gradient view and the bucket rebuild assume the planned layout and would permute its "
        "averaged gradient. Convert the model before wrapping it: "
        "co.wrap(net.to(memory_format=torch.channels_last))"
    )


def gradient_kept_warning(name: str) -> str:
    """The warning for a gradient kept across zero_grad(set_to_none=True) that a bucket view will overwrite."""
    return (
        f"the gradient of {name!r} from before the last zero_grad(set_to_none=True) is still "
        "referenced (p.grad kept across steps?). With gradient_as_bucket_view=True (the default) it is a view "
        "of its bucket, so this backward overwrites it, where DDP's default (False) would have kept it. Keep "
        "p.grad.clone() instead, or wrap(..., gradient_as_bucket_view=False). (Warned once.)"
    )


def main_grads_unsupported(options: Any, default_hook: bool) -> str | None:
    """Why a wrapped model cannot keep main gradients in another dtype than its parameters', or None.

    Each gradient is added into its bucket's buffer as it arrives (in no_sync() too), so the buffer must be where
    the gradient goes (gradient_as_bucket_view), the reduction the plain average of it (no compression, no custom
    comm hook), and every gradient of a step one that arrived (a parameter unused in the last micro-step keeps the
    earlier ones in the buffer, which find_unused_parameters would zero)."""
    if not options.gradient_as_bucket_view:
        return "main gradients live in the bucket buffers: wrap with gradient_as_bucket_view=True (the default)"
    if options.compression or not default_hook:
        return "main gradients are reduced by the built-in average: wrap without compression or a comm_hook"
    if options.find_unused_parameters:
        return "not with find_unused_parameters=True: wrap without it (every trained parameter needs a gradient)"
    return None
