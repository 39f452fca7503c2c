"""An iterable evaluation set, read once into a map-style list of its items.

An evaluation evaluates every item exactly once, split among the current
devices by chunks of indices (flexpar/core/evaluation.py). An iterable
`eval_dataset=` (an `IterableDataset`, a Hugging Face streaming split) has no
indices: `EvalItems.read` iterates it once, in its own order, where the `Job`
is built, and the evaluation then works on the list of its items, as on any
map-style set. The items are held in memory and travel to every device with
the job, so an iterable evaluation set must be finite and modest in size
(at most `LIMIT` items: a larger one is refused in one line).
"""

from __future__ import annotations

from torch.utils.data import Dataset

from flexpar.errors import ArgumentError

LIMIT = 1_000_000


class EvalItems(Dataset):
    """The items of an iterable evaluation set, in its order (map-style: `len`, `[index]`)."""

    def __init__(self, items: list, source: str):
        self.items = items
        self.source = source  # what they were read from, for messages

    @staticmethod
    def read(dataset) -> EvalItems:
        items = []
        for item in dataset:
            if len(items) == LIMIT:
                raise ArgumentError(
                    f"eval_dataset= is an iterable of more than {LIMIT} items: an iterable evaluation set is "
                    "read into memory where the Job is built; give a map-style one (or fewer items)"
                )
            items.append(item)
        return EvalItems(items, type(dataset).__name__)

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int):
        return self.items[index]
