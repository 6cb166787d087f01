"""Helpers shared by the benchmark scripts."""

from __future__ import annotations

import time


def spawn(target, world: int, *args, timeout: float = 3600):
    """Run ``target(rank, world, port, *args, queue)`` on ``world`` local processes; rank 0's result.

    A rank that dies (an exception, a crash) ends the wait at once with its exit code,
    instead of leaving the caller waiting on a result that will never come.
    """
    import multiprocessing as mp
    import queue as queue_module

    from tests.harness import free_port

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=target, args=(r, world, port, *args, results)) for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    try:
        while True:
            try:
                result = results.get(timeout=1.0)
                break
            except queue_module.Empty as empty:
                failed = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                if failed:
                    raise RuntimeError(
                        f"rank(s) exited with an error (rank, exit code): {failed}; see their output above"
                    ) from empty
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no result within {timeout} s") from empty
        for p in procs:
            p.join(timeout=60)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    return result
