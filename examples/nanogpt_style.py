"""A nanoGPT-style single-file training loop on collective-ops: the DDP line is the only change.

    torchrun --nproc-per-node 2 examples/nanogpt_style.py                  # collective_ops.wrap
    torchrun --nproc-per-node 2 examples/nanogpt_style.py --ddp            # torch's DDP, for comparison
    torchrun --nproc-per-node 2 examples/nanogpt_style.py --distributed-optimizer  # updates overlapped with forward

What nanoGPT's ``train.py`` does is kept as it writes it: gradient accumulation by toggling
``model.require_backward_grad_sync`` on the last micro-step, ``model.module`` for the raw model, clipping with
``torch.nn.utils.clip_grad_norm_``, evaluation on the master process only, and checkpoints of the raw model and
the optimizer from the master. The data is a synthetic token stream (no download). The last line printed is a
hash of the weights' bytes: the same under ``--ddp`` and without it.
"""

from __future__ import annotations

import argparse
import hashlib
import math
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

import collective_ops as co


class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln_1, self.ln_2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attn, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self.attn(self.ln_1(x)).split(width, dim=2)
        q, k, v = (t.view(batch, length, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(batch, length, width)
        x = x + self.proj(y)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int = 64, context: int = 32, width: int = 64, layers: int = 2, heads: int = 4) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, width), nn.Embedding(context, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)
        self.lm_head = nn.Linear(width, vocab, bias=False)
        self.wte.weight = self.lm_head.weight  # weight tying, as nanoGPT

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1)) if targets is not None else None
        return logits, loss


def get_batch(data: torch.Tensor, generator: torch.Generator, batch: int, context: int) -> tuple:
    starts = torch.randint(len(data) - context - 1, (batch,), generator=generator)
    x = torch.stack([data[i : i + context] for i in starts])
    return x, torch.stack([data[i + 1 : i + 1 + context] for i in starts])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ddp", action="store_true", help="torch's DistributedDataParallel instead of co.wrap")
    parser.add_argument("--distributed-optimizer", action="store_true", help="co.DistributedOptimizer(AdamW)")
    parser.add_argument("--iters", type=int, default=12)
    parser.add_argument("--eval-interval", type=int, default=4)
    parser.add_argument("--out-dir", default=None, help="where the master saves ckpt.pt (default: none saved)")
    args = parser.parse_args()
    torch.set_num_threads(1)

    ctx = co.init()  # torchrun's environment; adopts a process group made before it
    master_process = ctx.rank == 0
    gradient_accumulation_steps, batch, context = 2, 4, 32
    torch.manual_seed(1337)
    data = torch.randint(0, 64, (20_000,))
    train_gen = torch.Generator().manual_seed(1000 + ctx.rank)  # each rank its own batches
    model = GPT()
    model = torch.nn.parallel.DistributedDataParallel(model) if args.ddp else co.wrap(model)  # the one changed line
    raw_model = model.module
    if args.distributed_optimizer:
        optimizer = co.DistributedOptimizer(model, torch.optim.AdamW, lr=1e-3, weight_decay=0.1)
    else:
        optimizer = torch.optim.AdamW(raw_model.parameters(), lr=1e-3, weight_decay=0.1)

    @torch.no_grad()
    def estimate_loss() -> float:
        model.eval()
        eval_gen = torch.Generator().manual_seed(7)
        losses = [model(*get_batch(data, eval_gen, batch, context))[1].item() for _ in range(3)]
        model.train()
        return sum(losses) / len(losses)

    for iter_num in range(args.iters):
        lr = 1e-3 * 0.5 * (1 + math.cos(math.pi * iter_num / args.iters))
        for group in optimizer.param_groups:
            group["lr"] = lr
        if iter_num % args.eval_interval == 0 and master_process:
            print(f"step {iter_num}: val loss {estimate_loss():.4f}")
        for micro_step in range(gradient_accumulation_steps):
            model.require_backward_grad_sync = micro_step == gradient_accumulation_steps - 1
            _, loss = model(*get_batch(data, train_gen, batch, context))
            (loss / gradient_accumulation_steps).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if args.out_dir and master_process and iter_num == args.iters - 1:
            os.makedirs(args.out_dir, exist_ok=True)
            checkpoint = {"model": raw_model.state_dict(), "optimizer": optimizer.state_dict(), "iter_num": iter_num}
            torch.save(checkpoint, os.path.join(args.out_dir, "ckpt.pt"))
    weights = model.state_dict()  # (finishes any update a DistributedOptimizer still owes)
    digest = hashlib.sha1(b"".join(t.detach().contiguous().numpy().tobytes() for t in weights.values()))
    print(f"rank {ctx.rank}: weight checksum {digest.hexdigest()}", flush=True)
    dist.barrier()
    co.shutdown()


if __name__ == "__main__":
    main()
