"""The cost model and schedule simulator by hand; the tuner and bucket_size_mb='auto' on real Gloo ranks."""

from __future__ import annotations

import subprocess
import sys

import pytest

from collective_ops.bucketing import ParamSpec, plan_buckets
from collective_ops.bucketing.cost import (
    CANDIDATES_MB,
    BackwardProfile,
    CostModel,
    Prediction,
    choose,
    predict,
    simulate,
)
from collective_ops.comm.measure import estimated_contention
from tests.harness import run_ranks

MIB = 2**20


def specs(n: int, mib_each: float = 1.0) -> list[ParamSpec]:
    return [ParamSpec(f"p{i}", int(mib_each * MIB) // 4, "float32", "cpu", 4) for i in range(n)]


def test_one_bucket() -> None:
    plan = plan_buckets(specs(2), bucket_size_mb=100, first_bucket_mb=100)
    profile = BackwardProfile({0: 2.0, 1: 1.0}, backward_end_s=2.0, step_compute_s=3.0)
    p = simulate(plan, profile, CostModel(0.1, 0.0))
    assert p.collectives == 1 and p.finishes_s == pytest.approx((2.1,))
    assert p.exposed_comm_s == pytest.approx(0.1) and p.step_s == pytest.approx(3.1)


def test_all_buckets_ready_at_once() -> None:
    plan = plan_buckets(specs(3), bucket_size_mb=1, first_bucket_mb=1)  # one 1 MiB parameter per bucket
    profile = BackwardProfile({0: 1.0, 1: 1.0, 2: 1.0}, 1.0, 1.5)
    cost = CostModel(0.01, 0.02 / MIB)  # 0.03 s per 1 MiB bucket
    p = simulate(plan, profile, cost)
    assert p.finishes_s == pytest.approx((1.03, 1.06, 1.09))
    assert p.exposed_comm_s == pytest.approx(0.09) and p.comm_s == pytest.approx(0.09)


def test_compute_bound_hides_everything() -> None:
    plan = plan_buckets(specs(3), 1, 1)  # buckets in ready order: p2, p1, p0
    profile = BackwardProfile({2: 0.1, 1: 0.5, 0: 0.9}, 1.0, 2.0)
    p = simulate(plan, profile, CostModel(0.05, 0.0))
    assert p.finishes_s == pytest.approx((0.15, 0.55, 0.95))
    assert p.exposed_comm_s == 0.0 and p.step_s == pytest.approx(2.0)


def test_communication_bound_queues() -> None:
    plan = plan_buckets(specs(3), 1, 1)
    profile = BackwardProfile({2: 0.1, 1: 0.2, 0: 0.3}, 0.3, 1.0)
    p = simulate(plan, profile, CostModel(1.0, 0.0))
    assert p.finishes_s == pytest.approx((1.1, 2.1, 3.1))
    assert p.exposed_comm_s == pytest.approx(2.8)


def test_a_row_sparse_table_costs_the_share_of_its_bytes_it_sends() -> None:
    table = ParamSpec("embed", MIB // 4, "float32", "cpu", 4, rows=1024)  # 1 MiB, a bucket of its own
    plan = plan_buckets([table, *specs(1)], bucket_size_mb=100, first_bucket_mb=100)
    cost = CostModel(0.0, 1.0 / MIB)  # 1 s per MiB
    dense = simulate(plan, BackwardProfile({0: 1.0, 1: 1.0}, 1.0, 1.0), cost)
    sparse = simulate(plan, BackwardProfile({0: 1.0, 1: 1.0}, 1.0, 1.0, wire_share={0: 0.25}), cost)
    assert dense.comm_s == pytest.approx(2.0) and sparse.comm_s == pytest.approx(1.25)


def test_a_compressing_hook_costs_its_wire_element_size() -> None:
    """fp16 compression of fp32 buckets sends half their bytes (a row-sparse table: half its share); of a bf16
    model, all of them (the simulator once took every compressed bucket at half its bytes)."""
    table = ParamSpec("embed", MIB // 4, "float32", "cpu", 4, rows=1024)
    plan = plan_buckets([table, *specs(1)], bucket_size_mb=100, first_bucket_mb=100)
    cost = CostModel(0.0, 1.0 / MIB)  # 1 s per MiB
    compressed = simulate(plan, BackwardProfile({0: 1.0, 1: 1.0}, 1.0, 1.0, {0: 0.25}, wire_itemsize=2), cost)
    assert compressed.comm_s == pytest.approx(0.125 + 0.5)
    bf16 = plan_buckets([ParamSpec("w", MIB // 2, "bfloat16", "cpu", 2)], bucket_size_mb=100, first_bucket_mb=100)
    assert simulate(bf16, BackwardProfile({0: 1.0}, 1.0, 1.0, wire_itemsize=2), cost).comm_s == pytest.approx(1.0)


def test_a_saved_profile_keeps_the_row_sparse_tables_and_their_share(tmp_path) -> None:
    from types import SimpleNamespace

    from collective_ops.tools.tune import load_profile, save_profile

    params = [ParamSpec("embed", MIB // 4, "float32", "cpu", 4, rows=1024), *specs(2)]
    plan = plan_buckets(params, bucket_size_mb=100, first_bucket_mb=100)
    manager = SimpleNamespace(plan=plan, engine=SimpleNamespace(rank=0, world_size=2))
    profile = BackwardProfile({0: 1.0, 1: 0.5, 2: 0.2}, 1.0, 2.0, wire_share={0: 0.25}, wire_itemsize=2)
    save_profile(SimpleNamespace(manager=manager), lambda: None, str(tmp_path / "p.json"), profile=profile)
    saved = load_profile(str(tmp_path / "p.json"))
    assert saved.specs == params and saved.profile == profile  # collective-ops tune plans and charges the same


def test_a_queued_collective_pays_only_the_queued_latency() -> None:
    # all three ready at once: the first pays alpha, the two launched behind it alpha_queued
    plan = plan_buckets(specs(3), bucket_size_mb=1, first_bucket_mb=1)
    profile = BackwardProfile({0: 1.0, 1: 1.0, 2: 1.0}, 1.0, 1.5)
    p = simulate(plan, profile, CostModel(0.01, 0.02 / MIB, alpha_queued=0.0))
    assert p.finishes_s == pytest.approx((1.03, 1.05, 1.07))
    # a bucket that finds the channel idle pays the whole alpha again
    spread = BackwardProfile({2: 0.1, 1: 0.5, 0: 0.9}, 1.0, 2.0)
    assert simulate(plan, spread, CostModel(0.05, 0.0, alpha_queued=0.0)).finishes_s == pytest.approx(
        (0.15, 0.55, 0.95)
    )
    with pytest.raises(ValueError, match="alpha_queued"):
        CostModel(0.01, 0.0, alpha_queued=-1.0)


def test_a_link_is_derived_back_from_its_two_rank_fit() -> None:
    from collective_ops.bucketing.cost import link_from_fit

    fitted = CostModel(1.6e-3, 8e-9)  # 1.6 ms, 125 MB/s: an emulated 1gbit link at 2 ranks
    latency, bandwidth = link_from_fit(fitted, 2)
    assert latency == pytest.approx(0.8e-3) and bandwidth == pytest.approx(125e6)
    ring = CostModel.ring(2, latency, bandwidth)
    assert (ring.alpha, ring.beta) == pytest.approx((fitted.alpha, fitted.beta))
    at_8 = CostModel.ring(8, latency, bandwidth)
    assert at_8.alpha == pytest.approx(14 * 0.8e-3) and at_8.beta == pytest.approx(2 * 7 / 8 / 125e6)
    with pytest.raises(ValueError, match="2 or more ranks"):
        link_from_fit(fitted, 1)


def test_contention_charges_overlapped_communication() -> None:
    # the compute-bound schedule above: 0.15 s of communication, all of it during backward
    plan = plan_buckets(specs(3), 1, 1)
    profile = BackwardProfile({2: 0.1, 1: 0.5, 0: 0.9}, 1.0, 2.0)
    for contention, step in ((0.0, 2.0), (0.5, 2.075), (1.0, 2.15)):
        p = simulate(plan, profile, CostModel(0.05, 0.0), contention)
        assert p.hidden_comm_s == pytest.approx(0.15) and p.step_s == pytest.approx(step)
    # communication-bound: 0.2 s runs during backward (up to 0.3 s), 2.8 s after it
    p = simulate(
        plan_buckets(specs(3), 1, 1), BackwardProfile({2: 0.1, 1: 0.2, 0: 0.3}, 0.3, 1.0), CostModel(1.0, 0), 1
    )
    assert p.hidden_comm_s == pytest.approx(0.2) and p.step_s == pytest.approx(1.0 + 2.8 + 0.2)
    with pytest.raises(ValueError, match="between 0 and 1"):
        simulate(plan, profile, CostModel(0.05, 0.0), 1.5)


def test_contention_estimated_from_the_transports_cpu_share_on_cpu_only() -> None:
    assert estimated_contention(CostModel(0.0, 1e-9, cpu_share=0.3), "cpu") == pytest.approx(0.3)
    assert estimated_contention(CostModel(0.0, 1e-9, cpu_share=1.7), "cpu") == 1.0  # two threads busy: capped
    assert estimated_contention(CostModel(0.0, 1e-9, cpu_share=0.3), "cuda") == 0.0  # beside the device's compute
    assert estimated_contention(CostModel(0.0, 1e-9), "cpu") == 0.0  # not measured


def test_latency_bound_prefers_bigger_buckets() -> None:
    # 40 small gradients ready at the very end, expensive calls: one big bucket wins
    profile = BackwardProfile({i: 1.0 for i in range(40)}, 1.0, 1.0)
    ranked = predict(specs(40, 0.1), profile, CostModel(0.05, 1e-10), candidates_mb=(1, 2, 5, 10))
    # 4 MiB in all: 5 and 10 MiB both give [1 MiB first bucket, rest] = 2 calls; 1 MiB gives 4
    assert ranked[0].collectives == 2 and ranked[0].bucket_size_mb in (5, 10)
    assert ranked[-1].bucket_size_mb == 1 and ranked[-1].exposed_comm_s == pytest.approx(
        4 * 0.05 + 4e-10 * MIB / 10 * 10, rel=1e-3
    )


def test_cost_model_fit_and_ring_projection() -> None:
    fitted = CostModel.fit([1000, 2000, 4000], [0.002 + 1e-6 * b for b in (1000, 2000, 4000)])
    assert fitted.alpha == pytest.approx(0.002) and fitted.beta == pytest.approx(1e-6)
    ring = CostModel.ring(8, link_latency_s=5e-6, link_bandwidth_Bps=25e9)
    assert ring.alpha == pytest.approx(14 * 5e-6) and ring.beta == pytest.approx(1.75 / 25e9)
    assert "simulation" in ring.label
    with pytest.raises(ValueError, match="two different sizes"):
        CostModel.fit([8, 8], [1.0, 2.0])
    with pytest.raises(ValueError, match="alpha, beta and alpha_queued >= 0"):
        CostModel(-1.0, 0.0)
    with pytest.raises(ValueError, match="at least one gradient"):
        BackwardProfile({}, 1.0, 1.0)


def tuner_checks(rank: int, world: int, profile_path: str) -> dict:
    import torch

    import collective_ops as co
    from tests.models import MLP, build, rank_batch

    model = co.wrap(build("mlp"), bucket_size_mb=25)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = rank_batch(MLP, 0, rank)

    def step() -> None:
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()

    result = co.tune(model, step, candidates_mb=(0.01, 0.05, 25), confirm_top=2, confirm_steps=2, profile_steps=1)
    out = {
        "chosen": (result.bucket_size_mb, result.first_bucket_mb),
        "plan": (model.manager.plan.bucket_size_mb, model.manager.plan.first_bucket_mb),
        "predicted": len(result.predictions),
        "measured": sorted(result.measured_s),
        "trial_steps": result.trial_steps,
        "contention": result.contention,
    }
    with pytest.raises(ValueError, match="positive MiB"):
        co.tune(model, step, candidates_mb=(0,))
    # ranks that rank the candidates differently (here: opposite cost models) must still try rank 0's shortlist
    opposite = CostModel(1.0, 0.0) if rank == 0 else CostModel(0.0, 1e-3)  # rank 0: fewest calls; rank 1: smallest
    result = co.tune(
        model, step, candidates_mb=(0.01, 25), confirm_top=1, confirm_steps=1, cost=opposite, keep_current=False
    )
    out["disagreeing_choice"] = result.bucket_size_mb
    from collective_ops.tools.tune import save_profile

    save_profile(model, step, profile_path)

    auto = co.wrap(build("mlp"), bucket_size_mb="auto", auto_tune_step=2)
    optimizer = torch.optim.SGD(auto.parameters(), lr=0.01)
    sizes = []
    for _ in range(4):
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(auto(x), y).backward()
        optimizer.step()
        sizes.append(auto.manager.plan.bucket_size_mb)
    out["auto_sizes"] = sizes
    out["auto_report"] = auto.auto_tune_report is not None
    out["auto_best"] = _best_and_chosen(auto)
    out["auto_contention"] = auto.auto_tune_contention
    out["auto_fits"] = _auto_under_fits(rank)
    with pytest.raises(ValueError, match="'auto'"):
        co.wrap(build("mlp"), bucket_size_mb="fast")
    return out


def _best_and_chosen(model) -> tuple:
    """((size, first bucket) the online tune's cost model ranked best, the plan it set, its collectives, the
    fewest and most collectives among the candidates)."""
    report, plan = model.auto_tune_report, model.manager.plan
    counts = [p.collectives for p in report]
    best = (report[0].bucket_size_mb, report[0].first_bucket_mb)
    return best, (plan.bucket_size_mb, plan.first_bucket_mb), len(plan.buckets), min(counts), max(counts)


def _auto_under_fits(rank: int) -> dict:
    """bucket_size_mb="auto" on a 6 MiB model (six 1 MiB layers) with two injected alpha/beta fits in place of the
    measured one, on every rank alike: a latency-bound link (alpha only) and a bandwidth-bound one (beta only, a
    transfer far longer than backward: a slower one can hide behind a late end of backward, seen under load, where
    every size then ties at nothing exposed and the fewest collectives win)."""
    import torch

    import collective_ops as co
    from collective_ops.comm import measure

    measured, out = measure.measure_alpha_beta, {}
    try:
        for name, fit in (("latency", CostModel(0.05, 0.0)), ("bandwidth", CostModel(0.0, 1e-7))):
            measure.measure_alpha_beta = lambda engine, fit=fit: fit
            torch.manual_seed(0)
            model = co.wrap(torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(6)]), bucket_size_mb="auto")
            optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
            for step in range(3):
                x = torch.randn(8, 512, generator=torch.Generator().manual_seed(step + 10 * rank))
                optimizer.zero_grad()
                model(x).square().mean().backward()
                optimizer.step()
            out[name] = _best_and_chosen(model)
    finally:
        measure.measure_alpha_beta = measured
    return out


def test_tuner_and_auto_on_real_ranks(tmp_path) -> None:
    profile_path = tmp_path / "profile.json"
    outs = run_ranks(2, tuner_checks, str(profile_path))
    assert outs[0]["chosen"] == outs[1]["chosen"] and outs[0]["chosen"][0] in (0.01, 0.05, 25)
    for out in outs:
        # every distinct (size, first bucket) pair: first 0.25, 1 (capped at the size) or the size itself
        assert out["predicted"] == 1 + 1 + 3
        # rank 0's best two predictions, plus the plan the model had (25, first 1) when it is not among them
        assert out["plan"] == out["chosen"] and (25, 1) in out["measured"]
        assert len(out["measured"]) in (2, 3)
        # warm-up 1, profiling 2 x 1 + 3, confirmation (2 + 1) per candidate: far fewer than sweeping all 7
        assert out["trial_steps"] == 1 + 5 + 3 * len(out["measured"]) < len(CANDIDATES_MB) * (2 + 1)
        assert 0.0 <= out["contention"] <= 1.0
        sizes = out["auto_sizes"]
        assert sizes[0] == 25.0 and sizes[1] == sizes[2] == sizes[3] in CANDIDATES_MB, sizes  # settled at step 2
        assert out["auto_report"]
        # rank 0's cost model decides for every rank (each rank's own ranking may differ, from its own timings)
        best, chosen = outs[0]["auto_best"][0], out["auto_best"][1]
        assert chosen == best and sizes[1] == best[0]  # the measured fit's best candidate, not just any
        # The choice follows the fit: a latency-bound link asks for the fewest collectives; a bandwidth-bound one
        # for more, smaller buckets, sent while backward still runs (the last bucket's transfer alone is exposed).
        fits = out["auto_fits"]
        for name, (_, chosen, *_) in fits.items():
            best = outs[0]["auto_fits"][name][0]
            assert chosen == best, f"{name} fit: set {chosen}, rank 0's cost model's best is {best}"
        assert fits["latency"][2] == fits["latency"][3] == 1 < fits["latency"][4], fits
        assert fits["bandwidth"][2] > 1 and fits["bandwidth"][1] != fits["latency"][1], fits
        # Gloo on CPU tensors spends CPU while bytes move: the online tune charges it (not the 0 of a device)
        assert 0.0 < out["auto_contention"] <= 1.0
    assert outs[0]["auto_sizes"] == outs[1]["auto_sizes"]
    assert outs[0]["auto_contention"] == outs[1]["auto_contention"]  # the largest over ranks, on every rank
    assert outs[0]["disagreeing_choice"] == outs[1]["disagreeing_choice"] == 25  # rank 0's shortlist

    # the saved profile projects to other world sizes (a simulation, and labelled so)
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "collective_ops.tools.cli",
            "tune",
            "--profile",
            str(profile_path),
            "--world",
            "8",
            "4096",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    assert result.stdout.startswith("SIMULATION") and "N=8 " in result.stdout and "N=4096" in result.stdout
    # --project needs the fitted cost saved with the profile; with it, the assumptions are printed
    result = subprocess.run(
        [sys.executable, "-m", "collective_ops.tools.cli", "tune", "--profile", str(profile_path), "--project"],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2 and "fitted cost" in result.stderr
    import json

    data = json.loads(profile_path.read_text())
    data.update(
        cost={"alpha": 1.6e-3, "beta": 8e-9, "alpha_queued": 0.0, "world_size": 2}, where="emulated link, 1gbit"
    )
    projected = tmp_path / "projected.json"
    projected.write_text(json.dumps(data))
    result = subprocess.run(
        [sys.executable, "-m", "collective_ops.tools.cli", "tune", "--profile", str(projected), "--project"]
        + ["--world", "8", "64", "512"],
        capture_output=True,
        text=True,
        check=True,
    )
    out = result.stdout
    assert out.startswith("SIMULATION: projection of the link measured emulated link, 1gbit") and "Assumptions:" in out
    assert "800 us latency per hop, 125.0 MB/s" in out and "weak scaling" in out
    assert all(f"N={n} " in out for n in (8, 64, 512))
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    result = subprocess.run(
        [sys.executable, "-m", "collective_ops.tools.cli", "tune", "--profile", str(bad)],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2 and "not a profile" in result.stderr


def test_with_updates_overlapping_the_forward_the_overlapped_step_chooses() -> None:
    def candidate(mb: float, step: float) -> Prediction:
        return Prediction(mb, 0.25, step, 0.0, 0.0, 1, (), 0.0)

    ranked = [candidate(2.0, 0.30), candidate(5.0, 0.31), candidate(1.0, 0.32)]  # backward-only, best first
    assert choose(ranked) is ranked[0] and choose(ranked, {}) is ranked[0]
    overlapped = {(2.0, 0.25): 0.29, (5.0, 0.25): 0.27, (1.0, 0.25): 0.27}
    assert choose(ranked, overlapped) is ranked[1]  # shortest overlapped step; ties keep the backward-only rank
