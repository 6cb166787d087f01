"""The emulated cluster link: its commands never touch the host's network, it is always torn down,
and a real 2-node run over it reduces correctly (where this machine lets us build namespaces)."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from collective_ops.tools.link import Link, check_available, rate_bits, run_on_link, strip_link_option

ROOT = Path(__file__).resolve().parents[1]


def test_rates_are_tc_rates() -> None:
    assert rate_bits("1gbit") == 1e9 and rate_bits("100mbit") == 1e8 and rate_bits("2.5gbit") == 2.5e9
    for bad in ("1gb", "fast", "0mbit", "-1gbit", "", None):
        with pytest.raises(ValueError, match="not a tc rate"):
            rate_bits(bad)


def test_every_command_stays_inside_the_links_own_namespaces() -> None:
    link = Link.new("1gbit")
    ours = {link.netns(0), link.netns(1)}
    setup, teardown = link.setup_commands(), link.teardown_commands()
    for argv in setup + teardown:
        if argv[:2] == ["ip", "netns"]:
            assert argv[2] in ("add", "delete") and argv[3] in ours, argv
        else:  # ip -n NS ... / tc -n NS ...: never the host's namespace
            assert argv[0] in ("ip", "tc") and argv[1] == "-n" and argv[2] in ours, argv
    assert all(len(link.ifname(node)) <= 15 for node in (0, 1))
    addresses = [argv[5] for argv in setup if argv[3:5] == ["addr", "add"]]
    assert addresses == ["198.18.0.1/30", "198.18.0.2/30"]  # the benchmarking range, only inside the namespaces
    qdiscs = [argv for argv in setup if argv[0] == "tc"]
    assert len(qdiscs) == 2 and all(q[q.index("rate") + 1] == "1gbit" for q in qdiscs)
    # a bucket of at least 128 KiB: veth hands tbf GSO frames of up to 64 KiB, which a smaller one drops forever
    assert all(int(q[q.index("burst") + 1]) >= 128 * 1024 for q in qdiscs)
    assert teardown == [["ip", "netns", "delete", name] for name in sorted(ours, key=lambda n: n[-1])]


def test_node_environment_and_command_templates() -> None:
    link = Link.new("10gbit")
    env = link.node_env(1, base={})
    assert env["MASTER_ADDR"] == "198.18.0.1" and env["GLOO_SOCKET_IFNAME"] == link.ifname(1)
    assert env["COLLECTIVE_OPS_NODE_RANK"] == "1" and env["COLLECTIVE_OPS_LINK"] == "10gbit"
    assert link.fill(["--node-rank", "{node_rank}", "--master-addr", "{master_addr}"], 1) == [
        "--node-rank",
        "1",
        "--master-addr",
        "198.18.0.1",
    ]
    assert strip_link_option(["--world", "2", "--link", "1gbit", "--x", "--link=2gbit"]) == ["--world", "2", "--x"]


def test_a_command_with_braces_of_its_own_is_passed_on_as_written() -> None:
    """Only the link's placeholders are filled: str.format raised KeyError on any other brace."""
    link = Link.new("10gbit")
    command = ["python", "-c", "d = {'a': 1}; print(f'{d} {{x}}')", "--rank={node_rank}", "${HOME}", "{}", "{ifname"]
    assert link.fill(command, 0) == [
        "python",
        "-c",
        "d = {'a': 1}; print(f'{d} {{x}}')",
        "--rank=0",
        "${HOME}",
        "{}",
        "{ifname",
    ]


@pytest.mark.parametrize("failing_step", [0, 3, 9, None])
def test_the_link_is_always_torn_down(failing_step) -> None:
    """A failure while building it, or in the nodes' command, still deletes both namespaces."""
    issued: list[list[str]] = []

    def runner(argv: list[str]) -> None:
        issued.append(argv)
        if failing_step is not None and len(issued) == failing_step + 1:
            raise RuntimeError("refused")

    command = [sys.executable, "-c", "raise SystemExit(3)"]
    if failing_step is None:  # setup succeeds (by the fake runner); the nodes cannot enter fake namespaces
        code = run_on_link("1gbit", lambda link, node: command, runner=runner, log_dir=None)
        assert code != 0
    else:
        with pytest.raises(RuntimeError, match="refused"):
            run_on_link("1gbit", lambda link, node: command, runner=runner)
    deletes = [argv for argv in issued if argv[:3] == ["ip", "netns", "delete"]]
    assert len(deletes) == 2, issued


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
def test_a_second_signal_does_not_cut_the_teardown_short(sig: str) -> None:
    """`timeout CMD` forwards the SIGTERM `pkill` also sent (a second Ctrl-C likewise): both deletes still run."""
    import signal

    issued: list[list[str]] = []

    def runner(argv: list[str]) -> None:
        issued.append(argv)
        if argv[:3] == ["ip", "netns", "delete"] and len(issued) == len(Link.new("1gbit").setup_commands()) + 1:
            os.kill(os.getpid(), getattr(signal, sig))  # arrives while the first namespace is deleted

    command = [sys.executable, "-c", "raise SystemExit(3)"]
    # what the process had before (SIG_IGN where a shell started it in the background): put back as it was
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    run_on_link("1gbit", lambda link, node: command, runner=runner, log_dir=None)
    deletes = [argv for argv in issued if argv[:3] == ["ip", "netns", "delete"]]
    assert len(deletes) == 2, issued
    assert {s: signal.getsignal(s) for s in before} == before  # handlers restored


def _namespaces_allowed() -> str | None:
    try:
        check_available()
    except Exception as exc:
        return str(exc)
    probe = subprocess.run(["ip", "netns", "add", f"coprobe{os.getpid()}"], capture_output=True, text=True)
    subprocess.run(["ip", "netns", "delete", f"coprobe{os.getpid()}"], capture_output=True)
    return None if probe.returncode == 0 else f"network namespaces refused: {probe.stderr.strip()}"


PROBE = """
import os, torch, collective_ops as co
ctx = co.init()  # RANK, WORLD_SIZE, DEVICE_ID, MASTER_ADDR, GLOO_SOCKET_IFNAME from the environment
node = int(os.environ["COLLECTIVE_OPS_NODE_RANK"])
assert (ctx.rank, ctx.world_size, ctx.backend) == (node, 2, "gloo"), ctx
t = torch.arange(1 << 18, dtype=torch.float32) * (node + 1)
co.allreduce(t)
assert torch.equal(t, torch.arange(1 << 18, dtype=torch.float32) * 3), "wrong sum over the link"
model = co.wrap(torch.nn.Linear(8, 2, bias=False))
model(torch.ones(4, 8) * (node + 1)).sum().backward()
assert torch.equal(model.module.weight.grad, torch.full((2, 8), 6.0)), "wrong gradient average over the link"
print("link ok", os.environ["COLLECTIVE_OPS_LINK"], os.environ["GLOO_SOCKET_IFNAME"], flush=True)
co.shutdown()
"""


def test_a_real_two_node_run_over_a_10gbit_link_launched_as_a_rank_loop() -> None:
    reason = _namespaces_allowed()
    if reason:
        pytest.skip(reason)
    before = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        # the seed-style launch across machines: each node sets RANK/WORLD_SIZE/DEVICE_ID (the link sets
        # MASTER_ADDR to node 0's address and GLOO_SOCKET_IFNAME to the node's interface)
        [sys.executable, "-m", "collective_ops.tools.link", "--rate", "10gbit", "--", "env", "RANK={node_rank}"]
        + ["WORLD_SIZE=2", "DEVICE_ID=0", sys.executable, "-c", PROBE],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "link ok 10gbit colk" in result.stdout
    after = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert after == before, "the link's namespaces must be gone"


STORE_HOLDER = """
import sys, collective_ops as co
co.init("gloo")  # RANK, WORLD_SIZE, MASTER_ADDR=127.0.0.1, MASTER_PORT from the environment
print("ready", flush=True)
sys.stdin.readline()  # the store stays up until the test has knocked
co.shutdown()
"""
KNOCK = """
import socket, sys
try:
    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=5).close()
    print("connected")
except OSError as exc:
    print("refused", exc)
"""


def _knock(link: Link, node: int, addr: str, port: int) -> str:
    argv = ["ip", "netns", "exec", link.netns(node), sys.executable, "-c", KNOCK, addr, str(port)]
    return subprocess.run(argv, capture_output=True, text=True, timeout=30).stdout.strip()


def test_the_rendezvous_store_listens_on_master_addr_only() -> None:
    """With MASTER_ADDR=127.0.0.1, nothing from another network namespace reaches rank 0's store (torch's own
    server listened on every interface: a client there read num_keys() and wrote a key)."""
    reason = _namespaces_allowed()
    if reason:
        pytest.skip(reason)
    link, port, ranks = Link.new("10gbit"), 29500, []
    env = {**os.environ, "PYTHONPATH": str(ROOT), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"}
    env.update({"MASTER_PORT": str(port), "COLLECTIVE_OPS_RENDEZVOUS_TIMEOUT": "30"})
    try:
        for argv in link.setup_commands():
            subprocess.run(argv, check=True, capture_output=True)
        for rank in range(2):  # both ranks on node 0, as a single-machine run
            ranks.append(
                subprocess.Popen(
                    ["ip", "netns", "exec", link.netns(0), sys.executable, "-c", STORE_HOLDER],
                    env={**env, "RANK": str(rank), "DEVICE_ID": str(rank)},
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    text=True,
                )
            )
        assert [rank.stdout.readline().strip() for rank in ranks] == ["ready", "ready"]
        assert _knock(link, 0, "127.0.0.1", port) == "connected"  # the store is up: the knocks below mean something
        assert _knock(link, 1, link.master_addr, port).startswith("refused")  # the other node
        assert _knock(link, 0, link.master_addr, port).startswith("refused")  # node 0's own outward address
        for rank in ranks:
            rank.stdin.write("\n")
            rank.stdin.flush()
        assert [rank.wait(timeout=60) for rank in ranks] == [0, 0]
    finally:
        for rank in ranks:
            if rank.poll() is None:
                rank.kill()
                rank.wait()
        for argv in link.teardown_commands():
            subprocess.run(argv, capture_output=True)


def _others_can_enter(path: Path) -> bool:
    """Whether a user outside the owner's group can reach ``path`` (every folder above it searchable by others)."""
    return all(folder.stat().st_mode & stat.S_IXOTH for folder in (path, *path.parents))


def test_a_machine_that_refuses_says_so_in_one_line() -> None:
    setpriv = shutil.which("setpriv")
    if os.geteuid() != 0 or setpriv is None:
        pytest.skip("needs root and setpriv to run the command as an unprivileged user")
    if not _others_can_enter(ROOT / "collective_ops") or not _others_can_enter(Path(sys.executable).parent):
        pytest.skip(f"{ROOT} or its Python lies in a folder other users cannot enter (mktemp -d makes such folders)")
    result = subprocess.run(
        [setpriv, "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-m", "collective_ops.tools.link"]
        + ["--rate", "1gbit", "--", "true"],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        cwd="/",
    )
    assert result.returncode == 2, result
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "needs root" in lines[0], result.stderr
