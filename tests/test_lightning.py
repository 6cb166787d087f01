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


def _launch(runs: dict[str, list[str]], torchrun_nodes: int = 0) -> None:
    """One launch of the script fitting each of ``runs`` in turn (name -> ``--fit`` fields), launched by Lightning (or
    by ``torchrun_nodes`` torchrun agents of one process each, as separate nodes)."""
    port = str(free_port())
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MASTER_PORT": port, "OMP_NUM_THREADS": "1"}
    script = [str(SCRIPT)] + [arg for fields in runs.values() for arg in ("--fit", ",".join(fields))]
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
        assert proc.returncode == 0, f"{' '.join(runs)} failed (rc {proc.returncode}):\n{log[-4000:]}"


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[int, dict]]:
    """Every run's per-rank records. Three launches, two at a time (each is two processes on this machine's cores):
    each fits several runs in turn, one of ours first (a fresh process, as users start one), a resumed run after
    the run that saved its checkpoint."""
    base = tmp_path_factory.mktemp("lightning")
    checkpoint, compressed = base / "one_epoch.ckpt", base / "one_epoch_powersgd.ckpt"
    launches = [
        {
            "ours": ["collective_ops", f"save={checkpoint}"],
            "resumed": ["collective_ops", f"resume={checkpoint}"],
            "ddp": ["ddp"],
            "optimizer": ["collective_ops_optimizer"],
        },
        {
            "powersgd": ["collective_ops_powersgd", f"save={compressed}"],
            "powersgd_resumed": ["collective_ops_powersgd", f"resume={compressed}"],
            "sharded": ["collective_ops_sharded"],
        },
    ]
    for launch in launches:  # the --fit fields: strategy, out directory, options
        for name, fields in launch.items():
            fields.insert(1, str(base / name))
    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(_launch, launch) for launch in launches]
        futures.append(pool.submit(_launch, {"two_nodes": ["collective_ops", str(base / "two_nodes")]}, 2))
        for future in futures:
            future.result()
    names = [name for launch in launches for name in launch] + ["two_nodes"]
    out = {name: {r: torch.load(base / name / f"rank{r}.pt") for r in range(2)} for name in names}
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
