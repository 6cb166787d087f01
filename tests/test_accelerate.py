"""collective_ops.accelerate against Accelerate's own DDP path: the same loop under torchrun at 2 CPU processes
(accumulate(), clip_grad_norm_, a scheduler, gather_for_metrics, unwrap_model, save_state/load_state), fp32 and
bf16 autocast, bit for bit; and a transformers Trainer (a tiny GPT-2 from a config) through use()."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.integrations import ROOT, optional_package, run_torchrun

optional_package("accelerate", "accelerate")
import torch  # noqa: E402


def _torchrun(script: str, out: Path, *args: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    run_torchrun(ROOT / "tests" / "integrations" / script, "--out", str(out), *args)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[int, dict]]:
    """Every run's per-rank records: three launches, two at a time (each is two processes on this machine's cores),
    each training our route first (a fresh process, as users start one), then Accelerate's own."""
    base = tmp_path_factory.mktemp("accelerate")
    jobs = {precision: ("accelerate_train.py", "--precision", precision) for precision in ("no", "bf16")}
    jobs["trainer"] = ("trainer_train.py",)
    with ThreadPoolExecutor(2) as pool:
        futures = [
            pool.submit(_torchrun, job[0], base / name, *job[1:], "--route", "ours", "ddp")
            for name, job in jobs.items()
        ]
        for future in futures:
            future.result()
    return {
        f"{route}_{name}" if name != "trainer" else f"trainer_{route}": {
            r: torch.load(base / name / route / f"rank{r}.pt") for r in range(2)
        }
        for name in jobs
        for route in ("ours", "ddp")
    }


@pytest.mark.parametrize("precision", ["no", "bf16"])
def test_prepare_trains_bit_identical_to_accelerates_ddp(runs: dict, precision: str) -> None:
    for rank in (0, 1):
        ours, ddp = runs[f"ours_{precision}"][rank], runs[f"ddp_{precision}"][rank]
        assert ours["trained_through"].startswith("collective_ops."), "prepare() did not wrap the model"
        assert torch.equal(ours["losses"], ddp["losses"]), f"rank {rank}: losses differ ({precision})"
        for name, tensor in ddp["state"].items():
            assert torch.equal(ours["state"][name], tensor), f"rank {rank}: {name} differs ({precision})"
        assert ours["metrics"] == ddp["metrics"]
        assert ours["output_dtype"] == ddp["output_dtype"]


def test_bf16_autocast_is_applied(runs: dict) -> None:
    """Accelerate's autocast reaches the wrapped forward: the bf16 run's losses are not the fp32 run's."""
    assert not torch.equal(runs["ours_bf16"][0]["losses"], runs["ours_no"][0]["losses"])


def test_unwrap_save_and_load_state_see_the_model(runs: dict) -> None:
    for rank in (0, 1):
        ours = runs["ours_no"][rank]
        assert ours["unwrapped"] == "Sequential", "unwrap_model returned the wrapper"
        assert ours["saved_model_files"] == runs["ddp_no"][rank]["saved_model_files"] == ["model.safetensors"]
        for name, tensor in ours["state"].items():
            assert torch.equal(ours["restored"][name], tensor), f"load_state did not restore {name}"


def test_transformers_trainer_through_use_equals_its_ddp_run(runs: dict) -> None:
    for rank in (0, 1):
        ours, ddp = runs["trainer_ours"][rank], runs["trainer_ddp"][rank]
        assert ours["trained_through"].startswith("collective_ops."), "the Trainer did not train through the wrapper"
        assert ddp["trained_through"].startswith("torch.")
        assert ours["losses"] == ddp["losses"]
        for name, tensor in ddp["state"].items():
            assert torch.equal(ours["state"][name], tensor), f"rank {rank}: {name} differs from the DDP Trainer's"


def test_save_and_load_state_carry_every_ranks_powersgd_state(tmp_path: Path) -> None:
    """PowerSGD's error feedback differs per rank: save_state() holds every rank's, load_state() gives each its own,
    and the resumed run (new processes, other initial weights) ends as the uninterrupted one, bit for bit."""
    script = ROOT / "tests" / "integrations" / "accelerate_resume.py"
    with ThreadPoolExecutor(2) as pool:
        runs = [
            pool.submit(run_torchrun, script, "--phase", phase, "--out", str(tmp_path)) for phase in ("full", "first")
        ]
        for run in runs:
            run.result()
    run_torchrun(script, "--phase", "resume", "--out", str(tmp_path))
    saved = torch.load(tmp_path / "state" / "custom_checkpoint_0.pkl", weights_only=True)
    assert saved["world_size"] == 2 and saved["ranks"][0]["iteration"] == 4, "PowerSGD's state was not saved"
    for rank in (0, 1):
        full, resumed = (torch.load(tmp_path / f"{phase}_rank{rank}.pt") for phase in ("full", "resume"))
        for name, tensor in full.items():
            assert torch.equal(resumed[name], tensor), f"rank {rank}: {name} differs from the uninterrupted run"


@pytest.mark.parametrize("each_node", [False, True])
def test_the_powersgd_state_is_gathered_onto_the_ranks_that_write_save_states_files(each_node: bool) -> None:
    """Accelerate's save() writes on the main process, or with save_on_each_node on each node's first: the
    compression state goes to rank 0 alone, or to every rank."""
    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration

    from collective_ops.accelerate import _writer_of

    accelerator = Accelerator(cpu=True, project_config=ProjectConfiguration(save_on_each_node=each_node))
    assert _writer_of(accelerator)() == (None if each_node else 0)
