"""Run worker scripts under ``msrun`` (MindSpore's launcher) and collect each rank's JSON result.

Each worker writes ``<out_dir>/rank<N>.json`` (``<part>.rank<N>.json`` under ms_workers/suite.py,
which runs several in one start); a run that fails or times out raises with the tail of every
worker's log, never hangs.
"""

from __future__ import annotations

import atexit
import functools
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
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


PART_ENV = "COLLECTIVE_OPS_TEST_PART"  # set by ms_workers/suite.py: the part whose result write_result writes
PART_ERROR = "suite_part_error"  # the one key of a part's result when the part raised: its traceback


def _launch(script: str, world: int, timeout: float, args: tuple[str, ...], env: dict | None, out_dir: Path) -> str:
    """Run ``script`` under msrun with its output in ``out_dir``; why it failed, or "" when it did not."""
    env = {**os.environ, **(env or {})}
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")  # workers use this python
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["COLLECTIVE_OPS_TEST_OUT"] = str(out_dir)
    env.setdefault("OMP_NUM_THREADS", "1")
    env["GLOG_v"] = "3"  # MindSpore's INFO logs are loud
    # the workers' registration with msrun's scheduler retries every 3-5 s by default: a start took ~18 s
    # here for a script that only initializes, ~14 s with these (the suite starts msrun three times)
    env.setdefault("MS_RETRY_INTERVAL_LOWER", "1")
    env.setdefault("MS_RETRY_INTERVAL_UPPER", "2")
    cmd = [
        "msrun",
        f"--worker_num={world}",
        f"--local_worker_num={world}",
        f"--master_port={free_port()}",
        f"--log_dir={out_dir / 'logs'}",
        "--join=True",
        str(ROOT / "tests" / "ms_workers" / script),
        *args,
    ]
    try:
        proc = subprocess.run(cmd, env=env, cwd=out_dir, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return f"msrun did not finish within {timeout}s"
    return f"msrun exited with {proc.returncode}" if proc.returncode != 0 else ""


def _collect(out_dir: Path, world: int, prefix: str = "") -> tuple[list[dict], str]:
    """Every rank's result (``<prefix>rank<N>.json``), or why some are missing."""
    results = []
    for rank in range(world):
        path = out_dir / f"{prefix}rank{rank}.json"
        if not path.exists():
            return results, f"rank {rank} wrote no result"
        result = json.loads(path.read_text())
        if PART_ERROR in result:
            return results, f"rank {rank} raised:\n{result[PART_ERROR]}"
        results.append(result)
    return results, ""


def _worker_logs(out_dir: Path) -> str:
    logs = []
    for log in sorted((out_dir / "logs").glob("worker_*.log")):
        lines = [
            ln for ln in log.read_text(errors="replace").splitlines() if "[INFO]" not in ln and "[WARNING]" not in ln
        ]
        logs.append(f"--- {log.name} ---\n" + "\n".join(lines[-40:]))
    return "\n".join(logs)


@dataclass(frozen=True)
class SuiteRun:
    """One msrun start that ran several worker scripts (ms_workers/suite.py); its trace file, if one was written."""

    results: dict[str, list[dict]]  # part -> every rank's result, for the parts that finished
    failure: str  # why the run failed, with the workers' logs; "" when it did not
    trace_file: Path

    def part(self, name: str) -> list[dict]:
        """Every rank's result of one part; a clear failure when that part did not finish."""
        if name not in self.results:
            raise AssertionError(f"part {name!r} did not finish: {self.failure}")
        return self.results[name]


@functools.cache
def run_msrun_suite(mode: str, world: int, parts: tuple[str, ...], timeout: float = 280) -> SuiteRun:
    """Run ``parts`` (worker scripts with arguments, see ms_workers/suite.py) in one msrun start, once per
    session; the parts that finished keep their results when a later one fails."""
    out_dir = Path(tempfile.mkdtemp(prefix="msrun-suite-"))
    atexit.register(shutil.rmtree, out_dir, True)  # kept until then: the tests read its trace file
    trace_file = out_dir / "comm_trace.json"
    env = {"COLLECTIVE_OPS_TRACE_FILE": str(trace_file)}  # a part that asks for a trace writes it here
    failure = _launch("suite.py", world, timeout, (mode, *parts), env, out_dir)
    results, failures = {}, [failure] if failure else []
    for part in parts:  # a part that raised does not hide the later parts' results
        part_results, missing = _collect(out_dir, world, prefix=f"{part}.")
        if missing:
            failures.append(f"part {part!r}: {missing}")
        else:
            results[part] = part_results
    failure = "; ".join(failures)
    if failure:
        failure = f"suite.py {mode} {' '.join(parts)}: {failure}\n{_worker_logs(out_dir)}"
    return SuiteRun(results, failure, trace_file)


def write_result(rank: int, result: dict) -> None:
    """Called by workers (under suite.py, named after the part that runs)."""
    part = os.environ.get(PART_ENV)
    name = f"{part}.rank{rank}.json" if part else f"rank{rank}.json"
    out = Path(os.environ["COLLECTIVE_OPS_TEST_OUT"]) / name
    out.write_text(json.dumps(result))
