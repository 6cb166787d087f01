"""Inputs, numpy references and comparisons shared by the torch and MindSpore tests."""

from __future__ import annotations

import numpy as np

OPS = ["sum", "avg", "max", "min", "prod"]
SHAPE = (5, 7)


def rank_input(rank: int, op: str) -> np.ndarray:
    """Small integers (exact in every dtype and under any summation order); 1..2 for prod."""
    rng = np.random.default_rng(1000 + rank)
    low, high = (1, 3) if op == "prod" else (-50, 50)
    return rng.integers(low, high, size=SHAPE).astype(np.float64)


def reference(values: list[np.ndarray], op: str) -> np.ndarray:
    stack = np.stack(values)
    return {"sum": stack.sum(0), "avg": stack.mean(0), "max": stack.max(0), "min": stack.min(0), "prod": stack.prod(0)}[
        op
    ]


def check_allreduce(got: np.ndarray, world: int, dtype: str, op: str) -> None:
    expected = reference([rank_input(r, op) for r in range(world)], op)
    if op == "avg" and dtype in ("float16", "bfloat16"):
        # the mean is rounded once to fp16/bf16: within half a unit in the last place
        tol = {"float16": 2**-10, "bfloat16": 2**-7}[dtype]
        np.testing.assert_allclose(got, expected, rtol=tol, atol=tol, err_msg=f"{dtype} {op}")
    elif op == "avg":
        np.testing.assert_array_equal(got, expected.astype(np.float32), err_msg=f"{dtype} {op}")
    else:
        np.testing.assert_array_equal(got, expected, err_msg=f"{dtype} {op}")


def check_gather_and_scatter(out: dict, rank: int, world: int) -> None:
    """The allgather / reduce_scatter results both primitive workers report, against numpy."""
    expected_gather = np.concatenate([np.arange(6).reshape(2, 3) + 100 * r for r in range(world)])
    np.testing.assert_array_equal(out["allgather"], expected_gather)
    np.testing.assert_array_equal(out["allgather_async"], expected_gather)
    full_sum = sum(np.arange(world * 4) * (r + 1) for r in range(world))
    np.testing.assert_array_equal(out["reduce_scatter"], full_sum[rank * 4 : rank * 4 + 4])


def collect_errors(cases: dict, kinds: tuple = (ValueError, TypeError)) -> dict:
    """Run each bad-input call; its error message (with the type when a custom one), or None if it passed."""
    errors = {}
    for name, call in cases.items():
        try:
            call()
            errors[name] = None
        except kinds as exc:
            errors[name] = f"{type(exc).__name__}: {exc}"
    return errors


def assert_identical(a, b, what: str) -> None:
    """Bit-for-bit equality of two results: dicts of arrays (same keys) or sequences of arrays."""
    if isinstance(a, dict):
        assert a.keys() == b.keys(), what
        for k in a:
            np.testing.assert_array_equal(np.array(a[k]), np.array(b[k]), err_msg=f"{what}: {k}")
    else:
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            np.testing.assert_array_equal(np.array(x), np.array(y), err_msg=f"{what}: #{i}")


def snapshot(model) -> dict:
    """A torch module's state_dict as numpy arrays (copies), for comparing trained models."""
    return {k: v.detach().clone().numpy() for k, v in model.state_dict().items()}


class InTurn:
    """Plain optimizers stepped one after another, as a DDP loop with two of them (Muon + AdamW) does."""

    def __init__(self, optimizers: list) -> None:
        self.optimizers = optimizers

    def zero_grad(self) -> None:
        for optimizer in self.optimizers:
            optimizer.zero_grad()

    def step(self) -> None:
        for optimizer in self.optimizers:
            optimizer.step()


def two_losses_per_step(model, optimizer, model_cls, rank: int, steps: int, losses_first: bool) -> None:
    """Each step: zero_grad(), two micro-batches each backpropagated without no_sync(), then step();
    ``losses_first``: both losses computed before either backward."""
    import torch

    from tests.models import rank_batch

    for step in range(steps):
        optimizer.zero_grad()
        losses = []
        for micro in range(2):
            x, y = rank_batch(model_cls, 2 * step + micro, rank)
            losses.append(torch.nn.functional.cross_entropy(model(x), y))
            if not losses_first:
                losses.pop().backward()
        for loss in losses:
            loss.backward()
        optimizer.step()


def shared_temporary_folder(prefix: str = "collective_ops_test_") -> str:
    """A new folder rank 0 makes, its path given to every rank (one collective): for checkpoints every rank writes."""
    import tempfile

    import torch.distributed as dist

    path = [tempfile.mkdtemp(prefix=prefix) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(path, src=0)
    return path[0]


def remove_shared_folder(path: str) -> None:
    """Once every rank is done with it (a barrier), rank 0 removes a :func:`shared_temporary_folder`."""
    import shutil

    import torch.distributed as dist

    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(path, ignore_errors=True)
