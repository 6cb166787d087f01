"""Row-sparse embedding gradients (bucketing/row_sparse.py): only the looked-up rows go on the wire,
and training stays bit-equal to torch DDP at 2 ranks. One 2-rank group runs every check."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

from tests.harness import run_ranks
from tests.reference import snapshot

STEPS = 6


def _batches(rank: int, dense: bool = False, disjoint: bool = False, peek: bool = False, padded: bool = False) -> list:
    import torch

    from tests.models import UntiedLM

    out = []
    for step in range(STEPS):
        gen = torch.Generator().manual_seed(100 * step + rank)
        if dense:  # every row looked up: the union is the whole table
            tokens = torch.randperm(UntiedLM.vocab, generator=gen).view(40, 5)
            out.append((tokens, torch.randint(0, 10, (40,), generator=gen)))
        elif disjoint:  # rank 0 looks up rows 0-99 only, rank 1 rows 100-199 only
            out.append(UntiedLM.batch(gen, low=100 * rank, high=100 * rank + 100))
        elif peek:  # PeekingLM: rank 1's batches start with the last token (row 0 read: rank 0's shard), rank 0's never
            tokens, labels = UntiedLM.batch(gen, low=1, high=UntiedLM.vocab - 1)
            tokens[0, 0] = UntiedLM.vocab - 1 if rank == 1 else tokens[0, 0]
            out.append((tokens, labels))
        elif padded:  # PaddedLM: every batch looks up the padding row 0
            tokens, labels = UntiedLM.batch(gen)
            tokens[0, 0] = 0
            out.append((tokens, labels))
        else:
            out.append(UntiedLM.batch(gen))
    return out


def _train(model, optimizer, batches: list, set_to_none: bool = True, accumulate: int = 1) -> None:
    """``accumulate`` micro-batches per step, all but the last under ``no_sync()`` (as with DDP)."""
    import torch

    for start in range(0, len(batches), accumulate):
        optimizer.zero_grad(set_to_none=set_to_none)
        for i, (x, y) in enumerate(batches[start : start + accumulate]):
            last = start + i == min(start + accumulate, len(batches)) - 1
            with contextlib.nullcontext() if last else model.no_sync():
                torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()


def _pair(
    rank: int,
    optimizer: str,
    batches: list,
    distributed_optimizer: bool = False,
    set_to_none: bool = True,
    model: str = "UntiedLM",
    accumulate: int = 1,
    **options,
) -> dict:
    """DDP + the optimizer against wrap (+ the optimizer, or DistributedOptimizer) from the same start."""
    import torch

    import collective_ops as co
    from tests import models

    cls = {"sgd": torch.optim.SGD, "adamw": torch.optim.AdamW}[optimizer]
    settings = {"lr": 0.1, "momentum": 0.9} if optimizer == "sgd" else {"lr": 1e-2, "weight_decay": 0.01}
    torch.manual_seed(0)
    unused = {"find_unused_parameters": options.get("find_unused_parameters", False)}
    ddp = torch.nn.parallel.DistributedDataParallel(getattr(models, model)(), **unused)
    if options.get("compression") == "fp16":  # DDP's own fp16 hook is the reference
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook

        ddp.register_comm_hook(None, fp16_compress_hook)
    _train(ddp, cls(ddp.parameters(), **settings), batches, set_to_none, accumulate)
    torch.manual_seed(0)
    ours = co.wrap(getattr(models, model)(), bucket_size_mb=0.01, first_bucket_mb=0.005, **options)
    if distributed_optimizer:  # True, "auto" (its held launch schedule) or "shard" (reduce-scatters: dense)
        extra = {"schedule": "auto"} if distributed_optimizer == "auto" else {"shard": distributed_optimizer == "shard"}
        opt = co.DistributedOptimizer(ours, cls, **settings, **extra)
    else:
        opt = cls(ours.parameters(), **settings)
    _train(ours, opt, batches, set_to_none, accumulate)
    getattr(opt, "synchronize", lambda: None)()
    sparse = ours.manager.row_sparse
    return {
        "ddp": snapshot(ddp.module),
        "ours": snapshot(ours.module),
        "density": None if sparse is None else dict(sparse.last_density),
        "given_up": None if sparse is None else sparse.given_up("embed.weight"),
        "untrusted": None if sparse is None else sorted(sparse.untrusted),
        "embed_alone": any(b.param_indices == (0,) for b in ours.manager.plan.buckets),
        "bytes_per_step": ours.comm_stats()["bytes_per_step"],
        "dense_bytes": sum(p.numel() * 4 for p in ours.parameters()),
        "wire_shares": ours.manager.wire_shares(),
    }


def row_sparse_checks(rank: int, world: int) -> dict:
    import torch

    import collective_ops as co
    from collective_ops.bucketing import allreduce_hook
    from tests.models import TinyTransformer, UntiedLM

    out = {
        "sgd": _pair(rank, "sgd", _batches(rank)),
        "adamw": _pair(rank, "adamw", _batches(rank)),
        # gradients kept between steps (zero_grad(set_to_none=False)): accumulated in the bucket, scaled by the hook
        "kept_grads": _pair(rank, "sgd", _batches(rank), set_to_none=False),
        "disjoint": _pair(rank, "adamw", _batches(rank, disjoint=True)),
        "distributed_optimizer": _pair(rank, "adamw", _batches(rank), distributed_optimizer=True),
        "fp16": _pair(rank, "sgd", _batches(rank), compression="fp16"),
        "held_schedule": _pair(rank, "sgd", _batches(rank), distributed_optimizer="auto"),
        "sharded": _pair(rank, "adamw", _batches(rank), distributed_optimizer="shard"),
        # a custom comm_hook, or PowerSGD, reduces whole buckets: no row-sparse reduction, no mask group
        "custom_hook": co.wrap(UntiedLM(), comm_hook=lambda ctx: allreduce_hook(ctx)).manager.row_sparse is None,
        "powersgd": co.wrap(UntiedLM(), compression=co.PowerSGD(rank=1, start_iter=2)).manager.row_sparse is None,
        "dense": _pair(rank, "sgd", _batches(rank, dense=True)),
        # a table no rank looked up: an empty union, nothing sent for it
        "unused": _pair(rank, "sgd", _batches(rank), model="UnusedTableLM", find_unused_parameters=True),
        "off": _pair(rank, "sgd", _batches(rank), row_sparse_embeddings=False),
        # the union from the forwards' lookups: the padding row (zero gradient) is in it, and sent
        "padded": _pair(rank, "sgd", _batches(rank, padded=True), model="PaddedLM"),
        # two micro-batches per step, the first under no_sync(): both forwards' rows are in the union
        "accumulated": _pair(rank, "adamw", _batches(rank), accumulate=2),
        # int32 token ids, which nn.Embedding takes as well as int64
        "int32_ids": _pair(rank, "sgd", [(x.int(), y) for x, y in _batches(rank)]),
        # rank 1's gradient has a row no forward looked up: every rank reduces that step densely
        "peeking": _pair(rank, "adamw", _batches(rank, peek=True), model="PeekingLM"),
        "peeking_fp16": _pair(rank, "sgd", _batches(rank, peek=True), model="PeekingLM", compression="fp16"),
        "peeking_sharded": _pair(
            rank, "sgd", _batches(rank, peek=True), distributed_optimizer="shard", model="PeekingLM"
        ),
    }
    out["tied"] = co.wrap(TinyTransformer()).manager.row_sparse is None  # the output layer's gradient is dense
    try:
        co.wrap(torch.nn.Embedding(10, 2), row_sparse_embeddings="yes")
    except ValueError as exc:
        out["bad_option"] = str(exc)
    return out


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_ranks(2, row_sparse_checks, timeout=300)


@pytest.mark.parametrize(
    "case",
    [
        *("sgd", "adamw", "kept_grads", "disjoint", "fp16", "distributed_optimizer", "held_schedule", "sharded"),
        *("dense", "unused", "off", "padded", "int32_ids", "accumulated"),
        *("peeking", "peeking_fp16", "peeking_sharded"),
    ],
)
def test_training_is_bit_equal_to_ddp(results: list[dict], case: str) -> None:
    for rank, out in enumerate(results):
        entry = out[case]
        assert entry["ddp"].keys() == entry["ours"].keys()
        for name, expected in entry["ddp"].items():
            np.testing.assert_array_equal(entry["ours"][name], expected, err_msg=f"{case} rank {rank} {name}")


@pytest.mark.parametrize(
    "case", ["sgd", "adamw", "kept_grads", "disjoint", "fp16", "distributed_optimizer", "held_schedule", "sharded"]
)
def test_only_the_looked_up_rows_are_reduced(results: list[dict], case: str) -> None:
    densities = [out[case]["density"]["embed.weight"] for out in results]
    assert len(set(densities)) == 1, f"ranks disagree on the union: {densities}"
    assert 0 < densities[0] <= 0.5, densities  # ~2 x 20 of 200 rows
    for out in results:
        entry = out[case]
        assert entry["embed_alone"], "the embedding must be a bucket of its own"
        assert entry["wire_shares"] == {0: densities[0]}, "the tuner's simulator sees the share sent"
        itemsize = 2 if case == "fp16" else 4  # what an element costs on the wire
        dense, table = entry["dense_bytes"] * itemsize // 4, 200 * 16 * itemsize
        assert entry["bytes_per_step"] == dense - table + int(table * densities[0])


def test_a_table_no_rank_looked_up_sends_nothing(results: list[dict]) -> None:
    for out in results:
        entry = out["unused"]
        assert entry["density"] == {"embed.weight": 0.0}
        assert entry["bytes_per_step"] == entry["dense_bytes"] - 200 * 16 * 4


def test_a_dense_union_falls_back_and_stops_trying(results: list[dict]) -> None:
    for out in results:
        assert out["dense"]["density"]["embed.weight"] == 1.0
        assert out["dense"]["given_up"] is True


def test_off_tied_and_bad_option(results: list[dict]) -> None:
    for out in results:
        assert out["off"]["density"] is None and out["custom_hook"] is True and out["powersgd"] is True
        assert out["tied"] is True
        assert "row_sparse_embeddings must be True, False or 'auto'" in out["bad_option"]


def test_the_union_is_the_rows_the_forwards_looked_up(results: list[dict]) -> None:
    """Found from the lookups (started with backward), not the gradient: the padding row, zero, is in it."""
    import torch

    last = [_batches(rank, padded=True)[-1][0] for rank in range(2)]
    looked_up = torch.cat([tokens.reshape(-1) for tokens in last]).unique().numel()
    for out in results:
        assert out["padded"]["density"] == {"embed.weight": looked_up / 200}
        for case in ("sgd", "adamw", "fp16", "distributed_optimizer", "sharded", "padded", "int32_ids", "accumulated"):
            assert out[case]["untrusted"] == [], case


@pytest.mark.parametrize("case", ["peeking", "peeking_fp16", "peeking_sharded"])
def test_a_gradient_row_no_forward_looked_up_is_caught_on_every_rank(results: list[dict], case: str) -> None:
    """Rank 1 reads a row outside the module: both ranks reduce that step densely (bit-equal: above), then find
    the rows from the gradient."""
    for out in results:
        assert out[case]["untrusted"] == ["embed.weight"]
        assert 0 < out[case]["density"]["embed.weight"] <= 0.5


def test_a_row_counts_as_sent_when_any_element_is_non_zero_or_nan() -> None:
    import torch

    from collective_ops.comm.torch_engine import _nonzero_rows

    table = torch.zeros(6, 3)
    table[1, 2], table[2, 0], table[3, 1], table[4, 0], table[5, 2] = -1e-30, float("nan"), -float("inf"), -0.0, 5
    rows = _nonzero_rows(table.view(-1), 6, 3)
    assert rows.dtype == torch.bool and rows.tolist() == [False, True, True, True, False, True]
