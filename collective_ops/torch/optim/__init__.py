"""The torch distributed optimizer: per-bucket updates (optimizer.py), sharded state (sharded.py).

:class:`DistributedOptimizer` here is the factory users call (``collective_ops.DistributedOptimizer`` hands a
torch model to it): it checks that every rank builds the same optimizer, then builds the unsharded class or,
with ``shard=True``, the sharded one. The classes themselves import nothing back from here.
"""

from __future__ import annotations

from typing import Any

from ...factory import factory_type
from ..ddp import DistributedDataParallel
from .checks import check_settings_agree
from .optimizer import DistributedOptimizer as PerBucketOptimizer
from .sharded import ShardedDistributedOptimizer


class DistributedOptimizer(metaclass=factory_type(lambda: (PerBucketOptimizer,))):
    """``DistributedOptimizer(model, torch.optim.AdamW, lr=1e-3)``: per-bucket updates of a wrapped model
    (:class:`~collective_ops.torch.optim.optimizer.DistributedOptimizer`); with ``shard=True``, the optimizer
    state sharded across ranks (:class:`~collective_ops.torch.optim.sharded.ShardedDistributedOptimizer`)."""

    def __new__(cls, *args: Any, shard: bool = False, **kwargs: Any) -> Any:
        if args and isinstance(args[0], DistributedDataParallel):  # before any group is made (shard=True makes some)
            check_settings_agree(args[0], args[1:], shard, kwargs)
        chosen = ShardedDistributedOptimizer if shard else PerBucketOptimizer
        return chosen(*args, **kwargs)


__all__ = ["DistributedOptimizer", "PerBucketOptimizer", "ShardedDistributedOptimizer"]
