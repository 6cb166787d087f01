"""Faults injected into a 2-rank training run: what the other rank prints, and how long until every process is gone.

Each row: one fault (``kill``: SIGKILL, ``stop``: SIGSTOP, ``raise``: an exception in the loop, ``partition``:
the emulated link taken down, ``ip link set DEV down`` inside the rank's network namespace) on rank 0 (which
hosts the rendezvous store) or rank 1, before the backward of step 2 of a wrapped MLP trained by a
DistributedOptimizer (tests/fault_worker.py, each rank a process of its own). Recorded: the first line of
each rank's error, and the seconds from the fault until each process exited; a process still running
``--stall`` + 30 s after the fault is killed and counted as left behind (a stopped rank cannot exit: it is
killed at the end and not counted). The partition rows run on the emulated link (collective_ops/link.py,
needs root; its namespaces are always deleted) and are skipped where it is unavailable.

    python benchmarks/fault_matrix.py [--stall 10] [--faults kill,stop,raise,partition]

Writes benchmarks/results/fault_matrix.json (with the machine and commit) and prints the table.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from collective_ops.tools.link import Link, LinkUnavailable, _run_checked, check_available  # noqa: E402
from tests.harness import free_port, run_rank_processes  # noqa: E402

FAULTS = ("kill", "stop", "raise", "partition")
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "fault_matrix.json")


def _env(fault: str, rank: int, stall: float, port: int) -> list[dict]:
    common = {
        "WORLD_SIZE": "2",
        "MASTER_PORT": str(port),
        "COLLECTIVE_OPS_STALL_TIMEOUT": f"{stall:g}",
        "COLLECTIVE_OPS_RENDEZVOUS_TIMEOUT": "60",
        "FAULT": fault,
        "FAULT_RANK": str(rank),
        "FAULT_STEP": "2",
    }
    return [{**common, "RANK": str(r)} for r in range(2)]


def run_row(fault: str, rank: int, stall: float) -> dict:
    """One fault on one rank; each rank's first error line and seconds from the fault to its exit."""
    bound = stall + 30
    timeout = bound + 60  # (the ranks' start and rendezvous come before the fault)
    if fault != "partition":
        results = run_rank_processes(_env(fault, rank, stall, free_port()), timeout=timeout)
        return _summarise(fault, rank, results, bound, namespaces_left=None)
    link = Link.new("1gbit")
    try:
        for argv in link.setup_commands():
            _run_checked(argv)
        env = _env(fault, rank, stall, 29500)
        for node in range(2):
            env[node].update({k: v for k, v in link.node_env(node, {}).items() if k in ("MASTER_ADDR", "MASTER_PORT")})
            env[node]["GLOO_SOCKET_IFNAME"] = link.ifname(node)
            env[node]["FAULT_COMMAND"] = f"ip link set {link.ifname(node)} down"
        prefixes = [["ip", "netns", "exec", link.netns(node)] for node in range(2)]
        results = run_rank_processes(env, timeout=timeout, prefixes=prefixes)
    finally:
        for argv in link.teardown_commands():
            with contextlib.suppress(Exception):
                _run_checked(argv)
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    left = [link.netns(node) for node in range(2) if link.netns(node) in listed]
    return _summarise(fault, rank, results, bound, namespaces_left=left)


def _summarise(fault: str, rank: int, results: list[dict], bound: float, namespaces_left: list | None) -> dict:
    fault_at = results[rank]["fault_at"]
    row = {"fault": fault, "rank": rank, "bound_s": bound, "namespaces_left": namespaces_left}
    for r, out in enumerate(results):
        exited = out["exited_after"]
        row[f"rank{r}_error"] = (out["error"] or "").splitlines()[0] if out["error"] else None
        row[f"rank{r}_error_text"] = out["error"]
        row[f"rank{r}_exit_s"] = None if exited is None or fault_at is None else round(exited - fault_at, 1)
        row[f"rank{r}_returncode"] = out["returncode"]
    # the faulty rank of a stop cannot exit; every other process must be gone within the bound
    must_exit = [r for r in range(2) if not (fault == "stop" and r == rank)]
    row["left_behind"] = [r for r in must_exit if row[f"rank{r}_exit_s"] is None or row[f"rank{r}_exit_s"] > bound]
    row["fault_injected"] = fault_at is not None
    # each other rank's first line names the faulty one ("[1]": "Ranks not taking part: [1]", "... answering: [1]")
    others = [r for r in range(2) if r != rank]
    row["names_rank"] = all(f"[{rank}]" in (row[f"rank{r}_error"] or "") for r in others)
    if fault_at is None:  # the run never reached the fault: keep what it printed
        row["output_tail"] = [out["output"][-2000:] for out in results]
    return row


def _machine() -> dict:
    import torch

    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = bool(subprocess.run(["git", "status", "--porcelain"], capture_output=True, text=True).stdout.strip())
    return {
        "host": platform.node(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "commit": commit + ("-dirty" if dirty else ""),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def _short(text: str, limit: int = 150) -> str:
    """The start of an error's first line (the rank it names comes first; the JSON keeps the whole line)."""
    return text if len(text) <= limit else text[:limit].rstrip() + " ..."


def table(rows: list[dict]) -> str:
    lines = [
        "| fault | on rank | rank 0 prints (first line) | rank 1 prints (first line) | names the rank | "
        "exit after the fault, rank 0 / rank 1 (s) | left behind |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        shown = []
        for r in range(2):
            if row["fault"] in ("stop", "kill") and r == row["rank"]:
                shown.append(f"({'stopped' if row['fault'] == 'stop' else 'killed'})")
            else:
                shown.append(f"`{_short(row[f'rank{r}_error'])}`" if row[f"rank{r}_error"] else "(nothing)")
        exits = " / ".join(
            "killed by the harness"
            if row["fault"] == "stop" and r == row["rank"]
            else "-"
            if row[f"rank{r}_exit_s"] is None
            else f"{row[f'rank{r}_exit_s']:g}"
            for r in range(2)
        )
        left = ", ".join(f"rank {r}" for r in row["left_behind"]) or "nothing"
        if row.get("namespaces_left"):
            left += f"; namespaces {row['namespaces_left']}"
        named = "yes" if row.get("names_rank") else "no"
        lines.append(f"| {row['fault']} | {row['rank']} | {shown[0]} | {shown[1]} | {named} | {exits} | {left} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stall", type=float, default=10.0, help="COLLECTIVE_OPS_STALL_TIMEOUT of the ranks (s)")
    parser.add_argument("--faults", default=",".join(FAULTS), help=f"comma-separated, of {', '.join(FAULTS)}")
    parser.add_argument("--out", default=RESULTS)
    parser.add_argument("--table", metavar="JSON", help="only print the table of a results file")
    args = parser.parse_args(argv)
    if args.table:
        with open(args.table) as saved:
            print(table(json.load(saved)["rows"]))
        return 0
    faults = [f for f in args.faults.split(",") if f]
    if "partition" in faults:
        try:
            check_available()
        except LinkUnavailable as exc:
            print(f"partition rows skipped: {exc}", file=sys.stderr)
            faults.remove("partition")
    machine = _machine()  # (the commit measured: taken before the rows)
    rows = []
    for fault in faults:
        for rank in (0, 1):
            rows.append(run_row(fault, rank, args.stall))
            print(json.dumps(rows[-1]), flush=True)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as out:
        json.dump({"machine": machine, "stall_timeout_s": args.stall, "rows": rows}, out, indent=1)
    print(table(rows))
    return 1 if any(row["left_behind"] or row.get("namespaces_left") for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
