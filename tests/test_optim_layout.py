"""The optimizer's layout: the core after the collective imports no framework, the torch optimizer imports
neither its sharded subclass nor MindSpore's; one class per framework, the top-level name a function."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import collective_ops

PACKAGE = Path(collective_ops.__file__).parent
CORE = [
    *sorted((PACKAGE / "bucketing" / "update").glob("*.py")),
    *sorted((PACKAGE / "bucketing" / "shard").glob("*.py")),
    PACKAGE / "bucketing" / "participant.py",
]
FRAMEWORKS = ("torch", "mindspore", "numpy")


def imported(path: Path) -> set[str]:
    """Every module ``path`` imports, at any level (in functions too), relative ones resolved."""
    package = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts[:-1])
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level else ""
            module = ".".join(part for part in (base, node.module or "") if part)
            names.add(module)
            names |= {f"{module}.{alias.name}" for alias in node.names}
    return names


def test_the_core_after_the_collective_imports_no_framework() -> None:
    assert len(CORE) >= 9
    for path in CORE:
        frameworks = {name for name in imported(path) if name.split(".")[0] in FRAMEWORKS}
        assert not frameworks, f"{path.relative_to(PACKAGE)} imports {sorted(frameworks)}"
        upward = {name for name in imported(path) if name.startswith("collective_ops.") and ".bucketing" not in name}
        assert not upward, f"{path.relative_to(PACKAGE)} imports {sorted(upward)} from above the core"


def test_the_torch_optimizer_imports_neither_its_sharded_subclass_nor_mindspores() -> None:
    optim = PACKAGE / "torch" / "optim"
    for path in sorted(optim.glob("*.py")):
        if path.name in ("__init__.py",) or path.name.startswith("sharded"):
            continue
        names = imported(path)
        ours = {n for n in names if n.startswith("collective_ops.")}
        back = {n for n in ours if ".optim.sharded" in n or ".mindspore" in n or n == "collective_ops.torch.optim"}
        assert not back, f"torch/optim/{path.name} imports {sorted(back)}"


def test_one_class_per_framework_and_the_top_level_name_a_function_importing_no_framework() -> None:
    script = (
        "import inspect, sys, collective_ops as co\n"
        "assert inspect.isfunction(co.DistributedOptimizer)\n"
        "assert 'torch' not in sys.modules and 'mindspore' not in sys.modules, 'a framework was imported'\n"
        "import torch, collective_ops.torch as ct\n"
        "assert issubclass(ct.ShardedDistributedOptimizer, ct.DistributedOptimizer)\n"
        "assert ct.optim.DistributedOptimizer is ct.DistributedOptimizer\n"
        "assert not issubclass(torch.optim.SGD, ct.DistributedOptimizer)\n"
        "assert not type(ct.DistributedOptimizer).__module__.startswith('collective_ops'), 'a metaclass of ours'\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def test_a_subclass_asked_to_shard_is_told_which_class_shards() -> None:
    import torch

    import collective_ops.torch as ct

    class Mine(ct.DistributedOptimizer):
        pass

    with pytest.raises(TypeError, match="subclass collective_ops.torch.ShardedDistributedOptimizer"):
        Mine(None, torch.optim.SGD, shard=True)
