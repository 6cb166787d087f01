"""Scripts the integration tests launch (Lightning, Accelerate, transformers), and the import rule they share."""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import pytest


def optional_package(name: str, extra: str) -> ModuleType:
    """``name`` imported; skipped where it is not installed, except under CI (``CI`` set), whose setup installs it:
    there a missing package fails rather than passing silently."""
    if os.environ.get("CI"):
        return importlib.import_module(name)
    return pytest.importorskip(name, reason=f"pip install 'collective-ops[{extra}]'")
