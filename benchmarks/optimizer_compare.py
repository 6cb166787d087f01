"""DistributedOptimizer (updates overlapped with the next forward) against DDP at every bucket size.

    python benchmarks/optimizer_compare.py --link 1gbit --models transformer-5m cnn
    python benchmarks/optimizer_compare.py --link 1gbit --models transformer-5m --compression fp16

In the same processes, alternating in blocks of steps (the order reversed every round):
torch DDP with each ``bucket_cap_mb`` of the hand sweep {1, 2, 5, 10, 25, 50} and a plain
optimizer; ``wrap(bucket_size_mb="auto")`` with a plain optimizer; and
``wrap(bucket_size_mb="auto")`` + ``DistributedOptimizer`` with its defaults (its planned
launch order, ``schedule="auto"``; ``--schedule auto plan`` adds plan order; the simulator's
step for both orders is printed beside the measured ones; ``--shard`` adds ``shard=True`` (its own
planned reduce-scatter order, ``schedule="auto"``, printed with its trial);
``--whole-buckets`` adds one that weighs no chunked orders). Same optimizer
class everywhere (SGD, or AdamW with ``--optimizer adamw``; ``--optimizer muon``: Muon for the hidden
matrices and AdamW for the rest, two plain optimizers beside DDP and ``wrap``, both given to one
DistributedOptimizer). With ``--compression fp16``
the DDP runs use ``fp16_compress_hook`` and the wraps ``compression="fp16"``. Each
DistributedOptimizer block ends with ``synchronize()`` inside its last step, so its
in-flight communication is charged to it. Also reported: compute alone (the plain model and
optimizer with no communication, a setup of the alternation on every rank at once, so it
shares the CPU and the machine's noise with the steps it bounds) and the wire time at the link's rate of the bytes
one step of the DistributedOptimizer sent, whose maximum bounds the step from below (each step as a multiple of
it); on the link, the tighter bound of the lead (see ``_print_lead_bound``);
with ``--contention``, the compute of a step while a stream of allreduces keeps the link busy
beside it (on a CPU the transport's threads take cycles from the ranks' compute).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from torch import nn  # noqa: E402

from benchmarks.common import COMPUTE_ALONE, physical_limit, run_benchmark, where  # noqa: E402
from benchmarks.ddp_compare import MODELS, alternate_steps, build_model, one_step  # noqa: E402
from tests.reference import InTurn  # noqa: E402

DDP_SWEEP_MB = (1, 2, 5, 10, 25, 50)
SHARDED = "wrap auto + DistributedOptimizer(shard=True)"
WHOLE = "wrap auto + DistributedOptimizer, whole buckets"


def _optimizer(args):
    if args.optimizer == "sgd":
        return torch.optim.SGD, {"lr": 1e-3, "momentum": 0.9}
    return torch.optim.AdamW, {"lr": 1e-4, "weight_decay": 0.01}


def muon_and_adamw(model: nn.Module) -> list:
    """Muon for the hidden matrices, AdamW for embeddings, the output layer, norms and biases (the usual split)."""
    named = list(model.named_parameters())
    hidden = [p for n, p in named if p.ndim == 2 and not n.startswith(("embed", "head", "module.embed", "module.head"))]
    rest = [p for n, p in named if all(p is not h for h in hidden)]
    return [torch.optim.Muon(hidden, lr=0.02), torch.optim.AdamW(rest, lr=1e-4, weight_decay=0.01)]


def _plain(args, model: nn.Module):
    """The plain optimizer (or Muon + AdamW) over ``model``'s parameters, as under DDP."""
    if args.optimizer == "muon":
        return InTurn(muon_and_adamw(model))
    cls, kwargs = _optimizer(args)
    return cls(model.parameters(), **kwargs)


def _ours(args, wrapped, **options):
    """A DistributedOptimizer of the same class(es) over a wrapped model."""
    import collective_ops as co

    if args.optimizer == "muon":
        return co.DistributedOptimizer(wrapped, muon_and_adamw(wrapped), **options)
    cls, kwargs = _optimizer(args)
    return co.DistributedOptimizer(wrapped, cls, **options, **kwargs)


def _setups(args, name: str, batches: list) -> dict:
    import collective_ops as co

    model, _ = build_model(name)
    # alternated with the races, both ranks at once: the same CPU sharing and machine noise as the steps it bounds
    setups = {COMPUTE_ALONE: (model, _plain(args, model), batches)}
    for mb in DDP_SWEEP_MB:
        model, _ = build_model(name)
        ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=mb)
        if args.compression == "fp16":
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

            ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
        setups[f"DDP {mb:g} MiB"] = (ddp, _plain(args, ddp), batches)
    for label, schedule in (("wrap auto", None), *((_label(s), s) for s in args.schedule)):
        model, _ = build_model(name)
        wrapped = co.wrap(model, bucket_size_mb="auto", compression=args.compression)
        optimizer = _ours(args, wrapped, schedule=schedule) if schedule else _plain(args, wrapped)
        setups[label] = (wrapped, optimizer, batches)
    if args.whole_buckets:
        model, _ = build_model(name)
        wrapped = co.wrap(model, bucket_size_mb="auto", compression=args.compression)
        optimizer = _ours(args, wrapped)
        optimizer.chunk_candidates_mib = ()
        setups[WHOLE] = (wrapped, optimizer, batches)
    if args.shard:
        model, _ = build_model(name)
        wrapped = co.wrap(model, bucket_size_mb="auto", compression=args.compression)
        setups[SHARDED] = (wrapped, _ours(args, wrapped, shard=True), batches)
    return setups


def _label(schedule: str) -> str:
    """The setup's name: the DistributedOptimizer's defaults (schedule="auto") unnamed, plan order named."""
    return "wrap auto + DistributedOptimizer" + ("" if schedule == "auto" else " (schedule plan)")


def _compute_alone(args, name: str, batches: list, steps: int = 4) -> float:
    """One rank's step without any communication (median), the compute the schedule must contain (with the
    race's optimizer: its update is compute too)."""
    model, _ = build_model(name)
    optimizer = _plain(args, model)
    times = [one_step(model, optimizer, batches[i % len(batches)]) for i in range(steps + 1)]
    return statistics.median(times[1:])


def _allreduce_stream(group, stop: threading.Event, sent: list[int]) -> None:
    """1 MiB allreduces back to back on ``group`` until ``stop``; both ranks leave at the same round (the first
    to be told to stop tells the other), counting them in ``sent[0]``."""
    import torch.distributed as dist

    payload, flag = torch.ones(1 << 18), torch.zeros(1)
    while True:
        dist.all_reduce(payload, group=group)
        sent[0] += 1
        flag.fill_(float(stop.is_set()))
        dist.all_reduce(flag, group=group)
        if flag.item():
            return


def _compute_beside_traffic(args, name: str, batches: list, repeats: int = 5) -> tuple[float, float, float]:
    """(compute alone, compute while 1 MiB allreduces run back to back on a group of their own, the MiB/s they
    moved meanwhile): medians over ``repeats`` alternations, each the slowest rank's."""
    import torch.distributed as dist

    from collective_ops.runtime import get_engine

    group = dist.new_group(backend="gloo")
    alone, beside, rates = [], [], []
    for _ in range(repeats):
        alone.append(_compute_alone(args, name, batches))
        stop, sent = threading.Event(), [0]
        thread = threading.Thread(target=_allreduce_stream, args=(group, stop, sent))
        thread.start()
        started = time.perf_counter()
        beside.append(_compute_alone(args, name, batches))
        rates.append(sent[0] / (time.perf_counter() - started))
        stop.set()
        thread.join()
    slowest = get_engine("torch").reduce_floats([*alone, *beside, *(-r for r in rates)], "max")
    alone, beside, rates = slowest[:repeats], slowest[repeats : 2 * repeats], slowest[2 * repeats :]
    return statistics.median(alone), statistics.median(beside), -statistics.median(rates)


def rank_main(rank: int, world: int, port: int, args, queue) -> None:
    import collective_ops as co

    torch.set_num_threads(1)
    co.init("gloo", rank=rank, world_size=world, master_port=port)
    results = {}
    for name in args.models:
        _, batch = build_model(name)
        gen = torch.Generator().manual_seed(rank)
        batches = [batch(gen) for _ in range(4)]
        contention = _compute_beside_traffic(args, name, batches) if args.contention else None
        setups = _setups(args, name, batches)
        times = alternate_steps(setups, args.rounds, args.block)
        ours = setups[_label(args.schedule[0])][0]
        results[name] = {
            "median_step_ms": {key: statistics.median(v) * 1e3 for key, v in times.items()},
            "compute_alone_ms": statistics.median(times[COMPUTE_ALONE]) * 1e3,
            # what one step of ours sent (half with fp16; a row-sparse embedding sends its looked-up rows only)
            "wire_bytes": ours.comm_stats()["bytes_per_step"],
            "auto_plan": [ours.manager.plan.bucket_size_mb, ours.manager.plan.first_bucket_mb],
            "auto_overlapped_ms": {
                f"{mb:g}/{first:g}": s * 1e3 for (mb, first), s in ours.auto_tune_overlapped.items()
            },
            "update_ms": setups[_label(args.schedule[0])][1].update_seconds * 1e3,
            "schedule": _schedule_summary(setups[_label("auto")][1]) if "auto" in args.schedule else None,
            "shard_schedule": _schedule_summary(setups[SHARDED][1]) if args.shard else None,
            "params_m": sum(p.numel() for p in ours.module.parameters()) / 1e6,
            "contention_ms": None if contention is None else [contention[0] * 1e3, contention[1] * 1e3, contention[2]],
        }
        del setups
    co.barrier()
    co.shutdown()
    if rank == 0:
        queue.put(results)


def _schedule_summary(optimizer) -> dict | None:
    """With schedule="auto": the planned order and the simulator's step for it and for plan order."""
    report = optimizer.schedule_report
    if not report:
        return None
    plain = next(p for p in report if p.is_plan_order)
    order = tuple(optimizer.model.manager.launch_order)
    kept = next((p for p in report if p.order == order), plain)  # the order kept (plan order's if since replanned)
    trial = optimizer.schedule_trial
    return {
        "order": list(order),
        "deferred": kept.deferred,
        "held_from": kept.held_from,
        "predicted_step_ms": kept.step_s * 1e3,
        "plan_order_step_ms": plain.step_s * 1e3,
        "trial_ms": [round(s * 1e3, 1) for s in trial["median_s"]] if trial else None,
        "overlapped": optimizer.defers,  # False: the trial kept every bucket finished in backward
        "simulated_best_ms": report[0].step_s * 1e3,
        # from a forward's end to the next backward's first gradient (loss, the last layer's backward): no
        # gradient of the step is ready and the last step's are all applied, so the link has nothing to carry
        "lead_ms": (kept.step_s - kept.forward_end_s) * 1e3,
        # no launch order beats it: the link from when each bucket's bytes were ready, then the last-needed
        # bucket's forward and the lead (schedule.step_bound, from the planner's own profile and fitted cost)
        "step_bound_ms": optimizer.schedule_bound_s * 1e3 if optimizer.schedule_bound_s else None,
        "chunked_tried": [len(o) > len(trial["orders"][0]) for o in trial["orders"]] if trial else None,
    }


def _print_lead_bound(r: dict, plan: dict, measured: float, best_ddp: float, default: float) -> None:
    """The bounds no launch order beats: the link idles through the lead, so a step is at least lead + link
    (the link time of the bytes our step sent, at the nominal rate), and at least the compute alone; tighter,
    the planner's step bound (the link also idles in backward until enough bytes are ready, at its fitted rate)."""
    link, lead_ms = r["wire_ms"], plan["lead_ms"]
    bound = max(r["compute_alone_ms"], lead_ms + link)
    print(
        f"    bound: max(compute alone {r['compute_alone_ms']:.0f} ms, lead {lead_ms:.0f} ms + link time of the bytes "
        f"sent {link:.0f} ms) = {bound:.0f} ms (the lead, from a forward's end to the first gradient, has nothing "
        f"for the link); measured {measured / bound:.2f}x it; the bound is {bound / default:.3f}x DDP default, "
        f"{bound / best_ddp:.3f}x best DDP"
    )
    if plan["step_bound_ms"]:
        tight = max(r["compute_alone_ms"], plan["step_bound_ms"])
        print(
            f"    tighter: max(compute alone, the planner's step bound {plan['step_bound_ms']:.0f} ms: the link busy "
            f"from when each bucket was ready, at the fitted rate, then the last-needed bucket's forward and the "
            f"lead) = {tight:.0f} ms; measured {measured / tight:.2f}x it, the simulated best order "
            f"{plan['simulated_best_ms'] / tight:.2f}x; the bound is {tight / default:.3f}x DDP default, "
            f"{tight / best_ddp:.3f}x best DDP"
        )


def _print_shard_schedule(plan: dict, measured: float, unsharded: float | None) -> None:
    """shard=True's planned reduce-scatter launch order (schedule="auto"): kept order, simulated and tried steps."""
    print(
        f"    shard=True schedule auto: reduce-scatter order {plan['order']}; simulated step "
        f"{plan['predicted_step_ms']:.1f} ms ({plan['plan_order_step_ms']:.1f} in plan order), measured "
        f"{measured:.1f}" + (f" ({measured / unsharded:.3f}x the unsharded DistributedOptimizer)" if unsharded else "")
    )
    if plan["trial_ms"]:
        print(f"    its trial (median steps: plan order, then the simulator's shortlist): {plan['trial_ms']}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--models", nargs="+", choices=MODELS, default=["transformer-5m"])
    parser.add_argument(
        "--optimizer", choices=["sgd", "adamw", "muon"], default="sgd", help="muon: Muon (hidden matrices) + AdamW"
    )
    parser.add_argument("--compression", choices=["fp16"], default=None)
    parser.add_argument(
        "--schedule",
        nargs="+",
        choices=["plan", "auto"],
        default=["auto"],
        help="DistributedOptimizer's schedule(s) (default auto, its own default): each one a setup of the race",
    )
    parser.add_argument("--shard", action="store_true", help="also race DistributedOptimizer(shard=True)")
    parser.add_argument(
        "--whole-buckets",
        action="store_true",
        help="also race the DistributedOptimizer planning whole-bucket orders only (chunk_candidates_mib=())",
    )
    parser.add_argument("--rounds", type=int, default=4, help="alternation rounds")
    parser.add_argument(
        "--block",
        type=int,
        default=10,
        help="steps per configuration per round (a DistributedOptimizer's overlap runs across steps: each block's "
        "first step starts with nothing to overlap and its last synchronizes, so short blocks measure those edges)",
    )
    parser.add_argument(
        "--contention",
        action="store_true",
        help="also time compute alone against compute beside a stream of allreduces that keeps the link busy",
    )
    parser.add_argument("--json")
    started = time.monotonic()
    outcome = run_benchmark(parser, argv, rank_main)
    if isinstance(outcome, int):
        return outcome
    args, results = outcome
    print(
        f"# optimizer_compare: {args.world} Gloo ranks, {where()}, {args.optimizer}"
        + (f", compression {args.compression}" if args.compression else "")
        + f"; median step, {args.rounds} rounds x {args.block} steps alternating ({time.monotonic() - started:.0f} s)"
    )
    for name, r in results.items():
        ms = r["median_step_ms"]
        default = ms["DDP 25 MiB"]
        best_key = min((k for k in ms if k.startswith("DDP")), key=ms.get)
        limit = physical_limit(ms, r["compute_alone_ms"], r["wire_bytes"], args.world)
        r["wire_ms"] = limit.wire_ms
        print(
            f"  {name} ({r['params_m']:.1f}M params): {limit.line(_label(args.schedule[0]))}; "
            f"auto plan {r['auto_plan'][0]:g}/{r['auto_plan'][1]:g} MiB"
        )
        if r["auto_overlapped_ms"]:
            print(
                "    DistributedOptimizer's bucket size, by the simulated overlapped step (MiB/first: ms): "
                + ", ".join(
                    f"{key} {ms:.1f}" for key, ms in sorted(r["auto_overlapped_ms"].items(), key=lambda kv: kv[1])
                )
            )
        for key, value in sorted(ms.items(), key=lambda kv: kv[1]):
            print(
                f"    {key:<34} {value:>7.1f} ms  {value / default:.3f}x DDP default  "
                f"{value / ms[best_key]:.3f}x best DDP ({best_key})  {limit.column(value)}"
            )
        if r["schedule"]:
            plan = r["schedule"]
            measured = ms[_label("auto")]
            error = (
                f"{(plan['predicted_step_ms'] / measured - 1) * 100:+.1f}% of the measured {measured:.1f}"
                if plan["overlapped"]
                else f"not comparable: the measured {measured:.1f} finished every bucket in backward"
            )
            print(
                f"    schedule auto: order {plan['order']} (first {plan['deferred']} and from position "
                f"{plan['held_from']} held); simulated step {plan['predicted_step_ms']:.1f} ms ({error}), "
                f"{plan['plan_order_step_ms']:.1f} ms in plan order"
                + (f" (measured {ms[_label('plan')]:.1f})" if "plan" in args.schedule else "")
            )
            if plan["trial_ms"]:
                chunked = " (the last sends buckets in chunks)" if any(plan["chunked_tried"]) else ""
                print(
                    f"    its trial (median steps of this model's own time: every bucket finished in backward, plan "
                    f"order, then the simulator's shortlist{chunked}, best simulated {plan['simulated_best_ms']:.1f} "
                    f"ms): {plan['trial_ms']}; kept: "
                    + ("the order above, overlapped" if plan["overlapped"] else "every bucket finished in backward")
                )
            if limit.wire_ms is not None:
                _print_lead_bound(r, plan, measured, ms[best_key], default)
        if r.get("shard_schedule"):
            _print_shard_schedule(r["shard_schedule"], ms[SHARDED], ms.get(_label("auto")))
        if r["contention_ms"]:
            alone, beside, rate = r["contention_ms"]
            print(
                f"    contention: compute alone {alone:.0f} ms, beside a stream of 1 MiB allreduces {beside:.0f} ms "
                f"({beside / alone:.2f}x; the stream moved {rate:.1f} MiB/s meanwhile); medians of 5 alternations"
            )
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "where": where(), "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
