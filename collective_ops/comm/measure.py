"""The live alpha/beta measurement: a short allreduce sweep fitted to the cost model, on any engine.

Every rank calls it at the same point (it issues collectives) and gets the same fit. It goes through the
engine interface alone (:class:`collective_ops.comm.base.Engine`: ``zeros``, ``allreduce``, ``barrier``,
``synchronize``, ``reduce_floats``), so each framework's engine measures its own transport.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ..bucketing.cost import CostModel

SWEEP_BYTES = (1 << 12, 1 << 16, 1 << 20, 1 << 22, 1 << 24)
QUEUED_COUNT, QUEUED_BYTES = 8, 1 << 20  # the back-to-back launch that measures alpha_queued


def measure_alpha_beta(engine: Any, sizes: Sequence[int] = SWEEP_BYTES, iters: int = 10) -> CostModel:
    """Fit alpha/beta of allreduce on ``engine``'s group (every rank calls it; same result everywhere).

    Then ``alpha_queued`` from 8 async allreduces of 1 MiB launched back to back (as buckets
    are): their total time beyond ``alpha + 8 * beta * 1 MiB``, per queued collective.
    """
    nbytes = [max(n // 4, 1) * 4 for n in sizes]  # float32 buffers
    seconds = [sweep_seconds(engine, n, iters) for n in nbytes]
    fitted = CostModel.fit(nbytes, seconds)
    queued, cpu_share = back_to_back_seconds(engine, QUEUED_COUNT, QUEUED_BYTES)
    alpha_queued = (queued - fitted.alpha - QUEUED_COUNT * fitted.beta * QUEUED_BYTES) / (QUEUED_COUNT - 1)
    alpha_queued = float(min(max(alpha_queued, 0.0), fitted.alpha))
    return CostModel(fitted.alpha, fitted.beta, fitted.label, alpha_queued, cpu_share)


def sweep_seconds(engine: Any, nbytes: int, iters: int, warmup: int = 2) -> float:
    """The slowest rank's seconds per allreduce of a float32 buffer of ``nbytes``: ``iters`` calls timed as one
    block after ``warmup`` calls."""
    buffer = _buffer(engine, nbytes)
    call = lambda: engine.allreduce(buffer, "sum")  # noqa: E731
    for _ in range(warmup):
        call()
    engine.synchronize()
    engine.barrier()
    return engine.reduce_floats([_timed(engine, call, iters)], "max")[0]


def back_to_back_seconds(engine: Any, count: int, nbytes: int, repeats: int = 3) -> tuple[float, float]:
    """(time, CPU share): the slowest rank's median time for ``count`` async allreduces launched back to back,
    and the largest over ranks of this process's CPU time per second of them."""
    buffers = [_buffer(engine, nbytes) for _ in range(count)]
    times, shares = [], []
    for _ in range(repeats + 1):  # the first round warms up
        engine.barrier()
        start, cpu_start = time.perf_counter(), time.process_time()
        for handle in [engine.allreduce(b, "sum", async_op=True) for b in buffers]:
            handle.wait()
        engine.synchronize()
        times.append(time.perf_counter() - start)
        shares.append((time.process_time() - cpu_start) / max(times[-1], 1e-9))
    seconds, share = engine.reduce_floats([float(np.median(times[1:])), float(np.median(shares[1:]))], "max")
    return seconds, share


def estimated_contention(cost: CostModel, device_type: str) -> float:
    """The simulator's ``contention`` without profiling steps (the online ``bucket_size_mb="auto"``).

    On the CPU, compute uses every core it is given (the framework's intra-op threads), so whatever CPU the
    transport takes while a bucket is on the wire (``cost.cpu_share``) is taken from backward:
    about 1 on loopback Gloo, which moves bytes as fast as a core copies them, little on a slow
    link. Elsewhere the transport runs beside the device's compute: 0.
    (:func:`collective_ops.tuning.profile_with_contention` measures it instead, from steps: ``co.tune``.)
    """
    if device_type != "cpu" or cost.cpu_share is None:
        return 0.0
    return float(min(max(cost.cpu_share, 0.0), 1.0))


def _buffer(engine: Any, nbytes: int) -> Any:
    return engine.zeros(max(nbytes // 4, 1), "float32", str(engine.device))


def _timed(engine: Any, call: Callable[[], Any], iters: int) -> float:
    start = time.perf_counter()
    for _ in range(iters):
        call()
    engine.synchronize()
    return (time.perf_counter() - start) / iters
