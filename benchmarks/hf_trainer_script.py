"""The Trainer script benchmarks/hf_trainer.py runs: a plain transformers.Trainer script, its import switchable.

HF_BENCH_BASELINE=1 imports transformers.Trainer, else flexpar.hf.Trainer (the one changed line).
A small GPT-2 (random initialisation, no dropout, nothing downloaded) on fixed random token windows.
It writes HF_BENCH_OUTPUT/result.pt: the trained parameters, log_history and the step times its
callback saw (the Trainer's own steps, timed at on_step_end).
"""

import os
import time

import torch
from transformers import GPT2Config, GPT2LMHeadModel, TrainerCallback, TrainingArguments

if os.environ.get("HF_BENCH_BASELINE") == "1":
    from transformers import Trainer
else:
    from flexpar.hf import Trainer

LENGTH = 64
VOCABULARY = 256


class Windows(torch.utils.data.Dataset):
    def __init__(self, size):
        generator = torch.Generator().manual_seed(0)
        self.tokens = torch.randint(0, VOCABULARY, (size, LENGTH), generator=generator)

    def __len__(self):
        return len(self.tokens)

    def __getitem__(self, index):
        return {"input_ids": self.tokens[index], "labels": self.tokens[index]}


class StepTimes(TrainerCallback):
    def __init__(self):
        self.times = []

    def on_step_end(self, args, state, control, **kwargs):
        self.times.append(time.perf_counter())


def main():
    output = os.environ.get("HF_BENCH_OUTPUT", "hf-bench")
    config = GPT2Config(
        vocab_size=VOCABULARY,
        n_positions=LENGTH,
        n_embd=128,
        n_layer=2,
        n_head=4,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        use_cache=False,
    )
    torch.manual_seed(0)
    args = TrainingArguments(
        output_dir=output,
        per_device_train_batch_size=8,
        gradient_accumulation_steps=2,
        learning_rate=1e-3,
        weight_decay=0.01,
        warmup_steps=5,
        lr_scheduler_type="cosine",
        max_grad_norm=1.0,
        max_steps=int(os.environ.get("HF_BENCH_STEPS", "20")),
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        seed=11,
        use_cpu=True,
        disable_tqdm=True,
    )
    times = StepTimes()
    trainer = Trainer(model=GPT2LMHeadModel(config), args=args, train_dataset=Windows(2048), callbacks=[times])
    trainer.train()
    torch.save(
        {
            "state": trainer.model.state_dict(),
            "log_history": trainer.state.log_history,
            "step_times": times.times,
            "summary": getattr(trainer, "flexpar_summary", None),
        },
        os.path.join(output, "result.pt"),
    )


if __name__ == "__main__":
    main()
