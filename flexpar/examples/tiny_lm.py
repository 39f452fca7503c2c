"""A byte-level causal transformer trained on the Python standard library's source.

The corpus is the `.py` files of the running interpreter's standard library,
which every Python installation ships, so this demo needs no download. Every
piece a flexpar job needs is defined at module level, because worker processes
import the pieces by reference:

- `read_stdlib_corpus()`  the source bytes, in a fixed order, capped in size  } flexpar/examples/
- `ByteWindows`           fixed-length windows: input bytes and the next bytes } byte_corpus.py
- `load_splits()`         train / held-out windows (the held-out text is the tail)
- `make_model()`          `TinyLM`, a small pre-norm causal transformer
- `make_optimizer()`      AdamW
- `WarmupCosine`          linear warm-up then cosine decay, the `lr_scheduler=` piece
- `loss_fn()`             mean next-byte cross-entropy in nats
- `evaluate()`, `sample()`, `build_job()`, `main()`

Run it with ``python -m flexpar.examples.tiny_lm`` or
``flexpar run --devices 2 examples/tiny_lm.py`` (flexpar's flags before the script).
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from typing import Optional, Sequence, Union

import torch
import torch.nn.functional as F
from torch import nn

from flexpar.examples.byte_corpus import (
    DEFAULT_CONTEXT,
    DEFAULT_MAX_BYTES,
    VOCABULARY,
    ByteWindows,
    load_splits,
    read_stdlib_corpus,
    stdlib_root,
    stdlib_source_files,
)

# The data pieces live in flexpar/examples/byte_corpus.py; they are this demo's pieces too.
__all__ = [
    "DEFAULT_CONTEXT",
    "DEFAULT_MAX_BYTES",
    "VOCABULARY",
    "ByteWindows",
    "ModelConfig",
    "TinyLM",
    "WarmupCosine",
    "WarmupCosineFactor",
    "bits_per_byte",
    "build_job",
    "evaluate",
    "load_splits",
    "loss_fn",
    "main",
    "make_model",
    "make_optimizer",
    "parse_arguments",
    "read_stdlib_corpus",
    "sample",
    "stdlib_root",
    "stdlib_source_files",
]

# ---------------------------------------------------------------- model


@dataclass(frozen=True)
class ModelConfig:
    """Shape of `TinyLM`; the defaults train in minutes on a CPU."""

    context: int = DEFAULT_CONTEXT
    width: int = 128
    heads: int = 4
    layers: int = 2
    dropout: float = 0.1

    def __post_init__(self):
        for name in ("context", "width", "heads", "layers"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be at least 1")
        if self.width % self.heads:
            raise ValueError(f"width={self.width} is not divisible by heads={self.heads}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout={self.dropout} must be in [0, 1)")


class TinyLM(nn.Module):
    """Byte embedding + learned positions, pre-norm causal transformer, byte logits.

    No batch-statistic buffers (LayerNorm only), and the causal mask is built in
    `forward` rather than stored, so the model's state is its parameters alone.
    """

    def __init__(self, config: ModelConfig = ModelConfig()):
        super().__init__()
        self.config = config
        self.token_embedding = nn.Embedding(VOCABULARY, config.width)
        self.position_embedding = nn.Embedding(config.context, config.width)
        self.dropout = nn.Dropout(config.dropout)
        layer = nn.TransformerEncoderLayer(
            d_model=config.width,
            nhead=config.heads,
            dim_feedforward=4 * config.width,
            dropout=config.dropout,
            activation="gelu",
            batch_first=True,
            norm_first=True,  # pre-norm trains stably without a long warm-up
        )
        # Nested tensors only help with padding masks, which a causal LM has none of.
        self.blocks = nn.TransformerEncoder(layer, config.layers, enable_nested_tensor=False)
        self.final_norm = nn.LayerNorm(config.width)
        self.head = nn.Linear(config.width, VOCABULARY)

    @property
    def context(self) -> int:
        return self.config.context

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits [batch, length, 256] of tokens [batch, length], length <= context.

        Position t sees tokens 0..t only.
        """
        length = tokens.shape[1]
        if length > self.context:
            raise ValueError(f"sequence of {length} tokens is longer than the context of {self.context}")
        positions = torch.arange(length, device=tokens.device)
        hidden = self.dropout(self.token_embedding(tokens) + self.position_embedding(positions))
        mask = nn.Transformer.generate_square_subsequent_mask(length, device=tokens.device)
        hidden = self.blocks(hidden, mask=mask, is_causal=True)
        return self.head(self.final_norm(hidden))


def make_model() -> nn.Module:
    """The model factory: flexpar calls it under the job's seed on every device."""
    return TinyLM()


def make_optimizer(parameters) -> torch.optim.Optimizer:
    """AdamW; the peak rate is reached after `WarmupCosine`'s warm-up."""
    return torch.optim.AdamW(parameters, lr=2e-3, betas=(0.9, 0.95), weight_decay=0.01)


@dataclass(frozen=True)
class WarmupCosineFactor:
    """Learning-rate multiplier at a step: linear warm-up, then cosine decay to `floor`.

    A callable object (not a lambda) so that it pickles, and so that LambdaLR's
    state_dict records its fields (plain numbers) with the training state.
    """

    warmup_steps: int
    total_steps: int
    floor: float = 0.1

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            # (step + 1) so the very first step already trains.
            return (step + 1) / self.warmup_steps
        decay_steps = max(1, self.total_steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / decay_steps)
        return self.floor + (1.0 - self.floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


@dataclass(frozen=True)
class WarmupCosine:
    """The `lr_scheduler=` piece: maps the optimizer to a LambdaLR of `WarmupCosineFactor`.

    The schedule needs the run's length, so it is an object holding the numbers
    rather than a bare function; module-level classes pickle by reference.
    """

    total_steps: int
    warmup_steps: int = 20
    floor: float = 0.1

    def __post_init__(self):
        if self.total_steps < 1:
            raise ValueError(f"total_steps={self.total_steps} must be at least 1")
        if not 1 <= self.warmup_steps:
            raise ValueError(f"warmup_steps={self.warmup_steps} must be at least 1")
        if not 0.0 <= self.floor <= 1.0:
            raise ValueError(f"floor={self.floor} must be in [0, 1]")

    def factor(self) -> WarmupCosineFactor:
        return WarmupCosineFactor(self.warmup_steps, self.total_steps, self.floor)

    def __call__(self, optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
        return torch.optim.lr_scheduler.LambdaLR(optimizer, self.factor())


def loss_fn(model: nn.Module, batch) -> torch.Tensor:
    """Mean cross-entropy (nats) of predicting every next byte of the batch."""
    tokens, targets = batch
    logits = model(tokens)
    return F.cross_entropy(logits.reshape(-1, VOCABULARY), targets.reshape(-1))


def bits_per_byte(loss_nats: float) -> float:
    """A cross-entropy in nats per byte, in bits per byte."""
    return loss_nats / math.log(2.0)


def evaluate(model: nn.Module, dataset, batch_size: int = 256, max_windows: Optional[int] = None) -> float:
    """Mean next-byte cross-entropy (nats) of `model` over `dataset` (or its first `max_windows`).

    Eval mode (no dropout), no gradients; the model's previous mode is restored.
    """
    count = len(dataset) if max_windows is None else min(len(dataset), max_windows)
    if count == 0:
        raise ValueError("cannot evaluate on an empty dataset")
    was_training = model.training
    model.eval()
    total = 0.0
    try:
        with torch.no_grad():
            for start in range(0, count, batch_size):
                windows = [dataset[index] for index in range(start, min(count, start + batch_size))]
                tokens = torch.stack([window[0] for window in windows])
                targets = torch.stack([window[1] for window in windows])
                total += float(loss_fn(model, (tokens, targets))) * len(windows)
    finally:
        model.train(was_training)
    return total / count


def sample(
    model: nn.Module,
    prompt: Union[str, bytes],
    n: int,
    temperature: float = 0.0,
    seed: int = 0,
) -> bytes:
    """`n` bytes continuing `prompt`: greedy when temperature is 0, else sampled.

    Sampling uses its own generator seeded by `seed`, so it neither reads nor
    moves torch's global random state. The prompt is cut to the model's context.
    """
    if n < 0:
        raise ValueError(f"n={n} must be >= 0")
    if temperature < 0:
        raise ValueError(f"temperature={temperature} must be >= 0")
    data = prompt.encode() if isinstance(prompt, str) else bytes(prompt)
    tokens = list(data) or [ord("\n")]  # an empty prompt starts from a new line
    generator = torch.Generator().manual_seed(seed)
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    produced = []
    try:
        with torch.no_grad():
            for _ in range(n):
                window = torch.tensor([tokens[-model.context :]], device=device)
                logits = model(window)[0, -1].float().cpu()
                if temperature == 0:
                    following = int(logits.argmax())
                else:
                    probabilities = torch.softmax(logits / temperature, dim=0)
                    following = int(torch.multinomial(probabilities, 1, generator=generator))
                tokens.append(following)
                produced.append(following)
    finally:
        model.train(was_training)
    return bytes(produced)


# ---------------------------------------------------------------- the job


def build_job(
    steps: int = 300,
    global_batch: int = 128,
    virtual_workers: Optional[int] = 4,
    seed: int = 0,
    dataset=None,
    warmup_steps: int = 20,
):
    """The flexpar job of this demo; `dataset` defaults to the training windows.

    `steps` sets the length of the learning-rate schedule, so pass the same
    number to `fit(steps=...)`.
    """
    import flexpar

    return flexpar.Job(
        model=make_model,
        optimizer=make_optimizer,
        loss=loss_fn,
        dataset=load_splits()[0] if dataset is None else dataset,
        global_batch=global_batch,
        virtual_workers=virtual_workers,
        seed=seed,
        lr_scheduler=WarmupCosine(total_steps=steps, warmup_steps=min(warmup_steps, steps)),
    )


def parse_arguments(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """The demo's command line (shared with examples/tiny_lm.py)."""
    parser = argparse.ArgumentParser(
        description="Train a byte-level transformer on the Python standard library with flexpar."
    )
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps (default 300)")
    parser.add_argument("--devices", type=int, default=None, help="devices to start with (default: all local)")
    parser.add_argument("--schedule", default=None, help="device changes, e.g. '100:+1,200:-1'")
    parser.add_argument("--global-batch", type=int, default=128, help="windows per step (default 128)")
    parser.add_argument("--virtual-workers", type=int, default=4, help="virtual workers per step (default 4)")
    parser.add_argument("--max-bytes", type=int, default=DEFAULT_MAX_BYTES, help="corpus size cap in bytes")
    parser.add_argument("--seed", type=int, default=0, help="training seed (default 0)")
    return parser.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> float:
    """Train, print held-out loss, bits per byte and a sample; return the held-out loss."""
    arguments = parse_arguments(argv)
    train, held_out = load_splits(max_bytes=arguments.max_bytes)
    job = build_job(
        steps=arguments.steps,
        global_batch=arguments.global_batch,
        virtual_workers=arguments.virtual_workers,
        seed=arguments.seed,
        dataset=train,
    )
    model, summary = job.fit(steps=arguments.steps, devices=arguments.devices, schedule=arguments.schedule)
    loss = evaluate(model, held_out)
    print(
        f"held-out loss: {loss:.3f} nats/byte = {bits_per_byte(loss):.3f} bits/byte "
        f"({len(held_out)} windows of {held_out.context} bytes; uniform guessing is 8 bits/byte)"
    )
    prompt = "def "
    continuation = sample(model, prompt, 120)
    print("sample:\n" + prompt + continuation.decode("utf-8", errors="replace"))
    return loss


if __name__ == "__main__":
    # Under `python -m`, this file runs as `__main__`; call main() of the module
    # imported under its real name, so the pieces pickle as
    # `flexpar.examples.tiny_lm.*`, a name worker processes can import.
    from flexpar.examples import tiny_lm

    tiny_lm.main()
