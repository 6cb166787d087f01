"""The torch distributed optimizer: per-bucket updates (optimizer.py), sharded state (sharded.py).

``DistributedOptimizer(model, torch.optim.AdamW, lr=1e-3)`` steps a wrapped model bucket by bucket; with
``shard=True`` it holds this rank's shard of the optimizer state (a :class:`ShardedDistributedOptimizer`,
which is a ``DistributedOptimizer``).
"""

from __future__ import annotations

from .optimizer import DistributedOptimizer
from .sharded import ShardedDistributedOptimizer

__all__ = ["DistributedOptimizer", "ShardedDistributedOptimizer"]
