"""collective-ops for PyTorch: ``wrap`` a ``torch.nn.Module``, step it with ``DistributedOptimizer``."""

from __future__ import annotations

from .ddp import DistributedDataParallel, wrap
from .optim import DistributedOptimizer, ShardedDistributedOptimizer

__all__ = ["DistributedDataParallel", "DistributedOptimizer", "ShardedDistributedOptimizer", "wrap"]
