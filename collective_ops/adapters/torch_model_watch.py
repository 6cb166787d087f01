"""Trainable parameters added to a wrapped model after ``wrap()`` are refused as they are registered.

``wrap()`` plans its gradient buckets from the parameters it finds; a trainable parameter
registered on the model later (a new head assigned, ``load_state_dict(..., assign=True)``,
which puts the loaded tensors in place of the parameters) is in no bucket, so its gradient
would never be averaged and each rank would train it on its own data: the replicas part,
silently (as they do under torch DDP). torch's global registration hooks see every such
change on any module; the ones on a wrapped model's modules are checked here. Moving a
parameter the plan already holds (a parametrization registers the original under a new
module) and frozen parameters pass.
"""

from __future__ import annotations

import weakref
from typing import Any

from torch import nn
from torch.nn.modules.module import (
    register_module_module_registration_hook,
    register_module_parameter_registration_hook,
)

from ._options import names_text

# each module of a wrapped model -> its wrapper's set of planned parameter ids (weakly held by the wrapper)
_WATCHED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_HANDLES: list[Any] = []


class PlannedParameters:
    """The ids of the parameters a wrapper planned (they stay alive with it, so the ids stay theirs)."""

    def __init__(self, params: list[nn.Parameter]) -> None:
        self.ids = {id(p) for p in params}


def watch(module: nn.Module, planned: PlannedParameters) -> None:
    """Refuse trainable parameters registered on ``module``'s modules from now on, unless in ``planned``."""
    if not _HANDLES:
        _HANDLES.append(register_module_parameter_registration_hook(_on_parameter_registered))
        _HANDLES.append(register_module_module_registration_hook(_on_module_registered))
    for submodule in module.modules():
        _WATCHED[submodule] = weakref.ref(planned)


def _planned_for(module: nn.Module) -> PlannedParameters | None:
    ref = _WATCHED.get(module)
    return None if ref is None else ref()


def _on_parameter_registered(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
    planned = _planned_for(module)
    if planned is not None and param is not None and param.requires_grad and id(param) not in planned.ids:
        _refuse(module, [name])


def _on_module_registered(module: nn.Module, name: str, submodule: nn.Module | None) -> None:
    planned = _planned_for(module)
    if planned is None or submodule is None:
        return
    new = [f"{name}.{n}" for n, p in submodule.named_parameters() if p.requires_grad and id(p) not in planned.ids]
    if new:
        _refuse(module, new)
    for inner in submodule.modules():  # (a parametrization's modules, holding planned parameters): watched too
        _WATCHED[inner] = weakref.ref(planned)


def _refuse(module: nn.Module, names: list[str]) -> None:
    raise RuntimeError(
        f"a trainable parameter was added to a wrapped model ({names_text(names, 3)} on its {type(module).__name__}): wrap() "
        "planned its gradient buckets without it, so its gradient would never be averaged and the ranks' "
        "replicas would part. Change the model before wrapping it; to change a wrapped one, drop the wrapper "
        "(and any optimizer over it) and wrap the changed model again. (load_state_dict(..., assign=True) "
        "replaces the parameters: load without assign=True after wrap(), it copies into them)"
    )
