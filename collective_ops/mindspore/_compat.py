"""Every private MindSpore API the library uses, and every MindSpore class attribute it replaces, in one place.

MindSpore may move any of these in a release. ``tests/test_compat.py`` checks each against the installed
MindSpore (it fails, naming the entry, when one moves), and ``tests/test_layout.py`` refuses a private MindSpore
name anywhere else in the library.

Replacements (:class:`ClassPatches`) are installed by ``collective_ops.wrap`` of a network, not at import, and
removed by ``collective_ops.shutdown()`` or once the last wrapper is gone: importing ``collective_ops.mindspore``
changes no MindSpore class.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import mindspore as ms
from mindspore import nn
from mindspore.train import amp

# dotted name -> why the library needs it (the test checks that each resolves in the installed MindSpore)
PRIVATE_APIS: dict[str, str] = {
    "mindspore.nn.Cell._params": "a cell's own parameters (not its sub-cells'): which bucket a cell reads",
    "mindspore.nn.Optimizer._params": "an optimizer's own state Parameters, shared between per-bucket optimizers",
    "mindspore.Parameter._version": "a Parameter's in-place version counter: a write to it after a step",
    "mindspore._no_grad": "applies owed updates outside autograd's record (PyNative)",
    "mindspore.train.amp._config_level": "the loss-scale manager Model picks for an amp level",
}


def own_parameters(cell: nn.Cell) -> dict[str, Any]:
    """``cell``'s own parameters by name (not its sub-cells'); values may be None (a declared, unset one)."""
    return cell._params


def optimizer_parameter_table(optimizer: nn.Optimizer) -> dict[str, Any]:
    """The optimizer cell's own Parameters (its state) by name; writable: a value replaced is the one it steps."""
    return optimizer._params


def version_of(param: ms.Parameter) -> int:
    """``param``'s in-place version counter."""
    return param._version


def no_grad() -> contextlib.AbstractContextManager[Any]:
    """Outside autograd's record (PyNative); nothing where this MindSpore has no such context."""
    context = getattr(ms, "_no_grad", None)
    return context() if context is not None else contextlib.nullcontext()


def amp_loss_scale_manager(level: str) -> Any:
    """The loss-scale manager ``Model`` uses for amp ``level`` when none is given (None: none)."""
    return getattr(amp, "_config_level", {}).get(level, {}).get("loss_scale_manager")


class ClassPatches:
    """MindSpore class (and module) attributes replaced while a wrapper needs them, each restored by
    :meth:`remove`: ``(owner, name) -> replacement``, built by ``make()`` from the original when installed."""

    _ABSENT = object()  # an attribute the owner itself did not hold (inherited): deleted again at removal

    def __init__(self) -> None:
        self._makers: dict[tuple[Any, str], Callable[[Any], Any]] = {}
        self._originals: dict[tuple[Any, str], Any] = {}

    def add(self, owner: Any, name: str, make: Callable[[Any], Any]) -> None:
        """Replace ``owner.name`` with ``make(original)`` whenever these patches are installed."""
        self._makers[(owner, name)] = make

    @property
    def owners(self) -> tuple[Any, ...]:
        """The classes and modules whose attributes these patches replace."""
        return tuple(dict.fromkeys(owner for owner, _ in self._makers))

    def install(self) -> None:
        """Every replacement in place (once: a second call changes nothing)."""
        for (owner, name), make in self._makers.items():
            if (owner, name) not in self._originals:
                self._originals[(owner, name)] = vars(owner).get(name, self._ABSENT)
                setattr(owner, name, make(getattr(owner, name)))

    def remove(self) -> None:
        """Every replaced attribute restored to MindSpore's own."""
        for (owner, name), original in self._originals.items():
            if original is self._ABSENT:
                delattr(owner, name)
            else:
                setattr(owner, name, original)
        self._originals.clear()


# What the wrappers replace in MindSpore: the training cells' constructors (Model's cells then reduce through the
# wrapper in their network), amp.build_train_network (a dynamic loss scale on CPU), Cell.parameters_and_names
# (owed per-bucket updates applied before a checkpoint reads the parameters). Filled in by the modules that
# define the replacements; installed by wrap().
TRAINING_PATCHES = ClassPatches()
