"""Launcher environments and backend selection, with the hardware probe substituted (we have no NPU)."""

from __future__ import annotations

import pytest

from collective_ops.launch import HardwareProbe, detect_launch_env, select_backend

NONE = HardwareProbe(torch_npu_installed=False, npu_available=False, cuda_available=False)
CUDA = HardwareProbe(torch_npu_installed=False, npu_available=False, cuda_available=True)
NPU = HardwareProbe(torch_npu_installed=True, npu_available=True, cuda_available=False)
NPU_PKG_NO_DEVICE = HardwareProbe(torch_npu_installed=True, npu_available=False, cuda_available=False)
BOTH = HardwareProbe(torch_npu_installed=True, npu_available=True, cuda_available=True)


@pytest.mark.parametrize(
    ("probe", "expected"),
    [(NONE, "gloo"), (CUDA, "nccl"), (NPU, "hccl"), (BOTH, "hccl"), (NPU_PKG_NO_DEVICE, "gloo")],
)
def test_automatic_choice(probe, expected) -> None:
    assert select_backend(None, probe, environ={}) == expected


def test_env_override_wins() -> None:
    assert select_backend(None, BOTH, environ={"COLLECTIVE_OPS_BACKEND": "gloo"}) == "gloo"
    assert select_backend("hccl", BOTH, environ={"COLLECTIVE_OPS_BACKEND": "NCCL"}) == "nccl"


def test_explicit_choice_the_hardware_cannot_serve() -> None:
    with pytest.raises(RuntimeError, match=r"collective-ops\[npu\]"):
        select_backend("hccl", NONE, environ={})
    with pytest.raises(RuntimeError, match="sees none"):
        select_backend("hccl", NPU_PKG_NO_DEVICE, environ={})
    with pytest.raises(RuntimeError, match="CUDA"):
        select_backend("nccl", NPU, environ={})
    with pytest.raises(ValueError, match="unknown backend 'mpi'"):
        select_backend("mpi", NONE, environ={})


def test_torchrun_env() -> None:
    env = detect_launch_env(
        {
            "RANK": "3",
            "WORLD_SIZE": "8",
            "LOCAL_RANK": "1",
            "MASTER_ADDR": "10.0.0.1",
            "MASTER_PORT": "1234",
            "TORCHELASTIC_RUN_ID": "x",
        }
    )
    assert (env.launcher, env.rank, env.world_size, env.local_rank, env.master_addr, env.master_port) == (
        "torchrun",
        3,
        8,
        1,
        "10.0.0.1",
        1234,
    )


def test_msrun_env() -> None:
    env = detect_launch_env(
        {"RANK_ID": "1", "MS_WORKER_NUM": "2", "MS_ROLE": "MS_WORKER", "MS_SCHED_HOST": "127.0.0.1"}
    )
    assert (env.launcher, env.rank, env.world_size, env.master_addr) == ("msrun", 1, 2, "127.0.0.1")


def test_seed_device_id_loop() -> None:
    env = detect_launch_env({"RANK": "2", "WORLD_SIZE": "4", "DEVICE_ID": "2"})
    assert (env.launcher, env.rank, env.device_id) == ("device_id", 2, 2)


def test_no_launcher_and_bad_values() -> None:
    assert detect_launch_env({}).launcher == "none"
    with pytest.raises(ValueError, match="RANK='x'"):
        detect_launch_env({"RANK": "x"})
