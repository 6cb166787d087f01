"""Sharded optimizer state (ZeRO-1): speed and memory against the unsharded optimizer and torch's ZeRO.

    python benchmarks/sharded_compare.py                      # loopback, 2 ranks
    python benchmarks/sharded_compare.py --world 3
    python benchmarks/sharded_compare.py --link 1gbit         # emulated 2-node link
    python benchmarks/sharded_compare.py --checkpoint         # also a torch.distributed.checkpoint save
    python benchmarks/sharded_compare.py --memory-only --world 3   # memory alone, no step times

In the same processes, alternating in blocks of steps (the order reversed every round), with
AdamW everywhere: torch DDP (25 MiB buckets) + AdamW; DDP + ``ZeroRedundancyOptimizer(AdamW)``;
``wrap(bucket_size_mb="auto")`` (or ``--bucket-size-mb``) + ``DistributedOptimizer`` (unsharded); the same with
``shard=True``. Memory per rank: the bytes of the optimizer's state tensors and fp32 master
copies, counted after the steps (max over ranks). With ``--link``, also compute alone (the plain model and AdamW,
no communication, alternated with the others) and each setup's wire time: one step's bytes per direction at the
link's rate (:func:`step_wire_bytes`), each step then also as a multiple of max(compute alone, its wire). With ``--memory`` (or ``--memory-only``, which skips the
step times) each setup also trains alone in fresh processes for 3 steps: the bytes of every live tensor's
storage it holds then (tests.reference.live_tensor_bytes, net of what was live before it was built: parameters,
gradients, buckets, optimizer state, receive buffers; what torch keeps in C++ alone, as DDP's bucket copy of the
gradients, is not seen) and the process's peak RSS, max over ranks. ``--checkpoint``: ``shard=True`` saved with
torch.distributed.checkpoint (``get_state_dict`` + ``dcp.save``) as a full state dict and as DCP's default
sharded one, each in a run of its own: the optimizer-state bytes the state dict holds on a rank, the growth of
the process's peak RSS across the save, and its seconds (max over ranks).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from torch import nn  # noqa: E402

from benchmarks.common import COMPUTE_ALONE, link_seconds, run_benchmark, spawn, where  # noqa: E402
from benchmarks.ddp_compare import MODELS, alternate_steps, build_model, one_step  # noqa: E402

ADAMW = {"lr": 1e-4, "weight_decay": 0.01}
SETUPS = (
    "DDP + AdamW",
    "DDP + ZeroRedundancyOptimizer(AdamW)",
    "wrap + DistributedOptimizer",
    "wrap + DistributedOptimizer(shard=True)",
)


def build_setup(label: str, name: str, bucket_size_mb: float | str = "auto", row_sparse: bool = True) -> tuple:
    """(model, optimizer) of one setup; ``row_sparse=False``: embeddings reduced densely, as DDP does."""
    import collective_ops as co

    model, _ = build_model(name)
    if label.startswith("DDP"):
        ddp = nn.parallel.DistributedDataParallel(model)
        if "Zero" in label:
            from torch.distributed.optim import ZeroRedundancyOptimizer

            return ddp, ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.AdamW, **ADAMW)
        return ddp, torch.optim.AdamW(ddp.parameters(), **ADAMW)
    wrapped = co.wrap(model, bucket_size_mb=bucket_size_mb, row_sparse_embeddings="auto" if row_sparse else False)
    return wrapped, co.DistributedOptimizer(wrapped, torch.optim.AdamW, shard="shard" in label, **ADAMW)


def state_bytes(optimizer) -> int:
    """Bytes of the optimizer's per-element state tensors and fp32 master copies on this rank."""
    inner = getattr(optimizer, "_optimizer", None) or getattr(optimizer, "optim", None) or optimizer
    total = sum(v.numel() * v.element_size() for s in inner.state.values() for v in s.values() if v.dim() > 0)
    buffers = getattr(optimizer, "_param_buffers", None)
    for piece, tensor in getattr(optimizer, "_pieces", []):
        if tensor.dtype != buffers[piece.bucket].dtype:
            total += tensor.numel() * tensor.element_size()
    return total


def step_wire_bytes(label: str, model, optimizer) -> int:
    """One step's bytes on each direction of a 2-node link, as the size of a 2-rank allreduce that moves as
    much (what :func:`benchmarks.common.link_seconds` prices). DDP allreduces every gradient; torch's
    ZeRO also broadcasts each rank's updated parameters (half of them cross each way); ours reduce what the last
    step reduced (a row-sparse table: its rows), and sharded each bucket's all-gather moves half of it each way
    beside its reduce-scatter's half: a dense bucket as an allreduce, a row-sparse table its rows plus half."""
    grads = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    if label.startswith("DDP"):
        return grads + (grads // 2 if "Zero" in label else 0)
    manager = model.manager
    sent = manager.last_stats.bytes_communicated
    if not getattr(optimizer, "shards", False):
        return sent
    shares = manager.wire_shares()
    by_rows = [b for b in manager.plan.buckets if len(b.param_indices) == 1 and b.param_indices[0] in shares]
    return sent + sum(b.nbytes for b in by_rows) // 2


def _compute_alone(name: str, batches: list) -> tuple:
    """The plain model and AdamW, no communication: the compute every setup's step holds."""
    model, _ = build_model(name)
    return model, torch.optim.AdamW(model.parameters(), **ADAMW), batches


def _padding_bytes(optimizer) -> int:
    layout = getattr(optimizer, "_layout", None)
    if layout is None:
        return 0
    return sum(b.padded_numel - b.numel for b in layout.buckets) // layout.world_size * 4 * 2


def _batches(name: str, rank: int) -> list:
    _, batch = build_model(name)
    gen = torch.Generator().manual_seed(rank)
    return [batch(gen) for _ in range(4)]


def rank_main(rank: int, world: int, port: int, args, queue) -> None:
    import collective_ops as co
    from collective_ops.runtime import get_engine

    if args.memory_only:
        if rank == 0:
            queue.put({})
        return

    torch.set_num_threads(1)
    co.init("gloo", rank=rank, world_size=world, master_port=port)
    engine = get_engine("torch")
    results = {}
    for name in args.models:
        batches = _batches(name, rank)
        setups = {
            label: (*build_setup(label, name, args.bucket_size_mb, args.row_sparse_embeddings == "auto"), batches)
            for label in SETUPS
        }
        on_link = link_seconds(1) is not None
        if on_link:  # alternated with the races: the same CPU sharing and machine noise as the steps it bounds
            setups[COMPUTE_ALONE] = _compute_alone(name, batches)
        times = alternate_steps(setups, args.rounds, args.block)
        memory = {label: engine.reduce_floats([state_bytes(setups[label][1])], "max")[0] for label in SETUPS}
        wire = {label: link_seconds(step_wire_bytes(label, *setups[label][:2])) for label in SETUPS} if on_link else {}
        sharded = setups[SETUPS[3]][1]
        plan = sharded.model.manager.plan
        simulated = sharded.model.auto_tune_overlapped.get((plan.bucket_size_mb, plan.first_bucket_mb))
        results[name] = {
            "plan": [plan.bucket_size_mb, plan.first_bucket_mb],
            "simulated_sharded_ms": None if simulated is None else simulated * 1e3,
            "median_step_ms": {key: statistics.median(v) * 1e3 for key, v in times.items()},
            "wire_ms": {key: seconds * 1e3 for key, seconds in wire.items()},
            "state_bytes": memory,
            "padding_bytes": _padding_bytes(sharded),
            "params_m": sum(p.numel() for p in setups[SETUPS[0]][0].parameters()) / 1e6,
        }
        del setups
    co.barrier()
    co.shutdown()
    if rank == 0:
        queue.put(results)


def memory_rank(rank: int, world: int, port: int, args, label: str, queue) -> None:
    """One setup alone for 3 steps: (live tensor MiB it holds, peak RSS MiB, RSS MiB before it was built), each
    the max over ranks."""
    import collective_ops as co
    from collective_ops.runtime import get_engine
    from tests.reference import live_tensor_bytes

    torch.set_num_threads(1)
    co.init("gloo", rank=rank, world_size=world, master_port=port)
    name = args.models[0]
    batches = _batches(name, rank)
    before_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    before = live_tensor_bytes()
    model, optimizer = build_setup(label, name, args.bucket_size_mb, args.row_sparse_embeddings == "auto")
    for i in range(3):
        one_step(model, optimizer, batches[i % len(batches)])
    getattr(optimizer, "synchronize", lambda: None)()
    live = (live_tensor_bytes() - before) / 2**20
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    worst = get_engine("torch").reduce_floats([live, peak_mib, before_rss], "max")
    co.barrier()
    co.shutdown()
    if rank == 0:
        queue.put(worst)


BF16_SETUPS = ("bf16 model, forward and backward alone", "wrap + DistributedOptimizer(shard=True, master_weights=True)")


def bf16_memory_rank(rank: int, world: int, port: int, args, label: str, queue) -> None:
    """One bf16 setup alone for 3 steps: (peak RSS growth MiB over the RSS before the model was built, parameters),
    the growth the max over ranks. The bare setup runs the same forward and backward (its p.grad kept, in bf16)."""
    import collective_ops as co
    from collective_ops.runtime import get_engine

    torch.set_num_threads(1)
    co.init("gloo", rank=rank, world_size=world, master_port=port)
    batches = _batches(args.models[0], rank)
    # torch's optimizer code loaded first, in both setups (a 1-element AdamW, stepped): its first optimizer
    # imports its compile machinery, tens of MiB of code, not bytes per parameter
    loaded = torch.zeros(1, requires_grad=True)
    loaded.grad = torch.zeros(1)
    torch.optim.AdamW([loaded], **ADAMW).step()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    model = build_model(args.models[0])[0].to(torch.bfloat16)
    count = sum(p.numel() for p in model.parameters())
    optimizer = None
    if label == BF16_SETUPS[1]:
        model = co.wrap(model, bucket_size_mb=args.bucket_size_mb)
        optimizer = co.DistributedOptimizer(model, torch.optim.AdamW, shard=True, master_weights=True, **ADAMW)
    for i in range(3):
        if optimizer is None:
            x, y = batches[i % len(batches)]
            model.zero_grad(set_to_none=True)
            nn.functional.cross_entropy(model(x), y).backward()
        else:
            one_step(model, optimizer, batches[i % len(batches)])
    getattr(optimizer, "synchronize", lambda: None)()
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - before
    worst = get_engine("torch").reduce_floats([grown], "max")[0]
    co.barrier()
    co.shutdown()
    if rank == 0:
        queue.put((worst, count))


def bf16_bytes_per_param(grown: dict[str, tuple[float, int]], world: int) -> tuple[float, float]:
    """(measured, Megatron-core's 6 + 12/N) bytes per parameter of ``shard=True`` with fp32 main gradients and
    masters on a bf16 model, beyond the bare model's activations: its peak RSS growth less the bare forward and
    backward's, per parameter, plus the 4 bytes of bf16 parameter and gradient that the bare setup holds too."""
    (bare, count), (ours, _) = grown[BF16_SETUPS[0]], grown[BF16_SETUPS[1]]
    return (ours - bare) * 2**20 / count + 4, 6 + 12 / world


def checkpoint_rank(rank: int, world: int, port: int, args, full: bool, queue) -> None:
    """``shard=True`` trained 4 steps, then saved through torch.distributed.checkpoint (``full_state_dict``
    as given): (state MiB in the state dict, peak-RSS growth MiB, seconds), each the max over ranks."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    import collective_ops as co
    from collective_ops.runtime import get_engine
    from tests.reference import remove_shared_folder, shared_temporary_folder

    torch.set_num_threads(1)
    co.init("gloo", rank=rank, world_size=world, master_port=port)
    name = args.models[0]
    batches = _batches(name, rank)
    model, optimizer = build_setup(SETUPS[3], name, args.bucket_size_mb, args.row_sparse_embeddings == "auto")
    for i in range(4):
        one_step(model, optimizer, batches[i % len(batches)])
    optimizer.synchronize()
    path = shared_temporary_folder("collective_ops_checkpoint_")
    before, started = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, time.perf_counter()
    model_state, optim_state = get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=full))
    held = sum(_local_bytes(value) for values in optim_state["state"].values() for value in values.values())
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=path)
    seconds = time.perf_counter() - started
    grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    worst = get_engine("torch").reduce_floats([held / 2**20, grown, seconds], "max")
    remove_shared_folder(path)
    co.shutdown()
    if rank == 0:
        queue.put(worst)


def _local_bytes(value) -> int:
    """Bytes of a state-dict value held on this rank (a ShardedTensor's local shards; not a 0-d step)."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    if isinstance(value, ShardedTensor):
        return sum(shard.tensor.numel() * shard.tensor.element_size() for shard in value.local_shards())
    is_vector = isinstance(value, torch.Tensor) and value.dim() > 0
    return value.numel() * value.element_size() if is_vector else 0


def memory_goal(peaks: dict[str, tuple[float, float, float]]) -> str:
    """The memory goal's line: ``shard=True``'s peak-RSS growth (over the RSS before its setup was built) no more
    than DDP + ZeroRedundancyOptimizer's, each setup alone in processes of its own, at the defaults."""
    ours, zero = peaks.get(SETUPS[3]), peaks.get(SETUPS[1])
    if ours is None or zero is None:
        return ""
    grown, limit = ours[1] - ours[2], zero[1] - zero[2]
    verdict = "met" if grown <= limit else "NOT met"
    return f"goal: {SETUPS[3]} peak RSS growth {grown:.0f} MiB <= {SETUPS[1]}'s {limit:.0f} MiB: {verdict}"


def _size(value: str) -> float | str:
    return value if value == "auto" else float(value)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--models", nargs="+", choices=MODELS, default=["transformer-5m"])
    parser.add_argument("--rounds", type=int, default=4, help="alternation rounds")
    parser.add_argument(
        "--block",
        type=int,
        default=10,
        help="steps per configuration per round (as optimizer_compare.py: a DistributedOptimizer's overlap runs "
        "across steps, and each block's first and last steps are its edges)",
    )
    parser.add_argument(
        "--bucket-size-mb", type=_size, default="auto", help="collective_ops' bucket size (MiB or auto)"
    )
    parser.add_argument(
        "--row-sparse-embeddings",
        choices=("auto", "off"),
        default="auto",
        help="collective_ops' embedding gradients sent by rows (auto, the default) or densely (off: every setup "
        "then moves the same bytes, the comparison the sharded goal assumes)",
    )
    parser.add_argument(
        "--memory", action="store_true", help="also measure each setup's live tensor bytes and peak RSS alone"
    )
    parser.add_argument("--memory-only", action="store_true", help="only --memory (no step times)")
    parser.add_argument(
        "--checkpoint", action="store_true", help="also save shard=True through torch.distributed.checkpoint"
    )
    parser.add_argument(
        "--bf16",
        action="store_true",
        help="also measure bytes per parameter of shard=True with master_weights=True on the bf16 model (peak RSS)",
    )
    parser.add_argument("--json")
    started = time.monotonic()
    outcome = run_benchmark(parser, argv, rank_main)
    if isinstance(outcome, int):
        return outcome
    args, results = outcome
    measure = args.memory or args.memory_only
    peaks = {label: spawn(memory_rank, args.world, args, label) for label in SETUPS} if measure else {}
    saves = {full: spawn(checkpoint_rank, args.world, args, full) for full in (True, False)} if args.checkpoint else {}
    bf16 = {label: spawn(bf16_memory_rank, args.world, args, label) for label in BF16_SETUPS} if args.bf16 else {}
    timed = "" if args.memory_only else f"; median step, {args.rounds} rounds x {args.block} steps alternating"
    print(f"# sharded_compare: {args.world} Gloo ranks, {where()}, AdamW{timed} ({time.monotonic() - started:.0f} s)")
    for name, r in results.items():
        ms, memory = r["median_step_ms"], r["state_bytes"]
        unsharded, zero = ms[SETUPS[2]], ms[SETUPS[1]]
        print(
            f"  {name} ({r['params_m']:.1f}M params), collective_ops plan {r['plan'][0]:g}/{r['plan'][1]:g} MiB "
            f"({args.bucket_size_mb}), padding {r['padding_bytes']} B of AdamW state per rank, "
            f"row-sparse embeddings {args.row_sparse_embeddings}"
        )
        wire = r.get("wire_ms") or {}
        compute = ms.get(COMPUTE_ALONE)
        bound_head = f"  {'wire':>8}  {'/max(compute, wire)':>19}" if wire else ""
        print(
            f"    {'setup':<46} {'step':>9}  {'/unsharded':>10}  {'/DDP+ZeRO':>9}  {'state/rank':>10}  {'peak RSS':>8}"
            + bound_head
        )
        for key in SETUPS:
            peak = f"{peaks[key][1]:.0f} MiB" if key in peaks else "-"
            bound = f"  {wire[key]:>5.1f} ms  {ms[key] / max(compute, wire[key]):>18.2f}x" if wire else ""
            print(
                f"    {key:<46} {ms[key]:>6.1f} ms  {ms[key] / unsharded:>9.3f}x  {ms[key] / zero:>8.3f}x  "
                f"{memory[key] / 2**20:>7.2f} MiB  {peak:>8}{bound}"
            )
        if compute is not None:
            print(
                f"    {COMPUTE_ALONE:<46} {compute:>6.1f} ms  {compute / unsharded:>9.3f}x  (wire: one step's bytes "
                "per direction at the link's rate)"
            )
        if r.get("simulated_sharded_ms") is not None:
            simulated, measured = r["simulated_sharded_ms"], ms[SETUPS[3]]
            print(
                f"    shard=True, the online tune's score at its plan (simulated step + contention charge): {simulated:.1f} ms "
                f"({(simulated / measured - 1) * 100:+.1f}% of the measured {measured:.1f})"
            )
        share = memory[SETUPS[3]] / memory[SETUPS[2]]
        print(f"    sharded state / unsharded state: {share:.3f} (1/{args.world} = {1 / args.world:.3f})")
    if peaks:
        print(
            f"  {args.models[0]}, each setup alone for 3 steps ({args.world} ranks, bucket size {args.bucket_size_mb}, "
            f"row-sparse embeddings {args.row_sparse_embeddings}), max over ranks:"
        )
        print(f"    {'setup':<46} {'live tensors':>12}  {'peak RSS':>9}  {'RSS before setup':>16}")
        for key, (live, peak, before) in peaks.items():
            print(f"    {key:<46} {live:>8.1f} MiB  {peak:>5.0f} MiB  {before:>12.0f} MiB")
        goal = memory_goal(peaks)
        if goal:
            print(f"  {goal}")
    for full, (held, grown, seconds) in saves.items():
        kind = "full_state_dict=True " if full else "sharded (DCP's default)"
        print(
            f"  {args.models[0]}, shard=True saved by torch.distributed.checkpoint, {kind}: optimizer state held "
            f"{held:.2f} MiB/rank, peak RSS +{grown:.1f} MiB, {seconds:.2f} s (max over ranks)"
        )
    if bf16:
        measured, formula = bf16_bytes_per_param(bf16, args.world)
        verdict = "met" if measured <= formula * 1.1 else "NOT met"
        print(f"  {args.models[0]} in bf16, each setup alone for 3 steps, peak RSS growth (max over ranks):")
        for key, (grown, count) in bf16.items():
            print(f"    {key:<60} {grown:>7.1f} MiB ({count / 1e6:.2f}M parameters)")
        print(
            f"  goal: bf16 shard=True + master_weights {measured:.2f} bytes/parameter beyond the bare model's "
            f"activations <= 1.1 x (6 + 12/{args.world} = {formula:.2f}): {verdict}"
        )
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "args": vars(args),
                    "where": where(),
                    "results": results,
                    "peak_rss_mib": peaks,
                    "dcp_saves": saves,
                    "bf16_peak_growth_mib": bf16,
                },
                indent=1,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
