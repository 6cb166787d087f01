"""Run a function on N real processes joined by Gloo, and collect what each returns.

Starting a process and importing torch costs seconds (torch's import alone ~3.5 s of CPU
on this 2-core machine), so tests hand one group a whole list of checks, and ranks are
forked from a forkserver that imported torch once (0.1 s for a 2-rank group instead of ~4 s).
Each rank still starts as spawn starts it: a process with no parent state but the parent's
environment, sys.path and working directory. A rank that raises has its traceback re-raised
here; a group that does not finish within ``timeout`` is killed and reported, never left hanging.
``run_checks`` runs a group's checks by name, each failing on its own: one check that raises (or hangs)
fails its own test, with that rank's traceback, and the others keep their results.
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
from collections.abc import Callable, Mapping
from typing import Any

# The server is a fresh interpreter (not a fork of pytest) holding only what importing torch loads,
# which reads none of the variables a test sets for its ranks and, with OMP_NUM_THREADS=1, starts no
# thread to fork beside (numpy's BLAS pool would otherwise). bootstrap.sh sets it; set here for a
# bare pytest run.
os.environ.setdefault("OMP_NUM_THREADS", "1")
_RANK_CONTEXT = mp.get_context("forkserver")
# Set to a file's path: rank 0 of every run_checks group appends each check's seconds there (what to trim first).
CHECK_TIMES_ENV = "COLLECTIVE_OPS_CHECK_TIMES"
_RANK_CONTEXT.set_forkserver_preload(["torch"])


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank_environment(extra: dict | None) -> dict:
    """What a rank's os.environ is: this process's now (a monkeypatched variable included), plus ``extra``."""
    return {**os.environ, **(extra or {})}


def _join_as_rank(rank: int, world_size: int, port: int, env: dict) -> Any:
    """A forked rank's start: the parent's environment at the start, as under spawn (not the forkserver's), one
    thread, the Gloo group joined. Returns the collective_ops module."""
    os.environ.clear()
    os.environ.update(env)
    import torch

    torch.set_num_threads(1)
    import collective_ops

    collective_ops.init("gloo", rank=rank, world_size=world_size, master_port=port, timeout=60)
    return collective_ops


def _start_ranks(target: Callable, world_size: int, port: int, *args: Any) -> list:
    """``target(rank, world_size, port, *args)`` started in one forked process per rank."""
    procs = [
        _RANK_CONTEXT.Process(target=target, args=(r, world_size, port, *args), daemon=True) for r in range(world_size)
    ]
    for p in procs:
        p.start()
    return procs


def _entry(
    rank: int, world_size: int, port: int, fn: Callable, args: tuple, results: Any, env: dict, clean_exit: bool = True
) -> None:
    try:
        collective_ops = _join_as_rank(rank, world_size, port, env)
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
    procs = _start_ranks(_entry, world_size, port, fn, args, results, env, clean_exit)
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


# -- named checks: one failing check fails its own test only ------------------------------------------------------


class CheckResults(Mapping):
    """One rank's results of :func:`run_checks`, by check name. Reading a check that failed raises an
    AssertionError with the traceback of the rank where it failed, so only that check's test fails."""

    def __init__(self, rank: int, entries: dict) -> None:
        self.rank = rank
        self._entries = entries  # name -> ("ok", value) | ("error", text)

    def __getitem__(self, name: str) -> Any:
        status, value = self._entries[name]
        if status != "ok":
            raise AssertionError(f"check {name!r} failed on rank {self.rank}:\n{value}")
        return value

    def __iter__(self):
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)


def _checks_entry(
    rank: int, world_size: int, port: int, checks_fn: Callable, args: tuple, results: Any, env: dict, start: int
) -> None:
    """A rank of :func:`run_checks`: the checks from ``start`` on, each one's result sent as it ends. The first
    that raises ends this rank (its peers may be inside that check's collectives: the group is not trusted)."""
    try:
        collective_ops = _join_as_rank(rank, world_size, port, env)
        checks = checks_fn(rank, world_size, *args)
        results.put((rank, "names", list(checks)))
    except BaseException:
        results.put((rank, "setup error", traceback.format_exc()))
        return
    times = os.environ.get(CHECK_TIMES_ENV) if rank == 0 else None
    for index, (name, check) in enumerate(list(checks.items())[start:], start):
        try:
            began = time.perf_counter()
            value = check()
            if times:
                with open(times, "a") as out:
                    out.write(
                        f"{time.perf_counter() - began:8.2f} s  {checks_fn.__module__}.{checks_fn.__name__}: {name}\n"
                    )
            pickle.dumps(value)
            results.put((rank, index, ("ok", value)))
        except BaseException:
            results.put((rank, index, ("error", traceback.format_exc())))
            return  # exiting closes this rank's connections: a peer waiting on it in a collective fails promptly
    try:
        collective_ops.barrier()
        collective_ops.shutdown()
    finally:
        results.put((rank, "done", None))


def _check_group(
    world_size: int, checks_fn: Callable, args: tuple, timeout: float, env: dict, start: int, found: list[dict]
) -> tuple[list, int | None]:
    """One rank group running the checks from ``start``; their results written into ``found`` (per rank, by
    index). Returns the checks' names and where a fresh group must go on (None: every check has run)."""
    results = _RANK_CONTEXT.Queue()
    port = free_port()
    procs = _start_ranks(_checks_entry, world_size, port, checks_fn, args, results, env, start)
    names: list = []
    done: set[int] = set()
    failed_at: int | None = None  # the first check that raised on some rank
    # starting a group (forking, importing, joining) can take tens of seconds on a loaded machine: its own bound;
    # then one per check, renewed by every result
    deadline = time.monotonic() + max(timeout, 120)
    try:
        while len(done) < world_size:
            try:
                rank, what, value = results.get(timeout=0.5)
            except queue.Empty:
                if time.monotonic() > deadline or all(not p.is_alive() for r, p in enumerate(procs) if r not in done):
                    break
                continue
            if what == "setup error":
                raise AssertionError(f"multi-process run failed:\n--- rank {rank} ---\n{value}")
            if what == "names":
                names = value
                deadline = time.monotonic() + timeout
            elif what == "done":
                done.add(rank)
            else:
                found[rank][what] = value
                if value[0] != "ok" and failed_at is None:
                    failed_at = what
                    deadline = time.monotonic() + 10  # the peers' own report of it (a broken connection, say)
                if failed_at is not None and all(failed_at in f for f in found):
                    break
                if failed_at is None:
                    deadline = time.monotonic() + timeout
    finally:
        for p in procs:
            p.join(timeout=5 if failed_at is None and len(done) == world_size else 0.1)
            if p.is_alive():
                p.kill()
                p.join()
    if len(done) == world_size:
        return names, None
    if not names:
        raise AssertionError(f"the ranks did not start their checks within {timeout}s")
    # the check some rank did not finish (it failed on a peer, hung, or its process died): recorded, then on
    stuck = failed_at if failed_at is not None else min(max(f, default=start - 1) + 1 for f in found)
    culprit = next((r for r, f in enumerate(found) if f.get(stuck, ("ok",))[0] != "ok"), None)
    for f in found:
        if stuck not in f:
            why = f"rank {culprit} failed in it" if culprit is not None else f"not finished within {timeout}s"
            f[stuck] = ("error", f"this rank did not finish the check: {why} (or this rank's process died)")
    return names, stuck + 1 if stuck + 1 < len(names) else None


def run_checks(
    world_size: int, checks_fn: Callable, *args: Any, timeout: float = 180, env: dict | None = None
) -> list[CheckResults]:
    """Named checks on ``world_size`` Gloo ranks, each failing on its own: the per-rank results by name.

    ``checks_fn(rank, world_size, *args)`` returns ``{name: check}`` (the same names, in the same order, on
    every rank), each ``check()`` returning that check's value; a tuple of names takes a tuple of values. A
    check that raises on a rank is that check's result there (reading it raises with the traceback); its
    peers' results of it too, and the checks after it run on a fresh group, so the others' results stand.
    ``timeout`` bounds each check: one that hangs is recorded as not finished and the next one runs.
    """
    env = _rank_environment(env)
    found: list[dict] = [{} for _ in range(world_size)]
    names, start = _check_group(world_size, checks_fn, args, timeout, env, 0, found)
    while start is not None:
        names, start = _check_group(world_size, checks_fn, args, timeout, env, start, found)
    _share_failures(len(names), found)
    return [CheckResults(rank, _by_name(names, f)) for rank, f in enumerate(found)]


def _share_failures(count: int, found: list[dict]) -> None:
    """A check that failed reads, on every rank where it failed, as every rank's side of it: the tracebacks
    (the raising rank's; a peer's broken connection), then the ranks that did not finish it."""
    for index in range(count):
        reports = sorted(enumerate(f[index] for f in found), key=lambda r: "did not finish" in str(r[1][1]))
        if all(status == "ok" for _, (status, _) in reports):
            continue
        text = "\n".join(f"--- rank {r} ---\n{v if s != 'ok' else 'finished it'}" for r, (s, v) in reports)
        for f in found:
            if f[index][0] != "ok":
                f[index] = ("error", text)


def _by_name(names: list, found: dict) -> dict:
    """Results by index -> by name; a check named by a tuple of names gives each of them its value."""
    entries = {}
    for index, name in enumerate(names):
        status, value = found[index]
        if isinstance(name, tuple):
            entries.update({n: (status, value[i] if status == "ok" else value) for i, n in enumerate(name)})
        else:
            entries[name] = (status, value)
    return entries


def run_rank_processes(
    env_by_rank: list[dict],
    timeout: float,
    module: str = "tests.fault_worker",
    prefixes: list[list[str]] | None = None,
    wait_for: list[int] | None = None,
) -> list[dict]:
    """``python -m module`` once per entry of ``env_by_rank`` (its RANK etc. on top of this environment), each
    a process of its own, so that when each exits can be timed: a rank stopped or hung is never waited for
    past ``timeout`` seconds, and every process is killed afterwards (SIGKILL ends a stopped one too).

    ``prefixes``: each rank's command runs after its prefix (e.g. ``ip netns exec NS``).
    ``wait_for``: the entries whose exit ends the wait (default: all); a rank stopped on purpose is left out, so
    the test does not sit out ``timeout`` for a process that cannot exit.
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
        awaited = set(range(len(procs)) if wait_for is None else wait_for)
        while not awaited <= exited.keys() and time.time() - start < timeout:
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
