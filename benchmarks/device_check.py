"""The CUDA/NCCL path in one run: equality with DDP and primitives on GPU tensors, bench, tune, ddp_compare.

Run by ``benchmarks/device_check.sh`` on a machine with one CUDA GPU (within 8 minutes);
prints one summary table (markdown) and writes it to ``$OUT/device_check.md`` when ``OUT``
is set. ``--device cpu`` runs the same checks on Gloo/CPU, to try the script where there
is no GPU. Never part of CI.

Checks:
- ``gloo2``: 2 ranks, Gloo with CUDA tensors: wrap == DDP after 3 steps (MLP; MLP given
  ``device_ids`` and host inputs, which both move onto the GPU; channels_last
  CNN, transformer; gradient views keep channels_last), primitives on CUDA tensors vs numpy;
- ``nccl1``: world size 1 on NCCL: the same equality, primitives, ``bench.run_sweep``,
  ``co.tune`` and ``wrap(bucket_size_mb="auto")`` (every bookkeeping collective on the GPU);
- in both: ``DistributedOptimizer`` (its default ``schedule="auto"``, which plans a launch
  order after step 3; ``schedule="plan"``; a held launch order that sends buckets in chunks, each
  an allreduce of a slice of the bucket's device buffer) and ``shard=True`` (reduce-scatter and
  all-gather: NCCL's own in place) against DDP + the same SGD after 6 steps; Muon (hidden matrices)
  + AdamW given to one ``DistributedOptimizer`` against DDP + the two; the sharded state saved through
  torch.distributed.checkpoint (each rank's shards, device tensors) and read back whole;
  ``compression=co.PowerSGD(rank=2)`` against DDP + torch's ``powerSGD_hook`` (reduced gradients to fp32
  rounding, same buckets) and ``DistributedOptimizer`` + it against AdamW + it (bit-identical);
- ``collective-ops bench --backend nccl`` (CLI, #wrong must be 0);
- ``benchmarks/ddp_compare.py --backend nccl --world 1`` (step time and peak memory vs DDP).
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402


def _steps(model, batches, optimizer_name: str = "sgd") -> dict:
    import torch

    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for x, y in batches:
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    module = getattr(model, "module", model)
    return {k: v.detach().cpu().numpy() for k, v in module.state_dict().items()}


def equality_checks(rank: int, device: str) -> dict:
    """wrap vs DDP on ``device`` for three models; the number of tensors that differ (0 is bit-equal)."""
    import torch

    import collective_ops as co
    from tests.models import MODELS, build, rank_batch

    results = {}
    for name, cls in MODELS.items():
        layout = torch.channels_last if name == "cnn" else torch.contiguous_format

        def make(name=name, layout=layout):
            model = build(name).to(device)
            return model.to(memory_format=layout) if name == "cnn" else model

        def batches(name=name, cls=cls, layout=layout):
            out = []
            for step in range(3):
                x, y = rank_batch(cls, step, rank)
                x = x.to(device)
                out.append((x.to(memory_format=layout) if name == "cnn" else x, y.to(device)))
            return out

        ddp = _steps(torch.nn.parallel.DistributedDataParallel(make()), batches())
        wrapped = co.wrap(make(), bucket_size_mb=0.01, first_bucket_mb=0.002)
        ours = _steps(wrapped, batches())
        differ = [k for k in ddp if not np.array_equal(ddp[k], ours[k])]
        layouts_kept = all(
            p.grad.stride() == p.stride() for p in wrapped.module.parameters() if p.grad is not None and p.dim() == 4
        )
        results[name] = {"differ": differ, "layouts_kept": layouts_kept}
    if device != "cpu":  # DDP's device_ids: inputs given on the host are moved onto the model's device, as by DDP
        ids = [torch.device(device).index or 0]
        host_inputs = [(x, y.to(device)) for x, y in (rank_batch(MODELS["mlp"], step, rank) for step in range(3))]
        ddp = _steps(torch.nn.parallel.DistributedDataParallel(build("mlp").to(device), device_ids=ids), host_inputs)
        ours = _steps(co.wrap(build("mlp").to(device), device_ids=ids), host_inputs)
        results["mlp, device_ids, host inputs"] = {
            "differ": [k for k in ddp if not np.array_equal(ddp[k], ours[k])],
            "layouts_kept": True,
        }
    return results


def optimizer_checks(rank: int, device: str) -> dict:
    """DistributedOptimizer, unsharded (default schedule) and sharded, vs DDP + SGD: the tensors that differ."""
    import torch

    from tests.models import TinyTransformer, build, rank_batch

    batches = [tuple(t.to(device) for t in rank_batch(TinyTransformer, step, rank)) for step in range(6)]

    from benchmarks.optimizer_compare import muon_and_adamw
    from tests.reference import InTurn

    ddp = torch.nn.parallel.DistributedDataParallel(build("transformer").to(device))
    references = {"SGD": _trained(ddp, torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9), batches)}
    ddp = torch.nn.parallel.DistributedDataParallel(build("transformer").to(device))
    references["Muon + AdamW"] = _trained(ddp, InTurn(muon_and_adamw(ddp)), batches)
    out = {}
    cases = (
        ("DistributedOptimizer", {}),  # schedule="auto": a launch order planned after step 3
        ("DistributedOptimizer(schedule='plan')", {"schedule": "plan"}),
        ("DistributedOptimizer, chunked held order", {"schedule": "plan"}),
        ("DistributedOptimizer(shard=True)", {"shard": True}),
        ("DistributedOptimizer([Muon, AdamW])", {}),  # two classes given as optimizers
    )
    for label, options in cases:
        try:
            out[label] = _optimizer_case(rank, device, label, options, batches, references)
        except Exception:  # one case's crash: the others still report (a rank out of step fails theirs too)
            out[label] = _crashed(rank, label)
    return out


def _trained(model, optimizer, batches: list) -> dict:
    """``model``'s weights (numpy) after a step on each batch, the optimizer's owed work finished."""
    import torch

    for x, y in batches:
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    if hasattr(optimizer, "synchronize"):
        optimizer.synchronize()
    return {k: v.detach().cpu().numpy() for k, v in model.module.state_dict().items()}


def _crashed(rank: int, what: str) -> dict:
    """The exception being handled, as a check's result, and on stderr in full."""
    print(f"device_check rank {rank}: {what} failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
    return {"crash": traceback.format_exc(limit=6)}


def _optimizer_case(rank: int, device: str, label: str, options: dict, batches: list, references: dict) -> dict:
    import torch

    import collective_ops as co
    from benchmarks.optimizer_compare import muon_and_adamw
    from tests.models import build

    wrap_options = {"rebuild_buckets": False} if "chunked" in label else {}
    wrapped = co.wrap(build("transformer").to(device), bucket_size_mb=0.004, first_bucket_mb=0.001, **wrap_options)
    muon = "Muon" in label
    if muon:
        optimizer = co.DistributedOptimizer(wrapped, muon_and_adamw(wrapped))
    else:
        optimizer = co.DistributedOptimizer(wrapped, torch.optim.SGD, lr=0.05, momentum=0.9, **options)
    reference = references["Muon + AdamW" if muon else "SGD"]
    if "chunked" in label:
        _hold_in_chunks(wrapped.manager)
    ours = _trained(wrapped, optimizer, batches)
    differ = [k for k in reference if not np.array_equal(reference[k], ours[k])]
    if options.get("shard"):
        differ += _consolidation_faults(optimizer, rank) + _dcp_faults(wrapped, optimizer)
    return {
        "reference": "Muon + AdamW" if muon else "SGD",
        "differ": differ,
        "order": "planned"
        if getattr(optimizer, "schedule_report", None)
        else ("chunked" if len(wrapped.manager.launch_order) > len(wrapped.manager.plan.buckets) else "plan order"),
    }


def powersgd_checks(rank: int, device: str) -> dict:
    """compression=co.PowerSGD on ``device`` tensors: each step's reduced gradients against DDP + torch's
    powerSGD_hook (rank 2, same buckets; the largest difference relative to each gradient's largest entry), and
    DistributedOptimizer + the compression against a plain optimizer + it (the tensors that differ)."""
    import torch
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_powersgd

    import collective_ops as co
    from tests.models import MLP, build, rank_batch
    from tests.test_powersgd import DDP_CAP_MB, OUR_CAP_MB, SEED, START, _serial

    batches = [tuple(t.to(device) for t in rank_batch(MLP, step, rank)) for step in range(6)]

    def compressed():
        compression = co.PowerSGD(rank=2, start_iter=START, random_seed=SEED)
        return co.wrap(
            build("mlp").to(device), bucket_size_mb=OUR_CAP_MB, first_bucket_mb=OUR_CAP_MB, compression=compression
        )

    def reduced(model) -> list:
        grads = []
        for x, y in batches:
            model.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            grads.append([p.grad.detach().double().cpu() for p in model.parameters()])
            with torch.no_grad():
                for p in model.parameters():
                    p -= 0.1 * p.grad
        return grads

    ddp = torch.nn.parallel.DistributedDataParallel(build("mlp").to(device), bucket_cap_mb=DDP_CAP_MB)
    state = torch_powersgd.PowerSGDState(None, matrix_approximation_rank=2, start_powerSGD_iter=START, random_seed=SEED)
    ddp.register_comm_hook(state, _serial(torch_powersgd.powerSGD_hook))
    worst = max(
        float((a - b).abs().max() / a.abs().max().clamp_min(1e-30))
        for theirs, ours in zip(reduced(ddp), reduced(compressed()), strict=True)
        for a, b in zip(theirs, ours, strict=True)
    )

    plain = compressed()
    reference = _trained(plain, torch.optim.AdamW(plain.parameters(), lr=1e-2), batches)
    distributed = compressed()
    ours = _trained(distributed, co.DistributedOptimizer(distributed, torch.optim.AdamW, lr=1e-2), batches)
    return {
        "hook_max_rel": worst,
        "optimizer_differ": [k for k in reference if not np.array_equal(reference[k], ours[k])],
    }


def _consolidation_faults(optimizer, rank: int) -> list[str]:
    """consolidate_state_dict(to=0): rank 0's state is the one state_dict() gives every rank, in host memory."""
    import torch

    everywhere = optimizer.state_dict()
    optimizer.consolidate_state_dict(to=0)
    if rank != 0:
        return []
    consolidated = optimizer.state_dict()
    faults = []
    for index, entry in everywhere["state"].items():
        for key, value in entry.items():
            mine = consolidated["state"][index][key]
            if isinstance(value, torch.Tensor) and mine.device.type != "cpu":
                faults.append(f"consolidated {index}/{key} on {mine.device}")
            elif isinstance(value, torch.Tensor) and not torch.equal(mine, value.cpu()):
                faults.append(f"consolidated {index}/{key}")
    return faults


def _dcp_faults(model, optimizer) -> list[str]:
    """torch.distributed.checkpoint: the sharded state dict (each rank's shards, device tensors) saved with
    dcp.save and read back into the full state dict's tensors equals the full state."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    from tests.reference import remove_shared_folder, shared_temporary_folder

    path = shared_temporary_folder("collective_ops_device_check_")
    dcp.save({"optim": get_optimizer_state_dict(model, optimizer)}, checkpoint_id=path)
    full = get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True))
    read = {name: {k: torch.zeros_like(v) for k, v in entry.items()} for name, entry in full["state"].items()}
    dcp.load({"optim": {"state": read, "param_groups": full["param_groups"]}}, checkpoint_id=path)
    remove_shared_folder(path)
    return [
        f"DCP {name}/{key}"
        for name, entry in full["state"].items()
        for key, value in entry.items()
        if not torch.equal(read[name][key], value)
    ]


def _hold_in_chunks(manager) -> None:
    """Every chunkable bucket in 3 chunks; the first 4 and the last 4 chunks held for the end of backward."""
    from collective_ops.bucketing.update.schedule import held_order_in_chunks

    chunks = [3 if manager.chunkable(b) else 1 for b in range(len(manager.plan.buckets))]
    manager.set_launch_order(held_order_in_chunks(chunks, sum(chunks) - 4, 4))


def primitive_checks(rank: int, world: int, device: str) -> dict:
    """Each primitive on ``device`` tensors against numpy; the names of those that are wrong or fail."""
    import torch

    import collective_ops as co

    base = np.arange(6, dtype=np.float32).reshape(2, 3)
    wrong = []

    def check(name: str, fn, expected) -> None:
        try:
            got = fn()
            if not np.array_equal(got.cpu().numpy(), expected):
                wrong.append(name)
        except Exception as exc:
            wrong.append(f"{name}: {type(exc).__name__}: {exc}")

    def local(r: int) -> np.ndarray:
        return base + r

    everyone = [local(r) for r in range(world)]
    check("allreduce sum", lambda: co.allreduce(torch.tensor(local(rank), device=device)), sum(everyone))
    check(
        "allreduce avg", lambda: co.allreduce(torch.tensor(local(rank), device=device), op="avg"), sum(everyone) / world
    )
    check("allreduce max", lambda: co.allreduce(torch.tensor(local(rank), device=device), op="max"), local(world - 1))
    check(
        "allreduce async",
        lambda: co.allreduce(torch.tensor(local(rank), device=device), async_op=True).wait(),
        sum(everyone),
    )
    check("allgather", lambda: co.allgather(torch.tensor(local(rank), device=device)), np.concatenate(everyone))
    check("broadcast", lambda: co.broadcast(torch.tensor(local(rank), device=device), src=0), local(0))
    full = np.arange(world * 4, dtype=np.float32)
    check(
        "reduce_scatter",
        lambda: co.reduce_scatter(torch.tensor(full * (rank + 1), device=device)),
        (full * sum(range(1, world + 1)))[rank * 4 : rank * 4 + 4],
    )
    bucket = co.GradientBucket(bucket_size_mb=25)
    tensors = [torch.tensor(local(rank), device=device) for _ in range(3)]
    for t in tensors:
        bucket.add(t)
    check("GradientBucket", lambda: (bucket.allreduce(), tensors[2])[1], sum(everyone))
    return {"wrong": wrong}


def accelerator_paths(device: str) -> dict:
    """bench, tune and bucket_size_mb='auto' under the live group: every bookkeeping collective on its device."""
    import torch

    import collective_ops as co
    from collective_ops.tools.bench import run_sweep
    from tests.models import MLP, build, rank_batch

    out = {}
    rows = run_sweep("allreduce", [1 << 10, 1 << 20], iters=4, warmup=1, rounds=2, progress=False)
    out["bench_wrong"] = sum(r.wrong for r in rows)
    x, y = (t.to(device) for t in rank_batch(MLP, 0, 0))
    model = co.wrap(build("mlp").to(device))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

    def step() -> None:
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()

    out["tune_mb"] = co.tune(model, step, confirm_steps=1, profile_steps=1).bucket_size_mb
    auto = co.wrap(build("mlp").to(device), bucket_size_mb="auto")
    for _ in range(3):
        torch.nn.functional.cross_entropy(auto(x), y).backward()
    out["auto_mb"] = auto.manager.plan.bucket_size_mb
    return out


def _guarded(out: dict, key: str, fn, rank: int) -> None:
    started = time.monotonic()
    try:
        out[key] = fn()
    except Exception:
        out[key] = _crashed(rank, key)
    print(f"device_check rank {rank}: {key} in {time.monotonic() - started:.1f} s", file=sys.stderr, flush=True)


def rank_main(rank: int, world: int, port: int, backend: str, device: str, group_timeout: float, queue) -> None:
    import torch

    import collective_ops as co

    torch.set_num_threads(1)
    # a rank still running when its group's time is nearly up prints where each of its threads is
    faulthandler.dump_traceback_later(max(group_timeout - 15, group_timeout / 2))
    co.init(backend, rank=rank, world_size=world, master_port=port)
    out: dict = {}
    _guarded(out, "equality", lambda: equality_checks(rank, device), rank)
    _guarded(out, "primitives", lambda: primitive_checks(rank, world, device), rank)
    _guarded(out, "optimizers", lambda: optimizer_checks(rank, device), rank)
    _guarded(out, "powersgd", lambda: powersgd_checks(rank, device), rank)
    if backend != "gloo" or device == "cpu":
        _guarded(out, "paths", lambda: accelerator_paths(device), rank)
    faulthandler.cancel_dump_traceback_later()
    co.barrier()
    co.shutdown()
    if rank == 0:
        queue.put(out)


def _group_rows(label: str, out: dict) -> list[tuple[str, str, str]]:
    rows = []
    equality = out["equality"]
    if "crash" in equality:
        rows.append((f"{label}: wrap == DDP", "FAIL", equality["crash"].strip().splitlines()[-1]))
    else:
        for name, r in equality.items():
            ok = not r["differ"] and r["layouts_kept"]
            detail = "bit-identical after 3 steps" if not r["differ"] else f"differ: {r['differ'][:4]}"
            detail += "; grad views keep channels_last" if name == "cnn" and r["layouts_kept"] else ""
            rows.append((f"{label}: wrap == DDP ({name})", "ok" if ok else "FAIL", detail))
    prims = out["primitives"]
    wrong = prims.get("wrong", [prims.get("crash", "")])
    rows.append((f"{label}: primitives vs numpy", "ok" if not wrong else "FAIL", "; ".join(wrong)[:200] or "8 checks"))
    optimizers = out["optimizers"]
    if "crash" in optimizers:
        rows.append(
            (f"{label}: DistributedOptimizer == DDP + SGD", "FAIL", optimizers["crash"].strip().splitlines()[-1])
        )
    else:
        for name, r in optimizers.items():
            if "crash" in r:
                rows.append((f"{label}: {name}", "FAIL", r["crash"].strip().splitlines()[-1]))
                continue
            detail = "bit-identical after 6 steps" if not r["differ"] else f"differ: {r['differ'][:4]}"
            if "shard" in name:
                detail += "; consolidate_state_dict(to=0): the state, on the host; DCP's sharded save read back whole"
            row = f"{label}: {name} == DDP + {r['reference']}"
            rows.append((row, "FAIL" if r["differ"] else "ok", f"{detail} ({r['order']})"))
    rows += _powersgd_rows(label, out["powersgd"])
    if "paths" in out:
        paths = out["paths"]
        if "crash" in paths:
            rows.append((f"{label}: bench, tune, auto", "FAIL", paths["crash"].strip().splitlines()[-1]))
        else:
            ok = paths["bench_wrong"] == 0
            detail = f"bench #wrong {paths['bench_wrong']}; tune -> {paths['tune_mb']:g} MiB; auto -> {paths['auto_mb']:g} MiB"
            rows.append((f"{label}: bench, tune, auto", "ok" if ok else "FAIL", detail))
    return rows


def _powersgd_rows(label: str, out: dict) -> list[tuple[str, str, str]]:
    from tests.test_powersgd import FP32_AGREEMENT

    if "crash" in out:
        return [(f"{label}: PowerSGD", "FAIL", out["crash"].strip().splitlines()[-1])]
    worst = out["hook_max_rel"]
    hook = f"largest difference {worst:.2g} of each gradient's largest entry (tests allow {FP32_AGREEMENT:g}), 6 steps"
    differ = out["optimizer_differ"]
    optimizer = "bit-identical after 6 steps" if not differ else f"differ: {differ[:4]}"
    return [
        (
            f"{label}: wrap(compression=PowerSGD(rank=2)) vs DDP + powerSGD_hook",
            "ok" if worst <= FP32_AGREEMENT else "FAIL",
            hook,
        ),
        (f"{label}: DistributedOptimizer + PowerSGD == AdamW + PowerSGD", "FAIL" if differ else "ok", optimizer),
    ]


def _run(cmd: list[str], timeout: float) -> tuple[int, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        return proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired:
        return 124, f"timed out after {timeout:g} s"


def cli_bench_row(backend: str, device: str) -> tuple[str, str, str]:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "bench.json"
        cmd = [sys.executable, "-m", "collective_ops.tools.cli", "bench", "--backend", backend, "-b", "8", "-e", "64M"]
        code, log = _run([*cmd, "-f", "8", "-n", "20", "--json", str(path)], 180)
        if code != 0 or not path.exists():
            return (f"collective-ops bench --backend {backend}", "FAIL", log.strip().splitlines()[-1] if log else "")
        rows = json.loads(path.read_text())
        rows = rows["rows"] if isinstance(rows, dict) else rows
        wrong = sum(r["wrong"] for r in rows)
        big = [r for r in rows if r["impl"] == "collective_ops"][-1]
        detail = f"#wrong {wrong}; {big['bytes'] / 2**20:.0f} MiB: {big['time_us']:.0f} us, algbw {big['algbw_gbs']:.1f} GB/s"
        return (f"collective-ops bench --backend {backend} ({device})", "ok" if wrong == 0 else "FAIL", detail)


def ddp_compare_rows(backend: str) -> list[tuple[str, str, str]]:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "ddp.json"
        cmd = [sys.executable, "benchmarks/ddp_compare.py", "--backend", backend, "--world", "1"]
        code, log = _run([*cmd, "--models", "transformer", "cnn", "--steps", "30", "--json", str(path)], 300)
        if code != 0 or not path.exists():
            return [(f"ddp_compare --backend {backend}", "FAIL", log.strip().splitlines()[-1] if log else "")]
        results = json.loads(path.read_text())["results"]
        rows = []
        for name, r in results.items():
            ddp, ours = r["ddp"], r["collective_ops"]
            detail = (
                f"step {ours['median_step_ms']:.1f} vs DDP {ddp['median_step_ms']:.1f} ms "
                f"({ours['median_step_ms'] / ddp['median_step_ms']:.3f}x); peak memory growth "
                f"{ours.get('growth_over_unwrapped_mb', float('nan')):.0f} vs {ddp.get('growth_over_unwrapped_mb', float('nan')):.0f} MB"
            )
            rows.append((f"ddp_compare {name} (world 1, {backend})", "measured", detail))
        return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu: try the script without a GPU")
    parser.add_argument(
        "--groups", choices=["all", "gloo2"], default="all", help="gloo2: only the 2-rank Gloo group's checks"
    )
    parser.add_argument("--group-timeout", type=float, default=240, help="seconds each group of ranks may run")
    args = parser.parse_args(argv)
    from benchmarks.common import spawn

    device = "cuda:0" if args.device == "cuda" else "cpu"
    single_backend = "nccl" if args.device == "cuda" else "gloo"
    started = time.monotonic()
    rows: list[tuple[str, str, str]] = []
    import torch

    header = f"torch {torch.__version__}"
    if args.device == "cuda":
        header += f", CUDA {torch.version.cuda}, NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}"
        header += f", {torch.cuda.get_device_name(0)}"
    groups = [("gloo, 2 ranks", "gloo", 2)]
    if args.groups == "all":
        groups.append((f"{single_backend}, world 1", single_backend, 1))
    for label, backend, world in groups:
        try:
            rows += _group_rows(
                label, spawn(rank_main, world, backend, device, args.group_timeout, timeout=args.group_timeout)
            )
        except Exception as exc:
            rows.append((label, "FAIL", f"{type(exc).__name__}: {exc}"[:200]))
    if args.groups == "all":
        rows.append(cli_bench_row(single_backend, args.device))
        rows += ddp_compare_rows(single_backend)
    lines = [
        f"# device_check: {header}; {time.monotonic() - started:.0f} s",
        "",
        "| check | result | detail |",
        "| --- | --- | --- |",
        *[f"| {check} | {result} | {detail} |" for check, result, detail in rows],
    ]
    table = "\n".join(lines)
    print(table)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "device_check.md").write_text(table + "\n")
    return 1 if any(result == "FAIL" for _, result, _ in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
