"""Accelerate's save_state()/load_state() with PowerSGD under torchrun (2 CPU processes), for the integration tests.

    torchrun --nproc-per-node 2 tests/integrations/accelerate_resume.py --phase full|first|resume --out DIR

``full`` trains 8 steps; ``first`` trains the first 4 and saves the state into ``DIR/state``; ``resume`` (new
processes, another seed) loads it and trains the last 4. PowerSGD compresses from the third step, so the saved
state holds each rank's error-feedback memory. Each rank writes ``DIR/{phase}_rank{r}.pt``: its final weights.
"""

from __future__ import annotations

import argparse
import os

import torch
from accelerate import Accelerator
from torch import nn

import collective_ops as co
import collective_ops.accelerate as co_accelerate


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--phase", choices=("full", "first", "resume"), required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    accelerator = Accelerator(cpu=True)
    torch.manual_seed(1 if args.phase == "resume" else 0)  # resumed weights come from the state alone
    model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 8))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    compression = co.PowerSGD(rank=2, start_iter=2, random_seed=0)
    model, optimizer = co_accelerate.prepare(accelerator, model, optimizer, bucket_size_mb=25, compression=compression)
    rank, folder = accelerator.process_index, os.path.join(args.out, "state")
    if args.phase == "resume":
        accelerator.load_state(folder)
    for step in {"full": range(8), "first": range(4), "resume": range(4, 8)}[args.phase]:
        generator = torch.Generator().manual_seed(100 * step + rank)
        x, y = torch.randn(16, 32, generator=generator), torch.randint(0, 8, (16,), generator=generator)
        accelerator.backward(nn.functional.cross_entropy(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
    if args.phase == "first":
        accelerator.save_state(folder)
    weights = {k: v.detach().clone() for k, v in accelerator.unwrap_model(model).state_dict().items()}
    torch.save(weights, os.path.join(args.out, f"{args.phase}_rank{rank}.pt"))
    accelerator.wait_for_everyone()


if __name__ == "__main__":
    main()
