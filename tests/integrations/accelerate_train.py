"""An Accelerate training loop under torchrun (2 CPU processes), for the integration tests.

    torchrun --nproc-per-node 2 tests/integrations/accelerate_train.py --route ours [ddp] --out DIR [--precision bf16]

``ddp`` is Accelerate's own ``prepare`` (torch's DDP); ``ours`` is ``collective_ops.accelerate.prepare``; several
routes run in turn in the same processes (as a script that trains twice: importing Accelerate costs seconds of CPU a
process). Each rank writes ``DIR/ROUTE/rank{r}.pt``: losses, weights and buffers, the evaluation metric, what
``unwrap_model`` returned, the weights ``save_state`` wrote and those ``load_state`` restored into a fresh model.
"""

from __future__ import annotations

import argparse
import os

import torch
from accelerate import Accelerator
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def build() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(12, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 32), nn.LayerNorm(32), nn.ReLU(), nn.Linear(32, 3)
    )  # fmt: skip


def data() -> tuple[TensorDataset, TensorDataset]:
    generator = torch.Generator().manual_seed(1)
    x, y = torch.randn(160, 12, generator=generator), torch.randint(0, 3, (160,), generator=generator)
    return TensorDataset(x[:128], y[:128]), TensorDataset(x[128:], y[128:])


def prepare(accelerator: Accelerator, route: str, *objects: object) -> object:
    if route == "ddp":
        return accelerator.prepare(*objects)
    import collective_ops.accelerate as co_accelerate

    return co_accelerate.prepare(accelerator, *objects, bucket_size_mb=0.005)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--route", choices=("ddp", "ours"), nargs="+", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--precision", default="no")
    args = parser.parse_args()
    torch.set_num_threads(1)
    for route in args.route:
        train_route(route, args.precision, os.path.join(args.out, route))


def train_route(route: str, precision: str, out: str) -> None:
    os.makedirs(out, exist_ok=True)
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2, mixed_precision=precision)
    train, val = data()
    model = build()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=4, gamma=0.5)
    loaders = (
        DataLoader(train, batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(2)),
        DataLoader(val, batch_size=8),
    )
    model, optimizer, train_loader, val_loader, scheduler = prepare(
        accelerator, route, model, optimizer, *loaders, scheduler
    )
    loss_fn = nn.CrossEntropyLoss()
    losses, metrics = [], []
    for _epoch in range(2):
        model.train()
        for x, y in train_loader:
            with accelerator.accumulate(model):
                loss = loss_fn(model(x), y)
                losses.append(loss.detach().float())
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
        model.eval()
        correct = []
        with torch.no_grad():
            for x, y in val_loader:
                correct.append(accelerator.gather_for_metrics((model(x).argmax(-1) == y).float()))
        metrics.append(torch.cat(correct).mean().item())
    record = {
        "trained_through": type(model).__module__,
        "losses": torch.stack(losses),
        "metrics": metrics,
        "state": {k: v.detach().clone() for k, v in accelerator.unwrap_model(model).state_dict().items()},
        "unwrapped": type(accelerator.unwrap_model(model)).__name__,
        "output_dtype": str(model(torch.randn(4, 12)).dtype),
    }
    folder = os.path.join(out, "state")
    accelerator.save_state(folder)
    accelerator.wait_for_everyone()  # the main process writes it
    saved = [f for f in os.listdir(folder) if f.startswith("model")]
    record["saved_model_files"] = sorted(saved)
    fresh_accelerator = Accelerator(cpu=True)
    fresh = prepare(fresh_accelerator, route, nn.Sequential(*build()))
    fresh_accelerator.load_state(folder)
    record["restored"] = {k: v.detach().clone() for k, v in fresh_accelerator.unwrap_model(fresh).state_dict().items()}
    torch.save(record, os.path.join(out, f"rank{accelerator.process_index}.pt"))


if __name__ == "__main__":
    main()
