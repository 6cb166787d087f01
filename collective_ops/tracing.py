"""Communication tracing in the Chrome trace event format (Perfetto, chrome://tracing).

Enable with ``COLLECTIVE_OPS_TRACE=1`` (file: ``COLLECTIVE_OPS_TRACE_FILE``, default
``comm_trace.json``, or ``COLLECTIVE_OPS_TRACE_DIR``/comm_trace.json) or ``trace=True``
on ``wrap``. Off, it costs one ``is None`` check per bucket and per primitive call.

Per rank (one trace "process" each) there are three tracks: *backward* (the span in
which gradients became ready, and the exposed wait at its end), *communication* (one
span per bucket from launch to completion, with bytes, dtype and parameter names), and
*primitives* (every direct allreduce/allgather/broadcast/reduce_scatter call). Clocks
are anchored at a barrier when tracing starts, so ranks line up. Events sit in a ring
buffer (``COLLECTIVE_OPS_TRACE_MAX_EVENTS``, default 200000). ``collective_ops.shutdown()``
(or :func:`flush`, on every rank) merges all ranks' events into one file on rank 0; a
rank that exits without it writes its own ``<file>.rank<N>.json``.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import tempfile
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

TRACK_BACKWARD, TRACK_COMM, TRACK_PRIMITIVES, TRACK_UPDATES = 0, 1, 2, 3
TRACK_NAMES = {
    TRACK_BACKWARD: "backward",
    TRACK_COMM: "communication",
    TRACK_PRIMITIVES: "primitives",
    TRACK_UPDATES: "bucket updates and forward waits",
}
DEFAULT_FILE = "comm_trace.json"
MAX_PARAM_NAMES = 64  # per bucket event; the count is always given


def trace_path_from_env(environ: dict | None = None) -> Path:
    environ = os.environ if environ is None else environ
    if environ.get("COLLECTIVE_OPS_TRACE_FILE"):
        return Path(environ["COLLECTIVE_OPS_TRACE_FILE"])
    if environ.get("COLLECTIVE_OPS_TRACE_DIR"):
        return Path(environ["COLLECTIVE_OPS_TRACE_DIR"]) / DEFAULT_FILE
    return Path(DEFAULT_FILE)


def enabled_by_env(environ: dict | None = None) -> bool:
    environ = os.environ if environ is None else environ
    return environ.get("COLLECTIVE_OPS_TRACE", "").strip().lower() in ("1", "true", "yes", "on")


class Tracer:
    """Collects one rank's events; observer of bucket managers, recorder of primitive calls."""

    def __init__(self, rank: int, world_size: int, path: Path, max_events: int = 200_000) -> None:
        if max_events < 1:
            raise ValueError(f"COLLECTIVE_OPS_TRACE_MAX_EVENTS must be >= 1, got {max_events}")
        self.rank = rank
        self.world_size = world_size
        self.path = Path(path)
        self.events: deque[dict] = deque(maxlen=max_events)
        self._origin = time.perf_counter()
        self._lock = threading.Lock()
        self.flushed = False

    def anchor(self, barrier: Any) -> None:
        """Align this rank's clock with its peers: time zero is the moment a barrier lets all ranks go."""
        barrier()
        self._origin = time.perf_counter()

    def us(self, t: float) -> float:
        return (t - self._origin) * 1e6

    def _add(self, event: dict) -> None:
        event["pid"] = self.rank
        with self._lock:
            self.events.append(event)

    # -- observer interface of BucketManager ---------------------------------------------
    def bucket_launched(self, manager: Any, index: int) -> None:
        pass  # recorded with its completion, at the end of the step

    def bucket_completed(self, manager: Any, index: int) -> None:
        pass

    def step_finished(self, manager: Any, stats: Any) -> None:
        plan = manager.plan
        fingerprint = plan.fingerprint()[:12]  # bucket numbers mean something only within one plan
        step = stats.step
        if stats.backward_start is not None and stats.finalize_start is not None:
            self._add(
                {
                    "name": "backward",
                    "cat": "backward",
                    "ph": "X",
                    "tid": TRACK_BACKWARD,
                    "ts": self.us(stats.backward_start),
                    "dur": max(self.us(stats.finalize_start) - self.us(stats.backward_start), 0),
                    "args": {"step": step},
                }
            )
        if stats.finalize_start is not None and stats.finalize_end is not None:
            self._add(
                {
                    "name": "wait for communication",
                    "cat": "exposed",
                    "ph": "X",
                    "tid": TRACK_BACKWARD,
                    "ts": self.us(stats.finalize_start),
                    "dur": max(self.us(stats.finalize_end) - self.us(stats.finalize_start), 0),
                    "args": {"step": step, "exposed_ms": stats.exposed_comm_s * 1e3},
                }
            )
        for bucket, timing in zip(plan.buckets, stats.buckets):
            if timing.launched is None or timing.completed is None:
                continue
            names = [plan.params[i].name for i in bucket.param_indices]
            exposed = max(0.0, timing.completed - max(timing.launched, stats.finalize_start or timing.completed))
            self._add(
                {
                    "name": f"bucket {bucket.index}",
                    "cat": "bucket",
                    "ph": "X",
                    "tid": TRACK_COMM,
                    "ts": self.us(timing.launched),
                    "dur": max(self.us(timing.completed) - self.us(timing.launched), 0),
                    "args": {
                        "step": step,
                        "bucket": bucket.index,
                        "plan": fingerprint,
                        "bytes": bucket.nbytes,
                        "dtype": bucket.dtype,
                        "num_params": len(names),
                        "params": names[:MAX_PARAM_NAMES],
                        "first_ready_us": self.us(timing.first_ready) if timing.first_ready else None,
                        "last_ready_us": self.us(timing.last_ready) if timing.last_ready else None,
                        "exposed_us": exposed * 1e6,
                    },
                }
            )

    # -- per-bucket optimizer (DistributedOptimizer) ------------------------------------
    def bucket_update(self, kind: str, bucket: int, step: int, start: float, end: float, module: str = "") -> None:
        """``kind``: "forward wait" (a module's forward waiting for a bucket's reduction) or "update"."""
        self._add(
            {
                "name": f"{kind} {bucket}",
                "cat": "optimizer",
                "ph": "X",
                "tid": TRACK_UPDATES,
                "ts": self.us(start),
                "dur": max(self.us(end) - self.us(start), 0),
                "args": {"kind": kind, "bucket": bucket, "step": step, "module": module},
            }
        )

    # -- primitives ----------------------------------------------------------------------
    def primitive(self, op: str, nbytes: int, start: float, end: float, async_op: bool) -> None:
        self._add(
            {
                "name": op,
                "cat": "primitive",
                "ph": "X",
                "tid": TRACK_PRIMITIVES,
                "ts": self.us(start),
                "dur": max(self.us(end) - self.us(start), 0),
                "args": {"bytes": nbytes, "async": async_op},
            }
        )

    def graph_compiled(self, what: str, start: float, end: float) -> None:
        """A call that compiled a graph (and ran it once): shown apart, never as a step's communication or wait."""
        self._add(
            {
                "name": f"compile {what}",
                "cat": "compile",
                "ph": "X",
                "tid": TRACK_BACKWARD,
                "ts": self.us(start),
                "dur": max(self.us(end) - self.us(start), 0),
                "args": {"what": what},
            }
        )

    # -- output --------------------------------------------------------------------------
    def metadata(self) -> list[dict]:
        meta = [
            {"name": "process_name", "ph": "M", "pid": self.rank, "args": {"name": f"rank {self.rank}"}},
            {"name": "process_sort_index", "ph": "M", "pid": self.rank, "args": {"sort_index": self.rank}},
        ]
        for tid, name in TRACK_NAMES.items():
            meta.append({"name": "thread_name", "ph": "M", "pid": self.rank, "tid": tid, "args": {"name": name}})
        return meta

    def local_events(self) -> list[dict]:
        with self._lock:
            return self.metadata() + list(self.events)


def write_trace(path: Path, events: list[dict], world_size: int) -> Path:
    """Write a trace file without following a symlink at ``path`` (a new file, renamed into place)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # A name nobody can guess or hold beforehand (mkstemp: O_EXCL, a fresh random name until one is free), in
    # the target's folder so that the rename is atomic. A fixed name let anyone who made it first stop the write.
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o644)  # mkstemp's 0600 would hide rank 0's trace from the user's other accounts and tools
        with os.fdopen(fd, "w") as f:
            json.dump(
                {
                    "traceEvents": events,
                    "displayTimeUnit": "ms",
                    "otherData": {"generator": "collective-ops", "world_size": world_size},
                },
                f,
            )
        os.replace(tmp, path)  # replaces a symlink itself, never what it points to
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return path


_tracer: Tracer | None = None


def get_tracer() -> Tracer | None:
    return _tracer


def start(engine: Any, path: Path | None = None) -> Tracer:
    """Start tracing on this rank (collective: every rank must call it, e.g. through init or wrap)."""
    global _tracer
    if _tracer is not None:
        return _tracer
    raw = os.environ.get("COLLECTIVE_OPS_TRACE_MAX_EVENTS", "").strip() or "200000"
    try:
        max_events = int(raw)
    except ValueError:
        raise ValueError(f"COLLECTIVE_OPS_TRACE_MAX_EVENTS={raw!r} is not a whole number of events >= 1") from None
    tracer = Tracer(engine.rank, engine.world_size, path or trace_path_from_env(), max_events)
    tracer.anchor(engine.barrier)
    _tracer = tracer
    atexit.register(_write_own_file_if_unflushed)
    return tracer


def flush(engine: Any) -> Path | None:
    """Merge every rank's events into one file on rank 0 (collective). Returns the path on rank 0."""
    global _tracer
    tracer = _tracer
    if tracer is None:
        return None
    blob = json.dumps(tracer.local_events()).encode()
    gathered = engine.allgather_bytes(blob)
    tracer.flushed = True
    _tracer = None
    if engine.rank != 0:
        return None
    events = [event for data in gathered for event in json.loads(data)]
    return write_trace(tracer.path, events, tracer.world_size)


def _write_own_file_if_unflushed() -> None:
    tracer = _tracer
    if tracer is not None and not tracer.flushed:
        own = tracer.path.with_name(f"{tracer.path.stem}.rank{tracer.rank}{tracer.path.suffix or '.json'}")
        write_trace(own, tracer.local_events(), tracer.world_size)
