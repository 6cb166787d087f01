"""Lightning on collective-ops: ``strategy=CollectiveOpsStrategy(...)`` (or ``"collective_ops"``) where DDP was.

python examples/lightning_train.py                      # Lightning's launcher starts 2 CPU processes
python examples/lightning_train.py --distributed-optimizer --shard
torchrun --nproc-per-node 2 examples/lightning_train.py  # or any launcher Lightning understands
"""

from __future__ import annotations

import argparse

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from collective_ops.lightning import CollectiveOpsStrategy


class Classifier(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 4))

    def training_step(self, batch: tuple, batch_index: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch: tuple, batch_index: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.cross_entropy(self.net(x), y), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--distributed-optimizer", action="store_true")
    parser.add_argument("--shard", action="store_true", help="with --distributed-optimizer: ZeRO-1")
    args = parser.parse_args()
    L.seed_everything(0)
    x, y = torch.randn(512, 16), torch.randint(0, 4, (512,))
    train = DataLoader(TensorDataset(x[:448], y[:448]), batch_size=16)
    val = DataLoader(TensorDataset(x[448:], y[448:]), batch_size=16)
    strategy = CollectiveOpsStrategy(
        bucket_size_mb=25, distributed_optimizer=args.distributed_optimizer, shard=args.shard
    )
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_epochs=2, accumulate_grad_batches=2,
        gradient_clip_val=1.0, enable_progress_bar=False, logger=False, enable_checkpointing=False,
    )  # fmt: skip
    trainer.fit(Classifier(), train, val)
    if trainer.is_global_zero:
        print(f"val_loss {trainer.callback_metrics['val_loss']:.4f}")


if __name__ == "__main__":
    main()
