"""Lightning training runs, launched by Lightning itself (``devices=2`` on CPU), for the integration tests.

    python tests/integrations/lightning_train.py --fit STRATEGY,DIR[,save=PATH][,resume=PATH] [--fit ...] \
        [--epochs N] [--num-nodes 2]

STRATEGY: ddp|collective_ops|collective_ops_optimizer|collective_ops_sharded|collective_ops_powersgd. Each ``--fit``
is one ``Trainer.fit`` of a fresh model, in the order given, in the same processes (as a script that fits twice:
importing Lightning costs ~10 s of CPU a process); ``save=`` writes a checkpoint after its first epoch (and
``PATH.after_fit`` after fit), ``resume=`` starts from one. Each rank writes ``DIR/rank{r}.pt``: its weights and
buffers, the metrics Lightning logged, the model's class after training (teardown unwrapped it?) and how many
gradient collectives the wrapper issued.
"""

from __future__ import annotations

import argparse
import os

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class Classifier(L.LightningModule):
    """A BatchNorm CNN: running statistics make buffer broadcasts visible in the weights and val_loss."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
            nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
            nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(32, 4),
        )  # fmt: skip
        self.loss = nn.CrossEntropyLoss()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: tuple, batch_index: int) -> torch.Tensor:
        x, y = batch
        loss = self.loss(self(x), y)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch: tuple, batch_index: int) -> None:
        x, y = batch
        self.log("val_loss", self.loss(self(x), y), sync_dist=True)

    def configure_optimizers(self) -> dict:
        optimizer = torch.optim.AdamW(self.parameters(), lr=0.01, weight_decay=0.01)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class BufferLog(L.Callback):
    """Each rank's BatchNorm statistics after every training batch: when buffers are broadcast shows here, where the
    final state hides it (a validation's broadcast overwrites what came before)."""

    def __init__(self) -> None:
        self.after_batch: list[torch.Tensor] = []
        self.trained_through = ""

    def on_train_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self.trained_through = type(trainer.strategy.model).__module__

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, *args: object) -> None:
        self.after_batch.append(torch.cat([b.detach().flatten().double() for b in module.buffers()]))


class SaveAfterFirstEpoch(L.Callback):
    """``trainer.save_checkpoint`` at the end of the first epoch (every rank calls it, as Lightning requires)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_epoch_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        if trainer.current_epoch == 0:
            trainer.save_checkpoint(self.path)


def loaders() -> tuple[DataLoader, DataLoader]:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(96, 3, 8, 8, generator=generator)
    y = torch.randint(0, 4, (96,), generator=generator)
    train = DataLoader(TensorDataset(x[:64], y[:64]), batch_size=4)
    val = DataLoader(TensorDataset(x[64:], y[64:]), batch_size=8)
    return train, val


def strategy(name: str) -> object:
    if name == "ddp":
        from lightning.pytorch.strategies import DDPStrategy

        return DDPStrategy()
    import collective_ops as co
    from collective_ops.lightning import CollectiveOpsStrategy

    return CollectiveOpsStrategy(
        distributed_optimizer=name in ("collective_ops_optimizer", "collective_ops_sharded"),
        shard=name == "collective_ops_sharded",
        bucket_size_mb=0.01,
        compression=co.PowerSGD(rank=1, start_iter=2) if name == "collective_ops_powersgd" else None,
    )


def run_spec(text: str) -> dict[str, str]:
    """``STRATEGY,DIR[,save=PATH][,resume=PATH]`` as a dict."""
    name, out, *options = text.split(",")
    return {"strategy": name, "out": out, **dict(option.split("=", 1) for option in options)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--fit", type=run_spec, action="append", required=True)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--num-nodes", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(1)
    for run in args.fit:
        fit(run, args.epochs, args.num_nodes)


def fit(run: dict[str, str], epochs: int, num_nodes: int) -> None:
    L.seed_everything(0, verbose=False)
    model = Classifier()
    buffer_log = BufferLog()
    save = run.get("save")
    callbacks = [buffer_log] + ([SaveAfterFirstEpoch(save)] if save else [])
    trainer = L.Trainer(
        callbacks=callbacks,
        accelerator="cpu",
        devices=2 // num_nodes,
        num_nodes=num_nodes,
        strategy=strategy(run["strategy"]),
        max_epochs=epochs,
        accumulate_grad_batches=2,
        gradient_clip_val=0.05,  # by value: under shard=True after the averaged gradients are gathered, so
        gradient_clip_algorithm="value",  # every run's arithmetic is DDPStrategy's
        num_sanity_val_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    train, val = loaders()
    trainer.fit(model, train, val, ckpt_path=run.get("resume"))
    if save:  # after fit, the strategy unwrapped: the checkpoint still holds what it did in fit
        trainer.save_checkpoint(f"{save}.after_fit")
    rank = trainer.global_rank
    os.makedirs(run["out"], exist_ok=True)
    torch.save(
        {
            "state": {k: v.clone() for k, v in model.state_dict().items()},
            "metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
            "buffers_after_batch": torch.stack(buffer_log.after_batch),
            "model_after": type(trainer.strategy.model).__name__,
            "trained_through": buffer_log.trained_through,
            "world_size": trainer.world_size,
        },
        os.path.join(run["out"], f"rank{rank}.pt"),
    )


if __name__ == "__main__":
    main()
