"""Step time: nn.DistributedGradReducer against collective_ops.wrap on the same MindSpore network and data.

    python benchmarks/mindspore_compare.py --world 2 --steps 20          # launches msrun itself
    msrun --worker_num=2 --local_worker_num=2 --master_port=8119 --log_dir=logs --join=True \\
        benchmarks/mindspore_compare.py --steps 20 --json out.json        # or under msrun directly

Both reducers live in the same processes and alternate in blocks of steps; each step
ends with ``mindspore.runtime.synchronize()`` (on CPU ``CommHandle.wait()`` does not
block, and MindSpore's runtime would otherwise let one step's reductions run into the
next step), and the median step of each is reported. On CPU ``synchronize()`` itself does
nothing (it logs "CPU device is not supported"): there the step ends when its loss is read
back, queued work lands in the next step, and medians measure throughput (docs/benchmarks.md).

``--shard`` adds ``DistributedOptimizer(net, cls, shard=True)`` (ZeRO-1; its wrapper reduces after
backward) and a column of optimizer state per rank (``--optimizer adam`` makes that state two
tensors per parameter; the sharded setup also holds float32 copies of its pieces).

``--paths`` adds reference paths built from raw MindSpore calls (no reduction at all, one
fused ``ops.AllReduce`` after backward, one async ``mint.distributed.all_reduce`` per
gradient from a parameter hook) and splits every step into phases: ``backward`` (until
``value_and_grad`` returns), ``reduce`` (until the reducer returns) and ``update`` (the
optimizer, which waits for the reduced gradients, through the final synchronize). That
is the measurement behind docs/mindspore.md's account of where the time goes on MCCL.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=2, help="ranks, when this script launches msrun itself")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per reducer")
    parser.add_argument("--block", type=int, default=5)
    parser.add_argument("--bucket-size-mb", type=float, default=25.0)
    parser.add_argument("--graph", action="store_true", help="GRAPH mode (both reducers run after backward)")
    parser.add_argument(
        "--model",
        choices=["convnet", "mlp", "cnn23m", "transformer-5m", "tiny400"],
        default="convnet",
        help="convnet: compute-heavy (examples/train_mindspore.py); mlp: 24 Dense layers, communication-heavy; "
        "tiny400: 200 Dense(16, 16) layers, 400 tensors and near-zero compute (the host's share of a step); "
        "cnn23m: a CNN with 22 MB of float32 gradients; transformer-5m: benchmarks/ddp_compare.py's link workload "
        "(5.7 M parameters, 23 MB of float32 gradients in 54 tensors); use the last two with --link",
    )
    parser.add_argument("--overlap", choices=["auto", "on", "off"], default="auto")
    parser.add_argument(
        "--compression",
        choices=["fp16", "powersgd"],
        help="collective_ops communicates in fp16, or compressed by co.PowerSGD(rank=4, start_iter=2) from the "
        "timed steps on (DistributedGradReducer: fp32)",
    )
    parser.add_argument(
        "--train-cell",
        action="store_true",
        help="whole steps as nn.TrainOneStepCell (one graph per step in GRAPH mode) with each reducer inside",
    )
    parser.add_argument("--paths", action="store_true", help="also time raw reference paths, per phase")
    parser.add_argument("--shard", action="store_true", help="also time DistributedOptimizer(shard=True)")
    parser.add_argument(
        "--distributed-optimizer",
        action="store_true",
        help="also time the unsharded DistributedOptimizer in the functional loop (its wrapper reducing per bucket)",
    )
    parser.add_argument("--optimizer", choices=["momentum", "adam"], default="momentum")
    parser.add_argument(
        "--step-check-cost",
        action="store_true",
        help="also time collective_ops with check_step_alignment=True (the price of the per-step check)",
    )
    parser.add_argument("--json")
    parser.add_argument(
        "--link",
        default="none",
        help="run as 2 msrun nodes joined by an emulated link (a tc rate, e.g. 1gbit; needs root); none = loopback",
    )
    return parser.parse_args(argv)


def launch(args) -> int:
    """Not under msrun: run this script under msrun and print rank 0's result."""
    out = Path(tempfile.mkdtemp(prefix="ms-compare-"))
    env = dict(os.environ, PATH=str(Path(sys.executable).parent) + os.pathsep + os.environ.get("PATH", ""))
    env.setdefault("GLOG_v", "3")
    from tests.harness import free_port

    if args.link != "none":  # one msrun node per namespace, rendezvous at node 0's veth address
        if args.world % 2:
            raise SystemExit(f"--world {args.world} does not split over the link's 2 nodes")
        msrun = ["msrun", f"--worker_num={args.world}", f"--local_worker_num={args.world // 2}"]
        msrun += ["--node_rank={node_rank}", "--master_addr={master_addr}", "--master_port={master_port}"]
        msrun += [f"--log_dir={out / 'logs'}" + "/node{node_rank}"]
    else:
        msrun = ["msrun", f"--worker_num={args.world}", f"--local_worker_num={args.world}"]
        msrun += [f"--master_port={free_port()}", f"--log_dir={out / 'logs'}"]
    cmd = (
        [
            *msrun,
            "--join=True",
            __file__,
            "--steps",
            str(args.steps),
            "--block",
            str(args.block),
            "--bucket-size-mb",
            str(args.bucket_size_mb),
            "--json",
            str(out / "result.json"),
            "--model",
            args.model,
            "--overlap",
            args.overlap,
        ]
        + (["--graph"] if args.graph else [])
        + (["--paths"] if args.paths else [])
        + (["--train-cell"] if args.train_cell else [])
        + (["--shard"] if args.shard else [])
        + (["--distributed-optimizer"] if args.distributed_optimizer else [])
        + (["--step-check-cost"] if args.step_check_cost else [])
        + ["--optimizer", args.optimizer]
        + (["--compression", args.compression] if args.compression else [])
    )
    if args.link != "none":
        from collective_ops.tools.link import run_on_link_or_explain

        code = run_on_link_or_explain(args.link, lambda link, node: link.fill(cmd, node), log_dir=str(out), env=env)
        proc = subprocess.CompletedProcess(cmd, code, "", "")
    else:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0 or not (out / "result.json").exists():
        print(proc.stdout[-3000:], proc.stderr[-3000:], file=sys.stderr)
        for log in sorted((out / "logs").rglob("worker_*.log")):
            print(log.read_text(errors="replace")[-3000:], file=sys.stderr)
        return 1
    result = json.loads((out / "result.json").read_text())
    print(result["table"])
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


def run(args) -> None:
    import mindspore as ms
    import numpy as np
    from mindspore import nn

    import collective_ops as co
    from collective_ops.tools.link import link_label
    from examples.train_mindspore import ConvNet

    ms.set_context(mode=ms.GRAPH_MODE if args.graph else ms.PYNATIVE_MODE)
    ctx = co.init()
    loss_fn = nn.CrossEntropyLoss()
    rng = np.random.default_rng(ctx.rank)
    data = [_batch(args.model, rng) for _ in range(4)]

    def build():
        if args.model == "convnet":
            return ConvNet()
        if args.model == "cnn23m":
            return _cnn23m()
        if args.model == "transformer-5m":
            return _transformer_5m()
        if args.model == "tiny400":
            return nn.SequentialCell(*[nn.Dense(16, 16) for _ in range(199)], nn.Dense(16, 10))
        layers = [cell for _ in range(24) for cell in (nn.Dense(256, 256), nn.ReLU())]
        return nn.SequentialCell(*layers, nn.Dense(256, 10))

    if args.train_cell:
        # As data-parallel MindSpore scripts set it: nn.TrainOneStepCell then builds its own
        # DistributedGradReducer (mean over the group) and MindSpore's comm-fusion settings apply.
        ms.set_auto_parallel_context(parallel_mode=ms.ParallelMode.DATA_PARALLEL, gradients_mean=True)
    setups = {}
    kinds = ["DistributedGradReducer", "collective_ops"]
    if args.paths and args.train_cell:
        raise SystemExit("--paths times the functional loop's phases; it does not combine with --train-cell")
    if args.paths:
        kinds += ["no reduction", "fused ops.AllReduce", "per-gradient hook launch"]
    elif _link_rate():  # compute alone, beside the link's wire time
        kinds.append("no reduction")
    if args.train_cell:
        kinds.append(OPTIMIZER)
    if args.step_check_cost:
        kinds.append(CHECKED)
    if args.shard and args.train_cell:
        raise SystemExit("--shard times the functional loop (opt(grads)); it does not combine with --train-cell")
    if args.shard:
        kinds.append(SHARDED)
    if args.distributed_optimizer:
        kinds.append(FUNCTIONAL_OPTIMIZER)
    optimizer_class, optimizer_kwargs = {
        "momentum": (nn.Momentum, {"learning_rate": 0.01, "momentum": 0.9}),
        "adam": (nn.Adam, {"learning_rate": 1e-3, "weight_decay": 0.01}),
    }[args.optimizer]
    for kind in kinds:
        ms.set_seed(0)
        net = build()
        wrapped = None
        if kind != SHARDED:  # (the sharded setup builds its optimizer over its pieces, below)
            opt = optimizer_class(net.trainable_params(), **optimizer_kwargs)
        if kind == OPTIMIZER:  # the reduction inside the optimizer, which TrainOneStepCell then leaves to it
            wrapped = co.wrap(net, bucket_size_mb=args.bucket_size_mb, overlap=False)
            opt = co.DistributedOptimizer(wrapped, optimizer_class, **optimizer_kwargs)
            reduce = lambda grads: grads  # noqa: E731  (the optimizer reduces them itself)
        elif kind == FUNCTIONAL_OPTIMIZER:
            wrapped = co.wrap(net, bucket_size_mb=args.bucket_size_mb)
            opt = co.DistributedOptimizer(wrapped, optimizer_class, **optimizer_kwargs)
            reduce = lambda grads: grads  # noqa: E731  (its wrapper reduces them, bucket by bucket)
        elif kind == SHARDED:
            wrapped = co.wrap(net, bucket_size_mb=args.bucket_size_mb, overlap=False)
            opt = co.DistributedOptimizer(wrapped, optimizer_class, shard=True, **optimizer_kwargs)
            reduce = lambda grads: grads  # noqa: E731  (the sharded optimizer reduces them itself)
        elif kind in ("collective_ops", CHECKED):
            overlap = {"auto": None, "on": True, "off": False}[args.overlap]
            wrapped = co.wrap(
                net,
                bucket_size_mb=args.bucket_size_mb,
                overlap=overlap,
                compression=_compression(args.compression),
                check_step_alignment=kind == CHECKED,
            )
            reduce = wrapped.reduce
        elif kind == "DistributedGradReducer":
            reduce = nn.DistributedGradReducer(opt.parameters, mean=True, degree=ctx.world_size)
        else:
            reduce = reference_path(kind, opt.parameters, ctx.world_size)

        setups[kind] = (ms.value_and_grad(_loss_of(net, loss_fn), None, opt.parameters), reduce, opt, wrapped)
        if args.train_cell:  # the reducer inside nn.TrainOneStepCell, where DistributedGradReducer sits
            with_loss = nn.WithLossCell(net, loss_fn)
            if kind == OPTIMIZER:
                cell = nn.TrainOneStepCell(nn.WithLossCell(wrapped, loss_fn), opt)
            elif wrapped is not None:
                from collective_ops.mindspore import TrainOneStepCell

                cell = TrainOneStepCell(with_loss, opt, wrapped)
            elif kind == "no reduction":  # built outside DATA_PARALLEL: no reducer in its graph
                ms.reset_auto_parallel_context()
                cell = nn.TrainOneStepCell(with_loss, opt)
                ms.set_auto_parallel_context(parallel_mode=ms.ParallelMode.DATA_PARALLEL, gradients_mean=True)
                assert not cell.reducer_flag
            else:
                cell = nn.TrainOneStepCell(with_loss, opt)  # its own DistributedGradReducer (data-parallel mode)
                assert isinstance(cell.grad_reducer, nn.DistributedGradReducer) and cell.reducer_flag
            setups[kind] = (cell, None, opt, wrapped)

    phase_names = ("backward", "reduce", "update", "step")

    def step(kind: str, i: int) -> tuple[float, ...]:
        grad_fn, reduce, opt, _ = setups[kind]
        start = time.perf_counter()
        if args.train_cell:  # one call: forward, backward, reduction, update
            grad_fn(*data[i % len(data)]).asnumpy()
            ms.runtime.synchronize()
            end = time.perf_counter()
            return end - start, 0.0, 0.0, end - start
        loss, grads = grad_fn(*data[i % len(data)])
        backward_done = time.perf_counter()
        reduced = reduce(grads)
        reduce_done = time.perf_counter()
        opt(reduced)
        loss.asnumpy()
        ms.runtime.synchronize()  # every update (so every reduction) is done: a step ends here for both
        end = time.perf_counter()
        return backward_done - start, reduce_done - backward_done, end - reduce_done, end - start

    times = {kind: {name: [] for name in phase_names} for kind in setups}
    first_call_s = {}  # GRAPH mode: the step's compilation
    for kind in setups:
        for i in range(2):
            seconds = step(kind, i)[-1]  # warm-up (and collective_ops' bucket rebuild)
            first_call_s.setdefault(kind, seconds)
    for round_ in range(max(args.steps // args.block, 1)):
        order = list(setups) if round_ % 2 == 0 else list(reversed(list(setups)))
        for kind in order:
            for i in range(args.block):
                for name, value in zip(phase_names, step(kind, i)):
                    times[kind][name].append(value)
    if ctx.rank == 0:
        median_ms = {k: {n: statistics.median(v) * 1e3 for n, v in phases.items()} for k, phases in times.items()}
        ref = median_ms["DistributedGradReducer"]["step"]
        ours = median_ms["collective_ops"]["step"]
        stats = setups["collective_ops"][3].comm_stats()
        n_grads = len(setups["collective_ops"][2].parameters)
        params = sum(int(p.size) for p in setups["collective_ops"][2].parameters)
        calls = {
            "DistributedGradReducer": f"{n_grads} in one @jit graph",
            "collective_ops": f"{stats['collectives_per_step']} ({stats['buckets']} bucket(s), {stats['mode']})",
            CHECKED: _collectives(setups[CHECKED][3], "with the step table") if CHECKED in setups else "",
            "no reduction": "0",
            OPTIMIZER: _collectives(setups[OPTIMIZER][3], "inside the optimizer") if OPTIMIZER in setups else "",
            "fused ops.AllReduce": "1 (after backward)",
            "per-gradient hook launch": f"{n_grads} (during backward)",
            FUNCTIONAL_OPTIMIZER: _collectives(setups[FUNCTIONAL_OPTIMIZER][3], "its wrapper's")
            if FUNCTIONAL_OPTIMIZER in setups
            else "",
            SHARDED: f"{2 * len(setups[SHARDED][3].manager.plan.buckets)} (reduce-scatter + all-gather per bucket)"
            if SHARDED in setups
            else "",
        }
        lines = [
            f"# mindspore_compare: {ctx.world_size} ranks, backend {ctx.backend}, {link_label()}, "
            f"{'GRAPH' if args.graph else 'PyNative'} "
            f"mode, {args.model} {params / 1e6:.2f} M params, bucket_size_mb={args.bucket_size_mb:g}"
            + (f", collective_ops compression={args.compression}" if args.compression else ""),
            f"# {'reducer':<36} {'median step ms':>15} {'x DGR':>7} {'first call s':>13} {'collectives/step':>36}"
            + ("   backward   reduce   update (median ms)" if args.paths else ""),
        ]
        for kind, phases in median_ms.items():
            line = (
                f"  {kind:<36} {phases['step']:>15.1f} {phases['step'] / ref:>7.3f} {first_call_s[kind]:>13.1f} "
                f"{calls[kind]:>36}"
            )
            if args.paths:
                line += f" {phases['backward']:>10.1f} {phases['reduce']:>8.1f} {phases['update']:>8.1f}"
            lines.append(line)
        lines.append(f"# ratio collective_ops / DistributedGradReducer = {ours / ref:.3f}")
        ratios = {kind: phases["step"] / ref for kind, phases in median_ms.items()}
        if _link_rate():
            lines += _wire_lines(ctx.world_size, setups["collective_ops"][2].parameters, median_ms)
        if SHARDED in setups:
            lines.append(_state_line(setups, median_ms, ref))
        table = "\n".join(lines)
        if args.json:
            Path(args.json).write_text(
                json.dumps(
                    {
                        "table": table,
                        "times_s": times,
                        "ratio": ours / ref,
                        "ratios": ratios,
                        "first_call_s": first_call_s,
                    }
                )
            )
        else:
            print(table)
    co.shutdown()


SHARDED = "collective_ops shard=True"
FUNCTIONAL_OPTIMIZER = "collective_ops DistributedOptimizer, functional loop"
OPTIMIZER = "collective_ops DistributedOptimizer"


def _loss_of(net, loss_fn):
    """The loss function of ``net`` for ``value_and_grad`` (a closure: GRAPH mode compiles no default arguments)."""

    def forward(x, y):
        return loss_fn(net(x), y)

    return forward


def _compression(name: str | None):
    """``--compression``'s option for wrap: PowerSGD at the rank the torch link benchmarks use, compressing from
    the third step (the first timed one: every setup runs two warm-up steps)."""
    import collective_ops as co

    return co.PowerSGD(rank=4, start_iter=2) if name == "powersgd" else name


def _collectives(wrapped, where: str) -> str:
    """A setup's collectives a step, as its wrapper counts them (a compiled reduction's allreduces: one per gradient
    sent alone and one per fused group; PowerSGD's two a bucket; the step-alignment check's table)."""
    stats = wrapped.comm_stats()
    return f"{stats['collectives_per_step']} ({stats['buckets']} bucket(s), {where})"


def _cnn23m():
    """A CNN with 5.8 M float32 parameters (23 MB of gradients): four 3x3 convolutions, then a wide Dense."""
    from mindspore import nn

    convs = [(3, 64), (64, 128), (128, 256), (256, 512)]
    layers = [c for i, o in convs for c in (nn.Conv2d(i, o, 3, pad_mode="same"), nn.ReLU(), nn.MaxPool2d(2, 2))]
    return nn.SequentialCell(*layers, nn.Flatten(), nn.Dense(512 * 2 * 2, 2048), nn.ReLU(), nn.Dense(2048, 10))


_VOCAB, _SEQ, _ROWS = 5000, 64, 10  # as benchmarks/ddp_compare.py's transformer-5m


def _batch(model: str, rng):
    """One batch of ``model``'s inputs and integer labels (random, per rank)."""
    import mindspore as ms
    import numpy as np

    if model == "transformer-5m":  # next-token labels over the flattened rows
        tokens = rng.integers(0, _VOCAB, (_ROWS, _SEQ + 1)).astype(np.int32)
        return ms.Tensor(tokens[:, :-1]), ms.Tensor(tokens[:, 1:].reshape(-1))
    shape = {"mlp": (16, 256), "tiny400": (4, 16)}.get(model, (16, 3, 32, 32))
    labels = rng.integers(0, 10, shape[0]).astype(np.int32)
    return ms.Tensor(rng.standard_normal(shape).astype(np.float32)), ms.Tensor(labels)


def _transformer_5m():
    """benchmarks/ddp_compare.py's transformer-5m in MindSpore: embedding, 4 pre-norm encoder layers (width 256,
    4 heads, feed-forward 1024), a vocabulary head; logits flattened to (rows * seq, vocab)."""
    from mindspore import nn, ops

    dim, heads, ffn, layers = 256, 4, 1024, 4

    class Layer(nn.Cell):
        def __init__(self):
            super().__init__()
            self.norm1, self.norm2 = nn.LayerNorm((dim,)), nn.LayerNorm((dim,))
            self.qkv, self.out = nn.Dense(dim, 3 * dim), nn.Dense(dim, dim)
            self.up, self.down = nn.Dense(dim, ffn), nn.Dense(ffn, dim)
            self.act, self.softmax = nn.GELU(), nn.Softmax(-1)

        def construct(self, x):
            rows, seq, _ = x.shape
            qkv = self.qkv(self.norm1(x)).reshape(rows, seq, 3, heads, dim // heads).transpose(2, 0, 3, 1, 4)
            scores = ops.matmul(qkv[0], qkv[1].transpose(0, 1, 3, 2)) * (dim // heads) ** -0.5
            mixed = ops.matmul(self.softmax(scores), qkv[2]).transpose(0, 2, 1, 3).reshape(rows, seq, dim)
            x = x + self.out(mixed)
            return x + self.down(self.act(self.up(self.norm2(x))))

    class Transformer(nn.Cell):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(_VOCAB, dim)
            self.layers = nn.SequentialCell([Layer() for _ in range(layers)])
            self.norm, self.head = nn.LayerNorm((dim,)), nn.Dense(dim, _VOCAB)

        def construct(self, tokens):
            return self.head(self.norm(self.layers(self.embed(tokens)))).reshape(-1, _VOCAB)

    return Transformer()


def _link_rate() -> str | None:
    """The emulated link's tc rate in an msrun worker on it (the workers' command line has no --link)."""
    from benchmarks.common import link_rate

    return link_rate()


def _wire_lines(world: int, params, median_ms: dict) -> list[str]:
    """Compute alone (the step without a reduction), the wire time of one step's float32 gradients at the link's
    rate, and each step as a multiple of the larger: what a step on that link cannot go under."""
    from benchmarks.common import physical_limit

    nbytes = sum(int(p.size) * p.itemsize for p in params)
    steps = {kind: phases["step"] for kind, phases in median_ms.items()}
    compute = median_ms.get("no reduction", {}).get("step")
    limit = physical_limit(steps, compute or 0.0, nbytes, world)
    if compute is None:
        return [f"# compute alone not timed; wire time of one step's {nbytes / 2**20:.2f} MiB: {limit.wire_ms:.1f} ms"]
    lines = [f"# {limit.line()}; each step x max(compute, wire):"]
    return lines + [f"#   {kind:<36} {limit.ratio(ms):.2f}x" for kind, ms in steps.items()]


CHECKED = "collective_ops check_step_alignment=True"


def _state_line(setups: dict, median_ms: dict, ref_ms: float) -> str:
    """The sharded setup's step against DGR's, and each one's optimizer state on this rank (MiB of float32)."""
    plain, sharded = setups["DistributedGradReducer"][2], setups[SHARDED][2]
    own = {id(p) for p in plain.parameters}
    plain_elements = sum(int(p.size) for p in plain.get_parameters() if id(p) not in own and p.name.partition(".")[2])
    mib = 4 / 2**20
    return (
        f"# {SHARDED}: {median_ms[SHARDED]['step'] / ref_ms:.3f}x DistributedGradReducer's step; optimizer state "
        f"on rank 0: {sharded.state_elements() * mib:.2f} MiB (+ {sharded.piece_elements * mib:.2f} MiB of "
        f"parameter pieces) against {plain_elements * mib:.2f} MiB unsharded"
    )


def reference_path(kind: str, params, world_size: int):
    """A reducer built from raw MindSpore calls, to show what each way of launching costs."""
    import mindspore as ms
    import mindspore.mint.distributed as mdist
    from mindspore import mint, ops

    if kind == "no reduction":
        return lambda grads: grads
    if kind == "fused ops.AllReduce":  # one flat buffer, reduced in MindSpore's kernel queue
        allreduce, scale = ops.AllReduce(), ms.Tensor(1.0 / world_size, ms.float32)
        sizes = [int(p.size) for p in params]

        def fused(grads):
            flat = allreduce(mint.cat([g.reshape(-1) for g in grads])) * scale
            return tuple(part.reshape(p.shape) for part, p in zip(mint.split(flat, sizes), params))

        return fused
    if kind == "per-gradient hook launch":  # each gradient reduced (async) as backward produces it
        reduced = {}

        def make_hook(name):
            def hook(grad):
                copy = grad.copy()
                mdist.all_reduce(copy, op="avg", async_op=True)
                reduced[name] = copy

            return hook

        for p in params:
            p.register_hook(make_hook(p.name))
        return lambda grads: tuple(reduced.pop(p.name) for p in params)
    raise ValueError(kind)


def main(argv=None) -> int:
    args = parse_args(argv)
    if "MS_ROLE" not in os.environ and "RANK_ID" not in os.environ:
        return launch(args)
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
