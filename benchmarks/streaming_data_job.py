"""The pieces benchmarks/streaming_data.py trains: streams of rows, the model, the plain DataLoader loop.

Rows are `(features, label)` pairs of one seeded tensor, read one at a time
(each item a view of its row, as a `TensorDataset` gives it: the two sides of
`throughput_ratio` do the same work per item); the same rows serve as a
map-style `TensorDataset` and as streams:

- `ShardedRows`: flexpar's shard protocol (`n_shards`, `shard(num_shards,
  index)`), shards read one after another; `StatefulRows` has
  `state_dict()`/`load_state_dict()` (a complete position: pass, shard,
  item), so a moved stream is reached by its state instead of skipping;
- `PlainRows`: the same rows as one stream with no shards (the round-robin
  split).

Both split their items between DataLoader processes by `get_worker_info()`,
as an iterable dataset must under a DataLoader with `num_workers`.

Run as a script (under `flexpar run`: the driver-kill part of the benchmark)
it trains `STREAMING_STEPS` steps of the sharded stream with the sample
ledger on and saves the model to `STREAMING_FINAL`.
"""

from __future__ import annotations

import os
import time

import torch
from torch import nn
from torch.utils.data import IterableDataset, get_worker_info

import flexpar

FEATURES, HIDDEN, CLASSES = 64, 512, 10


def make_rows(count: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(count, FEATURES, generator=generator)
    return inputs, inputs[:, :CLASSES].argmax(dim=1)


class PlainRows(IterableDataset):
    """`count` rows in order, no shards; pass p starts at row 7p (so passes differ)."""

    def __init__(self, count: int, seed: int = 0):
        self.inputs, self.labels = make_rows(count, seed)
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def order(self):
        size = len(self.labels)
        return ((k + 7 * self.epoch) % size for k in range(size))

    def __iter__(self):
        info = get_worker_info()
        for k, index in enumerate(self.order()):
            if info is None or k % info.num_workers == info.id:
                yield self.inputs[index], self.labels[index]


class ShardedRows(IterableDataset):
    """`shards` shards of `per_shard` rows each (flexpar's shard protocol), read one after another.
    No state: flexpar reaches a position by skipping from the pass start."""

    def __init__(self, shards: int, per_shard: int, seed: int = 0):
        self.inputs, self.labels = make_rows(shards * per_shard, seed)  # all rows (the map-style twin's)
        self.per_shard, self.epoch = per_shard, 0
        # Each shard's rows apart: a group's copy (flexpar copies a group's dataset) holds its shards only.
        self.shards = [
            (
                self.inputs[k * per_shard : (k + 1) * per_shard].clone(),
                self.labels[k * per_shard : (k + 1) * per_shard].clone(),
            )
            for k in range(shards)
        ]
        self._resume = None  # (index in shards, item) to start the next iteration from
        self._at = (0, 0)  # where the live iteration stands

    def __getstate__(self):
        state = dict(self.__dict__)
        state["inputs"] = state["labels"] = None  # a group reads its shards only
        return state

    @property
    def n_shards(self) -> int:
        return len(self.shards)

    def shard(self, num_shards: int, index: int):
        per = len(self.shards) // num_shards
        picked = type(self).__new__(type(self))
        picked.__dict__.update(self.__dict__)
        picked.inputs = picked.labels = None
        picked.shards = self.shards[index * per : (index + 1) * per]
        return picked

    def set_epoch(self, epoch: int) -> None:
        self.epoch, self._resume, self._at = epoch, None, (0, 0)

    def __iter__(self):
        info = get_worker_info()
        first_shard, first_item = self._resume or (0, 0)
        self._resume = None
        for position in range(first_shard, len(self.shards)):
            inputs, labels = self.shards[position]
            for item in range(first_item if position == first_shard else 0, len(labels)):
                if info is None or item % info.num_workers == info.id:
                    self._at = (position, item + 1)
                    yield inputs[item], labels[item]


class StatefulRows(ShardedRows):
    """ShardedRows with a complete state (pass, shard, item): flexpar loads a moved stream's position."""

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "shard": self._at[0], "item": self._at[1]}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self._resume = state["epoch"], (state["shard"], state["item"])
        self._at = self._resume


def sharded(shards: int, per_shard: int, stateful: bool = False) -> ShardedRows:
    return (StatefulRows if stateful else ShardedRows)(shards, per_shard)


def make_model() -> nn.Module:
    return nn.Sequential(
        nn.Linear(FEATURES, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, CLASSES)
    )


def make_optimizer(parameters):
    return torch.optim.SGD(parameters, lr=0.01)


def loss(model, batch):
    inputs, labels = batch
    return nn.functional.cross_entropy(model(inputs), labels)


class WaitForJoiner:
    """The loss; on a member, from step `hold_at` on (counted by its calls: `per_step` VWs a step), each
    call sleeps 0.25 s until the device trains in a group of 2, so the join's boundary comes a step or
    two after the joiner is warm, at a stream position known to within that."""

    def __init__(self, hold_at: int, per_step: int):
        self.hold_at, self.per_step, self.calls, self.joined = hold_at, per_step, 0, False

    def __call__(self, model, batch):
        import torch.distributed as dist

        self.calls += 1
        self.joined = self.joined or (dist.is_initialized() and dist.get_world_size() >= 2)
        if self.calls > self.hold_at * self.per_step and not self.joined:
            time.sleep(0.25)
        return loss(model, batch)


def make_job(dataset, virtual_workers: int, global_batch: int, **extra) -> flexpar.Job:
    return flexpar.Job(
        model=make_model,
        optimizer=make_optimizer,
        loss=extra.pop("loss", loss),
        dataset=dataset,
        global_batch=global_batch,
        virtual_workers=virtual_workers,
        seed=3,
        **extra,
    )


# The driver-kill run's job: 4 shards, 4 VWs, the sample ledger on.
KILL_SHARDS, KILL_PER_SHARD, KILL_VWS, KILL_BATCH = 4, 400, 4, 64


def driver_kill_job() -> flexpar.Job:
    return make_job(sharded(KILL_SHARDS, KILL_PER_SHARD), KILL_VWS, KILL_BATCH, loss=SlowLoss())


class SlowLoss:
    """The loss with 20 ms more per VW: the driver is killed in a step, not after the last."""

    def __call__(self, model, batch):
        time.sleep(0.02)
        return loss(model, batch)


if __name__ == "__main__":
    model, summary = driver_kill_job().fit(steps=int(os.environ["STREAMING_STEPS"]), sample_ledger=True)
    torch.save(model.state_dict(), os.environ["STREAMING_FINAL"])
