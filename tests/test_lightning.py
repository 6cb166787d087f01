"""collective_ops.lightning.CollectiveOpsStrategy against Lightning's own DDPStrategy: the same script launched by
Lightning's launcher (and torchrun as two nodes), compared bit for bit: weights, BatchNorm buffers after every
training batch on every rank, logged metrics, with accumulate_grad_batches=2, validation, clipping, a
learning-rate schedule and a checkpoint resumed."""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.harness import free_port
from tests.integrations import optional_package

optional_package("lightning", "lightning")
import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "integrations" / "lightning_train.py"
TIMEOUT_S = 300


def _run(out: Path, *args: str, torchrun_nodes: int = 0) -> dict[int, dict]:
    """The script with ``args``, launched by Lightning (or by ``torchrun_nodes`` torchrun agents of one process
    each, as separate nodes); each rank's record."""
    out.mkdir(parents=True, exist_ok=True)
    port = str(free_port())
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MASTER_PORT": port, "OMP_NUM_THREADS": "1"}
    script = [str(SCRIPT), "--out", str(out), *args]
    if not torchrun_nodes:
        commands = [[sys.executable, *script]]
    else:
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1"]
        where = ["--nnodes", str(torchrun_nodes), "--master-addr", "127.0.0.1", "--master-port", port]
        commands = [[*torchrun, *where, "--node-rank", str(n), *script, "--num-nodes", "2"] for n in range(2)]
    procs = [
        subprocess.Popen(c, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for c in commands
    ]
    logs = [p.communicate(timeout=TIMEOUT_S)[0] for p in procs]
    for proc, log in zip(procs, logs):
        assert proc.returncode == 0, f"{' '.join(args)} failed (rc {proc.returncode}):\n{log[-4000:]}"
    return {r: torch.load(out / f"rank{r}.pt") for r in range(2)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[int, dict]]:
    base = tmp_path_factory.mktemp("lightning")
    checkpoint, compressed = base / "one_epoch.ckpt", base / "one_epoch_powersgd.ckpt"
    with ThreadPoolExecutor(2) as pool:  # two runs at a time: each is two processes on this machine's cores
        futures = {
            "ddp": pool.submit(_run, base / "ddp", "--strategy", "ddp"),
            "ours": pool.submit(
                _run, base / "ours", "--strategy", "collective_ops", "--save-checkpoint", str(checkpoint)
            ),
            "optimizer": pool.submit(_run, base / "optimizer", "--strategy", "collective_ops_optimizer"),
            "sharded": pool.submit(_run, base / "sharded", "--strategy", "collective_ops_sharded"),
            "two_nodes": pool.submit(_run, base / "two_nodes", "--strategy", "collective_ops", torchrun_nodes=2),
        }
        futures["powersgd"] = pool.submit(
            _run, base / "powersgd", "--strategy", "collective_ops_powersgd", "--save-checkpoint", str(compressed)
        )
        futures["ours"].result()  # the checkpoint it saved after the first epoch, resumed for the second
        futures["resumed"] = pool.submit(
            _run, base / "resumed", "--strategy", "collective_ops", "--resume", str(checkpoint)
        )
        futures["powersgd"].result()
        futures["powersgd_resumed"] = pool.submit(
            _run, base / "powersgd_resumed", "--strategy", "collective_ops_powersgd", "--resume", str(compressed)
        )
        out = {name: future.result() for name, future in futures.items()}
    out["saved_after_fit"] = {"ours": Path(f"{checkpoint}.after_fit"), "powersgd": Path(f"{compressed}.after_fit")}
    return out


def _assert_same_run(
    ours: dict[int, dict], ddp: dict[int, dict], what: str, per_batch: bool = True, atol: float = 0.0
) -> None:
    """Bit for bit (``atol`` 0), or within ``atol`` where the arithmetic differs by design."""

    def same(a: torch.Tensor, b: torch.Tensor) -> bool:
        return torch.equal(a, b) if atol == 0 else torch.allclose(a.double(), b.double(), rtol=0, atol=atol)

    for rank in (0, 1):
        mine, theirs = ours[rank], ddp[rank]
        for name, tensor in theirs["state"].items():
            assert same(mine["state"][name], tensor), f"{what}: rank {rank}'s {name} differs from DDPStrategy's"
        for name, value in theirs["metrics"].items():
            assert same(torch.tensor(mine["metrics"][name]), torch.tensor(value)), (
                f"{what}: rank {rank}'s {name} differs"
            )
        if per_batch:
            after = mine["buffers_after_batch"], theirs["buffers_after_batch"]
            differs = [i for i, (a, b) in enumerate(zip(*after)) if not same(a, b)]
            assert not differs, f"{what}: rank {rank}'s BatchNorm buffers differ after batches {differs}"


@pytest.mark.parametrize("name", ["ours", "optimizer", "sharded", "two_nodes"])
def test_strategy_trains_bit_identical_to_ddp_strategy(runs: dict, name: str) -> None:
    _assert_same_run(runs[name], runs["ddp"], name)
    assert runs[name][0]["world_size"] == 2
    assert runs[name][0]["trained_through"].startswith("collective_ops."), "the strategy did not wrap the model"


def test_checkpoint_resumed_equals_the_uninterrupted_run(runs: dict) -> None:
    _assert_same_run(runs["resumed"], runs["ddp"], "resumed from the first epoch's checkpoint", per_batch=False)


def test_a_checkpoint_carries_every_ranks_powersgd_state(runs: dict) -> None:
    """PowerSGD's error feedback differs per rank: rank 0's checkpoint holds every rank's, and each rank resumes
    from its own, continuing as the uninterrupted run (compressed from the third step: the first epoch's last two
    steps leave error-feedback memory)."""
    _assert_same_run(runs["powersgd_resumed"], runs["powersgd"], "resumed with PowerSGD", per_batch=False)
    assert not torch.equal(runs["powersgd"][0]["state"]["net.8.weight"], runs["ours"][0]["state"]["net.8.weight"])
    for name, carries in (("powersgd", True), ("ours", False)):  # saved after fit(), once the strategy unwrapped
        saved = torch.load(runs["saved_after_fit"][name], weights_only=True)
        assert ("collective_ops_compression" in saved) == carries, name
        if carries:
            assert saved["collective_ops_compression"]["world_size"] == 2


def test_teardown_leaves_the_lightning_module_unwrapped(runs: dict) -> None:
    for name in ("ours", "optimizer", "sharded"):
        assert runs[name][0]["model_after"] == "Classifier", name


def test_the_strategy_is_registered_by_name() -> None:
    import lightning as L

    from collective_ops.lightning import CollectiveOpsStrategy

    trainer = L.Trainer(strategy="collective_ops", accelerator="cpu", devices=2, logger=False)
    assert type(trainer.strategy) is CollectiveOpsStrategy
