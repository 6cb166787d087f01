"""Helpers shared by the benchmark scripts: local ranks, and the emulated cluster link (--link)."""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from collective_ops.tools.bench import bus_factor
from collective_ops.tools.link import (
    ENV_LINK,
    ENV_NNODES,
    ENV_NODE_RANK,
    link_label,
    rate_bits,
    relaunch_on_link,
    strip_link_option,
)

COMPUTE_ALONE = "compute alone (no communication)"  # the setup that bounds every step from below
# compute alone plus the one synchronisation every data-parallel step has: what no gradient exchange can beat
SYNCED_FLOOR = "compute + a 4-byte allreduce a step"

_spawn_calls = 0  # successive spawns of one run use successive ports (every node counts alike)


def add_link_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--link",
        default="none",
        help="run the ranks as 2 emulated nodes joined by a rate-limited link (a tc rate: 10gbit, 1gbit, "
        "100mbit; needs root); none = one machine over loopback (default)",
    )


def run_on_link_if_asked(args: argparse.Namespace, argv: Sequence[str] | None) -> int | None:
    """With ``--link RATE`` (and not already on a node): run this script on the link; its exit status.

    None where the script should go on here (no link, or this process is one of the link's nodes).
    """
    if args.link == "none" or ENV_NODE_RANK in os.environ:
        return None
    try:
        rate_bits(args.link)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    argv = list(sys.argv[1:] if argv is None else argv)
    return relaunch_on_link(args.link, [os.path.abspath(sys.argv[0]), *strip_link_option(argv)])


def run_benchmark(parser: argparse.ArgumentParser, argv: Sequence[str] | None, target, *args) -> Any:
    """Parse (with --link), then run ``target`` on the ranks: ``(args, rank 0's result)`` for the caller
    to report, or an exit status (an int) where this process has nothing to report: the run was
    relaunched on the link, or this is a node of the link other than node 0.
    """
    add_link_option(parser)
    parsed = parser.parse_args(argv)
    relaunched = run_on_link_if_asked(parsed, argv)
    if relaunched is not None:
        return relaunched
    result = spawn(target, parsed.world, parsed, *args)
    return (parsed, result) if reporting_node() else 0


def reporting_node() -> bool:
    """True on the node that holds rank 0 (all of them off the link): the one that prints results."""
    return int(os.environ.get(ENV_NODE_RANK, "0")) == 0


def where() -> str:
    """The label every figure carries: "emulated link, 1gbit" or "loopback"."""
    return link_label()


def spawn(target, world: int, *args, timeout: float = 3600):
    """Run ``target(rank, world, port, *args, queue)`` on this node's ranks; rank 0's result (None on other nodes).

    Off the link every rank is local. On an emulated link (``--link``) each node runs
    ``world / nodes`` of them, with global ranks, rendezvous at node 0's address. A rank that
    dies (an exception, a crash) ends the wait at once with its exit code, instead of leaving
    the caller waiting on a result that will never come.
    """
    import multiprocessing as mp
    import queue as queue_module

    from tests.harness import free_port

    global _spawn_calls
    nnodes, node = int(os.environ.get(ENV_NNODES, "1")), int(os.environ.get(ENV_NODE_RANK, "0"))
    if world % nnodes:
        raise ValueError(f"--world {world} does not split over {nnodes} emulated nodes; use a multiple of {nnodes}")
    local = world // nnodes
    port = int(os.environ["MASTER_PORT"]) + _spawn_calls if nnodes > 1 else free_port()
    _spawn_calls += 1
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    ranks = [node * local + r for r in range(local)]
    procs = [ctx.Process(target=target, args=(r, world, port, *args, results)) for r in ranks]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    result = None
    try:
        while True:
            try:
                if node == 0:
                    result = results.get(timeout=1.0)
                    break
                time.sleep(1.0)  # another node: its ranks report nothing; wait for them to finish
                if all(p.exitcode == 0 for p in procs):
                    break
                raise queue_module.Empty
            except queue_module.Empty as empty:
                failed = [(r, p.exitcode) for r, p in zip(ranks, procs) if p.exitcode not in (None, 0)]
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


def link_rate() -> str | None:
    """The emulated link's tc rate, in a node of it (a relaunched script's own arguments have no --link); None off it."""
    rate = os.environ.get(ENV_LINK)
    return rate if rate and rate != "none" else None


def link_seconds(nbytes: float) -> float | None:
    """Seconds the link takes to carry ``nbytes`` in one direction at its rate; None off the link."""
    rate = link_rate()
    return nbytes * 8 / rate_bits(rate) if rate else None


@dataclass(frozen=True)
class Limit:
    """The physical limit of a step: compute alone, and the link's time for one step's allreduced bytes."""

    compute_ms: float
    wire_bytes: int  # the payload one step reduces (comm_stats()["bytes_per_step"]), not its ring traffic
    wire_ms: float | None  # None off the link
    step_ms: Mapping[str, float]

    @property
    def bound_ms(self) -> float:
        return max(self.compute_ms, self.wire_ms or 0.0)

    def ratio(self, step_ms: float) -> float:
        """A step as a multiple of max(compute, wire): 1.00 is the limit itself."""
        return step_ms / self.bound_ms

    def line(self, whose: str = "") -> str:
        """Compute alone and the wire time; ``whose``: which setup's count of the bytes (named in the line)."""
        sent = f"one step's {self.wire_bytes / 2**20:.2f} MiB" + (f" (as {whose} sends them)" if whose else "")
        wire = (
            f"wire time of {sent} at {link_rate()}: {self.wire_ms:.1f} ms"
            if self.wire_ms is not None
            else f"{sent}, no link: the bound is compute alone"
        )
        return f"compute alone {self.compute_ms:.1f} ms; {wire}"

    def column(self, step_ms: float) -> str:
        return f"{self.ratio(step_ms):.2f}x max(compute, wire)"

    @property
    def columns(self) -> dict[str, str]:
        """Each setup's column: its step as a multiple of max(compute, wire)."""
        return {key: self.column(ms) for key, ms in self.step_ms.items()}

    def lines(self, indent: str = "    ", whose: str = "") -> list[str]:
        """The line, then each setup's step and its column (fastest first)."""
        width = max(map(len, self.step_ms), default=0)
        rows = sorted(self.step_ms.items(), key=lambda kv: kv[1])
        return [indent + self.line(whose)] + [
            f"{indent}  {key:<{width}} {ms:>8.1f} ms  {self.column(ms)}" for key, ms in rows
        ]


def physical_limit(step_ms: Mapping[str, float], compute_ms: float, wire_bytes: int, world: int) -> Limit:
    """The distance of each step in ``step_ms`` (ms per setup) to the physical limit: max(compute alone, the wire
    time at the link's rate of a ring allreduce of ``wire_bytes``, what one step reduces: fp32 gradients, half with
    fp16, a row-sparse table's rows sent; use the library's count, ``comm_stats()["bytes_per_step"]``)."""
    # each rank sends 2 (n-1)/n of them (nccl-tests' bus factor); a ring over the link's two nodes puts as much
    # on each direction of the link
    wire = link_seconds(bus_factor("allreduce", world) * wire_bytes)
    return Limit(compute_ms, int(wire_bytes), None if wire is None else wire * 1e3, dict(step_ms))


class StepSynchronised:
    """``optimizer`` whose ``step`` first allreduces one float over the ranks (:data:`SYNCED_FLOOR`).

    Unsynchronised ranks (compute alone) each run at their own pace; any setup that exchanges gradients
    waits, every step, for the slowest rank of that step. This setup pays that wait and nothing else.
    """

    def __init__(self, optimizer: Any) -> None:
        import torch

        self.optimizer = optimizer
        self._token = torch.zeros(1)

    def step(self) -> None:
        import torch.distributed as dist

        dist.all_reduce(self._token)
        self.optimizer.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)
