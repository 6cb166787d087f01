"""torch's global optimizer-step hooks, registered at the first wrap(): what a wrapped model owes any optimizer
about to step its parameters (reductions finished for an optimizer beside a DistributedOptimizer; a warning for
a step on gradients accumulated under no_sync() and never averaged)."""

from __future__ import annotations

import warnings
import weakref
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

# model -> its live wrapper (weakly, both ways): wrapping a model twice would reduce its gradients twice; the
# step hooks below visit every live wrapper.
LIVE_WRAPPERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

_STEP_WATCH: Any = None  # torch's global optimizer step pre-hook, registered at the first wrap()


def watch_optimizer_steps() -> None:
    """torch's global optimizer-step hooks, registered once (removed by :func:`stop_watching_optimizer_steps`)."""
    global _STEP_WATCH
    if _STEP_WATCH is None:
        _STEP_WATCH = (
            register_optimizer_step_pre_hook(_before_any_optimizer_step),
            register_optimizer_step_post_hook(_after_any_optimizer_step),
        )


def stop_watching_optimizer_steps() -> None:
    """The global step hooks removed: at ``co.shutdown()``, and once no wrapper is left."""
    global _STEP_WATCH
    if _STEP_WATCH is not None:
        for handle in _STEP_WATCH:
            handle.remove()
        _STEP_WATCH = None


def live_wrappers() -> bool:
    """True while some wrapped model's wrapper is alive."""
    return any(ref() is not None for ref in LIVE_WRAPPERS.values())


def _before_any_optimizer_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """torch's global step pre-hook: what a wrapped model owes an optimizer about to step its parameters."""
    _finish_for_optimizer_beside(optimizer)
    if not _steps_with_closure(args, kwargs):
        _warn_unreduced_step(optimizer)


def _after_any_optimizer_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """torch's global step post-hook. A step given a closure (Lightning's, LBFGS's) runs the last micro-batch's
    backward inside it, after the pre-hook: whether that backward averaged the accumulation shows only now."""
    if _steps_with_closure(args, kwargs):
        _warn_unreduced_step(optimizer)


def _steps_with_closure(args: Any, kwargs: Any) -> bool:
    return (args[0] if args else kwargs.get("closure")) is not None


def _finish_for_optimizer_beside(optimizer: torch.optim.Optimizer) -> None:
    """A plain optimizer beside a model's DistributedOptimizer (AdamW for the parameters the DistributedOptimizer
    was not given) reads gradients whose reductions that optimizer's step may leave in flight: they are finished
    first (sharded, refused: outside this rank's shard they are never averaged)."""
    for ref in list(LIVE_WRAPPERS.values()):
        wrapper = ref()
        ours = None if wrapper is None else wrapper.optimizer
        if ours is None or optimizer is ours or ours.stepping:
            continue
        if wrapper._owns_any(optimizer):
            ours.before_optimizer_beside(optimizer)


def _warn_unreduced_step(optimizer: torch.optim.Optimizer) -> None:
    """Before any optimizer's step: one that steps a wrapped model on gradients accumulated under no_sync() and
    never averaged (every backward of the step ran inside it) trains each rank on its own data, and the
    replicas part silently, as under DDP. Warned once per model, not refused: local SGD does it on purpose.
    (A DistributedOptimizer refuses it in its own step.)"""
    for ref in list(LIVE_WRAPPERS.values()):
        wrapper = ref()
        if wrapper is None or wrapper._warned_local_step or wrapper.optimizer is not None:
            continue
        if not wrapper.manager.has_unreduced_accumulation:
            continue
        if wrapper._owns_any(optimizer):
            wrapper._warned_local_step = True
            warnings.warn(
                f"{type(optimizer).__name__}.step() is using gradients accumulated under model.no_sync() that no "
                "backward outside it has averaged across ranks: each rank trains on its own data and the ranks' "
                "weights now differ. Run the last micro-batch's backward outside no_sync() (it reduces "
                "everything accumulated). (Warned once; ignore it if you train locally on purpose.)",
                stacklevel=4,
            )
