"""Process-group lifecycle: ``init``, ``init_hccl``, rank queries, ``shutdown``.

One engine per framework may be live at a time (torch.distributed and/or MindSpore
communication); primitives pick the engine that owns the tensor they are given.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import errno
import importlib.util
import logging
import os
import socket
import time
import warnings
import weakref
from dataclasses import dataclass
from typing import Any

from . import tracing
from .environment import check_environment
from .launch import (
    DEFAULT_MASTER_ADDR,
    DEFAULT_MASTER_PORT,
    backend_problem,
    detect_launch_env,
    device_type_for,
    probe_hardware,
    select_backend,
)

logger = logging.getLogger("collective_ops")

DEFAULT_TIMEOUT = datetime.timedelta(minutes=10)
# Every rank must reach the rendezvous within this (COLLECTIVE_OPS_RENDEZVOUS_TIMEOUT, seconds).
DEFAULT_RENDEZVOUS_TIMEOUT = datetime.timedelta(seconds=120)


def rendezvous_timeout_from_env() -> datetime.timedelta:
    from .bucketing.interfaces import env_seconds

    seconds = env_seconds("COLLECTIVE_OPS_RENDEZVOUS_TIMEOUT", DEFAULT_RENDEZVOUS_TIMEOUT.total_seconds())
    if seconds is None:
        raise ValueError("COLLECTIVE_OPS_RENDEZVOUS_TIMEOUT must be a positive number of seconds")
    return datetime.timedelta(seconds=seconds)


@dataclass(frozen=True)
class DistContext:
    """What ``init`` set up."""

    framework: str
    backend: str
    rank: int
    world_size: int
    local_rank: int
    device: str
    launcher: str


_engines: dict[str, Any] = {}
_contexts: dict[str, DistContext] = {}
_engine_by_type: dict[type, Any] = {}  # the primitives' hot path: one dict lookup per call


def _default_framework(framework: str | None) -> str:
    if framework is not None:
        if framework not in ("torch", "mindspore"):
            raise ValueError(f"framework must be 'torch' or 'mindspore', got {framework!r}")
        return framework
    launched_by_msrun = detect_launch_env().launcher == "msrun"
    if launched_by_msrun and importlib.util.find_spec("mindspore") is not None:
        return "mindspore"
    if importlib.util.find_spec("torch") is not None:
        return "torch"
    if importlib.util.find_spec("mindspore") is not None:
        return "mindspore"
    raise RuntimeError("neither torch nor mindspore is installed: pip install 'collective-ops[torch]'")


def init(
    backend: str | None = None,
    *,
    rank: int | None = None,
    world_size: int | None = None,
    device_id: int | None = None,
    timeout: datetime.timedelta | float | None = None,
    master_addr: str | None = None,
    master_port: int | None = None,
    algorithm: str | None = None,
    framework: str | None = None,
    trace: bool | None = None,
) -> DistContext:
    """Join the process group, filling what is not given from the launcher's environment.

    torchrun (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``),
    msrun (``RANK_ID``, ``RANK_SIZE``, ``MS_*``) and the seed's ``DEVICE_ID`` loop are
    understood; without a launcher this is a single process on loopback. ``backend``
    None chooses hccl (NPU), nccl (CUDA) or gloo; ``COLLECTIVE_OPS_BACKEND`` overrides.
    ``algorithm`` is passed to the engine that owns the algorithms (``HCCL_ALGO`` /
    ``NCCL_ALGO``) before it starts. Calling ``init`` again with the same settings
    returns the same context. ``trace`` (default: ``COLLECTIVE_OPS_TRACE``) starts the
    communication trace (see :mod:`collective_ops.tracing`).
    """
    check_environment()  # every variable the library reads, before any of them is used
    context = _init(backend, rank, world_size, device_id, timeout, master_addr, master_port, algorithm, framework)
    if tracing.enabled_by_env() if trace is None else trace:
        tracing.start(get_engine(context.framework))
    return context


def _init(
    backend: str | None,
    rank: int | None,
    world_size: int | None,
    device_id: int | None,
    timeout: datetime.timedelta | None,
    master_addr: str | None,
    master_port: int | None,
    algorithm: str | None,
    framework: str | None,
) -> DistContext:
    framework = _default_framework(framework)
    if isinstance(timeout, (int, float)):
        timeout = datetime.timedelta(seconds=timeout)
    if framework == "mindspore":
        if "mindspore" in _contexts:
            return _contexts["mindspore"]
        from .comm.mindspore_engine import init_mindspore

        engine, local_rank, target = init_mindspore(backend, device_id=device_id, algorithm=algorithm)
        context = DistContext("mindspore", engine.backend, engine.rank, engine.world_size, local_rank, target, "msrun")
        return _remember("mindspore", context, engine)
    return _init_torch(backend, rank, world_size, device_id, timeout, master_addr, master_port, algorithm)


def _init_torch(
    backend: str | None,
    rank: int | None,
    world_size: int | None,
    device_id: int | None,
    timeout: datetime.timedelta | None,
    master_addr: str | None,
    master_port: int | None,
    algorithm: str | None,
) -> DistContext:
    import torch
    import torch.distributed as dist

    from .bucketing.interfaces import call_with_deadline
    from .comm.torch_engine import TorchEngine

    env = detect_launch_env()
    requested = os.environ.get("COLLECTIVE_OPS_BACKEND") or backend  # an explicit choice, not the default
    backend = select_backend(backend, probe_hardware())
    rank = env.rank if rank is None else rank
    world_size = env.world_size if world_size is None else world_size
    existing = _contexts.get("torch")
    if existing is not None or dist.is_initialized():
        # A group already made (by us, or by the caller: Lightning's launcher sets WORLD_SIZE but not RANK, then
        # calls init_process_group) is adopted with its own rank and size; only the values known are checked.
        return _check_existing_torch(existing, backend if requested else None, rank, world_size)
    if rank is None and world_size is None:
        logger.warning(
            "collective_ops.init: no launcher variables (RANK, WORLD_SIZE) and no rank=/world_size= given: this "
            "process is a world of 1 and every collective is a local copy; launch with torchrun (or give rank= "
            "and world_size=) to train over several processes"
        )
        rank, world_size = 0, 1
    if rank is None or world_size is None:
        raise ValueError(
            f"got rank={rank} and world_size={world_size}: give both (or launch with torchrun, which sets RANK and WORLD_SIZE)"
        )
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in 0..{world_size - 1} (world_size={world_size})")
    local_rank = env.local_rank if env.local_rank is not None else rank
    if device_id is None:
        device_id = env.local_rank if env.local_rank is not None else env.device_id
    if device_id is None:
        device_id = local_rank

    if algorithm:
        os.environ["HCCL_ALGO" if backend == "hccl" else "NCCL_ALGO"] = algorithm
    _import_before_the_group_exists()
    device = _bind_device(torch, backend, device_id)
    addr = master_addr or env.master_addr or DEFAULT_MASTER_ADDR
    port = master_port or env.master_port or DEFAULT_MASTER_PORT
    if not isinstance(port, int) or not 1 <= port <= 65535:
        raise ValueError(f"master_port={port!r} is not a TCP port: a whole number in 1..65535")
    rendezvous = rendezvous_timeout_from_env() if timeout is None else min(timeout, rendezvous_timeout_from_env())
    timeout = timeout or DEFAULT_TIMEOUT
    try:
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":  # torchrun's agent holds the store
            dist.init_process_group(
                backend, init_method=f"tcp://{addr}:{port}", rank=rank, world_size=world_size, timeout=timeout
            )
        else:
            # The rendezvous gets a deadline of its own, far shorter than the collectives' timeout: a rank
            # whose peers never come, or whose MASTER_PORT is someone else's server, fails within it.
            # TCPStore's own timeout does not cover a server that accepts and never answers: bounded here.
            # The master does not wait for world_size clients itself: _agree_on_world waits for every rank, and
            # names a rank started with another WORLD_SIZE (or a RANK given twice) instead of waiting for it.
            store = call_with_deadline(
                lambda: _agree_on_world(
                    _tcp_store(addr, port, world_size, rank == 0, rendezvous),
                    rank,
                    world_size,
                    rendezvous.total_seconds(),
                ),
                rendezvous.total_seconds() + 5,
                f"the rendezvous at {addr}:{port}",
            )
            dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
    except Exception as exc:
        raise RuntimeError(_rendezvous_hint(exc, addr, port, rank, world_size, rendezvous)) from exc
    _engines["torch"] = TorchEngine(backend, device)
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        _engines["torch"].store_host, _engines["torch"].store_rank = f"torchrun's agent at {addr}:{port}", None
    atexit.register(_leave_at_exit)
    logger.info("collective_ops: rank %d/%d joined via %s on %s (%s)", rank, world_size, backend, device, env.launcher)
    return _remember("torch", DistContext("torch", backend, rank, world_size, local_rank, str(device), env.launcher))


_ARRIVED_KEY = "collective_ops/rendezvous/arrived"


def _agree_on_world(store: Any, rank: int, world_size: int, timeout_s: float) -> Any:
    """``store`` once all ``world_size`` ranks arrived on it, each with this WORLD_SIZE and a RANK of its own.

    Each rank records (rank, world size) under its arrival number; every rank reads every record, so a
    mismatch is an error on each rank that sees it, at once, rather than a wait for a rank that never comes.
    """
    arrival = store.add(_ARRIVED_KEY, 1)
    store.set(f"{_ARRIVED_KEY}/{arrival}", f"{rank} {world_size}")
    deadline = time.monotonic() + timeout_s
    seen: dict[int, tuple[int, int]] = {}  # arrival number -> (rank, world size)
    while True:
        arrived = store.add(_ARRIVED_KEY, 0)
        for number in range(len(seen) + 1, arrived + 1):
            if store.check([f"{_ARRIVED_KEY}/{number}"]):  # (set just after its add)
                other_rank, other_world = (int(v) for v in store.get(f"{_ARRIVED_KEY}/{number}").split())
                _check_peer(rank, world_size, {r for r, _ in seen.values()}, other_rank, other_world)
                seen[number] = (other_rank, other_world)
            else:
                break
        if len(seen) >= world_size:
            return store
        if time.monotonic() > deadline:
            ranks = sorted(r for r, _ in seen.values())
            raise TimeoutError(f"timed out after {timeout_s:g} s: {len(seen)} of {world_size} ranks arrived {ranks}")
        time.sleep(0.02)


def _check_peer(rank: int, world_size: int, ranks_seen: set[int], other_rank: int, other_world: int) -> None:
    if other_world != world_size:
        raise ValueError(
            f"rank {other_rank} was started with WORLD_SIZE={other_world}, but rank {rank} with "
            f"WORLD_SIZE={world_size}; start every rank with the same WORLD_SIZE (and a distinct RANK in 0..N-1)"
        )
    if other_rank in ranks_seen:
        raise ValueError(
            f"two processes were started as rank {other_rank} (of {world_size}); give each process a distinct RANK "
            f"in 0..{world_size - 1}"
        )


def _import_before_the_group_exists() -> None:
    """Import torch.distributed.nn.functional while there is no default group.

    Its functions take ``group=group.WORLD`` as a default argument, evaluated at import: imported
    after the group exists (torch imports it with the first optimizer, through torch._dynamo), it
    holds the default group forever, so ``destroy_process_group()`` could not free it and its Gloo
    threads lived on into the interpreter's teardown, where a rank could abort after a clean
    shutdown ("terminate called without an active exception"). Imported first, the defaults are
    None (the default group, whichever is live at the call).
    """
    import torch.distributed as dist

    if dist.is_available() and not dist.is_initialized():
        import torch.distributed.nn.functional  # noqa: F401


def _tcp_store(addr: str, port: int, world_size: int, is_master: bool, timeout: datetime.timedelta) -> Any:
    """The rendezvous store; rank 0's listens on ``addr`` only (torch's own server listens on every interface,
    so with MASTER_ADDR=127.0.0.1 any host that reached this machine could read and write the store)."""
    import torch.distributed as dist

    if not is_master:
        return dist.TCPStore(addr, port, world_size, is_master=False, timeout=timeout)
    # The store owns the descriptor from here and closes it, also when it fails (closing it here as well
    # could close a descriptor another thread has been given the number of since).
    fd = _listen_on(addr, port).detach()
    # (wait_for_workers=False: _agree_on_world waits for every rank itself, and names one that disagrees)
    return dist.TCPStore(
        addr, port, world_size, is_master=True, timeout=timeout, master_listen_fd=fd, wait_for_workers=False
    )


def _listen_on(addr: str, port: int) -> socket.socket:
    """A listening socket bound to ``addr``:``port`` (the first address ``addr`` resolves to, which is also the
    first a connecting rank tries)."""
    family, kind, proto, _, where = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)[0]
    listener = socket.socket(family, kind, proto)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as torch's own server: no TIME_WAIT wait
        listener.bind(where)
        listener.listen(1024)
    except OSError as exc:
        listener.close()
        if exc.errno == errno.EADDRNOTAVAIL:
            raise OSError(
                exc.errno,
                f"MASTER_ADDR {addr} is not an address of this machine: rank 0 hosts the rendezvous and listens on "
                "MASTER_ADDR only, so set it (on every rank) to an address of rank 0's machine that the other ranks reach",
            ) from None
        raise
    return listener


def _rendezvous_hint(
    exc: Exception, addr: str, port: int, rank: int, world_size: int, timeout: datetime.timedelta
) -> str:
    text = str(exc)
    lowered = text.lower()
    where = f"rendezvous of rank {rank}/{world_size} at tcp://{addr}:{port} failed"
    if "address already in use" in lowered or "eaddrinuse" in lowered:
        return (
            f"{where}: port {port} is already in use on {addr}; pick a free MASTER_PORT (or master_port=) for this run"
        )
    if isinstance(exc, TimeoutError) or "timed out" in lowered or "timeout" in lowered:
        return (
            f"{where}: not every rank arrived within {timeout.total_seconds():g} s ({text.splitlines()[0]}). "
            f"Check that all {world_size} ranks were started (WORLD_SIZE={world_size}) with the same MASTER_ADDR "
            f"and MASTER_PORT, that each has a distinct RANK, and that {addr}:{port} is rank 0's rendezvous and not "
            "another program's port. COLLECTIVE_OPS_RENDEZVOUS_TIMEOUT (seconds) sets how long ranks wait"
        )
    return f"{where}: {text.splitlines()[0] if text else type(exc).__name__}"


def _check_existing_torch(
    existing: DistContext | None, backend: str | None, rank: int | None, world_size: int | None
) -> DistContext:
    """The live context if it is what was asked for (None: anything), else a clear error."""
    import torch.distributed as dist

    from .comm.torch_engine import TorchEngine

    live_rank, live_world = dist.get_rank(), dist.get_world_size()
    live_backend = str(dist.get_backend()).lower()
    if rank not in (None, live_rank) or world_size not in (None, live_world):
        raise RuntimeError(
            f"already initialized as rank {live_rank}/{live_world}; init was asked for rank {rank}/{world_size}. "
            "Call collective_ops.shutdown() first to change it."
        )
    if backend is not None and backend not in live_backend.split(","):
        raise RuntimeError(
            f"already initialized with backend {live_backend!r}; init was asked for {backend!r}. "
            "Call collective_ops.shutdown() first to switch backends (or call init() without a backend)."
        )
    if existing is not None:
        return existing
    # A process group created by the user: adopt it.
    import torch

    device = _bind_device(torch, live_backend, None) if live_backend in ("nccl", "hccl") else torch.device("cpu")
    _engines["torch"] = TorchEngine(live_backend, device, owns_group=False)
    return _remember("torch", DistContext("torch", live_backend, live_rank, live_world, live_rank, str(device), "user"))


def _bind_device(torch: Any, backend: str, device_id: int | None) -> Any:
    """Bind this process to its accelerator with device-generic calls (torch.accelerator where present)."""
    device_type = device_type_for(backend)
    if device_type == "cpu":
        return torch.device("cpu")
    module = getattr(torch, device_type)
    count = module.device_count()
    index = device_id or 0
    if not 0 <= index < count:
        # Never wrap around: DEVICE_ID modulo the count would put two ranks on one device, silently.
        raise RuntimeError(
            f"device {index} was asked for (DEVICE_ID / LOCAL_RANK / device_id=), but this machine has {count} "
            f"{device_type} device(s): 0..{count - 1}. Start at most {count} rank(s) per machine, one per device."
        )
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None and hasattr(accelerator, "set_device_index"):
        accelerator.set_device_index(index)
    else:
        module.set_device(index)
    return torch.device(device_type, index)


# Bound methods (held weakly) that finish the collectives an object left in flight: a DistributedOptimizer's
# step returns before its buckets land. Run before any process group is destroyed: a Gloo work still running
# when the interpreter finalizes is freed on Gloo's worker thread, which then needs the GIL and aborts the
# process ("terminate called without an active exception").
_in_flight_finishers: list[weakref.WeakMethod] = []
EXIT_FINISH_TIMEOUT_S = 10.0  # at exit without shutdown(), a peer may be gone: wait this long at most


_process_wide_releases: dict[Any, None] = {}  # what shutdown() removes from the process (hooks on torch's tables)


def release_at_shutdown(release: Any) -> None:
    """Have ``shutdown()`` call ``release()`` (once, however often registered): it removes something process-wide
    the library added, such as a hook on a framework's global table, so that the process is as before."""
    _process_wide_releases[release] = None


def _release_process_wide() -> list[BaseException]:
    errors: list[BaseException] = []
    releases = list(_process_wide_releases)
    _process_wide_releases.clear()
    for release in releases:
        try:
            release()
        except Exception as exc:
            errors.append(exc)
    return errors


def finish_in_flight_before_leaving(method: Any) -> None:
    """Have ``shutdown()`` (and the exit hook) call ``method`` first: it finishes work left in flight."""
    _in_flight_finishers[:] = [ref for ref in _in_flight_finishers if ref() is not None]  # objects since deleted
    _in_flight_finishers.append(weakref.WeakMethod(method))


def _finish_in_flight(timeout: float | None) -> list[BaseException]:
    from .bucketing.interfaces import call_with_deadline

    finishers = [ref() for ref in _in_flight_finishers]
    _in_flight_finishers.clear()
    errors: list[BaseException] = []
    for finish in finishers:
        if finish is None:
            continue
        try:
            call_with_deadline(finish, timeout, "finishing the collectives left in flight (is a peer rank gone?)")
        except Exception as exc:
            errors.append(exc)
    return errors


def _leave_at_exit() -> None:
    """A script that never called shutdown(): destroy the process group this library created, at exit.

    Left to the interpreter's teardown, the process group's worker threads are destroyed while
    still joinable, and the process aborts ("terminate called without an active exception",
    SIGABRT) instead of exiting 0. Local only: no collective, so a peer that is gone cannot
    hold it up. (Each rank's trace file is written by the tracer's own exit hook.)
    """
    engine = _engines.get("torch")
    if engine is None:
        return
    if getattr(engine, "stalled", False):  # a collective never ended: nothing to finish, no group to destroy
        engine.shutdown(EXIT_FINISH_TIMEOUT_S)
        return
    if not getattr(engine, "owns_group", False):
        return
    _finish_in_flight(EXIT_FINISH_TIMEOUT_S)
    import torch.distributed as dist

    if dist.is_initialized():
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


def _remember(framework: str, context: DistContext, engine: Any = None) -> DistContext:
    _engine_by_type.clear()
    _contexts[framework] = context
    if engine is not None:
        _engines[framework] = engine
    return context


def init_hccl(
    rank: int | None = None,
    world_size: int | None = None,
    device_id: int | None = None,
    *,
    strict: bool = False,
    **kwargs: Any,
) -> DistContext:
    """The seed's entry point: ``init`` asking for HCCL.

    Where HCCL is unavailable it warns and falls back to the best backend here
    (nccl or gloo) so the same script runs on a laptop; ``strict=True`` makes that an error.
    """
    problem = None if os.environ.get("COLLECTIVE_OPS_BACKEND") else backend_problem("hccl", probe_hardware())
    if problem is None:
        backend = None if os.environ.get("COLLECTIVE_OPS_BACKEND") else "hccl"
        return init(backend, rank=rank, world_size=world_size, device_id=device_id, framework="torch", **kwargs)
    if strict:
        raise RuntimeError(problem)
    warnings.warn(f"{problem}; falling back to the best available backend", RuntimeWarning, stacklevel=2)
    return init(None, rank=rank, world_size=world_size, device_id=device_id, framework="torch", **kwargs)


def _context(framework: str | None = None) -> DistContext:
    if framework is not None:
        if framework in _contexts:
            return _contexts[framework]
    elif _contexts:
        return next(iter(_contexts.values()))
    raise RuntimeError("collective_ops is not initialized: call collective_ops.init() first")


def is_initialized(framework: str | None = None) -> bool:
    return framework in _contexts if framework else bool(_contexts)


def get_rank(framework: str | None = None) -> int:
    return _context(framework).rank


def get_world_size(framework: str | None = None) -> int:
    return _context(framework).world_size


def context(framework: str | None = None) -> DistContext:
    """The :class:`DistContext` ``init`` returned."""
    return _context(framework)


def get_engine(framework: str) -> Any:
    try:
        return _engines[framework]
    except KeyError:
        raise RuntimeError(
            f"collective_ops is not initialized for {framework}: call collective_ops.init("
            f"{'' if framework == 'torch' else 'framework=' + repr(framework)}) first"
        ) from None


def engine_for_tensor(tensor: Any) -> Any:
    """The live engine that owns ``tensor`` (torch tensors and numpy arrays prefer torch)."""
    engine = _engine_by_type.get(type(tensor))
    if engine is not None:
        return engine
    if not _engines:
        raise RuntimeError("collective_ops is not initialized: call collective_ops.init() first")
    for framework in sorted(_engines, key=lambda name: name != "torch"):
        engine = _engines[framework]
        if engine.owns(tensor):
            _engine_by_type[type(tensor)] = engine
            return engine
    kinds = " or ".join(sorted(_engines))
    raise TypeError(
        f"cannot communicate a {type(tensor).__module__}.{type(tensor).__name__}: the live engine(s) take {kinds} tensors and numpy arrays"
    )


def barrier(framework: str | None = None) -> None:
    get_engine(_context(framework).framework).barrier()


def shutdown(timeout: float | None = None) -> None:
    """Leave every process group this library joined (a group the user created stays). Safe to call twice.

    Always returns or raises within ``timeout`` seconds (default: the stall timeout,
    ``COLLECTIVE_OPS_STALL_TIMEOUT``), also when a peer has died; the library's own state is
    torn down first, whatever happens after.
    """
    from .bucketing.interfaces import call_with_deadline
    from .bucketing.manager import stall_timeout_from_env

    timeout = stall_timeout_from_env() if timeout is None else timeout
    started = time.monotonic()
    # Half the time for work left in flight (a DistributedOptimizer's last step), the rest for the groups.
    # After a stall (an engine's ``stalled``) the work in flight never ends, and the groups are left behind.
    stalled = any(getattr(engine, "stalled", False) for engine in _engines.values())
    errors: list[BaseException] = []
    if _engines and not stalled:
        errors = _finish_in_flight(None if timeout is None else timeout / 2)
    _in_flight_finishers.clear()
    if timeout is not None:
        timeout = max(timeout - (time.monotonic() - started), 0.1)
    engines = list(_engines.values())
    _engines.clear()
    _contexts.clear()
    _engine_by_type.clear()
    if tracing.get_tracer() is not None and engines and not stalled:
        try:  # collective: merges all ranks' events on rank 0 (each rank's own file is written at exit otherwise)
            call_with_deadline(
                lambda: tracing.flush(engines[0]), timeout, "merging the communication trace (is a peer rank gone?)"
            )
        except Exception as exc:
            errors.append(exc)
    for engine in engines:
        try:
            engine.shutdown(timeout)
        except Exception as exc:
            errors.append(exc)
    errors += _release_process_wide()
    if errors:
        raise RuntimeError(
            f"collective_ops.shutdown() left its process groups, but: {'; '.join(str(e) for e in errors)}"
        ) from errors[0]
