"""A byte-level causal transformer trained on the Python standard library's source.

The corpus is the `.py` files of the running interpreter's standard library,
which every Python installation ships, so this demo needs no download. Every
piece a flexpar job needs is defined at module level, because worker processes
import the pieces by reference:

- `read_stdlib_corpus()`  the source bytes, in a fixed order, capped in size
- `ByteWindows`           fixed-length windows: input bytes and the next bytes
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
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

VOCABULARY = 256  # one token per byte value
DEFAULT_CONTEXT = 64
DEFAULT_MAX_BYTES = 2_000_000
# Folders under the stdlib path that are not the standard library itself (the
# installed packages differ between machines) or hold no source.
_SKIPPED_FOLDERS = frozenset({"site-packages", "dist-packages", "__pycache__"})


# ---------------------------------------------------------------- corpus and data


def stdlib_root() -> Path:
    """The folder of the running interpreter's standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_source_files(root: Optional[Path] = None) -> List[Path]:
    """The standard library's `.py` files, sorted by their path relative to `root`.

    Sorting the relative POSIX paths (not the walk order of the file system)
    makes the corpus the same on every run of the same Python version.
    `_sysconfigdata*` files are skipped: they describe the build machine.
    """
    root = stdlib_root() if root is None else Path(root)
    found = []
    for folder, subfolders, names in os.walk(root):
        subfolders[:] = [name for name in subfolders if name not in _SKIPPED_FOLDERS]
        for name in names:
            if name.endswith(".py") and not name.startswith("_sysconfigdata"):
                found.append(Path(folder) / name)
    return sorted(found, key=lambda path: path.relative_to(root).as_posix())


def read_stdlib_corpus(max_bytes: int = DEFAULT_MAX_BYTES, root: Optional[Path] = None) -> bytes:
    """At most `max_bytes` of standard-library source, files joined by a blank line.

    Files are read in `stdlib_source_files` order until the cap is reached; the
    last file is cut at the cap. The cap keeps the demo fast, and reading stops
    early, so a small cap is also cheap.
    """
    if max_bytes < 2:
        raise ValueError(f"max_bytes={max_bytes} must be at least 2 (one input and one target byte)")
    pieces: List[bytes] = []
    total = 0
    for path in stdlib_source_files(root):
        text = path.read_bytes() + b"\n\n"
        pieces.append(text[: max_bytes - total])
        total += len(pieces[-1])
        if total >= max_bytes:
            break
    if total < 2:
        raise FileNotFoundError(f"found no Python source under {root or stdlib_root()}")
    return b"".join(pieces)


class ByteWindows(Dataset):
    """Non-overlapping windows of a byte string: sample `i` is (input, target).

    input  = bytes [i*context, (i+1)*context)        as int64 [context]
    target = the same window shifted by one byte     as int64 [context]

    The bytes are held as one uint8 tensor, so the dataset pickles compactly
    (its size in bytes) when it travels to worker processes.
    """

    def __init__(self, data: Union[bytes, torch.Tensor], context: int = DEFAULT_CONTEXT):
        if context < 1:
            raise ValueError(f"context={context} must be at least 1 byte")
        if isinstance(data, (bytes, bytearray)):
            data = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        if data.dtype != torch.uint8 or data.dim() != 1:
            raise TypeError(f"data must be bytes or a 1-D uint8 tensor (got {data.dtype}, {data.dim()}-D)")
        if len(data) < context + 1:
            raise ValueError(
                f"{len(data)} bytes make no window of context={context} (needs {context + 1} bytes)"
            )
        # clone(): a slice of a larger tensor would otherwise pickle its whole storage.
        self.data = data.clone()
        self.context = context

    def __len__(self) -> int:
        # Each window needs one byte beyond it for the last target.
        return (len(self.data) - 1) // self.context

    def __getitem__(self, index: int) -> Tuple[torch.Tensor, torch.Tensor]:
        if not -len(self) <= index < len(self):
            raise IndexError(f"window {index} out of range for {len(self)} windows")
        start = (index % len(self)) * self.context
        window = self.data[start : start + self.context + 1].long()
        return window[:-1], window[1:]


def load_splits(
    context: int = DEFAULT_CONTEXT,
    max_bytes: int = DEFAULT_MAX_BYTES,
    held_out_fraction: float = 0.05,
) -> Tuple[ByteWindows, ByteWindows]:
    """Train and held-out windows; the held-out text is the corpus's tail.

    Cutting the text (not shuffling windows) keeps the held-out files unseen in
    training, apart from the one file the cut may fall inside.
    """
    if not 0.0 < held_out_fraction < 1.0:
        raise ValueError(f"held_out_fraction={held_out_fraction} must be strictly between 0 and 1")
    corpus = torch.frombuffer(bytearray(read_stdlib_corpus(max_bytes)), dtype=torch.uint8)
    cut = len(corpus) - int(len(corpus) * held_out_fraction)
    return ByteWindows(corpus[:cut], context), ByteWindows(corpus[cut:], context)


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
