"""The test harness itself: named checks in one rank group, each failing on its own (tests/harness.run_checks)."""

from __future__ import annotations

import time

import pytest

from tests.harness import run_checks


def _allreduce(value: float) -> float:
    import torch
    import torch.distributed as dist

    tensor = torch.tensor([value])
    dist.all_reduce(tensor)
    return float(tensor)


def _crash_on_rank_one(rank: int) -> float:
    if rank == 1:
        raise ValueError("deliberate failure on rank 1")
    return _allreduce(1.0)  # rank 0 waits in a collective its peer never joins


def _hang_on_rank_one(rank: int) -> float:
    if rank == 1:
        time.sleep(1000)
    return _allreduce(1.0)


def harness_checks(rank: int, world: int) -> dict:
    return {
        "before": lambda: _allreduce(rank + 1.0),
        "crash": lambda: _crash_on_rank_one(rank),
        "after": lambda: _allreduce(rank + 1.0),
        ("pair_rank", "pair_world"): lambda: (rank, world),
        "hang": lambda: _hang_on_rank_one(rank),
        "last": lambda: _allreduce(10.0),
    }


def test_a_crashing_check_fails_alone_and_the_others_keep_their_results() -> None:
    began = time.monotonic()
    results = run_checks(2, harness_checks, timeout=10)
    elapsed = time.monotonic() - began
    for rank, out in enumerate(results):
        assert out["before"] == 3.0 and out["after"] == 3.0 and out["last"] == 20.0
        assert (out["pair_rank"], out["pair_world"]) == (rank, 2)
        # rank 0's read too, with rank 1's traceback: its collective never completed, nor paired with a later one's
        with pytest.raises(AssertionError, match=f"(?s)check 'crash' failed on rank {rank}.*deliberate failure"):
            out["crash"]
        with pytest.raises(AssertionError, match="(?s)check 'hang' failed.*not finished within 10"):
            out["hang"]
    # the hung check costs its timeout (10 s), three group starts seconds each (more on a loaded machine); the
    # crash costs no wait for the collectives' own timeout (60 s): its rank exits, breaking its peer's connection
    assert elapsed < 65, elapsed
