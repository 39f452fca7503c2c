"""A plain transformers.Trainer script; the one line that makes it flexpar's is marked.

    python examples/hf_trainer.py                              # one CPU process (or every local GPU)
    flexpar run --devices 2 examples/hf_trainer.py                 # two devices (or elastic: README, Launching)

A small GPT-2 built from a config (random initialisation: nothing is downloaded) learns the bytes of
this file's own directory; pip install -e ".[hf]" in flexpar's checkout.
"""

import glob
import os

import torch
from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

from flexpar.hf import Trainer  # was: from transformers import Trainer

CONTEXT = 64


class ByteWindows(torch.utils.data.Dataset):
    """Windows of CONTEXT bytes of the text files beside this script; the labels are the inputs (causal LM)."""

    def __init__(self):
        text = b"".join(
            open(path, "rb").read() for path in sorted(glob.glob(os.path.join(os.path.dirname(__file__), "*.py")))
        )
        self.data = torch.tensor(list(text[: len(text) // CONTEXT * CONTEXT]), dtype=torch.long).view(-1, CONTEXT)

    def __len__(self):
        return len(self.data)

    def __getitem__(self, index):
        return {"input_ids": self.data[index], "labels": self.data[index]}


def main():
    config = GPT2Config(vocab_size=256, n_positions=CONTEXT, n_embd=64, n_layer=2, n_head=2)
    args = TrainingArguments(
        output_dir="runs/hf-trainer",
        per_device_train_batch_size=8,
        gradient_accumulation_steps=2,
        learning_rate=2e-3,
        weight_decay=0.01,
        warmup_steps=10,
        lr_scheduler_type="cosine",
        max_steps=80,
        logging_steps=10,
        save_steps=40,
        save_total_limit=1,
        report_to=["tensorboard"],
        use_cpu=not torch.cuda.is_available(),
    )
    trainer = Trainer(model=GPT2LMHeadModel(config), args=args, train_dataset=ByteWindows())
    trainer.train()
    trainer.save_model("runs/hf-trainer/final")  # GPT2LMHeadModel.from_pretrained("runs/hf-trainer/final")
    print(f"{trainer.state.global_step} steps, final loss {trainer.state.log_history[-2]['loss']:.3f}")


if __name__ == "__main__":  # flexpar's devices import this script: keep training under the guard
    main()
