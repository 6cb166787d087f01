"""The nanoGPT-style example (examples/nanogpt_style.py) at 2 ranks under torchrun, as nanoGPT's train.py runs:
accumulation through model.require_backward_grad_sync, evaluation on the master process only, clipping, a
checkpoint. co.wrap and co.DistributedOptimizer each print the weight checksum torch's DDP prints, bit for bit."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.integrations import ROOT, run_torchrun


def _nanogpt(tmp_path: Path, *flags: str) -> tuple[list[str], list[str]]:
    """The example's evaluation lines and each rank's checksum line."""
    stdout = run_torchrun(ROOT / "examples" / "nanogpt_style.py", "--out-dir", str(tmp_path), *flags)
    evaluations = re.findall(r"step \d+: val loss \S+", stdout)
    checksums = sorted(re.findall(r"rank \d: weight checksum \S+", stdout))
    assert len(checksums) == 2 and evaluations, stdout
    return evaluations, checksums


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[str], list[str]]:
    return _nanogpt(tmp_path_factory.mktemp("ddp"), "--ddp")


@pytest.mark.parametrize("flags", [(), ("--distributed-optimizer",)], ids=["wrap", "distributed_optimizer"])
def test_nanogpt_style_loop_equals_ddp(ddp_run: tuple, flags: tuple[str, ...], tmp_path: Path) -> None:
    evaluations, checksums = _nanogpt(tmp_path, *flags)
    assert evaluations == ddp_run[0], "the master's evaluations differ from DDP's"
    assert checksums == ddp_run[1], "the weights differ from DDP's"
    assert (tmp_path / "ckpt.pt").exists()
