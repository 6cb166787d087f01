"""The nccl-tests style benchmark: formulas by hand, a tiny real sweep, and that a wrong result is caught."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from collective_ops.tools import bench
from tests.harness import run_ranks


def test_bus_factors_match_nccl_tests() -> None:
    # nccl-tests PERFORMANCE.md: allreduce 2(n-1)/n, allgather and reduce_scatter (n-1)/n, broadcast 1
    assert bench.bus_factor("allreduce", 8) == pytest.approx(1.75)
    assert bench.bus_factor("allgather", 8) == pytest.approx(0.875)
    assert bench.bus_factor("reduce_scatter", 4) == pytest.approx(0.75)
    assert bench.bus_factor("broadcast", 16) == 1.0
    algbw, busbw = bench.bandwidths("allreduce", 1_000_000_000, 0.5, 2)
    assert (algbw, busbw) == (2.0, 2.0)
    algbw, busbw = bench.bandwidths("allgather", 3_000_000_000, 1.0, 3)
    assert algbw == 3.0 and busbw == pytest.approx(2.0)
    with pytest.raises(ValueError, match="unknown collective"):
        bench.bus_factor("alltoall", 2)


def test_sizes() -> None:
    assert bench.parse_size("8") == 8 and bench.parse_size("64K") == 65536 and bench.parse_size("256M") == 256 << 20
    assert bench.parse_size("1g") == 1 << 30
    assert bench.size_sweep(8, 64, 2) == [8, 16, 32, 64]
    for bad in ("-8", "8X", "", "0"):
        with pytest.raises(argparse.ArgumentTypeError):
            bench.parse_size(bad)
    with pytest.raises(ValueError, match="factor"):
        bench.size_sweep(8, 64, 1)
    with pytest.raises(ValueError, match="larger than the last"):
        bench.size_sweep(64, 8, 2)


def sweep_checks(rank: int, world: int) -> dict:
    import collective_ops as co

    out = {}
    for op in bench.OPS:
        rows = bench.run_sweep(op, [64, 4096], warmup=1, iters=2, progress=False)
        out[op] = [(r.impl, r.bytes, r.wrong, r.time_us > 0, r.busbw_gbs > 0) for r in rows]
    # every reduce op checked against its own reference (a sum-only check counted them all wrong)
    for op in ("allreduce", "reduce_scatter"):
        for reduce_op in ("max", "min", "prod"):
            rows = bench.run_sweep(op, [64], reduce_op=reduce_op, warmup=0, iters=1, rounds=1, progress=False)
            out[f"{op}/{reduce_op}"] = [(r.wrong, r.redop, r.world) for r in rows]
    # the tuner's sweep: times only (no run on known data), marked as not checked
    unchecked = bench.run_sweep("allreduce", [64], warmup=0, iters=1, rounds=1, progress=False, check=False)
    out["unchecked"] = [r.wrong for r in unchecked]
    # a corrupted result must be counted as wrong
    import torch

    t = torch.zeros(16)

    def corrupt(t, out_):
        co.allreduce(t)
        t[3] += 1

    out["corrupt_wrong"] = bench._check("allreduce", corrupt, t, None, rank, world)
    return out


def test_tiny_sweep_on_real_ranks() -> None:
    world = 3
    for out in run_ranks(world, sweep_checks):
        for op in bench.OPS:
            rows = out[op]
            assert [impl for impl, *_ in rows] == ["raw", "collective_ops"] * 2
            assert rows[0][1] == rows[1][1] <= 64 and rows[2][1] == rows[3][1] <= 4096  # divisible by the world
            assert all(wrong == 0 and timed and bw for _, _, wrong, timed, bw in rows), (op, rows)
        assert out["corrupt_wrong"] == 1
        assert out["unchecked"] == [-1, -1]
        for op in ("allreduce", "reduce_scatter"):
            for reduce_op in ("max", "min", "prod"):
                assert out[f"{op}/{reduce_op}"] == [(0, reduce_op, world)] * 2, (op, reduce_op)


def test_cli_writes_table_csv_json_and_plot(tmp_path) -> None:
    cmd = [
        sys.executable,
        "benchmarks/allreduce_benchmark.py",
        "--spawn",
        "2",
        "-b",
        "8",
        "-e",
        "1K",
        "-f",
        "16",
        "-n",
        "2",
        "-w",
        "1",
        "--csv",
        str(tmp_path / "r.csv"),
        "--json",
        str(tmp_path / "r.json"),
        "--plot",
        str(tmp_path / "r.png"),
    ]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "busbw(GB/s)" in result.stdout and "collective_ops vs raw" in result.stdout
    data = json.loads((tmp_path / "r.json").read_text())
    assert len(data["rows"]) == 4 and all(r["wrong"] == 0 for r in data["rows"])
    assert (tmp_path / "r.csv").read_text().startswith("op,impl,bytes")
    assert "redop,world" in (tmp_path / "r.csv").read_text().splitlines()[0]
    assert all(r["redop"] == "sum" and r["world"] == 2 for r in data["rows"])
    assert " redop " in result.stdout
    assert (tmp_path / "r.png").read_bytes()[:4] == b"\x89PNG"
    bad = subprocess.run(
        [sys.executable, "-m", "collective_ops.tools.cli", "bench", "-b", "lots"], capture_output=True, text=True
    )
    assert bad.returncode == 2 and "is not a number of bytes" in bad.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["bench", "-b", "1K", "-e", "8"], "larger than the last"),
        (["bench", "-f", "1"], "step factor must be >= 2"),
        (["bench", "-d", "bogus"], "unknown dtype 'bogus'"),
        (["bench", "-n", "0"], "iters >= 1"),
        (["bench", "-w", "-1"], "warmup >= 0"),
        (["bench", "--backend", "nccl"], "needs a CUDA GPU"),
        (["tune", "--profile", "x.json", "--candidates", "0", "-5"], "--candidates are bucket sizes in MiB"),
        (["tune", "--profile", "missing.json"], "not a profile"),
        (["heatmap", "--trace", "t.json", "--output", "x.txt"], "must be a .png"),
        (["bench", "--link", "1gbit", "--spawn", "3"], "does not split over the link's 2 nodes"),
        (["bench", "--link", "fast"], "is not a tc rate"),
        (["bench", "--launcher", "msrun"], "starts the nodes of --link RATE"),
        (["nonsense"], "invalid choice"),
    ],
)
def test_cli_mistakes_are_one_line_usage_errors(args, message) -> None:
    import torch

    if "nccl" in args and torch.cuda.is_available():
        pytest.skip("on a GPU host --backend nccl is right")
    result = subprocess.run([sys.executable, "-m", "collective_ops.tools.cli", *args], capture_output=True, text=True)
    assert result.returncode == 2, (result.returncode, result.stderr)
    assert message in result.stderr and "Traceback" not in result.stderr, result.stderr


def test_cli_version_and_help_texts() -> None:
    from collective_ops import __version__

    version = subprocess.run(
        [sys.executable, "-m", "collective_ops.tools.cli", "--version"], capture_output=True, text=True
    )
    assert version.returncode == 0 and version.stdout.strip() == f"collective-ops {__version__}"
    helptext = subprocess.run(
        [sys.executable, "-m", "collective_ops.tools.cli", "bench", "--help"], capture_output=True, text=True
    ).stdout
    assert "powers of 1024" in helptext and "(default: 60)" in helptext and "(default: 64M)" in helptext


def test_race_step_times_are_the_slowest_ranks_progress() -> None:
    """Two ranks that take one wait each in different steps: each step counts it once, not both."""
    from benchmarks.ddp_compare import slowest_rank_steps

    class TwoRanks:  # elementwise max over rank 0 (these) and rank 1 (its waits one step later)
        def reduce_floats(self, values, op):
            assert op == "max"
            peer = [0.25, 0.35, 0.25, 0.25, 0.35, 0.25]  # cumulative per block of 3: 0.25 0.6 0.85
            peer_elapsed = [sum(peer[b : b + j + 1]) for b in (0, 3) for j in range(3)]
            return [max(a, b) for a, b in zip(values, peer_elapsed)]

    ours = [0.35, 0.25, 0.25, 0.35, 0.25, 0.25]
    steps = slowest_rank_steps(ours, 3, TwoRanks())
    assert sum(steps[:3]) == pytest.approx(0.85) and sum(steps[3:]) == pytest.approx(0.85)
    assert sorted(round(s, 6) for s in steps) == [0.25, 0.25, 0.25, 0.25, 0.35, 0.35]


def test_physical_limit_is_compute_or_the_wire_time_of_a_ring_allreduce(monkeypatch) -> None:
    """A step against max(compute alone, the link's time for each rank's 2 (n-1)/n of the step's bytes)."""
    from benchmarks.common import physical_limit
    from collective_ops.tools.link import ENV_LINK

    monkeypatch.setenv(ENV_LINK, "1gbit")
    steps = {"ddp": 400.0, "wrap": 300.0}
    limit = physical_limit(steps, 150.0, 25_000_000, 2)  # 25 MB at 1e9 bit/s: 200 ms each way
    assert limit.wire_ms == pytest.approx(200.0) and limit.bound_ms == pytest.approx(200.0)
    assert limit.columns == {"ddp": "2.00x max(compute, wire)", "wrap": "1.50x max(compute, wire)"}
    assert physical_limit(steps, 150.0, 25_000_000, 4).wire_ms == pytest.approx(300.0)
    assert "at 1gbit: 200.0 ms" in limit.line() and limit.lines()[1].split()[0] == "wrap"  # fastest first
    assert physical_limit(steps, 250.0, 25_000_000, 2).ratio(300.0) == pytest.approx(1.2)  # compute-bound
    monkeypatch.delenv(ENV_LINK)
    off = physical_limit(steps, 150.0, 25_000_000, 2)
    assert off.wire_ms is None and off.ratio(300.0) == pytest.approx(2.0)


def test_bench_on_the_link_under_msrun_starts_one_msrun_node_per_namespace(monkeypatch) -> None:
    """``bench --link RATE --launcher msrun``: each node runs msrun with half the ranks, rendezvous at node 0's
    address, and the workers run the same bench without --link/--launcher (they must not relaunch)."""
    from collective_ops.tools import cli, link

    started = {}

    def fake_run_on_link(rate, node_command, **options):
        started["rate"], started["options"] = rate, options
        started["nodes"] = [node_command(link.Link.new(rate), node) for node in range(2)]
        return 0

    monkeypatch.setattr(link, "run_on_link_or_explain", fake_run_on_link)
    argv = ["bench", "--link", "1gbit", "--launcher", "msrun", "--op", "broadcast", "-b", "64K", "-e", "64K"]
    assert cli.main(argv) == 0
    the_link = link.Link.new("1gbit")
    for node, command in enumerate(started["nodes"]):
        assert command[:4] == ["msrun", "--worker_num=2", "--local_worker_num=1", f"--node_rank={node}"]
        assert f"--master_addr={the_link.master_addr}" in command
        script = command.index("--join=True") + 1
        assert command[script + 1 :] == ["bench", "--op", "broadcast", "-b", "64K", "-e", "64K"]
        assert "from collective_ops.tools.cli import main" in Path(command[script]).read_text()
    assert "collective_ops" in os.listdir(started["options"]["env"]["PYTHONPATH"].split(os.pathsep)[0])
