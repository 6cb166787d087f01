"""What a torch DistributedOptimizer refuses (at construction, at step(), after each class step), with what
to do; and its parameter groups' settings, frozen at step() and compared after each class step.

Every rank's settings agree (one small all-gather), the optimizer class can run bucket by bucket,
the parameters are the wrapped model's, and a class step leaves its parameter groups' settings alone.
"""

from __future__ import annotations

import inspect
import sys
from typing import Any

import torch

from ...consistency import OptimizerMismatchError, check_same_on_all_ranks
from .optimizer_set import given_optimizers, refuse_shared_params

OPTIMIZER_ADVICE = (
    "the DistributedOptimizer is not built alike on every rank; give every rank the same optimizer class, "
    "param groups and settings (lr, ..., shard, schedule, overlap) and wrap the model with the same compression, "
    "or the ranks update their replicas apart (or wait in collectives their peers never issue)"
)


def check_settings_agree(model: Any, args: tuple, shard: bool, kwargs: dict) -> None:
    """Every rank's optimizer class, param groups' settings, shard, schedule, overlap and compression must agree
    (one small all-gather); else each rank raises ``OptimizerMismatchError`` naming the first difference."""
    if model.engine.world_size == 1:
        return
    settings = {"shard": shard, "compression": model.compression, **kwargs}
    optimizer = args[0] if args else settings.pop("optimizer_class", None)
    given = given_optimizers(optimizer)
    entries: list[tuple] = [("optimizer", "class", {"value": _class_names(optimizer, given)})]
    if args[1:]:
        entries.append(("optimizer", "positional settings", {"value": _plain(args[1:])}))
    params = settings.pop("params", None)
    entries += [("optimizer", key, {"value": _plain(value)}) for key, value in sorted(settings.items())]
    if given is not None:
        groups = [group for o in given for group in o.param_groups]
    else:  # (a generator of parameters is left unread: __init__ reads it)
        groups = [g for g in params if isinstance(g, dict)] if isinstance(params, (list, tuple)) else []
    for index, group in enumerate(groups):
        shown = {key: _plain(value) for key, value in sorted(group.items()) if key != "params"}
        entries.append(("param group", str(index), {**shown, "parameters": len(list(group["params"]))}))
    check_same_on_all_ranks(entries, model.engine.allgather_bytes, OptimizerMismatchError, OPTIMIZER_ADVICE)


def _class_names(optimizer: Any, given: tuple | None) -> list[str]:
    classes = [type(o) for o in given] if given is not None else [optimizer]
    return [f"{getattr(c, '__module__', '')}.{getattr(c, '__qualname__', type(c).__name__)}" for c in classes]


def _plain(value: Any) -> Any:
    """``value`` as JSON that is the same on every rank for the same setting (no addresses, no pickles)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, torch.Tensor):
        return value.tolist() if value.numel() <= 16 else f"tensor{tuple(value.shape)}"
    if callable(value):
        return getattr(value, "__qualname__", type(value).__name__)
    text = repr(value)
    return type(value).__name__ if " at 0x" in text else text


def _needs_closure(optimizer_class: type) -> bool:
    """True for a class whose step() requires a closure (LBFGS)."""
    try:
        closure = inspect.signature(optimizer_class.step).parameters.get("closure")
    except (TypeError, ValueError):
        return False
    return closure is not None and closure.default is inspect.Parameter.empty


def changed_settings(given: list[dict], groups: list[dict]) -> list[tuple[int, str, Any, Any]]:
    """(group, key, before, after) of every setting a step() changed in the parameter groups."""
    changed = []
    for k, (before, group) in enumerate(zip(given, groups)):
        for key in set(before) | set(group):
            if key == "params":
                continue
            old, new = before.get(key, _MISSING), group.get(key, _MISSING)
            if not _same(old, new):
                changed.append((k, key, old, new))
    return changed


def _same(old: Any, new: Any) -> bool:
    """The same setting: the same object, or equal plain values (tensors and arrays: the same object only)."""
    if old is new:
        return True
    try:
        return not isinstance(old, torch.Tensor) and not isinstance(new, torch.Tensor) and bool(old == new)
    except (TypeError, ValueError, RuntimeError):  # an array's elementwise ==
        return False


def refuse_group_mutation(name: str, changed: list[tuple[int, str, Any, Any]]) -> None:
    k, key, old, new = changed[0]
    raise RuntimeError(
        f"{name}.step() changed param_groups[{k}][{key!r}] ({old!r} -> {new!r}): it keeps values that advance "
        "every step in its parameter groups, and DistributedOptimizer calls step() once per bucket (the groups "
        "restored after each call), so they would not advance as they do under a plain optimizer. Use the plain "
        f"optimizer on the wrapped model instead ({name}(model.parameters(), ...) with model = co.wrap(net))"
    )


_MISSING = object()


def refuse_unusable(optimizer_class: Any, given: tuple | None, args: tuple, kwargs: dict, params: Any) -> None:
    """An optimizer class, or optimizers built by the user, that per-bucket updates can run; else what to do."""
    if given is not None:
        if args or kwargs or params is not None:
            got = "params" if params is not None else ", ".join(sorted(kwargs)) or "positional settings"
            raise TypeError(
                f"DistributedOptimizer given optimizers takes no settings or params (got {got}): they are the "
                "optimizers' own; set them where you build each optimizer"
            )
        refuse_shared_params(given)
    elif not (isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)):
        raise TypeError(
            "optimizer_class must be a torch.optim.Optimizer subclass (e.g. torch.optim.AdamW), or torch optimizers "
            f"built over the model's parameters (e.g. [Muon(matrices), AdamW(rest)]), got {optimizer_class!r}"
        )
    # torch.distributed.optim takes ~1.8 s to import: looked up, not imported (unimported, nobody built a ZeRO)
    zero = getattr(sys.modules.get("torch.distributed.optim"), "ZeroRedundancyOptimizer", None)
    for cls in [type(optimizer) for optimizer in given] if given is not None else [optimizer_class]:
        if zero is not None and issubclass(cls, zero):
            raise TypeError(
                "ZeroRedundancyOptimizer is a distributed optimizer of its own (its step broadcasts parameters): "
                "per-bucket steps would run its collectives once per bucket. Give the class it wraps, with "
                "shard=True for sharded state: DistributedOptimizer(model, torch.optim.AdamW, shard=True, lr=...)"
            )
        if _needs_closure(cls):
            raise ValueError(
                f"{cls.__name__}.step() needs a closure that evaluates the model again (a line search): "
                "updates applied bucket by bucket cannot do that; use it as a plain optimizer on the wrapped model"
            )


def refuse_foreign_params(model: Any, groups: list[dict[str, Any]]) -> None:
    owned = {id(p) for p in model.module.parameters()}
    for group in groups:
        for p in group["params"]:
            if id(p) not in owned:
                raise ValueError(
                    f"a parameter of shape {tuple(p.shape)} given to DistributedOptimizer is not a parameter of the "
                    "wrapped model: its updates follow the model's buckets, so give only the model's parameters"
                )


def as_groups(params: Any) -> list[dict[str, Any]]:
    """``params`` as torch.optim takes them (tensors, or parameter-group dicts) as a list of groups."""
    if isinstance(params, torch.Tensor):
        raise TypeError("params must be an iterable of tensors or of parameter-group dicts, not one tensor")
    params = list(params)
    if not params:
        raise ValueError("DistributedOptimizer got an empty parameter list")
    if not isinstance(params[0], dict):
        return [{"params": params}]
    return [{**group, "params": list(group["params"])} for group in params]


def refuse_unwrapped(model: Any, wrapper: type, shard: bool) -> None:
    """``model`` must be made by collective_ops.wrap(); ``shard``: shard=True given to the unsharded class."""
    if not isinstance(model, wrapper):
        raise TypeError(
            f"DistributedOptimizer takes a model wrapped by collective_ops.wrap(), got {type(model).__name__}; "
            "wrap it first: model = collective_ops.wrap(model)"
        )
    if shard:
        raise TypeError(
            "this class holds the whole optimizer state; for shard=True build collective_ops.DistributedOptimizer"
            "(model, optimizer_class, shard=True, ...), which picks the sharded class"
        )


def refuse_shard_options(kwargs: dict[str, Any]) -> None:
    for option in ("grad_reduce_dtype", "assume_elementwise"):
        if option in kwargs:
            raise ValueError(f"{option} is an option of the sharded optimizer: pass shard=True with it")


UNREDUCED_ACCUMULATION = (
    "step() on gradients accumulated under model.no_sync() that no backward outside it has averaged "
    "across ranks: each rank would train on its own data and the replicas would part. Run the last "
    "micro-batch's backward outside no_sync() (it reduces everything accumulated), or drop them "
    "with opt.zero_grad() and a backward outside no_sync()"
)


def nonfinite_gradients(bad: list[str], origin: str) -> FloatingPointError:
    return FloatingPointError(
        f"non-finite gradients (NaN or Inf) after reduction in {len(bad)} parameter(s): {bad[:10]}{origin}; "
        "the step was not applied (parameters and optimizer state unchanged). Lower the learning rate, use "
        "gradient clipping or loss scaling (torch.amp.GradScaler skips such steps), or check the data of that step."
    )


def given_stepped_directly(optimizer: Any) -> RuntimeError:
    return RuntimeError(
        f"{type(optimizer).__name__}.step() called directly: it was given to a DistributedOptimizer, whose "
        "step() runs it bucket by bucket as the reductions land; call that one's step() instead"
    )


def params_changed_while_owed(names: list[str]) -> RuntimeError:
    return RuntimeError(
        f"parameters {names[:5]}{' ...' if len(names) > 5 else ''} were changed in place after step() "
        "while their update was still owed: DistributedOptimizer applies each bucket's update (sharded: "
        "its all-gather) at the next forward that reads it, so the change would be lost or updated on, "
        "not applied after the step as with a plain optimizer. Take the parameters through the wrapped "
        "model (model.parameters() and model.load_state_dict() finish the step first) or call "
        "opt.synchronize() before changing them"
    )


def frozen_setting(value: Any) -> Any:
    """A parameter group's setting as it is now: tensors (a tensor lr, tensor betas) copied, since LR
    schedulers change a tensor lr in place (``fill_``)."""
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, (tuple, list)):
        return type(value)(frozen_setting(v) for v in value)
    return value
