"""An unmodified transformers.Trainer script, but for its import (the tests swap it back for the baseline).

A tiny GPT-2 (random initialisation, no dropout, nothing downloaded) trained as a causal LM on
fixed random token sequences of unequal lengths (padding labelled -100), with gradient
accumulation, warm-up, weight decay, clipping, evaluation and checkpoints. `TRAINER` picks the
class: `flexpar.hf.Trainer` (the default) or `transformers.Trainer` (the baseline).
Settings come from the environment (HF_SCRIPT_*), so the same file runs every test's variant.
"""

import inspect
import json
import os

import torch
from transformers import GPT2Config, GPT2LMHeadModel, TrainerCallback, TrainingArguments

if os.environ.get("HF_SCRIPT_BASELINE") == "1":
    from transformers import Trainer
else:
    from flexpar.hf import Trainer

VOCABULARY = 97
LENGTH = 16


class Sequences(torch.utils.data.Dataset):
    """`size` token sequences of LENGTH, the last positions padded (attention 0, label -100)."""

    def __init__(self, size, seed=0):
        generator = torch.Generator().manual_seed(seed)
        self.tokens = torch.randint(0, VOCABULARY, (size, LENGTH), generator=generator)
        self.lengths = torch.randint(LENGTH // 2, LENGTH + 1, (size,), generator=generator)

    def __len__(self):
        return len(self.tokens)

    def __getitem__(self, index):
        keep = int(self.lengths[index])
        mask = (torch.arange(LENGTH) < keep).long()
        labels = self.tokens[index].clone()
        labels[keep:] = -100
        return {"input_ids": self.tokens[index], "attention_mask": mask, "labels": labels}


class SlowUntilJoined(GPT2LMHeadModel):
    """A GPT-2 whose forward sleeps 0.3 s on a device until it has trained in a group of `devices`
    (tests/pieces.py's SlowUntilJoined, as a model): however long a joiner takes to start on a loaded
    host, the steps before it joins are slow, so a leave scheduled later finds it in. Same bits."""

    def __init__(self, config, devices=3):
        super().__init__(config)
        self.devices, self.joined = devices, False

    def forward(self, *args, **kwargs):
        import time

        import torch.distributed as distributed

        if distributed.is_initialized() and not self.joined:
            self.joined = distributed.get_world_size() >= self.devices
            time.sleep(0 if self.joined else 0.3)
        return super().forward(*args, **kwargs)

    # GPT-2's own signature, which the Trainer reads (its label names, whether the loss takes num_items).
    forward.__signature__ = inspect.signature(GPT2LMHeadModel.forward)


def build_model():
    config = GPT2Config(
        vocab_size=VOCABULARY,
        n_positions=LENGTH,
        n_embd=32,
        n_layer=2,
        n_head=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        use_cache=False,
    )
    torch.manual_seed(1234)
    slow_until = int(os.environ.get("HF_SCRIPT_SLOW_UNTIL", "0"))
    model = SlowUntilJoined(config, slow_until) if slow_until else GPT2LMHeadModel(config)
    if os.environ.get("HF_SCRIPT_LORA") == "1":
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(
            model,
            LoraConfig(
                r=4,
                lora_alpha=8,
                lora_dropout=0.0,
                fan_in_fan_out=True,
                target_modules=["c_attn"],
                task_type="CAUSAL_LM",
            ),
        )
    return model


def compute_metrics(prediction):
    logits, labels = prediction
    predicted = logits[:, :-1].argmax(-1)
    target = labels[:, 1:]
    valid = target != -100
    return {"accuracy": float((predicted[valid] == target[valid]).mean())}


class EventCounter(TrainerCallback):
    """Writes every TrainerCallback event it receives, in order, to HF_SCRIPT_EVENTS."""

    def __init__(self, path):
        self.path = path

    def _write(self, name, state):
        if self.path:
            with open(self.path, "a") as handle:
                handle.write(json.dumps([name, state.global_step]) + "\n")

    def on_train_begin(self, args, state, control, **kwargs):
        self._write("train_begin", state)

    def on_step_end(self, args, state, control, **kwargs):
        self._write("step_end", state)

    def on_log(self, args, state, control, logs=None, **kwargs):
        self._write("log", state)

    def on_evaluate(self, args, state, control, **kwargs):
        self._write("evaluate", state)

    def on_save(self, args, state, control, **kwargs):
        self._write("save", state)

    def on_train_end(self, args, state, control, **kwargs):
        self._write("train_end", state)


def main():
    environment = os.environ
    output_dir = environment.get("HF_SCRIPT_OUTPUT", "hf-output")
    args = TrainingArguments(
        output_dir=output_dir,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        learning_rate=3e-3,
        weight_decay=0.1,
        warmup_steps=3,
        lr_scheduler_type=environment.get("HF_SCRIPT_SCHEDULE", "linear"),
        max_steps=int(environment.get("HF_SCRIPT_STEPS", "12")),
        logging_steps=2,
        eval_strategy="steps",
        eval_steps=6,
        save_strategy="steps",
        save_steps=4,
        save_total_limit=2,
        seed=7,
        report_to=environment.get("HF_SCRIPT_REPORT", "none").split(","),
        per_device_eval_batch_size=8,
        use_cpu=True,
    )
    trainer = Trainer(
        model=build_model(),
        args=args,
        train_dataset=Sequences(96),
        eval_dataset=Sequences(24, seed=1),
        compute_metrics=compute_metrics,
        callbacks=[EventCounter(environment.get("HF_SCRIPT_EVENTS"))],
    )
    trainer.train(resume_from_checkpoint=environment.get("HF_SCRIPT_RESUME") or None)
    metrics = trainer.evaluate()
    trainer.save_model(os.path.join(output_dir, "final"))
    torch.save(
        {
            "state": trainer.model.state_dict(),
            "log_history": trainer.state.log_history,
            "global_step": trainer.state.global_step,
            "metrics": metrics,
        },
        os.path.join(output_dir, "result.pt"),
    )


if __name__ == "__main__":
    main()
