"""Run a function on N real processes joined by Gloo, and collect what each returns.

Starting a process and importing torch costs seconds (torch's import alone ~3.5 s of CPU
on this 2-core machine), so tests hand one group a whole list of checks, and ranks are
forked from a forkserver that imported torch once (0.1 s for a 2-rank group instead of ~4 s).
Each rank still starts as spawn starts it: a process with no parent state but the parent's
environment, sys.path and working directory. A rank that raises has its traceback re-raised
here; a group that does not finish within ``timeout`` is killed and reported, never left hanging.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import socket
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

# The server is a fresh interpreter (not a fork of pytest) holding only what importing torch loads,
# which reads none of the variables a test sets for its ranks and, with OMP_NUM_THREADS=1, starts no
# thread to fork beside (numpy's BLAS pool would otherwise). bootstrap.sh sets it; set here for a
# bare pytest run.
os.environ.setdefault("OMP_NUM_THREADS", "1")
_RANK_CONTEXT = mp.get_context("forkserver")
_RANK_CONTEXT.set_forkserver_preload(["torch"])


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank_environment(extra: dict | None) -> dict:
    """What a rank's os.environ is: this process's now (a monkeypatched variable included), plus ``extra``."""
    return {**os.environ, **(extra or {})}


def _entry(
    rank: int, world_size: int, port: int, fn: Callable, args: tuple, results: Any, env: dict, clean_exit: bool = True
) -> None:
    os.environ.clear()  # the parent's environment at the start, as under spawn (not the forkserver's)
    os.environ.update(env)
    try:
        import torch

        torch.set_num_threads(1)
        import collective_ops

        collective_ops.init("gloo", rank=rank, world_size=world_size, master_port=port, timeout=60)
        value = fn(rank, world_size, *args)
        pickle.dumps(value)  # a value the queue cannot send fails here, reported, not as a timeout
        if clean_exit:
            collective_ops.barrier()
            collective_ops.shutdown()
        results.put((rank, "ok", value))
    except BaseException:  # report everything, including SystemExit, to the parent
        results.put((rank, "error", traceback.format_exc()))


def run_ranks(
    world_size: int, fn: Callable, *args: Any, timeout: float = 180, env: dict | None = None, clean_exit: bool = True
) -> list[Any]:
    """``fn(rank, world_size, *args)`` on ``world_size`` Gloo ranks; the per-rank return values.

    ``clean_exit=False`` for a ``fn`` that calls ``collective_ops.shutdown()`` itself."""
    results = _RANK_CONTEXT.Queue()
    port = free_port()
    env = _rank_environment(env)
    procs = [
        _RANK_CONTEXT.Process(
            target=_entry, args=(r, world_size, port, fn, args, results, env, clean_exit), daemon=True
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    errors: list[str] = []
    try:
        for _ in range(world_size):
            rank, status, value = results.get(timeout=timeout)
            if status == "ok":
                out[rank] = value
            else:
                errors.append(f"--- rank {rank} ---\n{value}")
                break  # peers of a failed rank may block until their timeout
    except queue.Empty:
        errors.append(f"ranks {sorted(set(range(world_size)) - set(out))} did not finish within {timeout}s")
    finally:
        for p in procs:
            p.join(timeout=5 if not errors else 0.5)
            if p.is_alive():
                p.kill()
                p.join()
    if errors:
        raise AssertionError("multi-process run failed:\n" + "\n".join(errors))
    return [out[r] for r in range(world_size)]


def run_faulty_ranks(world_size: int, fn: Callable, *args: Any, timeout: float = 60, env: dict | None = None) -> dict:
    """Like run_ranks for fault-injection tests: ranks may fail, hang or exit; no closing barrier.

    Returns {rank: ("ok", value) | ("error", traceback) | ("missing", None)} once every rank
    reported or ``timeout`` passed; every process is killed afterwards.
    """
    results = _RANK_CONTEXT.Queue()
    port = free_port()
    env = _rank_environment(env)
    procs = [
        _RANK_CONTEXT.Process(target=_entry, args=(r, world_size, port, fn, args, results, env, False), daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    out: dict[int, tuple] = {}
    deadline = time.monotonic() + timeout
    while len(out) < world_size and time.monotonic() < deadline:
        try:
            rank, status, value = results.get(timeout=0.5)
            out[rank] = (status, value)
        except queue.Empty:
            if all(not procs[r].is_alive() for r in range(world_size) if r not in out):
                break  # every rank still owing a report has exited: nothing more will come
    while len(out) < world_size:  # reports sent just before their sender exited
        try:
            rank, status, value = results.get(timeout=0.5)
            out[rank] = (status, value)
        except queue.Empty:
            break
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join()
    return {r: out.get(r, ("missing", None)) for r in range(world_size)}


def run_rank_processes(
    env_by_rank: list[dict], timeout: float, module: str = "tests.fault_worker", prefixes: list[list[str]] | None = None
) -> list[dict]:
    """``python -m module`` once per entry of ``env_by_rank`` (its RANK etc. on top of this environment), each
    a process of its own, so that when each exits can be timed: a rank stopped or hung is never waited for
    past ``timeout`` seconds, and every process is killed afterwards (SIGKILL ends a stopped one too).

    ``prefixes``: each rank's command runs after its prefix (e.g. ``ip netns exec NS``).
    Per rank: ``returncode`` (None: still running at the end), ``exited_after`` (seconds since the start, None
    if it was still running), ``fault_at`` / ``error`` (its ``FAULT_AT`` / ``ERROR`` lines), and its output.
    """
    import json
    import subprocess
    import tempfile

    start = time.time()
    with tempfile.TemporaryDirectory(prefix="fault-ranks-") as folder:
        procs, outputs = [], []
        for index, extra in enumerate(env_by_rank):
            out = open(os.path.join(folder, f"{index}.out"), "w+")  # noqa: SIM115 (closed below)
            outputs.append(out)
            env = {**os.environ, "MASTER_ADDR": "127.0.0.1", **extra}
            argv = [*(prefixes[index] if prefixes else []), sys.executable, "-m", module]
            procs.append(subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env))
        exited: dict[int, float] = {}
        while len(exited) < len(procs) and time.time() - start < timeout:
            for index, proc in enumerate(procs):
                if index not in exited and proc.poll() is not None:
                    exited[index] = time.time() - start
            time.sleep(0.05)
        results = []
        for index, (proc, out) in enumerate(zip(procs, outputs)):
            returncode = proc.poll()
            if returncode is None:
                proc.kill()
                proc.wait()
            out.seek(0)
            text = out.read()
            out.close()
            lines = text.splitlines()
            fault_at = [float(line.split()[1]) - start for line in lines if line.startswith("FAULT_AT ")]
            errors = [json.loads(line[len("ERROR ") :]) for line in lines if line.startswith("ERROR ")]
            results.append(
                {
                    "returncode": returncode,
                    "exited_after": exited.get(index),
                    "fault_at": fault_at[0] if fault_at else None,
                    "error": errors[0] if errors else None,
                    "output": text,
                }
            )
    return results
