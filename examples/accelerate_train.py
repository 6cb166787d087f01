"""Accelerate on collective-ops: ``co_accelerate.prepare(accelerator, ...)`` where ``accelerator.prepare(...)`` was.

torchrun --nproc-per-node 2 examples/accelerate_train.py [--mixed-precision bf16]
accelerate launch --cpu --num_processes 2 examples/accelerate_train.py
"""

from __future__ import annotations

import argparse

import torch
from accelerate import Accelerator
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import collective_ops.accelerate as co_accelerate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mixed-precision", default="no", choices=("no", "bf16", "fp16"))
    args = parser.parse_args()
    on_cpu = not torch.accelerator.is_available()  # Accelerate runs CPU processes data-parallel only when told
    accelerator = Accelerator(cpu=on_cpu, gradient_accumulation_steps=2, mixed_precision=args.mixed_precision)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = TensorDataset(torch.randn(512, 16), torch.randint(0, 4, (512,)))
    loader = DataLoader(data, batch_size=16, shuffle=True)
    model, optimizer, loader = co_accelerate.prepare(accelerator, model, optimizer, loader, bucket_size_mb=25)
    for epoch in range(2):
        for x, y in loader:
            with accelerator.accumulate(model):
                loss = nn.functional.cross_entropy(model(x), y)
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                optimizer.zero_grad()
        losses = accelerator.gather_for_metrics(loss.detach().reshape(1))
        accelerator.print(f"epoch {epoch}: mean loss {losses.mean():.4f}")
    accelerator.save_state("accelerate_state")  # the weights (unwrapped), the optimizer, the RNG states


if __name__ == "__main__":
    main()
