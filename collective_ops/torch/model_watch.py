"""Trainable parameters added to a wrapped model after ``wrap()``: noted as they are registered.

``wrap()`` plans its gradient buckets from the parameters it finds; a trainable parameter
registered on the model later (a new head assigned, ``load_state_dict(..., assign=True)``,
which puts the loaded tensors in place of the parameters) is in no bucket, so its gradient
would never be averaged and each rank would train it on its own data: the replicas part,
silently (as they do under torch DDP). torch's global registration hooks see every such
change on any module; the ones on a wrapped model's modules are noted here, and the wrapper
refuses the next backward (evaluation and export after such a change, fusing modules for
inference say, still work). Moving a parameter the plan already holds (a parametrization
registers the original under a new module) and frozen parameters are not noted.
"""

from __future__ import annotations

import weakref
from typing import Any

from torch import nn
from torch.nn.modules.module import (
    register_module_module_registration_hook,
    register_module_parameter_registration_hook,
)

from ..options import names_text

# each module of a wrapped model -> its wrapper's set of planned parameter ids (weakly held by the wrapper)
_WATCHED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_HANDLES: list[Any] = []


class PlannedParameters:
    """The ids of the parameters a wrapper planned (they stay alive with it, so the ids stay theirs), and the
    trainable parameters registered since that the plan does not hold (``added``, names, for the error)."""

    def __init__(self, params: list[nn.Parameter]) -> None:
        self.ids = {id(p) for p in params}
        self.added: list[str] = []

    def refuse_training_if_added(self) -> None:
        if self.added:
            raise RuntimeError(
                f"a trainable parameter was added to the wrapped model after wrap() ({names_text(self.added, 3)}): "
                "its gradient buckets were planned without it, so its gradient would never be averaged and the "
                "ranks' replicas would part. Evaluation works, training does not: change the model before "
                "wrapping it, or drop the wrapper (and any optimizer over it) and wrap the changed model again. "
                "(load_state_dict(..., assign=True) replaces the parameters: after wrap(), load without "
                "assign=True, which copies into them)"
            )


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
        planned.added.append(f"{name} of a {type(module).__name__}")


def _on_module_registered(module: nn.Module, name: str, submodule: nn.Module | None) -> None:
    planned = _planned_for(module)
    if planned is None or submodule is None:
        return
    planned.added += [
        f"{name}.{n} of a {type(module).__name__}"
        for n, p in submodule.named_parameters()
        if p.requires_grad and id(p) not in planned.ids
    ]
    for inner in submodule.modules():  # watched too (a parametrization's modules hold planned parameters)
        _WATCHED[inner] = weakref.ref(planned)
