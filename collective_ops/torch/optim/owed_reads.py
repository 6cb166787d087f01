"""Reads of parameters whose update a step still owes: the forward hooks and the torch function mode that
finish an owed bucket before a forward reads it (:class:`OwedReads`), and the module hook that a copy
of the module (an EMA's ``AveragedModel``) does not carry."""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Container
from typing import Any, Protocol

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from .. import _compat


class OwedReader(Protocol):
    """What :class:`OwedReads` tells of a read: the optimizer finishes the parameter's write first."""

    def read_owed(self, param: torch.Tensor) -> None: ...


class OwedReads(TorchFunctionMode):
    """While a forward runs with parameter writes owed: every torch function (Tensor methods, ``.data``, indexing
    and ``torch.nn.functional`` included) whose arguments hold a parameter still owed its write has that write
    finished first (:meth:`OwedReader.read_owed`), so it never reads the step's old value.

    Each parameter costs one check per forward: it leaves :attr:`owed` at its first read, finished or found
    finished already; once none is left, each function pays one falsy test."""

    def __init__(self, optimizer: OwedReader) -> None:
        super().__init__()
        self._optimizer = weakref.ref(optimizer)  # (the optimizer holds the mode)
        self.owed: dict[int, int] = {}  # id(parameter) -> index, of those not yet read in this forward
        self._watching = False

    def watch(self, owed: dict[int, int]) -> None:
        self.owed = owed
        if not self._watching:
            self._watching = True
            self.__enter__()

    def unwatch(self) -> None:
        self.owed = {}
        if self._watching:
            self._watching = False
            self.__exit__(None, None, None)

    @contextlib.contextmanager
    def paused(self) -> Any:
        """The optimizer's own work (finishing buckets, applying updates) reads the parameters unwatched."""
        owed, self.owed = self.owed, {}
        try:
            yield
        finally:
            self.owed = owed

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if kwargs is None:
            kwargs = {}
        # (traced by torch.compile, a graph reads nothing owed: a compiled submodule's pre-hook finished every write)
        if self.owed and not torch.compiler.is_compiling():
            self._check(args)
            if kwargs:
                self._check(kwargs.values())
        return func(*args, **kwargs)

    def _check(self, values: Any) -> None:
        for value in values:
            if isinstance(value, (list, tuple)):  # torch.cat([...]), torch.stack, foreach lists
                self._check(value)
            elif id(value) in self.owed:  # (only live parameters are keys: an id match is the parameter)
                del self.owed[id(value)]
                optimizer = self._optimizer()
                if optimizer is not None:
                    optimizer.read_owed(value)


class HookOf:
    """A module hook calling a method of the optimizer. A copy of the module (``copy.deepcopy``, as an EMA's
    ``AveragedModel`` makes; a pickled module) gets a hook that does nothing instead: the copy is not this
    optimizer's to update, and the optimizer itself does not copy (torch's Optimizer pickles its state only)."""

    def __init__(self, method: Any) -> None:
        self._method = method

    def __call__(self, *args: Any) -> Any:
        return self._method(*args)

    def __reduce__(self) -> tuple:  # deepcopy and pickle both rebuild from it
        return _make_no_hook, ()


def without_autocast(device_type: str) -> Any:
    """A context that turns autocast off for ``device_type`` (none where that device has no autocast)."""
    if torch.amp.is_autocast_available(device_type):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()


def _may_read_owed(module: nn.Module, root: nn.Module, trained: Container[int]) -> bool:
    """Whether ``module``'s forward needs the optimizer's pre-hook: the root (the forward's start), a module with
    trained parameters of its own, or a compiled one (no wait can sit inside its graph). A module without them
    (a container, an activation, a dropout) costs no hook: a read its forward makes of a submodule's parameter
    that never ran (``F.linear(x, self.proj.weight)``) is one its nearest hooked ancestor waits for, learnt in
    the first forward or caught by :class:`OwedReads`."""
    if module is root or _compat.is_compiled(module):
        return True
    return any(id(p) in trained for p in module.parameters(recurse=False))


def _no_hook(*args: Any) -> None:
    return None


def _make_no_hook() -> Any:
    return _no_hook


def hook_model(model: Any, optimizer: Any, trained: Container[int]) -> list[Any]:
    """The hooks through which ``optimizer`` (a DistributedOptimizer) follows ``model``'s forwards and
    checkpoints (their handles): the forward of every module that may read an owed parameter waits for the owed
    updates of what it reads; the inner module's and every submodule's state_dict/load_state_dict see every
    update first. ``trained``: the ids of the parameters the model's buckets hold."""
    before_forward, after_forward = HookOf(optimizer._before_forward_of), HookOf(optimizer._after_forward_of)
    readers = [module for module in model.module.modules() if _may_read_owed(module, model.module, trained)]
    # First among each module's pre-hooks: those already there compute from the parameters too (the classic
    # torch.nn.utils.weight_norm / spectral_norm derive the weight from them there).
    hooks = [module.register_forward_pre_hook(before_forward, prepend=True) for module in readers]
    # always_call: a forward that raises leaves no module behind, nor the mode on torch's stack
    hooks += [module.register_forward_hook(after_forward, always_call=True) for module in readers]
    hooks.append(model.module.register_forward_hook(HookOf(optimizer._after_forward)))
    # on the wrapper: runs before its buffer broadcast
    hooks.append(model.register_forward_pre_hook(HookOf(optimizer._forward_starts)))
    # The inner module's own state_dict() (a checkpoint of model.module), and any submodule's (a backbone
    # saved alone: model.module.encoder.state_dict()), sees every update too; loading weights into any of them
    # (the wrapper's load_state_dict too) lands after every owed write, not under one. On every module: a
    # submodule's state_dict()/load_state_dict() runs its own hooks only, not its parents'.
    for module in model.module.modules():
        hooks.append(module.register_state_dict_pre_hook(HookOf(optimizer._before_state_dict)))
        hooks.append(module.register_load_state_dict_pre_hook(HookOf(optimizer._before_load)))
        hooks.append(module.register_load_state_dict_post_hook(HookOf(optimizer._after_load)))
    return hooks
