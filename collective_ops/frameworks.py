"""Which framework a model belongs to; wrap() and DistributedOptimizer() dispatching to that framework's package."""

from __future__ import annotations

import sys
from typing import Any

from .bucketing import DEFAULT_BUCKET_MB
from .ddp_keywords import translate_ddp_keywords
from .factory import factory_type


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


# The framework packages' optimizer modules: imported by the factory below when a model needs them, and
# looked up (never imported) by isinstance checks, so that importing collective_ops imports no framework.
_OPTIMIZER_MODULES = ("collective_ops.torch.optim", "collective_ops.mindspore.optim")


def _loaded_optimizer_classes() -> list[type]:
    modules = [sys.modules.get(name) for name in _OPTIMIZER_MODULES]
    return [module.DistributedOptimizer for module in modules if module is not None]


class DistributedOptimizer(metaclass=factory_type(_loaded_optimizer_classes)):
    """``DistributedOptimizer(model, optimizer_class, ..., shard=False, ...)`` for a model made by :func:`wrap`:
    torch's (:mod:`collective_ops.torch.optim`) for a torch model, MindSpore's (:mod:`collective_ops.mindspore.optim`)
    for a MindSpore network; each takes the settings its framework's optimizers take."""

    def __new__(cls, model: Any = None, *args: Any, **kwargs: Any) -> Any:
        if _is_mindspore(model):
            from .mindspore.optim import DistributedOptimizer as MindSporeDistributedOptimizer

            return MindSporeDistributedOptimizer(model, *args, **kwargs)
        try:
            from .torch.optim import DistributedOptimizer as TorchDistributedOptimizer
        except ModuleNotFoundError:  # MindSpore without torch: its own optimizer explains what it takes
            from .mindspore.optim import DistributedOptimizer as MindSporeDistributedOptimizer

            return MindSporeDistributedOptimizer(model, *args, **kwargs)
        return TorchDistributedOptimizer(model, *args, **kwargs)


def _is_mindspore(model: Any) -> bool:
    """A MindSpore network, wrapped or not (its module is mindspore's or our MindSpore adapter's)."""
    return _framework_of(model) == "mindspore" or type(model).__module__ == "collective_ops.mindspore.data_parallel"
