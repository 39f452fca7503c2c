"""Loading a virtual worker's samples through torch's DataLoader machinery.

The batch sampler yields, for each (step, virtual worker) this device will run,
the VW's sample indices paired with the VW's data seed. The dataset wrapper
seeds torch, `random` and numpy from it before loading the samples, so data
augmentation depends on the VW only, also inside DataLoader worker processes.
"""

from __future__ import annotations

import collections
import multiprocessing
import random
from typing import Callable, Iterator

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset
from torch.utils.data._utils.collate import default_collate

from flexpar.core import batching
from flexpar.data import VirtualWorkerStreams, is_stream


def seed_everything(seed: int) -> None:
    """Seed the CPU random streams a dataset may draw from: torch, `random`, numpy."""
    # torch.default_generator directly: torch.manual_seed also queues lazy seeding
    # of every accelerator backend, each capturing a traceback (about 1.5 ms a call
    # in a worker, on every virtual worker); data loading runs on the CPU.
    torch.default_generator.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed % (1 << 32))


class _SeededDataset(Dataset):
    """Wraps the user's dataset; items are (data seed, index) pairs of one VW."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, item):
        seed, index = item
        seed_everything(seed)
        return self.dataset[index]

    def __getitems__(self, items):
        seed_everything(items[0][0])
        return [self.dataset[index] for _, index in items]


class _RecordingDataset(_SeededDataset):
    """The sample ledger's wrapper: each item comes with the index it was loaded from."""

    def __getitem__(self, item):
        return item[1], super().__getitem__(item)

    def __getitems__(self, items):
        return list(zip([index for _, index in items], super().__getitems__(items)))


class _CollateWithIndices:
    """Collates the samples of `_RecordingDataset` items; returns (loaded indices, batch).

    A class, not a closure: DataLoader worker processes may need to pickle it.
    """

    def __init__(self, collate):
        self.collate = collate

    def __call__(self, pairs):
        return [index for index, _ in pairs], self.collate([sample for _, sample in pairs])


def load_batch(job, indices, seed: int):
    """One VW's batch, loaded in this process (used for checks and warm-up)."""
    seed_everything(seed)
    collate = job.collate_fn or default_collate
    return collate([job.dataset[index] for index in indices])


def first_batch(job):
    """VW 0's batch of step 0, loaded in this process (the driver's check and the warm-up).

    A streaming dataset's is read from the start of its stream, without DataLoader processes
    (with `num_workers=k` the job's stream may deal other items to it: a check needs a batch, not that one).
    """
    if is_stream(job.dataset):
        reader = VirtualWorkerStreams(
            job.dataset,
            job.virtual_workers,
            job.micro_batch_size,
            seed=job.seed,
            collate_fn=job.collate_fn,
            virtual_worker_ids=(0,),
        )
        try:
            return reader.batch(0, 0)
        finally:
            reader.close()
    dataset_size, batch, workers = len(job.dataset), job.global_batch, job.virtual_workers
    indices = batching.virtual_worker_indices(job.seed, 0, 0, dataset_size, batch, workers)
    return load_batch(job, indices, batching.data_seed(job.seed, 0, 0))


_LOADER_CONTEXT = "fork" if "fork" in multiprocessing.get_all_start_methods() else None


class VirtualWorkerLoader:
    """Batches for this device's virtual workers, in the order it runs them.

    `plan(step)` returns the VW ids this device runs at `step`, as currently
    known. With DataLoader workers, batches are prefetched along the plan; if
    the plan changes (re-balancing, a new device set), the prefetched batches
    are dropped and loading restarts at the requested VW.

    With `record_indices` (the sample ledger), every batch travels with the
    sample indices its dataset items were loaded from, through the same
    DataLoader path (worker processes included): `loaded_indices` holds those
    of the batch `batch` returned last, so the ledger counts what was loaded,
    not what the plan says should have been.
    """

    def __init__(self, job, plan: Callable[[int], range], total_steps: int, record_indices: bool = False):
        self.job = job
        self.record_indices = record_indices
        self.loaded_indices: list = []
        self.plan = plan
        self.total_steps = total_steps
        self.dataset_size = len(job.dataset)
        self._iterator = None
        self._issued: collections.deque = collections.deque()
        self._cached_step = None
        self._cached_batch = None

    def _step_indices(self, step: int) -> list:
        if self._cached_step != step:
            batch = batching.global_batch_indices(self.job.seed, step, self.dataset_size, self.job.global_batch)
            self._cached_batch = batching.split_global_batch(batch, self.job.virtual_workers)
            self._cached_step = step
        return self._cached_batch

    def _requests(self, step: int, first_virtual_worker: int) -> Iterator[list]:
        """Index lists along the plan, from (step, first_virtual_worker) on."""
        seed = self.job.seed
        while step < self.total_steps:
            for virtual_worker in self.plan(step):
                if virtual_worker < first_virtual_worker:
                    continue
                indices = self._step_indices(step)[virtual_worker]
                self._issued.append((step, virtual_worker))
                data_seed = batching.data_seed(seed, step, virtual_worker)
                yield [(data_seed, index) for index in indices]
            first_virtual_worker = 0
            step += 1

    def _restart(self, step: int, virtual_worker: int) -> None:
        self._issued.clear()
        self.close()
        collate = self.job.collate_fn or default_collate
        loader = DataLoader(
            (_RecordingDataset if self.record_indices else _SeededDataset)(self.job.dataset),
            batch_sampler=_Requests(self, step, virtual_worker),
            collate_fn=_CollateWithIndices(collate) if self.record_indices else collate,
            num_workers=self.job.num_workers,
            # Loader processes are this worker's own children (fork), so they end with it.
            # Under the worker's inherited fork-server start method they would be the fork
            # server's children instead, and outlive the job (their watchdog watches their parent).
            multiprocessing_context=_LOADER_CONTEXT if self.job.num_workers else None,
        )
        self._iterator = iter(loader)

    def close(self) -> None:
        """Stop the DataLoader's worker processes, if any (a worker's exit skips their clean-up)."""
        iterator, self._iterator = self._iterator, None
        shutdown = getattr(iterator, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()

    def batch(self, step: int, virtual_worker: int):
        """The batch of `virtual_worker` at `step`."""
        wanted = (step, virtual_worker)
        if self._iterator is not None and (not self._issued or self._issued[0] == wanted):
            batch, issued = self._pull()
            if issued == wanted:
                return batch
        # The plan changed, or a step is redone after a failure: start over here.
        self._restart(step, virtual_worker)
        batch, issued = self._pull()
        if issued != wanted:
            raise RuntimeError(f"the data plan does not reach step {step}, virtual worker {virtual_worker}")
        return batch

    def _pull(self):
        try:
            batch = next(self._iterator)
        except StopIteration:
            self._iterator = None
            return None, None
        if self.record_indices:
            self.loaded_indices, batch = batch
        return batch, self._issued.popleft()


class _Requests:
    """A batch sampler over the loader's plan (a fresh generator per DataLoader iterator)."""

    def __init__(self, loader: VirtualWorkerLoader, step: int, virtual_worker: int):
        self.loader, self.step, self.virtual_worker = loader, step, virtual_worker

    def __iter__(self):
        return self.loader._requests(self.step, self.virtual_worker)

    def __len__(self):
        return self.loader.total_steps * self.loader.job.virtual_workers


def to_device(batch, device):
    """`batch` (tensors, lists, tuples, dicts of them) on `device`; CPU batches as they are."""
    if device.type == "cpu":
        return batch
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(item, device) for item in batch)
    if isinstance(batch, dict):
        return {key: to_device(value, device) for key, value in batch.items()}
    return batch


def seed_model_randomness(device: torch.device, seed: int) -> None:
    """Seed the streams a VW's forward and backward draw from (dropout).

    The same streams as torch.manual_seed(seed) for the CPU and this device,
    without its lazy seeding of every other backend, which captures a
    traceback per call (milliseconds per VW on a small model).
    """
    torch.default_generator.manual_seed(seed)
    if device.type == "cuda":
        torch.cuda.manual_seed(seed)  # the current device: set in Worker.__init__
