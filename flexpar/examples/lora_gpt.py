"""LoRA fine-tuning of a "pretrained" Hugging Face GPT-2 with peft, through flexpar.

The example first writes a small GPT-2 checkpoint locally (built from a
config under a fixed seed and saved with `save_pretrained`: nothing is
downloaded), then fine-tunes it with peft's LoRA. The base weights are
frozen, so every device loads them from its own files and flexpar sends
joiners (and writes to checkpoints) only the adapters and their optimizer
state; a device whose base weights differ is refused, naming the tensors.
The recipe is hf_gpt's: bf16 autocast, clipping at 1.0, the token-weighted loss.

Every piece is defined at module level (worker processes import them by
name); `transformers` and `peft` are the `flexpar[hf]` extra, imported only
when the model is built.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from flexpar.examples import hf_gpt
from flexpar.examples.tiny_lm import WarmupCosine

PRETRAINED_SEED = 1234  # the "pretrained" model's own seed: every run writes the same files
DEFAULT_FOLDER = os.path.join("runs", "lora-gpt", "pretrained")


def quiet_transformers() -> None:
    """No progress bars or info logs from transformers in every worker."""
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def pretrained_config(layers: int = 4, width: int = 128, heads: int = 4, context: int = 64):
    config = hf_gpt.model_config(context)
    config.n_layer, config.n_embd, config.n_head = layers, width, heads
    return config


def write_pretrained(folder: str, layers: int = 4, width: int = 128, heads: int = 4, context: int = 64) -> str:
    """The "pretrained" checkpoint: a GPT-2 built under a fixed seed, saved with save_pretrained (once).

    Returns the folder's absolute path (the factory carries it to every device).
    """
    from transformers import GPT2LMHeadModel

    folder = os.path.abspath(folder)
    if not os.path.exists(os.path.join(folder, "config.json")):
        quiet_transformers()
        generator_state = torch.random.get_rng_state()
        torch.manual_seed(PRETRAINED_SEED)
        try:
            GPT2LMHeadModel(pretrained_config(layers, width, heads, context)).save_pretrained(folder)
        finally:
            torch.random.set_rng_state(generator_state)
    return folder


@dataclass(frozen=True)
class PretrainedLoRA:
    """The model factory: the pretrained GPT-2 in `folder` with LoRA adapters (peft) on its attention.

    A frozen dataclass of plain fields: it travels to the workers by value, and
    `flexpar export` rebuilds it by name from a checkpoint.
    """

    folder: str
    rank: int = 8
    alpha: int = 16
    dropout: float = 0.05

    def __call__(self):
        from peft import LoraConfig, get_peft_model
        from transformers import GPT2LMHeadModel

        quiet_transformers()
        base = GPT2LMHeadModel.from_pretrained(self.folder)
        config = LoraConfig(
            r=self.rank,
            lora_alpha=self.alpha,
            lora_dropout=self.dropout,
            task_type="CAUSAL_LM",
            fan_in_fan_out=True,  # GPT-2's Conv1D layers store (in, out)
        )
        return get_peft_model(base, config)


def make_optimizer(parameters) -> torch.optim.Optimizer:
    return torch.optim.AdamW(parameters, lr=2e-3, betas=(0.9, 0.95), weight_decay=0.0)


def build_job(
    folder: str,
    steps: int = 80,
    global_batch: int = 32,
    virtual_workers: int = 4,
    seed: int = 0,
    dataset=None,
    mixed_precision: Optional[str] = "bf16",
    max_grad_norm: Optional[float] = 1.0,
    rank: int = 8,
    loss=hf_gpt.loss_fn,
):
    """The flexpar job: LoRA on the pretrained GPT-2 in `folder` (see `write_pretrained`)."""
    import flexpar

    return flexpar.Job(
        model=PretrainedLoRA(os.path.abspath(folder), rank=rank),
        optimizer=make_optimizer,
        loss=loss,  # (loss_sum, count): the token mean of the whole global batch
        dataset=hf_gpt.load_splits()[0] if dataset is None else dataset,
        global_batch=global_batch,
        virtual_workers=virtual_workers,
        seed=seed,
        lr_scheduler=WarmupCosine(total_steps=steps, warmup_steps=min(10, steps)),
        mixed_precision=mixed_precision,
        max_grad_norm=max_grad_norm,
    )


def parse_arguments(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="LoRA fine-tuning of a local GPT-2 checkpoint with peft and flexpar")
    parser.add_argument("--steps", type=int, default=80, help="optimizer steps (default 80)")
    parser.add_argument("--devices", type=int, default=None, help="devices to start with (default: all local)")
    parser.add_argument("--schedule", default=None, help="device changes, e.g. '20:+1,50:-1'")
    parser.add_argument(
        "--pretrained", default=DEFAULT_FOLDER, help="the pretrained GPT-2's folder (written there if absent)"
    )
    parser.add_argument(
        "--adapter", default=os.path.join("runs", "lora-gpt", "adapter"), help="where the trained adapter goes"
    )
    parser.add_argument("--rank", type=int, default=8, help="LoRA rank (default 8)")
    parser.add_argument("--max-bytes", type=int, default=1_000_000, help="corpus size cap in bytes")
    return parser.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> float:
    """Write the pretrained model (once), fine-tune it, print held-out loss and a sample, save the adapter."""
    arguments = parse_arguments(argv)
    folder = write_pretrained(arguments.pretrained)
    train, held_out = hf_gpt.load_splits(max_bytes=arguments.max_bytes)
    job = build_job(folder, steps=arguments.steps, dataset=train, rank=arguments.rank)
    model, summary = job.fit(steps=arguments.steps, devices=arguments.devices, schedule=arguments.schedule)
    loss = hf_gpt.evaluate(model, held_out, max_windows=2000)
    print(f"held-out loss {loss:.3f} nats/byte = {hf_gpt.bits_per_byte(loss):.3f} bits/byte (uniform: 8 bits/byte)")
    print("def " + hf_gpt.sample(model, "def ", 120).decode("utf-8", errors="replace"))
    model.save_pretrained(arguments.adapter)  # peft's own layout: PeftModel.from_pretrained(base, adapter)
    print(f"adapter: {arguments.adapter}")
    return loss


if __name__ == "__main__":
    from flexpar.examples import lora_gpt  # the pieces pickle as flexpar.examples.lora_gpt.*

    lora_gpt.main()
