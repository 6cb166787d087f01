"""Run a worker script under ``msrun`` (MindSpore's launcher) and collect each rank's JSON result.

Each worker writes ``<out_dir>/rank<N>.json``; a run that fails or times out raises with
the tail of every worker's log, never hangs.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.harness import free_port

ROOT = Path(__file__).resolve().parents[1]


def mindspore_installed() -> bool:
    """True when mindspore is installed; skipping is only for its absence.

    An installed mindspore that fails to import, or lacks msrun, is a broken environment:
    the suite then fails (at collection, with the import error) instead of skipping.
    """
    if importlib.util.find_spec("mindspore") is None:
        return False
    import mindspore  # noqa: F401  (a broken install raises here, failing the run)

    msrun_path = str(Path(sys.executable).parent) + os.pathsep + os.environ.get("PATH", "")
    if shutil.which("msrun", path=msrun_path) is None:
        raise RuntimeError("mindspore is installed but its launcher msrun is not on PATH: the install is broken")
    return True


requires_mindspore = pytest.mark.skipif(not mindspore_installed(), reason="mindspore is not installed")


def run_msrun(
    script: str, world: int = 2, timeout: float = 240, args: tuple[str, ...] = (), env: dict | None = None
) -> list[dict]:
    out_dir = Path(tempfile.mkdtemp(prefix="msrun-out-"))
    log_dir = out_dir / "logs"
    env = {**os.environ, **(env or {})}
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")  # workers use this python
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["COLLECTIVE_OPS_TEST_OUT"] = str(out_dir)
    env.setdefault("OMP_NUM_THREADS", "1")
    env["GLOG_v"] = "3"  # MindSpore's INFO logs are loud
    cmd = [
        "msrun",
        f"--worker_num={world}",
        f"--local_worker_num={world}",
        f"--master_port={free_port()}",
        f"--log_dir={log_dir}",
        "--join=True",
        str(ROOT / "tests" / "ms_workers" / script),
        *args,
    ]
    try:
        proc = subprocess.run(cmd, env=env, cwd=out_dir, capture_output=True, text=True, timeout=timeout)
        failed = proc.returncode != 0
        reason = f"msrun exited with {proc.returncode}"
    except subprocess.TimeoutExpired:
        failed, reason = True, f"msrun did not finish within {timeout}s"
    results = []
    for rank in range(world):
        path = out_dir / f"rank{rank}.json"
        if not path.exists():
            failed, reason = True, reason + f"; rank {rank} wrote no result"
            break
        results.append(json.loads(path.read_text()))
    if failed:
        logs = []
        for log in sorted(log_dir.glob("worker_*.log")):
            lines = [
                ln
                for ln in log.read_text(errors="replace").splitlines()
                if "[INFO]" not in ln and "[WARNING]" not in ln
            ]
            logs.append(f"--- {log.name} ---\n" + "\n".join(lines[-40:]))
        raise AssertionError(f"{script}: {reason}\n" + "\n".join(logs))
    shutil.rmtree(out_dir, ignore_errors=True)
    return results


def write_result(rank: int, result: dict) -> None:
    """Called by workers."""
    out = Path(os.environ["COLLECTIVE_OPS_TEST_OUT"]) / f"rank{rank}.json"
    out.write_text(json.dumps(result))
