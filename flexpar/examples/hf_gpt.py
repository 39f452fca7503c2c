"""A Hugging Face `transformers` causal LM (GPT-2 architecture) trained with flexpar's recipes.

The model is built from a small `GPT2Config` (random initialisation: nothing
is downloaded) and trained on the same text as `flexpar.examples.tiny_lm`, the
Python standard library's own source, with the recipes a real language-model
run uses:

- `mixed_precision="bf16"`: each virtual worker's forward and loss under
  torch.autocast;
- `max_grad_norm=1.0`: the summed global gradient clipped (HF Trainer's default);
- a token-weighted loss: `loss_fn` returns `(summed token loss, token count)`
  with padding excluded from both, so the applied gradient is the mean over
  every real token of the global batch, however the batch is split.

The data: windows of the corpus cut after their last line break
(`LineWindows`), so samples hold different numbers of real tokens and the rest
is padding. Every piece is defined at module level, because worker processes
import the pieces by name. `transformers` is an optional extra
(``pip install -e ".[hf]"`` in flexpar's checkout) and is imported only when the model is built.

Run it with ``python -m flexpar.examples.hf_gpt`` or
``flexpar run --devices 2 examples/hf_gpt.py`` (flexpar's flags before the script).
"""

from __future__ import annotations

import argparse
import math
from typing import Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F
from torch import nn

from flexpar.examples.byte_corpus import DEFAULT_CONTEXT, ByteWindows, read_stdlib_corpus
from flexpar.examples.tiny_lm import WarmupCosine, bits_per_byte

PAD = 256  # an input token after the last line break: the byte vocabulary plus one
VOCABULARY = 257
IGNORE = -100  # the target of a padding position: cross_entropy's ignore_index
NEWLINE = ord("\n")


# ---------------------------------------------------------------- data


class LineWindows(ByteWindows):
    """tiny_lm's byte windows, each cut after its last line break and padded.

    Sample `i` is (input [context], target [context]) as in `ByteWindows`,
    except that the positions after the window's last line break hold PAD as
    input and IGNORE as target (a window without a line break is kept whole).
    A sample therefore trains on whole lines only, and samples differ in how
    many tokens count.
    """

    def __getitem__(self, index: int) -> Tuple[torch.Tensor, torch.Tensor]:
        tokens, targets = super().__getitem__(index)
        breaks = (targets == NEWLINE).nonzero()
        if len(breaks):
            keep = int(breaks[-1]) + 1  # through the target that is the last line break
            tokens, targets = tokens.clone(), targets.clone()
            tokens[keep:] = PAD
            targets[keep:] = IGNORE
        return tokens, targets


def load_splits(
    context: int = DEFAULT_CONTEXT, max_bytes: int = 1_000_000, held_out_fraction: float = 0.05
) -> Tuple[LineWindows, LineWindows]:
    """Train and held-out `LineWindows` of the standard library's source (the held-out text is the tail)."""
    if not 0.0 < held_out_fraction < 1.0:
        raise ValueError(f"held_out_fraction={held_out_fraction} must be strictly between 0 and 1")
    corpus = torch.frombuffer(bytearray(read_stdlib_corpus(max_bytes)), dtype=torch.uint8)
    cut = len(corpus) - int(len(corpus) * held_out_fraction)
    return LineWindows(corpus[:cut], context), LineWindows(corpus[cut:], context)


# ---------------------------------------------------------------- model, optimizer, loss


def model_config(context: int = DEFAULT_CONTEXT):
    """A small GPT-2: 2 layers, width 64, 2 heads; about 0.12M parameters."""
    from transformers import GPT2Config

    return GPT2Config(
        vocab_size=VOCABULARY,
        n_positions=context,
        n_embd=64,
        n_layer=2,
        n_head=2,
        bos_token_id=NEWLINE,
        eos_token_id=NEWLINE,
        pad_token_id=PAD,
        use_cache=False,
    )


def make_model() -> nn.Module:
    """The model factory (flexpar calls it under the job's seed on every device): random init, no download."""
    from transformers import GPT2LMHeadModel

    return GPT2LMHeadModel(model_config())


def make_optimizer(parameters) -> torch.optim.Optimizer:
    return torch.optim.AdamW(parameters, lr=3e-3, betas=(0.9, 0.95), weight_decay=0.01)


def loss_fn(model: nn.Module, batch):
    """(summed next-byte cross-entropy over the real tokens, their count): a token-weighted loss.

    Padding is excluded from both, so flexpar's applied gradient is the mean
    over every real token of the global batch. Padding sits after the real
    tokens, so a causal model's real positions never attend to it; the
    attention mask says so to transformers too.
    """
    tokens, targets = batch
    logits = model(input_ids=tokens, attention_mask=(tokens != PAD).long()).logits
    loss_sum = F.cross_entropy(
        logits.reshape(-1, VOCABULARY).float(), targets.reshape(-1), ignore_index=IGNORE, reduction="sum"
    )
    return loss_sum, (targets != IGNORE).sum()


def evaluate(model: nn.Module, dataset, batch_size: int = 256, max_windows: Optional[int] = None) -> float:
    """Token-mean next-byte cross-entropy (nats) over `dataset` (or its first `max_windows`), padding excluded."""
    count = len(dataset) if max_windows is None else min(len(dataset), max_windows)
    if count == 0:
        raise ValueError("cannot evaluate on an empty dataset")
    was_training = model.training
    model.eval()
    total, tokens_counted = 0.0, 0.0
    try:
        with torch.no_grad():
            for start in range(0, count, batch_size):
                windows = [dataset[index] for index in range(start, min(count, start + batch_size))]
                batch = (torch.stack([w[0] for w in windows]), torch.stack([w[1] for w in windows]))
                loss_sum, tokens = loss_fn(model, batch)
                total += float(loss_sum)
                tokens_counted += float(tokens)
    finally:
        model.train(was_training)
    return total / tokens_counted


def sample(model: nn.Module, prompt: Union[str, bytes], n: int, context: int = DEFAULT_CONTEXT) -> bytes:
    """`n` bytes continuing `prompt`, greedily (no padding token is ever produced)."""
    tokens = list(prompt.encode() if isinstance(prompt, str) else bytes(prompt)) or [NEWLINE]
    was_training = model.training
    model.eval()
    produced = []
    try:
        with torch.no_grad():
            for _ in range(n):
                logits = model(input_ids=torch.tensor([tokens[-context:]])).logits[0, -1, :256]
                tokens.append(int(logits.argmax()))
                produced.append(tokens[-1])
    finally:
        model.train(was_training)
    return bytes(produced)


# ---------------------------------------------------------------- the job


def build_job(
    steps: int = 200,
    global_batch: int = 64,
    virtual_workers: int = 4,
    seed: int = 0,
    dataset=None,
    mixed_precision: Optional[str] = "bf16",
    max_grad_norm: Optional[float] = 1.0,
    compile: bool = False,
):
    """The flexpar job of this demo; `dataset` defaults to the training windows."""
    import flexpar

    return flexpar.Job(
        model=make_model,
        optimizer=make_optimizer,
        loss=loss_fn,  # (loss_sum, count): the token mean of the whole global batch
        dataset=load_splits()[0] if dataset is None else dataset,
        global_batch=global_batch,
        virtual_workers=virtual_workers,
        seed=seed,
        lr_scheduler=WarmupCosine(total_steps=steps, warmup_steps=min(20, steps)),
        mixed_precision=mixed_precision,
        max_grad_norm=max_grad_norm,
        compile=compile,
    )


def parse_arguments(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """The demo's command line (shared with examples/hf_gpt.py)."""
    parser = argparse.ArgumentParser(
        description="Train a small Hugging Face GPT-2 on the Python standard library with flexpar (bf16, "
        "gradient clipping, token-weighted loss)."
    )
    parser.add_argument("--steps", type=int, default=200, help="optimizer steps (default 200)")
    parser.add_argument("--devices", type=int, default=None, help="devices to start with (default: all local)")
    parser.add_argument("--schedule", default=None, help="device changes, e.g. '100:+1,150:-1'")
    parser.add_argument("--global-batch", type=int, default=64, help="windows per step (default 64)")
    parser.add_argument("--virtual-workers", type=int, default=4, help="virtual workers per step (default 4)")
    parser.add_argument("--max-bytes", type=int, default=1_000_000, help="corpus size cap in bytes")
    parser.add_argument(
        "--mixed-precision",
        choices=["bf16", "fp16", "none"],
        default="bf16",
        help="autocast dtype of the forward (default bf16)",
    )
    parser.add_argument("--max-grad-norm", type=float, default=1.0, help="gradient clipping (default 1.0; 0: off)")
    parser.add_argument("--compile", action="store_true", help="torch.compile the model in every worker")
    parser.add_argument("--seed", type=int, default=0, help="training seed (default 0)")
    return parser.parse_args(argv)


def job_from_arguments(arguments: argparse.Namespace, dataset):
    return build_job(
        steps=arguments.steps,
        global_batch=arguments.global_batch,
        virtual_workers=arguments.virtual_workers,
        seed=arguments.seed,
        dataset=dataset,
        mixed_precision=None if arguments.mixed_precision == "none" else arguments.mixed_precision,
        max_grad_norm=arguments.max_grad_norm or None,
        compile=arguments.compile,
    )


def main(argv: Optional[Sequence[str]] = None) -> float:
    """Train, print held-out loss in bits per byte and a sample; return the held-out loss (nats per token)."""
    arguments = parse_arguments(argv)
    train, held_out = load_splits(max_bytes=arguments.max_bytes)
    job = job_from_arguments(arguments, train)
    model, summary = job.fit(steps=arguments.steps, devices=arguments.devices, schedule=arguments.schedule)
    loss = evaluate(model, held_out, max_windows=2000)
    print(
        f"held-out loss: {loss:.3f} nats/byte = {bits_per_byte(loss):.3f} bits/byte "
        f"(padding excluded; uniform guessing is {math.log2(256):.0f} bits/byte)"
    )
    print("sample:\ndef " + sample(model, "def ", 120).decode("utf-8", errors="replace"))
    return loss


if __name__ == "__main__":
    # Under `python -m`, call main() of the module imported under its real name, so the
    # pieces pickle as `flexpar.examples.hf_gpt.*`, a name worker processes can import.
    from flexpar.examples import hf_gpt

    hf_gpt.main()
