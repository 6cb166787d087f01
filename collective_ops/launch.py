"""Launcher environments and backend choice: pure functions, testable without hardware."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Mapping
from dataclasses import dataclass

TORCH_BACKENDS = ("hccl", "nccl", "gloo")
MINDSPORE_BACKENDS = ("hccl", "nccl", "mccl")
DEFAULT_MASTER_ADDR = "127.0.0.1"  # loopback unless the user or launcher says otherwise
DEFAULT_MASTER_PORT = 29500


@dataclass(frozen=True)
class LaunchEnv:
    """What the launcher told this process."""

    launcher: str  # "torchrun", "msrun", "device_id" (the seed's bash loop) or "none"
    rank: int | None
    world_size: int | None
    local_rank: int | None
    device_id: int | None
    master_addr: str | None
    master_port: int | None


def _int(environ: Mapping[str, str], *names: str) -> int | None:
    for name in names:
        value = environ.get(name)
        if value not in (None, ""):
            try:
                return int(value)
            except ValueError:
                raise ValueError(f"environment variable {name}={value!r} is not an integer") from None
    return None


def detect_launch_env(environ: Mapping[str, str] | None = None) -> LaunchEnv:
    """Read rank, world size and device from torchrun, msrun or the seed's DEVICE_ID loop."""
    environ = os.environ if environ is None else environ
    if "RANK_ID" in environ or "MS_ROLE" in environ:
        launcher = "msrun"
    elif "TORCHELASTIC_RUN_ID" in environ or "LOCAL_RANK" in environ:
        launcher = "torchrun"
    elif "RANK" in environ or "DEVICE_ID" in environ:
        launcher = "device_id"
    else:
        launcher = "none"
    return LaunchEnv(
        launcher=launcher,
        rank=_int(environ, "RANK", "RANK_ID"),
        world_size=_int(environ, "WORLD_SIZE", "RANK_SIZE", "MS_WORKER_NUM"),
        local_rank=_int(environ, "LOCAL_RANK", "MS_LOCAL_RANK"),
        device_id=_int(environ, "DEVICE_ID"),
        master_addr=environ.get("MASTER_ADDR") or environ.get("MS_SCHED_HOST") or None,
        master_port=_int(environ, "MASTER_PORT"),
    )


@dataclass(frozen=True)
class HardwareProbe:
    """What accelerators this process can use."""

    torch_npu_installed: bool
    npu_available: bool
    cuda_available: bool
    # torch_npu is installed but failed to import (CANN missing or mismatched): the reason, never hidden
    npu_error: str | None = None


def probe_hardware() -> HardwareProbe:
    """Look for NPUs and GPUs. Imports torch (and so torch_npu, if installed) only when present."""
    torch_npu_installed = importlib.util.find_spec("torch_npu") is not None
    if importlib.util.find_spec("torch") is None:
        return HardwareProbe(torch_npu_installed, False, False)
    import torch

    npu, npu_error = False, None
    if torch_npu_installed:
        try:
            import torch_npu  # noqa: F401  (registers torch.npu)

            npu = bool(getattr(torch, "npu", None) and torch.npu.is_available())
        except Exception as exc:  # a broken CANN install: kept, so the error says why there is no NPU
            npu_error = f"{type(exc).__name__}: {exc}"
    return HardwareProbe(torch_npu_installed, npu, bool(torch.cuda.is_available()), npu_error)


def select_backend(requested: str | None, probe: HardwareProbe, environ: Mapping[str, str] | None = None) -> str:
    """The torch.distributed backend to use.

    ``COLLECTIVE_OPS_BACKEND`` wins over everything (the operator's switch), then
    ``requested``, then: ``hccl`` with an NPU, ``nccl`` with CUDA, else ``gloo``.
    An explicit choice the hardware cannot serve is an error that says why.
    """
    environ = os.environ if environ is None else environ
    choice = (environ.get("COLLECTIVE_OPS_BACKEND") or requested or "").strip().lower() or None
    if choice is None:
        if probe.npu_error:
            # On an Ascend host a silent fall back to CPU would hide the real fault.
            raise RuntimeError(
                f"{backend_problem('hccl', probe)}. To run on CPU anyway, set COLLECTIVE_OPS_BACKEND=gloo"
            )
        if probe.npu_available:
            return "hccl"
        if probe.cuda_available:
            return "nccl"
        return "gloo"
    if choice not in TORCH_BACKENDS:
        raise ValueError(f"unknown backend {choice!r}; use one of {', '.join(TORCH_BACKENDS)} (or None to choose)")
    problem = backend_problem(choice, probe)
    if problem:
        raise RuntimeError(problem)
    return choice


def backend_problem(backend: str, probe: HardwareProbe) -> str | None:
    """Why ``backend`` cannot run here, or None if it can."""
    if backend == "hccl":
        if not probe.torch_npu_installed:
            return (
                "backend 'hccl' needs torch_npu (Ascend NPUs with the CANN toolkit): "
                "pip install 'collective-ops[npu]' on an Ascend machine"
            )
        if probe.npu_error:
            return (
                f"torch_npu is installed but failed to import ({probe.npu_error}); check the CANN toolkit "
                "(source its set_env.sh) and that the torch_npu version matches torch"
            )
        if not probe.npu_available:
            return "backend 'hccl' needs an Ascend NPU, and torch_npu sees none (check npu-smi info and CANN)"
    if backend == "nccl" and not probe.cuda_available:
        return "backend 'nccl' needs a CUDA GPU, and torch sees none (torch.cuda.is_available() is False)"
    return None


def device_type_for(backend: str) -> str:
    return {"hccl": "npu", "nccl": "cuda"}.get(backend, "cpu")
