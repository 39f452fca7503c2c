"""The sample order of `transformers.Trainer` on one device, given to flexpar's steps.

transformers.Trainer draws each epoch's order with a `RandomSampler` that
accelerate makes seedable: epoch `e` is `torch.randperm(N)` from a generator
seeded with `data_seed + e` (`data_seed` defaults to `seed`), and each
optimizer step takes the next `per_device_train_batch_size x
gradient_accumulation_steps (x world size)` samples of it.

flexpar's step `s` takes positions `s*B .. (s+1)*B-1` of its own epoch
permutation (flexpar/core/batching.py). `TrainerOrder` is a map-style dataset
whose item at flexpar's permuted position `k` is the Trainer's sample `k`: so
flexpar's step `s` trains exactly the samples of the Trainer's step `s`. The
epochs are laid end to end; where the dataset is not a whole number of global
batches, a flexpar step takes the end of one epoch and the start of the next
(the Trainer's last step of an epoch is a short one instead).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch.utils.data import Dataset

from flexpar.core import batching


def trainer_epoch_order(dataset_size: int, data_seed: int, epoch: int) -> torch.Tensor:
    """The Trainer's sample order of epoch `epoch` (accelerate's SeedableRandomSampler on one device)."""
    generator = torch.Generator()
    generator.manual_seed(data_seed + epoch)
    return torch.randperm(dataset_size, generator=generator)


def trainer_order(dataset_size: int, data_seed: int, samples: int, epoch_samples: Optional[int] = None) -> torch.Tensor:
    """The first `samples` sample indices the Trainer trains, epoch after epoch.

    `epoch_samples`: how many of each epoch's order it trains (dataloader_drop_last drops the partial
    last micro-batch); default all.
    """
    epoch_samples = dataset_size if epoch_samples is None else epoch_samples
    orders, total, epoch = [], 0, 0
    while total < samples:
        orders.append(trainer_epoch_order(dataset_size, data_seed, epoch)[:epoch_samples])
        total += epoch_samples
        epoch += 1
    return torch.cat(orders)[:samples]


class TrainerOrder(Dataset):
    """`dataset` re-indexed so that flexpar's steps take the Trainer's samples, in the Trainer's order.

    Its length is `steps x global_batch`: flexpar's first (and only) epoch
    over it is the whole run. Item `j` is the dataset's sample
    `order[inverse[j]]`, where `inverse` undoes flexpar's permutation of
    epoch 0 for `flexpar_seed`.
    """

    def __init__(
        self,
        dataset: Any,
        data_seed: int,
        flexpar_seed: int,
        steps: int,
        global_batch: int,
        epoch_samples: Optional[int] = None,
    ):
        self.dataset = dataset
        samples = steps * global_batch
        order = trainer_order(len(dataset), data_seed, samples, epoch_samples)
        permutation = batching.epoch_permutation(flexpar_seed, 0, samples)
        self.indices = torch.empty(samples, dtype=torch.int64)
        self.indices[permutation] = order  # flexpar reads position k at permutation[k]

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, index: int):
        return self.dataset[int(self.indices[index])]

    def sample_of(self, index: int) -> Optional[int]:
        """The underlying dataset's index of item `index` (for checks and ledgers)."""
        return int(self.indices[index])
