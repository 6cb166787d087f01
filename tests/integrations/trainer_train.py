"""A transformers ``Trainer`` run of a tiny GPT-2 built from a config (no download), under torchrun (2 CPU processes).

    torchrun --nproc-per-node 2 tests/integrations/trainer_train.py --route ours [ddp] --out DIR

``ours`` hands the Trainer's accelerator to ``collective_ops.accelerate.use`` before ``train()``; several routes run
in turn in the same processes. Each rank writes ``DIR/ROUTE/rank{r}.pt``: the logged losses, the final weights and
the wrapper class the Trainer trained through.
"""

from __future__ import annotations

import argparse
import os

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments


class Tokens(torch.utils.data.Dataset):
    def __init__(self, count: int = 48, length: int = 16) -> None:
        generator = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, 64, (count, length), generator=generator)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[index], "labels": self.ids[index]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--route", choices=("ddp", "ours"), nargs="+", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    for route in args.route:
        train_route(route, os.path.join(args.out, route))


def train_route(route: str, out: str) -> None:
    os.makedirs(out, exist_ok=True)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2))
    training = TrainingArguments(
        output_dir=os.path.join(out, "trainer"),
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        max_steps=6,
        learning_rate=1e-3,
        max_grad_norm=1.0,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=training, train_dataset=Tokens())
    if route == "ours":
        import collective_ops.accelerate as co_accelerate

        co_accelerate.use(trainer.accelerator, bucket_size_mb=0.05)
    trainer.train()
    rank = trainer.accelerator.process_index
    torch.save(
        {
            "losses": [entry["loss"] for entry in trainer.state.log_history if "loss" in entry],
            "state": {k: v.detach().clone() for k, v in model.state_dict().items()},
            "trained_through": type(trainer.model_wrapped).__module__,
        },
        os.path.join(out, f"rank{rank}.pt"),
    )


if __name__ == "__main__":
    main()
