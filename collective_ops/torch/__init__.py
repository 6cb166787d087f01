"""collective-ops for PyTorch: ``wrap`` a ``torch.nn.Module``, step it with ``DistributedOptimizer``."""

from __future__ import annotations

from .ddp import DistributedDataParallel, wrap
from .optim.optimizer import DistributedOptimizer
from .optim.sharded import ShardedDistributedOptimizer

__all__ = ["DistributedDataParallel", "DistributedOptimizer", "ShardedDistributedOptimizer", "wrap"]
