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
from collections.abc import Sequence
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

    def __init__(self, params: list[nn.Parameter], module: nn.Module) -> None:
        self.ids = {id(p) for p in params}
        self.params = list(params)
        self.added: list[str] = []
        # the model's parameters frozen at wrap: one unfrozen since is trainable outside the plan
        self.frozen = [p for p in module.parameters() if id(p) not in self.ids]
        # a parameter or module registered on the model since wrap (planned or not): the model is walked again
        self.registered = False

    def trainable_unchanged(self) -> bool:
        """True where the model's trainable parameters are still the planned ones, seen without walking the model:
        nothing registered on it since wrap, every planned parameter still trainable, no frozen one unfrozen."""
        if self.registered:
            return False
        return all(p.requires_grad for p in self.params) and not any(p.requires_grad for p in self.frozen)

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


def stop_watching() -> None:
    """torch's global registration hooks removed, and every model forgotten: at ``co.shutdown()``, and once no
    wrapper is left."""
    for handle in _HANDLES:
        handle.remove()
    _HANDLES.clear()
    _WATCHED.clear()


def _planned_for(module: nn.Module) -> PlannedParameters | None:
    ref = _WATCHED.get(module)
    return None if ref is None else ref()


def _on_parameter_registered(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
    planned = _planned_for(module)
    if planned is not None:
        planned.registered = True
    if planned is not None and param is not None and param.requires_grad and id(param) not in planned.ids:
        planned.added.append(f"{name} of a {type(module).__name__}")


def _on_module_registered(module: nn.Module, name: str, submodule: nn.Module | None) -> None:
    planned = _planned_for(module)
    if planned is not None:
        planned.registered = True
    if planned is None or submodule is None:
        return
    planned.added += [
        f"{name}.{n} of a {type(module).__name__}"
        for n, p in submodule.named_parameters()
        if p.requires_grad and id(p) not in planned.ids
    ]
    for inner in submodule.modules():  # watched too (a parametrization's modules hold planned parameters)
        _WATCHED[inner] = weakref.ref(planned)


def requires_grad_change_error(
    module: nn.Module, planned: set[int], names: Sequence[str], params: Sequence[nn.Parameter]
) -> RuntimeError | None:
    """The error for a plan no longer matching the model's trainable parameters (``planned``: their ids at wrap;
    ``names``/``params``: the planned ones): one frozen or unfrozen since, or replaced; None where they match."""
    if {id(p) for p in module.parameters() if p.requires_grad} == planned:
        return None
    changed = [n for n, p in module.named_parameters() if (id(p) in planned) != p.requires_grad]
    present = {id(p) for p in module.parameters()}
    gone = [names[i] for i, p in enumerate(params) if id(p) not in present]
    if gone:  # (a planned parameter replaced by another the plan holds: weights tied after wrap())
        return RuntimeError(
            f"parameters the bucket plan holds are no longer in the model ({names_text(gone, 5)}): replaced "
            "after wrap() by another parameter (weights tied, model.tie_weights() after resizing embeddings). "
            "Tie or replace parameters before wrapping, as DDP requires, then wrap again (call remove_hooks() "
            "on this wrapper first)."
        )
    return RuntimeError(
        f"requires_grad changed after wrap() for {changed[:10]}: the bucket plan (the same on every rank) was built "
        "from the trainable parameters at wrap time. Freeze or unfreeze parameters before wrapping, then "
        "wrap again (call remove_hooks() on this wrapper first)."
    )


def converted_error(changed: str) -> RuntimeError:
    """A backward after the model's parameters were converted since wrap() (``changed``: their names)."""
    return RuntimeError(
        f"the model's parameters were cast, moved or re-laid out after wrap() ({changed}"
        "): evaluation and saving work, training does not, since its gradient buckets were planned for "
        "the parameters as they were and would average the wrong elements. Cast and move the model "
        "before wrapping it, as DDP requires: co.wrap(net.to(device, dtype, memory_format=...))"
    )
