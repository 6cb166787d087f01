"""Communication traces from real Gloo runs; the summary names a deliberately slowed rank; heatmap output."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from collective_ops.tools.heatmap import TraceError, analyze, load_events, render
from collective_ops.tracing import write_trace
from tests.harness import run_ranks

STEPS = 3


class SleepInBackward(torch.autograd.Function):
    """Identity forward; backward sleeps ``seconds`` first."""

    @staticmethod
    def forward(ctx, x, seconds: float):
        ctx.seconds = seconds
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.seconds)
        return grad, None


def traced_training(rank: int, world: int, slow_rank: int) -> dict:
    import collective_ops as co
    from collective_ops import tracing
    from tests.models import MLP, build, rank_batch

    model = co.wrap(build("mlp"), bucket_size_mb=0.01, first_bucket_mb=0.005, rebuild_buckets=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(STEPS):
        x, y = rank_batch(MLP, step, rank)
        # a straggler, far above scheduling noise (3 ranks share 2 cores)
        delay = 0.3 if rank == slow_rank else 0.0
        loss = torch.nn.functional.cross_entropy(SleepInBackward.apply(model(x), delay), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    co.allreduce(torch.ones(10))
    co.broadcast(torch.ones(3), src=0, async_op=True).wait()
    return {"buckets": model.comm_stats()["buckets"], "tracing": tracing.get_tracer() is not None}


@pytest.mark.parametrize("world", [2, 3])
def test_trace_of_a_real_run(tmp_path: Path, world: int) -> None:
    trace_file = tmp_path / "out" / "comm_trace.json"
    env = {"COLLECTIVE_OPS_TRACE": "1", "COLLECTIVE_OPS_TRACE_FILE": str(trace_file)}
    slow_rank = world - 1
    results = run_ranks(world, traced_training, slow_rank, env=env)
    buckets = results[0]["buckets"]
    assert all(r["tracing"] for r in results)
    data = json.loads(trace_file.read_text())
    events = data["traceEvents"]
    assert {e["pid"] for e in events} == set(range(world)), "one process per rank"
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"}
    assert names == {r: f"rank {r}" for r in range(world)}
    for rank in range(world):
        for step in range(STEPS):
            got = sorted(
                e["args"]["bucket"]
                for e in events
                if e.get("cat") == "bucket" and e["pid"] == rank and e["args"]["step"] == step
            )
            assert got == list(range(buckets)), (rank, step, got)
        prims = [e["name"] for e in events if e.get("cat") == "primitive" and e["pid"] == rank]
        assert prims == ["allreduce", "broadcast"]
        assert sum(1 for e in events if e.get("cat") == "backward" and e["pid"] == rank) == STEPS
    for e in events:
        if e.get("ph") == "X":
            assert e["dur"] >= 0 and isinstance(e["ts"], float)
    bucket_event = next(e for e in events if e.get("cat") == "bucket")
    assert {"bytes", "dtype", "params", "num_params", "first_ready_us", "last_ready_us"} <= set(bucket_event["args"])

    analysis = analyze(load_events([trace_file]))
    assert analysis.slowest_rank == slow_rank, analysis.summary()
    assert analysis.comm_ms.shape == analysis.wait_skew_ms.shape == (world, buckets)
    assert f"slowest rank: {slow_rank}" in analysis.summary()
    png = render(analysis, tmp_path / "heatmap.png")
    import matplotlib.image

    height, width, _ = matplotlib.image.imread(png).shape
    assert width > height > 100


def traced_slow_layers(rank: int, world: int) -> dict:
    """Every layer's backward takes 0.2 s (a sleep between layers, on every rank); a bucket per layer."""
    import collective_ops as co

    class Slow(torch.nn.Module):
        def forward(self, x):
            return SleepInBackward.apply(x, 0.2)  # far above a few-KB allreduce and the ranks' skew (4 ms seen)

    torch.manual_seed(0)
    layers = [torch.nn.Linear(16, 16)]
    for _ in range(3):
        layers += [Slow(), torch.nn.Linear(16, 16)]
    # 2 KiB buckets: a layer's weight and bias (1088 bytes) fill one, the next layer's weight does not fit
    model = co.wrap(torch.nn.Sequential(*layers), bucket_size_mb=0.002, first_bucket_mb=0.002, rebuild_buckets=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(STEPS):
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(step * 10 + rank))
        optimizer.zero_grad()
        model(x).square().mean().backward()
        optimizer.step()
    return {"buckets": model.comm_stats()["buckets"]}


def test_a_buckets_span_ends_where_its_collective_completed(tmp_path: Path) -> None:
    """A bucket that completed while backward went on ends its span then, not at backward's end.

    Each layer's bucket is launched as its gradients are ready and completes during the next
    layer's 0.2 s of backward, so the next gradient sees it complete before the next bucket is
    launched. Before, every span ended when backward's end finished the bucket: after every launch.
    Step 0 is left out: a rank that starts late (seen: 0.56 s) holds its peer's first buckets back.
    """
    trace_file = tmp_path / "comm_trace.json"
    env = {"COLLECTIVE_OPS_TRACE": "1", "COLLECTIVE_OPS_TRACE_FILE": str(trace_file)}
    assert run_ranks(2, traced_slow_layers, env=env)[0]["buckets"] == 4
    events = [e for e in json.loads(trace_file.read_text())["traceEvents"] if e.get("cat") == "bucket"]
    for rank in range(2):
        for step in range(1, STEPS):  # the ranks left step 0 together: its last bucket waited for both
            spans = sorted(
                (e["ts"], e["ts"] + e["dur"]) for e in events if e["pid"] == rank and e["args"]["step"] == step
            )
            assert len(spans) == 4
            # the last two buckets are launched together, after the last sleep (autograd's order): not compared
            for (_, end), (next_launch, _) in zip(spans[:2], spans[1:3]):
                assert end <= next_launch, (rank, step, spans)


def untraced(rank: int, world: int) -> dict:
    import torch

    import collective_ops as co
    from collective_ops import tracing
    from tests.models import build

    model = co.wrap(build("mlp"))
    model(torch.randn(2, 16)).sum().backward()
    return {"tracer": tracing.get_tracer() is None, "observer": model.manager.observer is None}


def test_trace_off_adds_nothing(tmp_path: Path) -> None:
    env = {"COLLECTIVE_OPS_TRACE": "0", "COLLECTIVE_OPS_TRACE_DIR": str(tmp_path)}
    for r in run_ranks(2, untraced, env=env):
        assert r == {"tracer": True, "observer": True}
    assert list(tmp_path.iterdir()) == []


def test_bad_trace_files_are_refused_clearly(tmp_path: Path) -> None:
    truncated = tmp_path / "truncated.json"
    truncated.write_text('{"traceEvents": [{"ph": "X", "pid": 0')
    with pytest.raises(TraceError, match="truncated"):
        load_events([truncated])
    wrong = tmp_path / "wrong.json"
    wrong.write_text('{"something": 1}')
    with pytest.raises(TraceError, match="traceEvents"):
        load_events([wrong])
    bad_event = tmp_path / "bad_event.json"
    bad_event.write_text('{"traceEvents": [{"name": "x"}]}')
    with pytest.raises(TraceError, match="malformed event"):
        load_events([bad_event])
    empty = tmp_path / "empty.json"
    empty.write_text('{"traceEvents": []}')
    with pytest.raises(TraceError, match="no bucket events"):
        analyze(load_events([empty]))
    with pytest.raises(TraceError, match="no such file"):
        load_events([tmp_path / "missing.json"])
    binary = tmp_path / "binary.json"
    binary.write_bytes(b"\xff\xfe\x00\x01")
    with pytest.raises(TraceError):
        load_events([binary])
    cli = subprocess.run(
        [sys.executable, "tools/comm_heatmap.py", "--trace", str(truncated), "--output", str(tmp_path / "x.png")],
        capture_output=True,
        text=True,
    )
    assert cli.returncode == 2 and "truncated" in cli.stderr and not (tmp_path / "x.png").exists()
    assert "Traceback" not in cli.stderr
    for output, message in ((tmp_path / "x.txt", "must be a .png"), (tmp_path / "nowhere" / "x.png", "does not exist")):
        cli = subprocess.run(
            [
                sys.executable,
                "-m",
                "collective_ops.tools.cli",
                "heatmap",
                "--trace",
                str(truncated),
                "--output",
                str(output),
            ],
            capture_output=True,
            text=True,
        )
        assert cli.returncode == 2 and message in cli.stderr and "Traceback" not in cli.stderr, cli.stderr
    assert not (tmp_path / "nowhere").exists()


README_LOOP_SCRIPT = """
import torch, collective_ops as co
ctx = co.init()
model = co.wrap(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2)), bucket_size_mb=0.0001)
for step in range(3):
    model(torch.randn(4, 8)).sum().backward()
"""  # no co.shutdown(): each rank writes its own trace file at exit


def test_the_readme_flow_without_shutdown_reaches_the_heatmap(tmp_path: Path) -> None:
    """COLLECTIVE_OPS_TRACE=1 with the README's launch loop, then `collective-ops heatmap --trace comm_trace.json`."""
    from tests.harness import free_port

    env = {
        **os.environ,
        "WORLD_SIZE": "2",
        "MASTER_PORT": str(free_port()),
        "COLLECTIVE_OPS_TRACE": "1",
        "COLLECTIVE_OPS_TRACE_DIR": str(tmp_path),
        "PYTHONPATH": str(Path(__file__).resolve().parents[1]),
    }
    procs = [
        subprocess.Popen([sys.executable, "-c", README_LOOP_SCRIPT], env={**env, "RANK": str(r), "DEVICE_ID": str(r)})
        for r in range(2)
    ]
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    assert sorted(p.name for p in tmp_path.glob("comm_trace*.json")) == [
        "comm_trace.rank0.json",
        "comm_trace.rank1.json",
    ]
    cli = subprocess.run(
        [sys.executable, "-m", "collective_ops.tools.cli", "heatmap", "--trace", str(tmp_path / "comm_trace.json")]
        + ["--output", str(tmp_path / "heatmap.png")],
        capture_output=True,
        text=True,
    )
    assert cli.returncode == 0, cli.stderr
    assert (tmp_path / "heatmap.png").is_file() and "warning" not in cli.stderr
    # one rank's file alone: a warning names the missing rank
    cli = subprocess.run(
        [
            sys.executable,
            "-m",
            "collective_ops.tools.cli",
            "heatmap",
            "--trace",
            str(tmp_path / "comm_trace.rank0.json"),
        ]
        + ["--output", str(tmp_path / "one.png")],
        capture_output=True,
        text=True,
    )
    assert cli.returncode == 0 and "holds 1 of 2 ranks (missing: [1])" in cli.stderr, cli.stderr


def test_trace_writer_never_follows_a_symlink(tmp_path: Path) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    link = tmp_path / "comm_trace.json"
    os.symlink(victim, link)
    write_trace(link, [{"ph": "M", "pid": 0, "name": "process_name", "args": {"name": "rank 0"}}], 1)
    assert victim.read_text() == "precious"
    assert not link.is_symlink() and json.loads(link.read_text())["traceEvents"][0]["pid"] == 0


@pytest.mark.parametrize("planted", ["file", "symlink"])
def test_a_temporary_name_taken_beforehand_neither_stops_the_trace_nor_is_followed(tmp_path: Path, planted) -> None:
    """The temporary file had a fixed name (``.comm_trace.json.<pid>.tmp``): anyone who made it first made the
    write raise (shutdown() failed, the trace was lost) or, as a symlink, pointed it elsewhere."""
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    taken = tmp_path / f".comm_trace.json.{os.getpid()}.tmp"
    if planted == "file":
        taken.write_text("someone else's")
    else:
        os.symlink(victim, taken)
    target = tmp_path / "comm_trace.json"
    write_trace(target, [{"ph": "M", "pid": 0, "name": "process_name", "args": {"name": "rank 0"}}], 1)
    assert json.loads(target.read_text())["traceEvents"][0]["pid"] == 0
    assert victim.read_text() == "precious"
    assert taken.is_symlink() if planted == "symlink" else taken.read_text() == "someone else's"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([taken.name, "comm_trace.json", "victim.txt"])


def test_analysis_by_hand() -> None:
    # two ranks, one bucket, one step: rank 1 launches 3 ms after rank 0
    def bucket(pid, ts, dur, exposed):
        return {
            "ph": "X",
            "cat": "bucket",
            "pid": pid,
            "ts": ts,
            "dur": dur,
            "args": {"bucket": 0, "step": 0, "bytes": 1024, "exposed_us": exposed},
        }

    analysis = analyze([bucket(0, 1000.0, 5000.0, 1000.0), bucket(1, 4000.0, 2000.0, 0.0)])
    np.testing.assert_allclose(analysis.wait_skew_ms, [[3.0], [0.0]])
    np.testing.assert_allclose(analysis.comm_ms, [[5.0], [2.0]])
    assert analysis.slowest_rank == 1 and analysis.most_exposed_bucket == 0
    assert analysis.hidden_share == pytest.approx(1 - 1.0 / 7.0)


def test_analysis_keeps_the_latest_plan() -> None:
    def bucket(pid, step, index, plan):
        return {
            "ph": "X",
            "cat": "bucket",
            "pid": pid,
            "ts": 0.0,
            "dur": 1000.0,
            "args": {"bucket": index, "step": step, "plan": plan, "bytes": 8},
        }

    # step 0 ran a 3-bucket plan; after the rebuild, steps 1-2 ran a 2-bucket one
    events = [bucket(r, 0, b, "old") for r in (0, 1) for b in range(3)]
    events += [bucket(r, s, b, "new") for r in (0, 1) for s in (1, 2) for b in range(2)]
    analysis = analyze(events)
    assert analysis.buckets == [0, 1] and analysis.steps == [1, 2]
