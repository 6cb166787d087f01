"""Data-parallel MindSpore training with collective_ops.wrap.

    msrun --worker_num=2 --local_worker_num=2 --master_port=8118 --log_dir=logs --join=True \\
        examples/train_mindspore.py --steps 20

PyNative mode overlaps gradient communication with backward (per-Parameter hooks);
``--graph`` runs the network in GRAPH mode, where gradients are reduced after backward
in the same fused buckets. Data is synthetic.
"""

from __future__ import annotations

import argparse
import time

import mindspore as ms
import numpy as np
from mindspore import nn

import collective_ops as co


class ConvNet(nn.Cell):
    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.features = nn.SequentialCell(
            nn.Conv2d(3, 32, 3, pad_mode="same"),
            nn.ReLU(),
            nn.MaxPool2d(2, 2),
            nn.Conv2d(32, 64, 3, pad_mode="same"),
            nn.ReLU(),
            nn.MaxPool2d(2, 2),
        )
        self.flatten = nn.Flatten()
        self.classifier = nn.SequentialCell(nn.Dense(64 * 8 * 8, 256), nn.ReLU(), nn.Dense(256, num_classes))

    def construct(self, x):
        return self.classifier(self.flatten(self.features(x)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=16, help="per rank")
    parser.add_argument("--bucket-size-mb", type=float, default=25.0)
    parser.add_argument("--graph", action="store_true", help="GRAPH mode (no overlap)")
    args = parser.parse_args()

    ms.set_context(mode=ms.GRAPH_MODE if args.graph else ms.PYNATIVE_MODE)
    ctx = co.init()  # msrun's environment: MindSpore communication (MCCL on CPU, HCCL on Ascend)
    ms.set_seed(0)
    net = co.wrap(ConvNet(), bucket_size_mb=args.bucket_size_mb)
    optimizer = nn.Momentum(net.trainable_params(), learning_rate=0.01, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()

    def forward(x, y):
        return loss_fn(net(x), y)

    grad_fn = ms.value_and_grad(forward, None, optimizer.parameters)
    rng = np.random.default_rng(ctx.rank)  # each rank its own shard
    pool = [
        (
            ms.Tensor(rng.standard_normal((args.batch_size, 3, 32, 32)).astype(np.float32)),
            ms.Tensor(rng.integers(0, 10, args.batch_size).astype(np.int32)),
        )
        for _ in range(4)
    ]
    if ctx.rank == 0:
        print(f"{ctx.world_size} rank(s), backend {ctx.backend}, {'GRAPH' if args.graph else 'PyNative'} mode")
        print(net.describe_plan())
    for step in range(args.steps):
        start = time.perf_counter()
        loss, grads = grad_fn(*pool[step % len(pool)])
        grads = net.reduce(grads)  # waits for the buckets in flight, returns averaged gradients
        optimizer(grads)
        value = float(loss.asnumpy())  # reading the loss synchronizes
        if ctx.rank == 0 and (step % 5 == 0 or step == args.steps - 1):
            stats = net.comm_stats()
            print(
                f"step {step:3d}  loss {value:.4f}  {1000 * (time.perf_counter() - start):.0f} ms  "
                f"{stats['collectives_per_step']} collectives ({stats['mode']})"
            )
    co.shutdown()  # ends with a barrier so no rank leaves while a peer still sends


if __name__ == "__main__":
    main()
