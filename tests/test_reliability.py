"""Injected faults on real Gloo ranks: every surviving rank gets a clear error in bounded time, no hang."""

from __future__ import annotations

import gc
import os
import re
import socket
import time
import weakref

import pytest
import torch

import collective_ops as co
from tests.harness import free_port, run_faulty_ranks, run_rank_processes, run_ranks

STALL_ENV = {"COLLECTIVE_OPS_STALL_TIMEOUT": "3"}


PEER_REPORTED_KEY = "tests/rank0_reported"


def _rank0_reported() -> None:
    """Rank 0 has its error: a peer kept alive for it (``_stay_alive_for_rank0``) may go."""
    import torch

    torch.distributed.distributed_c10d._get_default_store().set(PEER_REPORTED_KEY, "1")


def _stay_alive_for_rank0(limit: float = 8) -> None:
    """Stay alive, out of any reduction (as a rank whose caller handles its error, or that finished early),
    until rank 0 has reported what it saw: a peer that exited would turn rank 0's stall into a lost
    connection. At most ``limit`` seconds; a store gone with rank 0 also ends it."""
    import torch

    store = torch.distributed.distributed_c10d._get_default_store()
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        try:
            if store.check([PEER_REPORTED_KEY]):
                return
        except Exception:  # rank 0, the store's host, is gone
            return
        time.sleep(0.1)


def _train(rank: int, steps_by_rank: dict, use_branch_by_rank: dict | None = None, find_unused: bool = False):
    import torch

    import collective_ops as co
    from tests.models import MLP, WithUnusedBranch, rank_batch

    torch.manual_seed(0)
    model = co.wrap(WithUnusedBranch(), bucket_size_mb=0.001, find_unused_parameters=find_unused)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    start = time.monotonic()
    try:
        for step in range(steps_by_rank[rank]):
            x, y = rank_batch(MLP, step, rank)
            use_branch = True if use_branch_by_rank is None else use_branch_by_rank[rank]
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(x, use_branch=use_branch), y).backward()
            optimizer.step()
    except Exception as exc:  # the error this rank reports, and how long it took to come
        seconds = time.monotonic() - start
        store = torch.distributed.distributed_c10d._get_default_store()
        left = [r for r in range(2) if store.check([f"collective_ops/progress/{r}"])]
        if rank == 0:
            _rank0_reported()
        else:
            _stay_alive_for_rank0()  # its peer must still see a stall
        return {"error": f"{type(exc).__name__}: {exc}", "seconds": seconds, "progress_keys_left": left}
    _stay_alive_for_rank0()  # finished early: alive while its peer waits
    return {"error": None}


def skipped_backward(rank: int, world: int) -> dict:
    return _train(rank, {0: 3, 1: 2})


def _skip_at_a_row_sparse_table(rank: int, zero_grad: bool) -> dict:
    """Rank 1 stops a step early. Gradients zeroed: the table's rows come from the lookups; kept: the gradient
    has rows outside them, the lookups are distrusted and the rows come from the gradient (a blocking round)."""
    import torch

    import collective_ops as co
    from tests.models import UntiedLM, rank_batch

    torch.manual_seed(0)
    model = co.wrap(UntiedLM(), bucket_size_mb=0.001)
    start = time.monotonic()
    try:
        for step in range({0: 3, 1: 2}[rank]):
            x, y = rank_batch(UntiedLM, step, rank)
            if zero_grad:
                model.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
    except Exception as exc:
        error = {"error": f"{type(exc).__name__}: {exc}", "seconds": time.monotonic() - start}
        _rank0_reported()
        return {**error, "untrusted": sorted(model.manager.row_sparse.untrusted)}
    _stay_alive_for_rank0()
    return {"error": None}


def skipped_at_looked_up_rows(rank: int, world: int) -> dict:
    return _skip_at_a_row_sparse_table(rank, zero_grad=True)


def skipped_at_gradient_rows(rank: int, world: int) -> dict:
    return _skip_at_a_row_sparse_table(rank, zero_grad=False)


def powersgd_skipped_backward(rank: int, world: int, bucket_size_mb: float = 0.001) -> dict:
    """Rank 1 stops before the first compressed step. On rank 0 the first bucket launched sends its P factors,
    which stall; the next bucket's launch (of one bucket: the end of backward) first launches that bucket's Q
    factors, waiting for its P factors."""
    import torch

    import collective_ops as co
    from tests.models import MLP, rank_batch

    torch.manual_seed(0)
    model = co.wrap(MLP(), bucket_size_mb=bucket_size_mb, compression=co.PowerSGD(rank=1, start_iter=2))
    start = time.monotonic()
    try:
        for step in range({0: 3, 1: 2}[rank]):
            x, y = rank_batch(MLP, step, rank)
            torch.nn.functional.cross_entropy(model(x), y).backward()
    except Exception as exc:
        error = {"error": f"{type(exc).__name__}: {exc}", "seconds": time.monotonic() - start}
        _rank0_reported()
        return {**error, "first_launched": model.manager.launch_order[0], "buckets": len(model.manager.plan.buckets)}
    _stay_alive_for_rank0()
    return {"error": None}


def different_branch(rank: int, world: int) -> dict:
    return _train(rank, {0: 2, 1: 2}, use_branch_by_rank={0: True, 1: False})


def killed_rank(rank: int, world: int) -> dict:
    import torch

    import collective_ops as co
    from tests.models import build

    model = co.wrap(build("mlp"), bucket_size_mb=0.01)
    start = time.monotonic()
    try:
        for step in range(3):
            if rank == 1 and step == 1:
                os._exit(3)  # killed mid-training
            model(torch.randn(4, 16)).sum().backward()
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}", "seconds": time.monotonic() - start}
    return {"error": None}


def _killed_rank_sharded(rank: int, between_steps: bool) -> dict:
    """A 4 MiB bucket: 2 MiB shards, which go point-to-point in 1 MiB pieces on Gloo. Rank 1 dies mid-training
    (its peer's pieces in flight or expected), or ``between_steps``: once every collective of a step ended,
    so that its peer's next sends are refused at once (Gloo knows the peer is gone)."""
    import torch

    import collective_ops as co

    torch.manual_seed(0)
    model = co.wrap(torch.nn.Linear(1024, 1024), bucket_size_mb=25)
    optimizer = co.DistributedOptimizer(model, torch.optim.SGD, lr=0.1, shard=True)
    start = time.monotonic()
    try:
        for step in range(3):
            if rank == 1 and step == 1 and not between_steps:
                os._exit(3)
            optimizer.zero_grad()
            model(torch.randn(4, 1024)).sum().backward()
            optimizer.step()
            if between_steps and step == 0:
                optimizer.synchronize()
                if rank == 1:
                    os._exit(3)
                time.sleep(2)  # the peer's exit reaches this rank's connections
                start = time.monotonic()
        optimizer.synchronize()
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}", "seconds": time.monotonic() - start}
    return {"error": None}


def killed_rank_sharded(rank: int, world: int) -> dict:
    return _killed_rank_sharded(rank, between_steps=False)


def killed_rank_sharded_between_steps(rank: int, world: int) -> dict:
    return _killed_rank_sharded(rank, between_steps=True)


@pytest.mark.parametrize("killed", [killed_rank_sharded, killed_rank_sharded_between_steps])
def test_a_killed_rank_ends_its_peers_sharded_pieces_with_a_clear_error(killed) -> None:
    results = run_faulty_ranks(2, killed, env=STALL_ENV, timeout=60)
    status, out = results[0]
    assert status == "ok" and out["error"], results
    assert out["error"].startswith(("CommunicationError", "StallError")), out["error"]
    # in step()'s reduce-scatter, the next forward's all-gather, or a send refused at its launch
    assert re.search(r"rank 0 waited for (the all-gather of updated parameters of )?bucket \d", out["error"])
    assert out["seconds"] < 3 + 2 + 5
    assert results[1][0] == "missing"


def test_a_rank_that_skips_a_backward_is_named() -> None:
    results = run_faulty_ranks(2, skipped_backward, env=STALL_ENV, timeout=60)
    status, out = results[0]
    assert status == "ok" and out["error"], results
    assert out["progress_keys_left"] == [], "a later stall would read this one's reports"
    assert out["error"].startswith("StallError") and "Ranks not taking part: [1]" in out["error"], out["error"]
    assert "rank 1: did not report" in out["error"]
    assert out["seconds"] < 3 + 2 + 5, "the stall must be reported soon after the configured timeout"


@pytest.mark.parametrize("rows_from", ["lookups", "gradient"])
def test_a_rank_that_skips_a_backward_is_named_at_a_row_sparse_table(rows_from: str) -> None:
    """The table waits for every rank's rows (the lookups exchanged from the step's first gradient, or the
    gradient's own round): a stall there is reported as one, not a hang in backward."""
    body = skipped_at_looked_up_rows if rows_from == "lookups" else skipped_at_gradient_rows
    results = run_faulty_ranks(2, body, env=STALL_ENV, timeout=60)
    status, out = results[0]
    assert status == "ok" and out["error"], results
    assert out["untrusted"] == ([] if rows_from == "lookups" else ["embed.weight"]), out
    assert out["error"].startswith("StallError") and "Ranks not taking part: [1]" in out["error"], out["error"]
    assert "'embed.weight'" in out["error"], out["error"]
    assert out["seconds"] < 3 + 2 + 5, "the stall must be reported soon after the configured timeout"


@pytest.mark.parametrize("bucket_size_mb", [0.001, 25.0], ids=["at-the-next-launch", "at-the-end-of-backward"])
def test_a_stall_found_launching_powersgds_later_stage_names_the_bucket_that_stalled(bucket_size_mb: float) -> None:
    """PowerSGD launches an earlier bucket's Q factors as the next bucket launches, and the last one's at the end
    of backward: a stall there is that earlier bucket's (its P factors never came back), reported as at its wait,
    not as the launching bucket's."""
    results = run_faulty_ranks(2, powersgd_skipped_backward, bucket_size_mb, env=STALL_ENV, timeout=60)
    status, out = results[0]
    assert status == "ok" and out["error"], results
    assert (out["buckets"] > 1) == (bucket_size_mb < 1), "where the stall is found: a later launch, or the end"
    assert out["error"].startswith("StallError") and "Ranks not taking part: [1]" in out["error"], out["error"]
    assert f"rank 0 waited for bucket {out['first_launched']} of step 2 " in out["error"], out["error"]
    assert out["seconds"] < 3 + 2 + 5


def test_a_different_branch_without_find_unused_is_reported_on_every_rank() -> None:
    results = run_faulty_ranks(2, different_branch, env=STALL_ENV, timeout=60)
    (s0, out0), (s1, out1) = results[0], results[1]
    assert s0 == s1 == "ok", results
    # the rank that skipped the branch names the parameters and the fix ...
    assert "'branch.weight'" in out1["error"] and "find_unused_parameters=True" in out1["error"]
    # ... and its peer, left waiting, names that rank instead of hanging
    assert out0["error"].startswith("StallError") and "[1]" in out0["error"], out0["error"]


def test_a_killed_rank_ends_its_peers_with_a_clear_error() -> None:
    results = run_faulty_ranks(2, killed_rank, env=STALL_ENV, timeout=60)
    status, out = results[0]
    assert status == "ok" and out["error"], results
    assert out["error"].startswith(("CommunicationError", "StallError")), out["error"]
    assert "rank 0 waited for bucket" in out["error"]
    assert "(ranks gone or not answering: [1])" in out["error"] or "Ranks not taking part: [1]" in out["error"]
    assert out["seconds"] < 3 + 2 + 5
    assert results[1][0] == "missing"  # it was killed


def nonfinite(rank: int, world: int) -> dict:
    import torch

    import collective_ops as co
    from tests.models import build

    model = co.wrap(build("mlp"), check_finite=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(4, 16)
    if rank == 1:
        x[0, 0] = float("nan")
    model(x).sum().backward()  # judged before the next forward: an optimizer may skip the step
    optimizer.step()  # plain SGD applies the NaN
    try:
        model(x)
        return {"error": None}
    except FloatingPointError as exc:
        return {"error": str(exc)}


def test_nan_gradient_is_named_on_every_rank() -> None:
    results = run_ranks(2, nonfinite)
    for rank, out in enumerate(results):
        assert out["error"] and "non-finite gradients" in out["error"] and "'net.0.weight'" in out["error"]
        assert ("before reduction" in out["error"]) == (rank == 1)


def test_rendezvous_trouble_fails_fast_with_a_hint(monkeypatch) -> None:
    monkeypatch.delenv("MASTER_PORT", raising=False)
    # a rank that never arrives
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"not every rank arrived within 2 s.*WORLD_SIZE=2"):
        co.init("gloo", rank=0, world_size=2, master_port=free_port(), timeout=2)
    assert time.monotonic() - start < 15
    assert not co.is_initialized()
    # the port is taken by someone else
    with socket.socket() as blocker:
        blocker.bind(("127.0.0.1", 0))
        blocker.listen()
        port = blocker.getsockname()[1]
        with pytest.raises(RuntimeError, match=rf"port {port} is already in use"):
            co.init("gloo", rank=0, world_size=1, master_port=port, timeout=5)
    assert not co.is_initialized()


def test_a_rank_whose_rendezvous_port_is_another_programs_fails_in_bounded_time(monkeypatch) -> None:
    """Rank 1 of 2 meets a foreign server at MASTER_PORT: an error naming the address, not a 10-minute hang."""
    monkeypatch.setenv("COLLECTIVE_OPS_RENDEZVOUS_TIMEOUT", "2")
    with socket.socket() as foreign:
        foreign.bind(("127.0.0.1", 0))
        foreign.listen()  # accepts connections, never answers
        port = foreign.getsockname()[1]
        start = time.monotonic()
        with pytest.raises(
            RuntimeError, match=rf"rank 1/2 at tcp://127.0.0.1:{port}.*not every rank arrived within 2 s"
        ):
            co.init("gloo", rank=1, world_size=2, master_port=port)
        assert time.monotonic() - start < 2 + 5 + 5
    assert not co.is_initialized()
    monkeypatch.setenv("COLLECTIVE_OPS_RENDEZVOUS_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="COLLECTIVE_OPS_RENDEZVOUS_TIMEOUT='soon' is not a number"):
        co.init("gloo", rank=0, world_size=1, master_port=free_port())


# Each variable the library reads, with a value it does not take, and what the error says it takes. Before,
# these failed later and elsewhere: a comm hook error at the first backward (a stall timeout of nan/inf), a
# wait with no limit (a negative one), a raw ValueError/OverflowError (rendezvous nan/inf), int()'s own message
# (max events), "not every rank arrived within 120 s" (a port out of range).
BAD_ENVIRONMENT = [
    ("COLLECTIVE_OPS_STALL_TIMEOUT", "nan", "seconds >= 0"),
    ("COLLECTIVE_OPS_STALL_TIMEOUT", "inf", "seconds >= 0"),
    ("COLLECTIVE_OPS_STALL_TIMEOUT", "-1", "seconds >= 0"),
    ("COLLECTIVE_OPS_RENDEZVOUS_TIMEOUT", "nan", "seconds > 0"),
    ("COLLECTIVE_OPS_RENDEZVOUS_TIMEOUT", "inf", "seconds > 0"),
    ("COLLECTIVE_OPS_RENDEZVOUS_TIMEOUT", "0", "seconds > 0"),
    ("COLLECTIVE_OPS_TRACE_MAX_EVENTS", "abc", "whole number of events >= 1"),
    ("COLLECTIVE_OPS_TRACE_MAX_EVENTS", "0", "whole number of events >= 1"),
    ("COLLECTIVE_OPS_TRACE", "maybe", "a switch"),
    ("COLLECTIVE_OPS_CHECK_SHAPES", "yes please", "0 or 1"),
    ("COLLECTIVE_OPS_BACKEND", "mpi2", "a backend"),
    ("MASTER_PORT", "99999", "1..65535"),
    ("MASTER_PORT", "-1", "1..65535"),
    ("WORLD_SIZE", "0", "whole number >= 1"),
]


@pytest.mark.parametrize(("name", "value", "takes"), BAD_ENVIRONMENT)
def test_a_bad_environment_variable_is_named_at_init(monkeypatch, name: str, value: str, takes: str) -> None:
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    monkeypatch.setenv("COLLECTIVE_OPS_TRACE_MAX_EVENTS", "1000")  # (the tracer, if a case turns it on, is small)
    monkeypatch.setenv(name, value)
    try:
        with pytest.raises(ValueError, match=rf"{name}={value!r} is not .*{re.escape(takes)}"):
            co.init("gloo", rank=0, world_size=1, trace=name == "COLLECTIVE_OPS_TRACE_MAX_EVENTS")
    finally:
        monkeypatch.delenv(name)
        co.shutdown()
    assert not co.is_initialized()


def test_no_hooks_or_buffers_outlive_a_deleted_wrapper(monkeypatch) -> None:
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    from tests.models import build

    try:
        model = build("mlp")
        wrapped = co.wrap(model)
        with pytest.raises(ValueError, match="already has a live collective_ops wrapper"):
            co.wrap(model)
        buffers = [weakref.ref(b) for b in wrapped.manager.buffers]
        model(torch.randn(2, 16)).sum().backward()  # through the unwrapped model: hooks fire
        assert all(p.grad is not None for p in model.parameters())
        model.zero_grad(set_to_none=True)  # the gradients were views into the buckets: let them go too
        del wrapped
        gc.collect()
        assert all(ref() is None for ref in buffers), "bucket buffers must be freed with their wrapper"
        assert all(not p._post_accumulate_grad_hooks for p in model.parameters()), "hooks must be removed"
        model.zero_grad()
        model(torch.randn(2, 16)).sum().backward()  # plain autograd again
        rewrapped = co.wrap(model)  # and wrapping again is fine
        assert rewrapped.manager.plan.buckets
    finally:
        co.shutdown()


def mismatched_shapes(rank: int, world: int) -> dict:
    import torch

    import collective_ops as co

    out = {}
    for name, call in {
        "allreduce": lambda: co.allreduce(torch.ones(3 + rank)),
        "allgather": lambda: co.allgather(torch.ones(2, dtype=torch.float32 if rank == 0 else torch.float64)),
    }.items():
        try:
            call()
            out[name] = None
        except ValueError as exc:
            out[name] = str(exc)
    co.allreduce(torch.ones(4))  # matching calls still work afterwards
    return out


def test_mismatched_shapes_across_ranks_are_named_in_debug_mode() -> None:
    for out in run_ranks(2, mismatched_shapes, env={"COLLECTIVE_OPS_CHECK_SHAPES": "1"}):
        assert "rank 0: (3,) float32, rank 1: (4,) float32" in out["allreduce"]
        assert "rank 0: (2,) float32, rank 1: (2,) float64" in out["allgather"]


class _DeadStore:
    def set(self, *args):
        raise RuntimeError("the rendezvous store is gone")

    check = get = delete_key = set


def test_a_stall_is_reported_even_when_the_store_is_dead(monkeypatch) -> None:
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    from collective_ops.bucketing.manager import StallError
    from collective_ops.comm.torch_engine import StoreGoneError

    try:
        co.init("gloo", rank=0, world_size=1)
        engine = co.runtime.get_engine("torch")
        monkeypatch.setattr(torch.distributed.distributed_c10d, "_get_default_store", lambda: _DeadStore())
        with pytest.raises(StoreGoneError, match=r"the rendezvous store, hosted by rank 0, is gone \(RuntimeError"):
            engine.exchange_progress({"step": 0}, grace_s=0.01)
        from tests.models import build

        model = co.wrap(build("mlp"))
        error = model.manager.explain_failure(0, TimeoutError("timed out"))
        assert isinstance(error, StallError) and "stall: rank 0 waited for bucket 0" in str(error)
    finally:
        co.shutdown()


def dies_before_shutdown(rank: int, world: int) -> dict:
    import collective_ops as co

    if rank == 1:
        os._exit(0)  # gone without shutdown()
    time.sleep(1)
    start = time.monotonic()
    try:
        co.shutdown()
        error = None
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    return {"error": error, "seconds": time.monotonic() - start, "initialized_after": co.is_initialized()}


def test_shutdown_with_a_dead_peer_returns_in_bounded_time(tmp_path) -> None:
    env = {**STALL_ENV, "COLLECTIVE_OPS_TRACE": "1", "COLLECTIVE_OPS_TRACE_DIR": str(tmp_path)}
    results = run_faulty_ranks(2, dies_before_shutdown, env=env, timeout=40)
    status, out = results[0]
    assert status == "ok", results
    assert out["error"] and "shutdown() left its process groups" in out["error"], out
    assert out["seconds"] < 3 + 5 and out["initialized_after"] is False


def test_shutdown_leaves_a_process_group_the_user_created(monkeypatch) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        context = co.init()  # adopts the user's group
        assert context.launcher == "user"
        co.shutdown()
        assert dist.is_initialized(), "the user's process group must survive collective_ops.shutdown()"
        assert not co.is_initialized()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


# Ranks as processes of their own (tests/fault_worker.py), stopped or killed with a signal, and every process's
# exit timed: a rank that diagnosed a stall must not sit in Gloo's teardown until the group's 10-minute timeout.
STALL_S = 5


def _fault_ranks(fault: str, fault_rank: int, **extra: str) -> list[dict]:
    port = str(free_port())
    common = {"MASTER_PORT": port, "WORLD_SIZE": "2", "COLLECTIVE_OPS_STALL_TIMEOUT": str(STALL_S)}
    common |= {"COLLECTIVE_OPS_RENDEZVOUS_TIMEOUT": "60", "FAULT": fault, "FAULT_RANK": str(fault_rank), **extra}
    peers = [r for r in range(2) if not (fault in ("stop", "sleep") and r == fault_rank)]  # (it does not exit)
    return run_rank_processes([{**common, "RANK": str(r)} for r in range(2)], timeout=STALL_S + 30 + 60, wait_for=peers)


def test_a_script_ending_after_a_state_dict_stall_on_rank_0_exits_within_seconds() -> None:
    """Rank 0 alone calls the sharded optimizer's state_dict() (a collective), catches its StallError and ends without
    co.shutdown(): its exit left the arrival allreduce behind instead of joining it (a hang: both ranks still
    running after 100 s), and its peer, waiting in a barrier, gets a connection error once it is gone."""
    port = str(free_port())
    common = {"MASTER_PORT": port, "WORLD_SIZE": "2", "COLLECTIVE_OPS_STALL_TIMEOUT": str(STALL_S)}
    common |= {"COLLECTIVE_OPS_RENDEZVOUS_TIMEOUT": "60", "FAULT_SCENARIO": "state_on_rank_0"}
    results = run_rank_processes([{**common, "RANK": str(r)} for r in range(2)], timeout=STALL_S + 60)
    rank0 = results[0]
    assert rank0["error"] and rank0["error"].startswith("StallError"), rank0["output"]
    assert "state_dict()" in rank0["error"], rank0["error"]
    assert rank0["returncode"] == 0, rank0["output"]
    for rank, result in enumerate(results):
        assert result["exited_after"] is not None and result["exited_after"] < STALL_S + 30, (rank, result["output"])


@pytest.mark.parametrize("stopped", [0, 1])
def test_a_stopped_rank_is_named_and_its_peer_exits_within_seconds(stopped: int) -> None:
    """SIGSTOP on one rank mid-training. Stopped rank 0 also stops the rendezvous store it hosts, where the
    peer's stall diagnosis reads the ranks' progress: that read had no limit (a hang, nothing raised in 175 s).
    After the StallError the peer's exit joined Gloo's worker, still inside the allreduce, for 10 minutes."""
    results = _fault_ranks("stop", stopped)
    peer = results[1 - stopped]
    fault_at = results[stopped]["fault_at"]
    assert fault_at is not None, results[stopped]["output"]
    assert peer["error"] and peer["error"].startswith("StallError"), peer["output"]
    assert f"Ranks not taking part: [{stopped}]" in peer["error"], peer["error"]
    if stopped == 0:
        assert "the rendezvous store, hosted by rank 0, did not answer" in peer["error"], peer["error"]
        assert "look at that process" in peer["error"]
    else:
        assert "rank 1: did not report: it is not waiting in a gradient reduction (it stopped" in peer["error"]
    assert peer["exited_after"] is not None, "the rank that reported the stall did not exit"
    assert peer["exited_after"] - fault_at < STALL_S + 30, (peer["exited_after"], fault_at)
    assert peer["returncode"] == 1, peer["output"]  # the StallError's, not a crash in teardown


@pytest.mark.parametrize(
    ("fault", "model", "waited_in"),
    [
        ("sleep", "mlp", "the launch-order plan"),
        ("kill", "mlp", "the launch-order plan"),
        ("sleep", "cnn", "the collectives before a forward (join()'s count, the buffers' broadcast)"),
    ],
)
def test_a_rank_lost_between_steps_is_named_in_bounded_time(fault: str, model: str, waited_in: str) -> None:
    """Rank 0 stalls (in Python: its transport still runs, as in a slow loader or a long evaluation) or is killed
    between steps, before the forward whose start broadcasts BatchNorm's buffers (cnn) and whose end settles the
    DistributedOptimizer's launch order (schedule="auto": rank 0's decision broadcast). Its peer waited there with
    no limit (still silent after 90 s) or raised Gloo's raw 'Connection reset by peer', naming no rank."""
    from collective_ops.bucketing.update.planner import SCHEDULE_AFTER_STEPS

    at = {"FAULT_PHASE": "forward", "FAULT_STEP": str(SCHEDULE_AFTER_STEPS), "FAULT_DELAY_S": "2"}
    results = _fault_ranks(fault, 0, FAULT_MODEL=model, **at)  # (the delay: the last step's reductions land)
    peer, fault_at = results[1], results[0]["fault_at"]
    assert fault_at is not None, results[0]["output"]
    expected = "StallError" if fault == "sleep" else "CommunicationError"
    assert peer["error"] and peer["error"].startswith(expected), peer["output"]
    assert f"rank 1 waited in {waited_in}" in peer["error"], peer["error"]
    assert "[0]" in peer["error"], peer["error"]  # the rank not taking part, or gone
    assert peer["exited_after"] is not None and peer["exited_after"] - fault_at < STALL_S + 30, peer["output"]


@pytest.mark.parametrize("worlds", [(2, 3), (3, 2)])
def test_ranks_started_with_different_world_sizes_are_named_at_the_rendezvous(worlds: tuple[int, int]) -> None:
    """Rank 0 with WORLD_SIZE=2 and rank 1 with 3 (or the other way round): both waited past 180 s before."""
    common = {"MASTER_PORT": str(free_port()), "COLLECTIVE_OPS_RENDEZVOUS_TIMEOUT": "20", "FAULT_SCENARIO": "init"}
    env = [{**common, "RANK": str(r), "WORLD_SIZE": str(worlds[r])} for r in range(2)]
    results = run_rank_processes(env, timeout=20 + 30)
    for out in results:
        assert out["exited_after"] is not None and out["exited_after"] < 20 + 15, out
        assert out["error"] and re.search(r"rank \d was started with WORLD_SIZE=\d, but rank \d with", out["error"])
        assert "WORLD_SIZE=2" in out["error"] and "WORLD_SIZE=3" in out["error"], out["error"]
        assert "start every rank with the same WORLD_SIZE" in out["error"]


def test_a_rank_given_twice_is_named_at_the_rendezvous() -> None:
    common = {"MASTER_PORT": str(free_port()), "COLLECTIVE_OPS_RENDEZVOUS_TIMEOUT": "20", "FAULT_SCENARIO": "init"}
    env = [{**common, "RANK": str(r), "WORLD_SIZE": "3"} for r in (0, 1, 1)]
    results = run_rank_processes(env, timeout=20 + 30)
    for out in results:
        assert out["exited_after"] is not None and out["exited_after"] < 20 + 15, out
        assert out["error"], out["output"]
        assert "two processes were started as rank 1 (of 3)" in out["error"], out["error"]
        assert "distinct RANK in 0..2" in out["error"]


def settings_that_differ(rank: int, world: int) -> dict:
    """DistributedOptimizers built differently on the two ranks, and a model still on the meta device."""
    import torch

    import collective_ops as co
    from tests.models import MLP, build, rank_batch

    def build_optimizer(model, **settings) -> str | None:
        try:
            co.DistributedOptimizer(model, **settings)
        except co.consistency.OptimizerMismatchError as exc:
            return str(exc)
        return None

    model = co.wrap(build("mlp"))
    first, second = list(model.parameters())[:2], list(model.parameters())[2:]
    sgd = torch.optim.SGD
    out = {
        "shard": build_optimizer(model, optimizer_class=sgd, lr=0.1, shard=rank == 1),
        "lr": build_optimizer(model, optimizer_class=sgd, lr=0.1 * (rank + 1)),
        "class": build_optimizer(model, optimizer_class=torch.optim.Adam if rank else sgd, lr=0.1),
        "group": build_optimizer(
            model, optimizer_class=sgd, lr=0.1, params=[{"params": first, "lr": 0.5 + rank}, {"params": second}]
        ),
        "given": build_optimizer(model, optimizer_class=torch.optim.SGD(model.parameters(), lr=0.1, momentum=rank)),
    }
    optimizer = co.DistributedOptimizer(model, sgd, lr=0.1)  # alike: trains
    x, y = rank_batch(MLP, 0, rank)
    torch.nn.functional.cross_entropy(model(x), y).backward()
    optimizer.step()
    optimizer.synchronize()
    with torch.device("meta"):
        on_meta = build("mlp")
    try:
        co.wrap(on_meta)
        out["meta"] = None
    except ValueError as exc:
        out["meta"] = str(exc)
    return out


def test_optimizer_settings_that_differ_across_ranks_are_named() -> None:
    """Before, a different lr or class trained apart silently, and shard=True on one rank blocked it in
    dist.new_group while its peer's StallError blamed it for skipping a backward."""
    for out in run_ranks(2, settings_that_differ, timeout=60):
        for case in ("shard", "lr", "class", "group", "given"):
            assert out[case] and out[case].startswith("the DistributedOptimizer is not built alike"), (case, out)
            assert "rank 0 has" in out[case] and "where rank 1 has" in out[case], out[case]
        assert "optimizer 'shard' (value False) where rank 1 has optimizer 'shard' (value True)" in out["shard"]
        assert "(value 0.1) where rank 1 has optimizer 'lr' (value 0.2)" in out["lr"], out["lr"]
        assert "torch.optim.sgd.SGD" in out["class"] and "torch.optim.adam.Adam" in out["class"], out["class"]
        assert "param group '0' (lr 0.5" in out["group"] and "param group '0' (lr 1.5" in out["group"]
        assert "momentum 0" in out["given"] and "momentum 1" in out["given"], out["given"]
        assert out["meta"] and "parameter 'net.0.weight' is on the meta device" in out["meta"], out["meta"]
        assert "materialise the model first (model.to_empty(device=...)" in out["meta"]
