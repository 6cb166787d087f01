"""Which framework a model belongs to; wrap() and DistributedOptimizer() dispatching to that framework's package."""

from __future__ import annotations

from typing import Any

from .bucketing import DEFAULT_BUCKET_MB
from .ddp_keywords import translate_ddp_keywords


def _framework_of(model: Any) -> str | None:
    for cls in type(model).__mro__:
        root = cls.__module__.split(".", 1)[0]
        if root in ("torch", "mindspore"):
            return root
    return None


def wrap(model: Any, bucket_size_mb: float | str = DEFAULT_BUCKET_MB, **options: Any) -> Any:
    """Wrap a ``torch.nn.Module`` or a ``mindspore.nn.Cell`` for data-parallel training."""
    if type(model).__module__.startswith(("collective_ops.torch.", "collective_ops.mindspore.")):
        raise ValueError("this model is already wrapped by collective_ops; wrap the original model once")
    bucket_size_mb = translate_ddp_keywords(bucket_size_mb, DEFAULT_BUCKET_MB, options)  # (DDP's names, ported code)
    framework = _framework_of(model)
    if framework == "torch":
        from .torch.ddp import wrap as wrap_torch

        return wrap_torch(model, bucket_size_mb, **options)
    if framework == "mindspore":
        from .mindspore.data_parallel import wrap as wrap_mindspore

        return wrap_mindspore(model, bucket_size_mb, **options)
    raise TypeError(f"wrap() takes a torch.nn.Module or a mindspore.nn.Cell, got {type(model).__name__}")


def DistributedOptimizer(model: Any, *args: Any, **kwargs: Any) -> Any:  # (named as the classes it builds)
    """``DistributedOptimizer(model, optimizer_class, ..., shard=False, ...)`` for a model made by :func:`wrap`:
    torch's class (:class:`collective_ops.torch.DistributedOptimizer`) for a torch model, MindSpore's
    (:class:`collective_ops.mindspore.DistributedOptimizer`) for a MindSpore network; each takes the settings its
    framework's optimizers take. ``isinstance`` checks name the framework's class."""
    if _is_mindspore(model):
        from .mindspore.optim import DistributedOptimizer as framework_optimizer
    else:
        try:
            from .torch.optim import DistributedOptimizer as framework_optimizer
        except ModuleNotFoundError:  # MindSpore without torch: its own optimizer explains what it takes
            from .mindspore.optim import DistributedOptimizer as framework_optimizer
    return framework_optimizer(model, *args, **kwargs)


def _is_mindspore(model: Any) -> bool:
    """A MindSpore network, wrapped or not (its module is mindspore's or our MindSpore adapter's)."""
    return _framework_of(model) == "mindspore" or type(model).__module__ == "collective_ops.mindspore.data_parallel"
