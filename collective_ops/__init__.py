"""collective-ops: fast data-parallel gradient communication for Ascend (HCCL), CUDA (NCCL) and CPU (Gloo).

Importing this package imports no deep-learning framework; each is loaded when used.
"""

from __future__ import annotations

from typing import Any

from .bucketing import DEFAULT_BUCKET_MB
from .bucketing import GradientBucket as _CoreGradientBucket
from .bucketing.compression import PowerSGD
from .primitives import allgather, allreduce, broadcast, reduce_scatter
from .runtime import (
    DistContext,
    barrier,
    context,
    engine_for_tensor,
    get_rank,
    get_world_size,
    init,
    init_hccl,
    is_initialized,
    shutdown,
)

__version__ = "0.2.0"


class GradientBucket(_CoreGradientBucket):
    """Manual bucketing: ``add`` gradients, ``allreduce()`` them in as few collectives as the cap allows.

    Works for torch tensors, MindSpore tensors and numpy arrays, through the engine
    ``init`` started for their framework.
    """

    def __init__(self, bucket_size_mb: float = DEFAULT_BUCKET_MB, reduce_op: Any = "sum") -> None:
        super().__init__(bucket_size_mb, reduce_op, engine_for=engine_for_tensor)


def tune(model: Any, step_fn: Any, **options: Any) -> Any:
    """Choose and set ``bucket_size_mb`` for a wrapped model (see :func:`collective_ops.tuning.tune`)."""
    if type(model).__module__.startswith("collective_ops.mindspore."):  # before tune's first step, not after it
        import mindspore as ms

        if ms.get_context("mode") != ms.PYNATIVE_MODE:
            raise ValueError(
                "collective_ops.tune() on MindSpore needs PyNative mode: it replans between steps, and a GRAPH-mode "
                "step has the bucket plan compiled into its graph. Tune in PyNative and wrap with the size it "
                "chooses (bucket_size_mb=result.bucket_size_mb, first_bucket_mb=result.first_bucket_mb)"
            )
    from .tuning import tune as _tune

    return _tune(model, step_fn, **options)


def __getattr__(name: str) -> Any:
    # Loaded on first use: importing collective_ops imports no deep-learning framework.
    if name == "DistributedOptimizer":  # a torch model gets torch's optimizer, a MindSpore one MindSpore's
        from .frameworks import DistributedOptimizer

        return DistributedOptimizer
    raise AttributeError(f"module 'collective_ops' has no attribute {name!r}")


def wrap(model: Any, bucket_size_mb: float | str = DEFAULT_BUCKET_MB, **options: Any) -> Any:
    """Make ``model`` data-parallel: a ``torch.nn.Module`` or a ``mindspore.nn.Cell``."""
    from .frameworks import wrap as _wrap

    return _wrap(model, bucket_size_mb=bucket_size_mb, **options)


__all__ = [
    "DistContext",
    "DistributedOptimizer",
    "GradientBucket",
    "PowerSGD",
    "allgather",
    "allreduce",
    "barrier",
    "broadcast",
    "context",
    "get_rank",
    "get_world_size",
    "init",
    "init_hccl",
    "is_initialized",
    "reduce_scatter",
    "shutdown",
    "tune",
    "wrap",
]
