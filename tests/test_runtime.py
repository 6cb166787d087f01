"""init / init_hccl / shutdown on a real single-process group, and the `collective-ops info` command."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import collective_ops as co
from tests.harness import free_port


def test_primitives_before_init_say_what_to_do() -> None:
    assert not co.is_initialized()
    with pytest.raises(RuntimeError, match=r"call collective_ops.init\(\) first"):
        co.allreduce(torch.ones(2))
    with pytest.raises(RuntimeError, match="not initialized"):
        co.get_rank()


def test_init_is_idempotent_and_checks_conflicts(monkeypatch) -> None:
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    try:
        ctx = co.init()  # no launcher: a single process on loopback
        assert (ctx.rank, ctx.world_size, ctx.backend, ctx.device) == (0, 1, "gloo", "cpu")
        assert co.init() is ctx
        assert co.get_rank() == 0 and co.get_world_size() == 1 and co.is_initialized()
        with pytest.raises(RuntimeError, match="already initialized as rank 0/1"):
            co.init(rank=1, world_size=2)
        t = torch.full((3,), 2.0)
        co.allreduce(t, op="avg")
        assert torch.equal(t, torch.full((3,), 2.0))
        co.barrier()
    finally:
        co.shutdown()
        co.shutdown()  # twice is fine
    assert not co.is_initialized()


def test_init_hccl_falls_back_with_a_warning(monkeypatch) -> None:
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    monkeypatch.delenv("COLLECTIVE_OPS_BACKEND", raising=False)
    with pytest.raises(RuntimeError, match="torch_npu"):
        co.init_hccl(0, 1, 0, strict=True)
    try:
        with pytest.warns(RuntimeWarning, match="falling back"):
            ctx = co.init_hccl(0, 1, 0)
        assert ctx.backend == "gloo"
    finally:
        co.shutdown()


def test_bad_init_arguments(monkeypatch) -> None:
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    with pytest.raises(ValueError, match="rank 3 is not in 0..1"):
        co.init("gloo", rank=3, world_size=2)
    with pytest.raises(ValueError, match="give both"):
        co.init("gloo", rank=0)
    with pytest.raises(ValueError, match="unknown backend 'tcp'"):
        co.init("tcp")
    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        co.init("nccl")
    assert not co.is_initialized()


def test_info_command() -> None:
    env = {"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "TORCHELASTIC_RUN_ID": "x", "PATH": "/usr/bin:/bin"}
    result = subprocess.run(
        [sys.executable, "-m", "collective_ops.cli", "info"], capture_output=True, text=True, env=env, check=True
    )
    assert "launcher      : torchrun" in result.stdout
    assert "rank/world    : 1/4" in result.stdout
    assert "backend       : gloo" in result.stdout
    bad = subprocess.run([sys.executable, "-m", "collective_ops.cli", "nonsense"], capture_output=True, text=True)
    assert bad.returncode == 2 and "invalid choice" in bad.stderr
