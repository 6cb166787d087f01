"""A Lightning strategy that trains through ``collective_ops.wrap`` where ``DDPStrategy`` uses torch's DDP.

.. code-block:: python

    import lightning as L
    from collective_ops.lightning import CollectiveOpsStrategy

    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=CollectiveOpsStrategy(bucket_size_mb=25))
    # or, once this module is imported: L.Trainer(..., strategy="collective_ops")

Everything Lightning does around DDP stays Lightning's: its launcher (or ``torchrun``, or a cluster
environment), the process group, accumulation (``no_sync`` on the wrapped model), validation, clipping,
precision plugins and checkpoints (which also carry every rank's PowerSGD state). Only the model wrapper
differs, and, with ``distributed_optimizer=True``, each optimizer that ``configure_optimizers`` returns is handed
to :class:`collective_ops.DistributedOptimizer` (per-bucket updates overlapped with the next forward;
``shard=True`` for ZeRO-1).
"""

from __future__ import annotations

import inspect
import logging
from datetime import timedelta
from typing import Any

import torch
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from torch import nn

import collective_ops as co

from .torch.ddp import DistributedDataParallel as WrappedModel
from .torch.optim import DistributedOptimizer
from .torch.rank_states import RankCompressionStates

_log = logging.getLogger(__name__)
STRATEGY_NAME = "collective_ops"
COMPRESSION_KEY = "collective_ops_compression"  # the checkpoint's entry for every rank's compression state
# DDPStrategy's own keywords (launcher, plugins, process group): everything else is wrap()'s.
_LIGHTNING_KEYWORDS = frozenset(inspect.signature(DDPStrategy.__init__).parameters) - {"self", "kwargs"}


class CollectiveOpsStrategy(DDPStrategy):
    """``DDPStrategy`` with the model wrapped by :func:`collective_ops.wrap`.

    Args:
        distributed_optimizer: hand each optimizer from ``configure_optimizers`` to
            :class:`collective_ops.DistributedOptimizer` (its learning-rate schedulers keep working on it).
        shard: with ``distributed_optimizer``, shard the optimizer state over the ranks (ZeRO-1).
        **kwargs: ``DDPStrategy``'s keywords (``accelerator``, ``cluster_environment``, ``timeout``,
            ``start_method``, ``ddp_comm_hook``, ...) and :func:`collective_ops.wrap`'s options
            (``bucket_size_mb``, ``find_unused_parameters``, ``compression``, ...; DDP's names accepted).
    """

    strategy_name = STRATEGY_NAME

    def __init__(
        self,
        *,
        distributed_optimizer: bool = False,
        shard: bool = False,
        timeout: timedelta | None = None,
        **kwargs: Any,
    ) -> None:
        if shard and not distributed_optimizer:
            raise ValueError("shard=True shards the DistributedOptimizer's state: pass distributed_optimizer=True too")
        if kwargs.get("model_averaging_period") is not None:
            raise ValueError("model_averaging_period (post-local SGD) needs torch's DDP: use strategy='ddp' for it")
        lightning = {key: value for key, value in kwargs.items() if key in _LIGHTNING_KEYWORDS}
        if timeout is not None:
            lightning["timeout"] = timeout
        super().__init__(**lightning)
        self._wrap_options = {key: value for key, value in kwargs.items() if key not in _LIGHTNING_KEYWORDS}
        self._distributed_optimizer = distributed_optimizer
        self._shard = shard

    # -- process group --------------------------------------------------------------------------
    def setup_distributed(self) -> None:
        """Lightning makes the process group (from its cluster environment); collective_ops adopts it."""
        super().setup_distributed()
        co.init(rank=self.global_rank, world_size=self.world_size)

    # -- the model ------------------------------------------------------------------------------
    def _setup_model(self, model: nn.Module) -> WrappedModel:
        # kept past teardown: a checkpoint saved after fit() still carries the compression's state
        self._wrapped = co.wrap(model, device_ids=self.determine_ddp_device_ids(), **self._wrap_options)
        return self._wrapped

    def _register_ddp_hooks(self) -> None:
        """A DDP comm hook given to the strategy is registered on the wrapped model, on any device."""
        if self._ddp_comm_hook is None:
            return
        hook = self._ddp_comm_hook
        if self._ddp_comm_wrapper is not None:
            hook = self._ddp_comm_wrapper(hook)
        self.model.register_comm_hook(self._ddp_comm_state, hook)

    def setup_optimizers(self, trainer: Any) -> None:
        super().setup_optimizers(trainer)
        if self._distributed_optimizer and isinstance(self.model, WrappedModel):
            self.optimizers = [self._distributed(optimizer) for optimizer in self.optimizers]
            if self._shard:
                self._clip_through_shards()

    def _clip_through_shards(self) -> None:
        """Lightning clips (``gradient_clip_val``) over the optimizer's parameters, whose gradients are averaged
        only in each rank's own shard under ``shard=True``: by norm, the global norm from the shards
        (``clip_grad_norm_``); by value, after the averaged gradients are gathered."""
        plugin = self.precision_plugin
        by_norm, by_value = plugin.clip_grad_by_norm, plugin.clip_grad_by_value

        def clip_grad_by_norm(optimizer: Any, clip_val: float) -> None:
            if isinstance(_unwrapped(optimizer), DistributedOptimizer):
                _unwrapped(optimizer).clip_grad_norm_(clip_val)
            else:
                by_norm(optimizer, clip_val)

        def clip_grad_by_value(optimizer: Any, clip_val: float) -> None:
            inner = _unwrapped(optimizer)
            if not isinstance(inner, DistributedOptimizer):
                return by_value(optimizer, clip_val)
            inner.gather_gradients()
            # over its parameters as the model holds them: reading opt.param_groups would bind the shards again
            trained = [p for p in self.lightning_module.parameters() if id(p) in inner._trained]
            torch.nn.utils.clip_grad_value_(trained, clip_val)

        plugin.clip_grad_by_norm, plugin.clip_grad_by_value = clip_grad_by_norm, clip_grad_by_value

    def _distributed(self, optimizer: torch.optim.Optimizer) -> DistributedOptimizer:
        """``optimizer`` as a DistributedOptimizer. Unsharded it is given whole (its parameter groups stay the ones
        its schedulers change); sharded, its class is rebuilt over its groups and its schedulers follow."""
        if not self._shard:
            return co.DistributedOptimizer(self.model, [optimizer])
        groups = [
            {key: value for key, value in group.items() if key != "initial_lr"} for group in optimizer.param_groups
        ]
        # (defaults may hold more than the constructor takes: AdamW's decoupled_weight_decay; the groups hold them all)
        accepted = inspect.signature(type(optimizer).__init__).parameters
        settings = {key: value for key, value in optimizer.defaults.items() if key in accepted}
        sharded = co.DistributedOptimizer(self.model, type(optimizer), params=groups, shard=True, **settings)
        for config in self.lr_scheduler_configs:
            if config.scheduler.optimizer is optimizer:
                config.scheduler.optimizer = sharded
                for group, initial in zip(sharded.param_groups, optimizer.param_groups):
                    group.setdefault("initial_lr", initial.get("initial_lr", initial["lr"]))
        return sharded

    # -- checkpoints ----------------------------------------------------------------------------
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        """Lightning writes the checkpoint on rank 0; a stateful compression's state (PowerSGD's, each rank its own)
        is gathered into it first (Lightning calls this on every rank)."""
        wrapped = getattr(self, "_wrapped", None)
        # (every rank holds the same dict: a weights-only checkpoint, without optimizer states, skips it on each)
        if "optimizer_states" in checkpoint and RankCompressionStates.needed(wrapped):
            checkpoint[COMPRESSION_KEY] = RankCompressionStates(wrapped).state_dict()
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        """The optimizers' states, then this rank's compression state (restored with the training state, once the
        model is wrapped)."""
        super().load_optimizer_state_dict(checkpoint)
        if not RankCompressionStates.needed(self.model):
            return
        if COMPRESSION_KEY in checkpoint:
            RankCompressionStates(self.model).load_state_dict(checkpoint[COMPRESSION_KEY])
        else:
            _log.warning(
                "this checkpoint holds no PowerSGD state (saved without compression, or by DDPStrategy): its error "
                "feedback and step count start afresh, compressing from start_iter on"
            )

    def teardown(self) -> None:
        """Unwrap: the LightningModule leaves as it came, without the wrapper's hooks."""
        if isinstance(self.model, WrappedModel):
            for optimizer in self.optimizers:
                if isinstance(optimizer, DistributedOptimizer):
                    optimizer.remove_hooks()
            self.model.remove_hooks()
            self.model = self.lightning_module
        super().teardown()

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        if STRATEGY_NAME not in strategy_registry:
            strategy_registry.register(
                STRATEGY_NAME, cls, description="data-parallel training through collective_ops.wrap"
            )


def _unwrapped(optimizer: Any) -> Any:
    """The optimizer a LightningOptimizer stands for (Lightning hands either to its hooks)."""
    return optimizer.optimizer if isinstance(optimizer, LightningOptimizer) else optimizer


CollectiveOpsStrategy.register_strategies(StrategyRegistry)

__all__ = ["CollectiveOpsStrategy", "STRATEGY_NAME"]
