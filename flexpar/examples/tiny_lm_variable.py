"""The tiny language model on variable-length samples: paragraphs of the standard library's source.

`flexpar.examples.tiny_lm` cuts the corpus into windows of one length; real
text comes in pieces of every length. Here a sample is one *source unit*: a
paragraph of a standard-library `.py` file (text between blank lines), cut
into pieces of at most `max_length` bytes when longer, as long as it comes
otherwise (from a few bytes to `max_length`; median about 140). The loss runs
the model on each sample at its own length, no padding, so a virtual worker's
compute follows the summed length of its samples, and `token_count` is the
`sample_cost=` piece that lets flexpar balance by it
(``Job(..., sample_cost=dataset.token_count)``).

Pieces (module level, so that worker processes import them by reference):

- `source_units()`    the units as byte strings, in corpus order
- `SourceUnits`       the dataset: sample `i` is unit `i` as int64 bytes; `token_count(i)`
- `collate_units()`   the `collate_fn=`: a list of samples (no stacking, no padding)
- `ModelFactory`      `TinyLM` with a context of `max_length` bytes
- `loss_fn()`         (summed next-byte cross-entropy, predicted bytes): the token mean
- `build_job()`, `main()`

Run it with ``python -m flexpar.examples.tiny_lm_variable [--by-count]``.
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from flexpar.examples.byte_corpus import VOCABULARY, read_stdlib_corpus
from flexpar.examples.tiny_lm import ModelConfig, TinyLM, make_optimizer

DEFAULT_MAX_LENGTH = 1024
DEFAULT_MAX_BYTES = 2_000_000
MINIMUM_LENGTH = 2  # one input byte and its target
_BLANK_LINE = re.compile(rb"\n[ \t]*\n")


def source_units(max_bytes: int = DEFAULT_MAX_BYTES, max_length: int = DEFAULT_MAX_LENGTH) -> List[bytes]:
    """Paragraphs of the first `max_bytes` of standard-library source, in order.

    A paragraph is the text between blank lines, stripped of surrounding
    blank space; one longer than `max_length` bytes becomes consecutive
    pieces of `max_length` (the last one shorter). Pieces shorter than 2
    bytes (nothing to predict) are left out. The same on every run of the
    same Python version (the corpus is read in a fixed order).
    """
    if max_length < MINIMUM_LENGTH:
        raise ValueError(f"max_length={max_length} must be at least {MINIMUM_LENGTH} bytes")
    units = []
    for paragraph in _BLANK_LINE.split(read_stdlib_corpus(max_bytes)):
        paragraph = paragraph.strip(b"\n")
        for start in range(0, len(paragraph), max_length):
            piece = paragraph[start : start + max_length]
            if len(piece) >= MINIMUM_LENGTH and piece.strip():
                units.append(piece)
    if not units:
        raise ValueError(f"the first {max_bytes} bytes of the standard library hold no paragraph")
    return units


class SourceUnits(Dataset):
    """Variable-length samples: sample `i` is unit `i`'s bytes as an int64 tensor [length].

    The units are stored as one uint8 tensor and their offsets, so the dataset
    pickles compactly (about its size in bytes) when it travels to workers.
    """

    def __init__(self, units: Sequence[bytes]):
        if not units:
            raise ValueError("SourceUnits needs at least one unit")
        short = [index for index, unit in enumerate(units) if len(unit) < MINIMUM_LENGTH]
        if short:
            raise ValueError(f"unit {short[0]} has fewer than {MINIMUM_LENGTH} bytes: nothing to predict")
        lengths = torch.tensor([len(unit) for unit in units], dtype=torch.int64)
        self.offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
        self.data = torch.frombuffer(bytearray(b"".join(units)), dtype=torch.uint8).clone()

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def length(self, index: int) -> int:
        """Bytes of sample `index`."""
        return int(self.offsets[index + 1] - self.offsets[index])

    def token_count(self, index: int) -> int:
        """The bytes the model predicts for sample `index` (its length - 1): the `sample_cost=` piece."""
        return self.length(index) - 1

    def __getitem__(self, index: int) -> torch.Tensor:
        if not -len(self) <= index < len(self):
            raise IndexError(f"unit {index} out of range for {len(self)} units")
        index %= len(self)
        return self.data[self.offsets[index] : self.offsets[index + 1]].long()


def load_units(max_bytes: int = DEFAULT_MAX_BYTES, max_length: int = DEFAULT_MAX_LENGTH) -> SourceUnits:
    return SourceUnits(source_units(max_bytes, max_length))


def collate_units(samples: List[torch.Tensor]) -> List[torch.Tensor]:
    """The samples of one virtual worker as they are: a list of 1-D tensors of their own lengths."""
    return list(samples)


@dataclass(frozen=True)
class ModelFactory:
    """The `model=` piece: a `TinyLM` whose context holds the longest sample (a picklable object)."""

    context: int = DEFAULT_MAX_LENGTH
    width: int = 128
    heads: int = 4
    layers: int = 2
    dropout: float = 0.1

    def __call__(self) -> nn.Module:
        return TinyLM(
            ModelConfig(
                context=self.context, width=self.width, heads=self.heads, layers=self.layers, dropout=self.dropout
            )
        )


def loss_fn(model: nn.Module, batch: List[torch.Tensor]) -> Tuple[torch.Tensor, int]:
    """(summed next-byte cross-entropy in nats, bytes predicted) over the samples, each at its own length.

    The pair makes the gradient the mean over every predicted byte of the
    global batch, whichever device ran which sample.
    """
    total = None
    count = 0
    for sample in batch:
        logits = model(sample[None, :-1])[0]
        term = F.cross_entropy(logits.reshape(-1, VOCABULARY), sample[1:], reduction="sum")
        total = term if total is None else total + term
        count += len(sample) - 1
    return total, count


def build_job(
    dataset: Optional[SourceUnits] = None,
    by_cost: bool = True,
    global_batch: int = 16,
    virtual_workers: int = 16,
    seed: int = 0,
    model: Optional[ModelFactory] = None,
):
    """The flexpar job: balanced by token count (`by_cost`), or by VW count as without `sample_cost`."""
    import flexpar

    dataset = load_units() if dataset is None else dataset
    longest = max(dataset.length(index) for index in range(len(dataset)))
    return flexpar.Job(
        model=model or ModelFactory(context=max(longest - 1, 1)),
        optimizer=make_optimizer,
        loss=loss_fn,
        dataset=dataset,
        collate_fn=collate_units,
        global_batch=global_batch,
        virtual_workers=virtual_workers,
        seed=seed,
        sample_cost=dataset.token_count if by_cost else None,
    )


def main(argv: Optional[Sequence[str]] = None) -> dict:
    parser = argparse.ArgumentParser(description="The tiny LM on variable-length standard-library paragraphs.")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--devices", type=int, default=None)
    parser.add_argument("--by-count", action="store_true", help="balance by VW count (no sample_cost)")
    parser.add_argument("--max-bytes", type=int, default=DEFAULT_MAX_BYTES)
    arguments = parser.parse_args(argv)
    job = build_job(load_units(arguments.max_bytes), by_cost=not arguments.by_count)
    _, summary = job.fit(steps=arguments.steps, devices=arguments.devices)
    return summary


if __name__ == "__main__":
    from flexpar.examples import tiny_lm_variable

    tiny_lm_variable.main()
