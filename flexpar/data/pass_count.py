"""The steps of `epochs=N` over a stream of unknown length: its passes counted before the devices start.

A stream says nothing of its length, so `fit(epochs=N)` reads each stream group's first N passes here,
in the driver, item by item (nothing is collated or kept: one read of the data per pass, with set_epoch
and the DataLoader processes of `num_workers` as a device reads them), and the pure rule in
flexpar/core/stream_split.py (`steps_for_passes`) turns the lengths into the job's step count. The
devices then run that many steps, so every device set, resume and re-adoption agrees on the job's end.
"""

from __future__ import annotations

from typing import Optional

from flexpar.core.stream_split import split_stream, steps_for_passes
from flexpar.data.sources import StreamSource, describe


def pass_lengths(
    dataset,
    virtual_workers: int,
    batch: int,
    passes: int,
    seed: int = 0,
    num_workers: int = 0,
    source: Optional[StreamSource] = None,
) -> list:
    """Each stream group's first `passes` pass lengths (`[group][pass]`), read as a device reads them."""
    source = source if source is not None else describe(dataset)
    split = split_stream(virtual_workers, source.shards)
    lengths = []
    for group in range(split.groups):
        group_source = source.group(split, group, num_workers, seed, batch)
        counted = []
        for pass_ in range(passes):  # in order: a dataset's state may carry from one pass to the next
            counted.append(sum(1 for _ in group_source.open(pass_)))
        lengths.append(counted)
    return lengths


def steps_for_epochs(job, epochs: int) -> int:
    """The steps of `job` trained for `epochs` passes over its stream (stream_split.steps_for_passes)."""
    lengths = pass_lengths(job.dataset, job.virtual_workers, job.micro_batch_size, epochs, job.seed, job.num_workers)
    chunk = split_stream(job.virtual_workers, describe(job.dataset).shards).chunk(job.micro_batch_size)
    return steps_for_passes(lengths, chunk, job.pass_end)
