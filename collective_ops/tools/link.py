"""An emulated cluster link on one machine: two network namespaces joined by a rate-limited veth pair.

Communication-bound training (data parallel across 10-100 GbE nodes, or large models) cannot be
seen on loopback, where Gloo moves ~1.7 GB/s and communication hides behind backward. This
module makes that regime reproducible on one machine with the kernel's own tools: two network
namespaces (one per emulated node), a veth pair between them with a ``tbf`` rate limit on both
ends, addresses from the benchmarking range 198.18.0.0/15 that exist only inside those
namespaces. Each node's processes run in its namespace, launched like a 2-node job
(``MASTER_ADDR`` = node 0's veth address, ``GLOO_SOCKET_IFNAME`` = the node's veth), so the
transport is the framework's own TCP over a real rate-limited link.

The host's interfaces, routes and qdiscs are never touched: the pair is created inside the
namespaces, and deleting the namespaces (always, also on Ctrl-C or failure) removes it.
Needs root. ``python -m collective_ops.tools.link --rate 1gbit -- CMD ...`` runs ``CMD`` on each
node with ``{node_rank}``, ``{nnodes}``, ``{master_addr}``, ``{master_port}`` and ``{ifname}``
filled in, e.g. a ``torchrun --nnodes 2 --node-rank {node_rank} --master-addr {master_addr}``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

NODES = 2
SUBNET = "198.18.0.{host}/30"  # RFC 2544 benchmarking range, only inside the namespaces
MASTER_PORT = 29500  # free inside a fresh namespace
# Environment the benchmarks read to run one node's share of ranks (benchmarks/common.spawn).
ENV_LINK, ENV_NODE_RANK, ENV_NNODES = "COLLECTIVE_OPS_LINK", "COLLECTIVE_OPS_NODE_RANK", "COLLECTIVE_OPS_NNODES"

_RATE = re.compile(r"^(\d+(?:\.\d+)?)(bit|kbit|mbit|gbit)$")
_BITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
_PLACEHOLDER = re.compile(r"\{(node_rank|nnodes|master_addr|master_port|ifname)\}")


class LinkUnavailable(RuntimeError):
    """This machine refuses to build the link (no root, no namespaces, no tc)."""


def rate_bits(rate: str) -> float:
    """``"1gbit"`` -> 1e9 bits/s (tc's decimal units); a clear error for anything else."""
    match = _RATE.match(rate.strip().lower()) if isinstance(rate, str) else None
    if match is None or float(match.group(1)) <= 0:
        raise ValueError(f"link rate {rate!r} is not a tc rate such as 100mbit, 1gbit or 10gbit (or 'none')")
    return float(match.group(1)) * _BITS[match.group(2)]


def link_label(rate: str | None = None) -> str:
    """What a figure was measured on: "emulated link, 1gbit" or "loopback"."""
    rate = rate if rate is not None else os.environ.get(ENV_LINK)
    return f"emulated link, {rate}" if rate and rate != "none" else "loopback"


@dataclass(frozen=True)
class Link:
    """Names and addresses of one emulated link (unique per process, so concurrent runs never collide)."""

    rate: str
    tag: str

    @classmethod
    def new(cls, rate: str) -> Link:
        rate_bits(rate)
        return cls(rate.strip().lower(), f"{os.getpid() % 100000}")

    def netns(self, node: int) -> str:
        return f"colink{self.tag}n{node}"

    def ifname(self, node: int) -> str:
        return f"colk{self.tag}n{node}"  # at most 15 characters, as Linux requires

    def address(self, node: int) -> str:
        return SUBNET.format(host=node + 1)

    @property
    def master_addr(self) -> str:
        return self.address(0).split("/")[0]

    def tbf_args(self) -> list[str]:
        """tbf with a bucket of 10 ms of traffic (at least 128 KiB: veth hands over GSO frames up to 64 KiB,
        and a frame larger than the bucket would be dropped forever) and a 100 ms queue."""
        burst = max(int(rate_bits(self.rate) / 8 / 100), 128 * 1024)
        return ["tbf", "rate", self.rate, "burst", str(burst), "latency", "100ms"]

    def setup_commands(self) -> list[list[str]]:
        ns0, ns1 = self.netns(0), self.netns(1)
        commands = [["ip", "netns", "add", ns0], ["ip", "netns", "add", ns1]]
        # created inside node 0's namespace, its peer straight into node 1's: never in the host's
        commands.append(["ip", "-n", ns0, "link", "add", self.ifname(0), "type", "veth", "peer", "name"])
        commands[-1] += [self.ifname(1), "netns", ns1]
        for node in range(NODES):
            ns, dev = self.netns(node), self.ifname(node)
            commands += [
                ["ip", "-n", ns, "addr", "add", self.address(node), "dev", dev],
                ["ip", "-n", ns, "link", "set", "lo", "up"],
                ["ip", "-n", ns, "link", "set", dev, "up"],
                ["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", *self.tbf_args()],
            ]
        return commands

    def teardown_commands(self) -> list[list[str]]:
        """Deleting the namespaces deletes the veth pair and its qdiscs with them."""
        return [["ip", "netns", "delete", self.netns(node)] for node in range(NODES)]

    def node_env(self, node: int, base: dict | None = None) -> dict[str, str]:
        env = dict(os.environ if base is None else base)
        env.update(
            {
                ENV_LINK: self.rate,
                ENV_NODE_RANK: str(node),
                ENV_NNODES: str(NODES),
                "MASTER_ADDR": self.master_addr,
                "MASTER_PORT": str(MASTER_PORT),
                "GLOO_SOCKET_IFNAME": self.ifname(node),
                "HCCL_SOCKET_IFNAME": self.ifname(node),
                "NCCL_SOCKET_IFNAME": self.ifname(node),
            }
        )
        return env

    def fill(self, template: Sequence[str], node: int) -> list[str]:
        """``template`` with the known ``{placeholders}`` filled in; any other text, braces included (a
        ``python -c "d = {'a': 1}"`` or a shell ``${VAR}``), is passed on as written."""
        fields = {
            "node_rank": node,
            "nnodes": NODES,
            "master_addr": self.master_addr,
            "master_port": MASTER_PORT,
            "ifname": self.ifname(node),
        }
        return [_PLACEHOLDER.sub(lambda m: str(fields[m.group(1)]), part) for part in template]


def _run_checked(argv: list[str]) -> None:
    proc = subprocess.run(argv, capture_output=True, text=True)
    if proc.returncode != 0:
        raise LinkUnavailable(f"`{' '.join(argv)}` failed: {(proc.stderr or proc.stdout).strip()}")


def check_available() -> None:
    """Raise :class:`LinkUnavailable` with the reason where the link cannot be built here."""
    if sys.platform != "linux":
        raise LinkUnavailable("the emulated link needs Linux network namespaces")
    if os.geteuid() != 0:
        raise LinkUnavailable("the emulated link needs root (network namespaces, tc); run as root or use --link none")
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise LinkUnavailable(f"the emulated link needs {' and '.join(missing)} (Debian: apt-get install iproute2)")


def run_on_link(
    rate: str,
    node_command: Callable[[Link, int], list[str]],
    runner: Callable[[list[str]], None] = _run_checked,
    log_dir: str | None = None,
    env: dict | None = None,
) -> int:
    """Build the link, run ``node_command(link, node)`` in each node's namespace, always tear it down.

    Node 0's output goes to this terminal; node 1's to ``log_dir``/node1.log (printed if it fails).
    ``env``: the nodes' base environment (default: this process's). Returns the first non-zero
    exit status, else 0.
    """
    if runner is _run_checked:  # the real commands: say first why they cannot run here
        check_available()
    link = Link.new(rate)
    procs: list[subprocess.Popen] = []
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    log_path = os.path.join(log_dir or tempfile.mkdtemp(prefix="collective-ops-link-"), "node1.log")
    try:
        for argv in link.setup_commands():
            runner(argv)
        for node in range(NODES):
            argv = ["ip", "netns", "exec", link.netns(node), *node_command(link, node)]
            out = None if node == 0 else open(log_path, "w")  # noqa: SIM115 (closed with the process)
            procs.append(
                subprocess.Popen(
                    argv, env=link.node_env(node, env), stdout=out, stderr=subprocess.STDOUT if out else None
                )
            )
        codes = [proc.wait() for proc in procs]
        failed = next((code for code in codes if code != 0), 0)
        if codes[1] != 0 and os.path.exists(log_path):
            with open(log_path) as log:
                print(f"--- node 1 (exit {codes[1]}) ---\n" + log.read()[-4000:], file=sys.stderr)
        return failed
    finally:
        # A second signal must not cut the teardown short: `timeout CMD` forwards the SIGTERM a
        # `pkill` also sent, and a second Ctrl-C is common. Both wait until the namespaces are gone.
        held = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGTERM, signal.SIGINT)}
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
        for argv in link.teardown_commands():
            with contextlib.suppress(Exception):  # a namespace that was never made: nothing to remove
                runner(argv)
        signal.signal(signal.SIGINT, held[signal.SIGINT])
        signal.signal(signal.SIGTERM, previous)


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def run_on_link_or_explain(rate: str, node_command: Callable[[Link, int], list[str]], **options: Any) -> int:
    """:func:`run_on_link`, or one line on stderr and exit status 2 where this machine refuses the link."""
    try:
        return run_on_link(rate, node_command, **options)
    except LinkUnavailable as exc:
        print(f"emulated link unavailable: {exc}", file=sys.stderr)
        return 2


def relaunch_on_link(rate: str, argv: Sequence[str]) -> int:
    """Run this same Python command (``argv``, without its --link option) once per node on the link."""
    return run_on_link_or_explain(rate, lambda link, node: [sys.executable, *argv])


def strip_link_option(argv: Sequence[str], option: str = "--link") -> list[str]:
    """``argv`` without ``--link X`` / ``--link=X`` (the relaunched nodes must not relaunch again), or ``option``."""
    out, skip = [], False
    for part in argv:
        if skip:
            skip = False
        elif part == option:
            skip = True
        elif not part.startswith(f"{option}="):
            out.append(part)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m collective_ops.tools.link",
        description="Run a command on each of two emulated nodes joined by a rate-limited link.",
    )
    parser.add_argument("--rate", required=True, help="tc rate of the link, e.g. 100mbit, 1gbit, 10gbit")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- CMD ... with {node_rank}, {master_addr}, ...")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to run on each node after --")
    try:
        rate_bits(args.rate)
    except ValueError as exc:
        parser.error(str(exc))
    return run_on_link_or_explain(args.rate, lambda link, node: link.fill(command, node))


if __name__ == "__main__":
    sys.exit(main())
