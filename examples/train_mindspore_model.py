"""MindSpore's high-level API with collective_ops: ``Model.train`` with callbacks, rank 0 checkpoints.

    msrun --worker_num=2 --local_worker_num=2 --master_port=8118 --log_dir=logs --join=True \\
        examples/train_mindspore_model.py --epochs 2

The training network is ``collective_ops.mindspore.TrainOneStepCell``: MindSpore's
``nn.TrainOneStepCell`` whose gradient reducer is collective_ops' bucket reduction (hooks in
PyNative mode, the plan compiled into the step in GRAPH mode with ``--graph``), in place of the
``DistributedGradReducer`` that ``Model(net, loss_fn, optimizer)`` builds in data-parallel
mode. With ``--loss-scale N`` it is ``TrainOneStepWithLossScaleCell`` instead, with a dynamic
loss scale from N (mixed precision; every rank skips an overflowed step alike). Rank 0 alone writes
checkpoints; they load with ``mindspore.load_checkpoint`` into the plain network, without
collective_ops. Data is synthetic, each rank its own shard.
"""

from __future__ import annotations

import argparse

import mindspore as ms
import numpy as np
from mindspore import nn
from mindspore.train import CheckpointConfig, LossMonitor, Model, ModelCheckpoint, TimeMonitor

import collective_ops as co
from collective_ops.mindspore import TrainOneStepCell, TrainOneStepWithLossScaleCell


class ConvNet(nn.Cell):
    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.features = nn.SequentialCell(
            nn.Conv2d(3, 16, 3, pad_mode="same"), nn.ReLU(), nn.MaxPool2d(2, 2), nn.Flatten()
        )
        self.classifier = nn.Dense(16 * 16 * 16, num_classes)

    def construct(self, x):
        return self.classifier(self.features(x))


def shard(rank: int, batches: int, batch_size: int) -> ms.dataset.Dataset:
    """This rank's part of the data (a real job would pass num_shards/shard_id to its dataset)."""
    rng = np.random.default_rng(rank)
    x = rng.standard_normal((batches * batch_size, 3, 32, 32)).astype(np.float32)
    y = rng.integers(0, 10, batches * batch_size).astype(np.int32)
    return ms.dataset.NumpySlicesDataset({"x": x, "y": y}, shuffle=False).batch(batch_size)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batches", type=int, default=8, help="per rank and epoch")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--checkpoint-dir", default="checkpoints")
    parser.add_argument("--graph", action="store_true", help="GRAPH mode (the reduction compiled into the step)")
    parser.add_argument(
        "--loss-scale",
        type=float,
        default=None,
        help="a dynamic loss scale starting at this value (a power of two: the reduction is then bit-exact)",
    )
    args = parser.parse_args()

    ms.set_context(mode=ms.GRAPH_MODE if args.graph else ms.PYNATIVE_MODE)
    ctx = co.init()  # msrun's environment; no set_auto_parallel_context: the reduction is ours
    ms.set_seed(0)
    net = co.wrap(ConvNet())  # rank 0's weights on every rank, the bucket plan checked alike
    with_loss = nn.WithLossCell(net.network, nn.CrossEntropyLoss())
    optimizer = nn.Momentum(with_loss.trainable_params(), learning_rate=0.001, momentum=0.9)
    if args.loss_scale is None:
        train_cell = TrainOneStepCell(with_loss, optimizer, net)
    else:  # halves on an overflow (that step skipped on every rank), doubles after 1000 steps without one
        scale = nn.DynamicLossScaleUpdateCell(loss_scale_value=args.loss_scale, scale_factor=2, scale_window=1000)
        train_cell = TrainOneStepWithLossScaleCell(with_loss, optimizer, net, scale_sense=scale)
    model = Model(train_cell)

    callbacks = [LossMonitor(per_print_times=4), TimeMonitor()]
    if ctx.rank == 0:  # one copy of the weights is enough: every rank holds the same
        config = CheckpointConfig(save_checkpoint_steps=args.batches, keep_checkpoint_max=2)
        callbacks.append(ModelCheckpoint(prefix="convnet", directory=args.checkpoint_dir, config=config))
    model.train(
        args.epochs, shard(ctx.rank, args.batches, args.batch_size), callbacks=callbacks, dataset_sink_mode=False
    )
    if ctx.rank == 0:
        print(f"{ctx.world_size} rank(s), backend {ctx.backend}; checkpoints in {args.checkpoint_dir}/")
    co.shutdown()


if __name__ == "__main__":
    main()
