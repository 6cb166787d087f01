"""The wrapper calls only what the core declares of its optimizer (bucketing.participant.UpdateParticipant)."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import collective_ops.torch.ddp as ddp
from collective_ops.bucketing.participant import UpdateParticipant

DECLARED = {
    name for name, _ in inspect.getmembers(UpdateParticipant) if not name.startswith("_") or name == "shards"
} | set(UpdateParticipant.__annotations__)


def optimizer_members_called(source: str) -> set[str]:
    """Every attribute the code reads on an attached optimizer: ``<x>.optimizer.<member>``, or ``<name>.<member>``
    where the function bound ``<name>`` to ``<x>.optimizer`` (``optimizer = self.optimizer``)."""

    def is_optimizer(node: ast.AST, aliases: set[str]) -> bool:
        return (isinstance(node, ast.Attribute) and node.attr == "optimizer") or (
            isinstance(node, ast.Name) and node.id in aliases
        )

    called: set[str] = set()
    for function in ast.walk(ast.parse(source)):
        if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        aliases = {
            target.id
            for node in ast.walk(function)
            if isinstance(node, ast.Assign) and any(is_optimizer(v, set()) for v in ast.walk(node.value))
            for target in node.targets
            if isinstance(target, ast.Name)
        }
        for node in ast.walk(function):
            if isinstance(node, ast.Attribute) and is_optimizer(node.value, aliases):
                called.add(node.attr)
    return called


def test_the_wrapper_calls_only_the_declared_participant_members() -> None:
    wrapper_modules = Path(ddp.__file__).parent.glob("*.py")  # the torch wrapper's modules (optim/ is the optimizer)
    called = set().union(*(optimizer_members_called(path.read_text()) for path in wrapper_modules))
    assert {"synchronize", "defers", "on_settle", "before_optimizer_beside"} <= called  # the walk sees calls
    assert called <= DECLARED, f"ddp.py calls undeclared optimizer members: {sorted(called - DECLARED)}"


def test_both_torch_optimizers_provide_every_declared_member() -> None:
    from collective_ops.torch.optim import DistributedOptimizer, ShardedDistributedOptimizer

    for cls in (DistributedOptimizer, ShardedDistributedOptimizer):
        missing = [name for name in DECLARED if not hasattr(cls, name)]
        assert not missing, f"{cls.__name__} lacks {missing}"
