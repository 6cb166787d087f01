"""Scripts the integration tests launch (Lightning, Accelerate, transformers), and the import rule they share."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest


def optional_package(name: str, extra: str) -> ModuleType:
    """``name`` imported; skipped where it is not installed, except under CI (``CI`` set), whose setup installs it:
    there a missing package fails rather than passing silently."""
    if os.environ.get("CI"):
        return importlib.import_module(name)
    return pytest.importorskip(name, reason=f"pip install 'collective-ops[{extra}]'")


ROOT = Path(__file__).resolve().parents[2]


def run_torchrun(script: Path, *args: str, processes: int = 2, timeout: float = 300) -> str:
    """``script`` under ``torchrun --nproc-per-node processes`` on a free port, with this checkout importable; its
    stdout (a failure raises with the end of its stderr)."""
    from tests.harness import free_port

    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(processes)]
    command += ["--master-port", str(free_port()), str(script), *args]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{script.name} {' '.join(args)} failed (rc {done.returncode}):\n{done.stderr[-4000:]}"
    return done.stdout
