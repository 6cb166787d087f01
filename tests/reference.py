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


def live_storages() -> dict:
    """Every torch storage reachable from a live tensor (gc's objects, autograd's ``.grad``, optimizer state all
    included), by address: {data_ptr: bytes}. Views share their base's storage, counted once at its full size."""
    import gc

    import torch

    gc.collect()
    storages = {}
    for obj in gc.get_objects():
        try:
            if not issubclass(type(obj), torch.Tensor) or obj.is_meta:  # (type(): isinstance reads __class__, which
                continue  # a deprecated module's stand-in warns on)
            tensors = [obj] if obj.grad is None else [obj, obj.grad]
        except Exception:  # a half-built or foreign object gc still lists
            continue
        for tensor in tensors:
            storage = tensor.untyped_storage()
            if storage.data_ptr():
                storages[storage.data_ptr()] = max(storages.get(storage.data_ptr(), 0), storage.nbytes())
    return storages


def live_tensor_bytes(baseline: dict | None = None) -> int:
    """Bytes of every live torch storage (:func:`live_storages`), less those already live in ``baseline`` (a
    :func:`live_storages` taken before the setup measured)."""
    storages = live_storages()
    return sum(size for ptr, size in storages.items() if baseline is None or ptr not in baseline)


class EngineTraffic:
    """The bytes this rank sends and receives through a TorchEngine, by the engine method that moved them (the
    collective kind) and the torch.distributed call under it: ``counts[(kind, call, "sent" | "received")]``.

    The engine module's ``dist`` and its gather / scatter aliases are replaced by counting ones, and the engine's
    methods named in ``KINDS`` note themselves while they run, so an engine method that moves more than it
    should (a reduce-scatter done as an allreduce) shows under its own name. ``allreduce`` counts its tensor's
    bytes as sent and received (what Gloo's algorithm moves depends on the world size). A context manager.
    """

    KINDS = (
        "reduce_scatter_shard",
        "all_gather_shard",
        "allreduce",
        "allreduce_rows",
        "rows_union",
        "broadcast",
        "allgather",
        "reduce_scatter",
        "reduce_floats",
        "allgather_bytes",
        "broadcast_ints",
    )

    def __init__(self, engine) -> None:
        from collections import Counter

        self.engine = engine
        self.counts: Counter = Counter()
        self._kinds: list[str] = []

    def reset(self) -> None:
        self.counts.clear()

    def by_kind(self, direction: str = "sent") -> dict:
        """{kind: bytes} in ``direction``."""
        totals: dict = {}
        for (kind, _call, way), size in self.counts.items():
            if way == direction:
                totals[kind] = totals.get(kind, 0) + size
        return totals

    def _note(self, call: str, sent: int, received: int) -> None:
        kind = self._kinds[-1] if self._kinds else "other"
        self.counts[(kind, call, "sent")] += sent
        self.counts[(kind, call, "received")] += received

    def __enter__(self) -> EngineTraffic:
        from collective_ops.comm import torch_engine as module

        self._module = module
        self._saved = {name: getattr(module, name) for name in ("dist", "_all_gather_single", "_reduce_scatter_single")}
        world, note = self.engine.world_size, self._note
        dist = self._saved["dist"]

        def all_gather(out, tensor, *args, **kwargs):
            note("all_gather", tensor.nbytes * (world - 1), out.nbytes - tensor.nbytes)
            return self._saved["_all_gather_single"](out, tensor, *args, **kwargs)

        def reduce_scatter(out, tensor, *args, **kwargs):
            note("reduce_scatter", tensor.nbytes - out.nbytes, tensor.nbytes - out.nbytes)
            return self._saved["_reduce_scatter_single"](out, tensor, *args, **kwargs)

        class CountingDist:
            def __getattr__(self, name):
                return getattr(dist, name)

            @staticmethod
            def all_reduce(tensor, *args, **kwargs):
                note("all_reduce", tensor.nbytes, tensor.nbytes)
                return dist.all_reduce(tensor, *args, **kwargs)

            @staticmethod
            def broadcast(tensor, *args, **kwargs):
                note("broadcast", tensor.nbytes, tensor.nbytes)
                return dist.broadcast(tensor, *args, **kwargs)

            @staticmethod
            def all_to_all_single(out, tensor, *args, **kwargs):
                note("all_to_all", tensor.nbytes * (world - 1) // world, out.nbytes * (world - 1) // world)
                return dist.all_to_all_single(out, tensor, *args, **kwargs)

            @staticmethod
            def isend(tensor, *args, **kwargs):
                note("send", tensor.nbytes, 0)
                return dist.isend(tensor, *args, **kwargs)

            @staticmethod
            def irecv(tensor, *args, **kwargs):
                note("recv", 0, tensor.nbytes)
                return dist.irecv(tensor, *args, **kwargs)

        module.dist, module._all_gather_single, module._reduce_scatter_single = (
            CountingDist(),
            all_gather,
            reduce_scatter,
        )
        for kind in self.KINDS:
            setattr(self.engine, kind, self._noting(kind, getattr(self.engine, kind)))
        return self

    def _noting(self, kind: str, method):
        def noted(*args, **kwargs):
            self._kinds.append(kind)
            try:
                return method(*args, **kwargs)
            finally:
                self._kinds.pop()

        return noted

    def __exit__(self, *exc) -> None:
        for name, value in self._saved.items():
            setattr(self._module, name, value)
        for kind in self.KINDS:
            self.engine.__dict__.pop(kind, None)
