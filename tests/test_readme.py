"""The README's code, extracted and run as written: torch snippets at 2 ranks (the launch loop it shows),
the MindSpore one under msrun. The README cannot drift from the code without this failing."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.harness import free_port
from tests.msrun_harness import requires_mindspore

ROOT = Path(__file__).resolve().parents[1]


def snippet(name: str) -> str:
    """The README's ```python block whose first line is ``# name``."""
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)
    found = [b for b in blocks if b.startswith(f"# {name}\n")]
    assert len(found) == 1, f"README.md has {len(found)} python blocks starting '# {name}'"
    return found[0]


def _two_ranks(script: Path, tmp_path: Path) -> list[tuple[int, str, str]]:
    """``script`` at 2 ranks as the README launches it: (return code, stdout, stderr) of each rank."""
    env = {**os.environ, "WORLD_SIZE": "2", "MASTER_PORT": str(free_port()), "PYTHONPATH": str(ROOT)}
    procs = [
        subprocess.Popen(
            [sys.executable, str(script)],
            env={**env, "RANK": str(r), "DEVICE_ID": str(r)},
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(2)
    ]
    outputs = [p.communicate(timeout=180) for p in procs]
    return [(proc.returncode, out, err) for proc, (out, err) in zip(procs, outputs)]


@pytest.mark.parametrize("name", ["train.py", "primitives.py"])
def test_torch_snippets_run_at_two_ranks_as_the_readme_launches_them(name: str, tmp_path: Path) -> None:
    """Every rank exits 0, at once: no rerun (an abort at exit, "terminate called without an active exception",
    was torch's default group outliving shutdown(); test_runtime.py checks no Gloo thread is left)."""
    script = tmp_path / name
    script.write_text(snippet(name))
    results = _two_ranks(script, tmp_path)
    for rank, (code, out, err) in enumerate(results):
        assert code == 0, f"rank {rank}: {err[-2000:]}"
        if name == "train.py":
            assert f"rank {rank}/2: loss" in out


@requires_mindspore
def test_mindspore_snippet_runs_under_msrun(tmp_path: Path) -> None:
    script = tmp_path / "train_mindspore.py"
    script.write_text(snippet("train_mindspore.py"))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "GLOG_v": "3", "OMP_NUM_THREADS": "1"}
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    cmd = ["msrun", "--worker_num=2", "--local_worker_num=2", f"--master_port={free_port()}"]
    cmd += [f"--log_dir={tmp_path / 'logs'}", "--join=True", str(script)]
    result = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=240)
    logs = "\n".join(p.read_text(errors="replace") for p in sorted((tmp_path / "logs").glob("worker_*.log")))
    assert result.returncode == 0, logs[-3000:]
    assert "rank 0: loss" in logs and "rank 1: loss" in logs
