"""The steps of `epochs=N` over a stream of unknown length: its passes counted before the devices start.

A stream says nothing of its length, so `fit(epochs=N)` reads each stream group's first N passes here,
in the driver, item by item (nothing is collated or kept: one read of the data per pass, with set_epoch
and the DataLoader processes of `num_workers` as a device reads them), and the pure rule in
flexpar/core/stream_split.py (`steps_for_passes`) turns the lengths into the job's step count. The
devices then run that many steps, so every device set, resume and re-adoption agrees on the job's end.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from flexpar.core.stream_split import split_stream, steps_for_passes
from flexpar.data import pass_record
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


@dataclass(frozen=True)
class EpochCount:
    """What `epochs=N` over a stream comes to: the job's steps, the pass lengths they were derived from,
    and what the driver says about it (counted, or taken from the run's record, and what is left out)."""

    steps: int
    lengths: tuple  # [group][pass]: each stream group's first N pass lengths
    chunk: int  # items a group's stream gives each step
    fingerprint: dict  # what the lengths depend on (pass_record.fingerprint)
    note: str
    reused: bool = False  # taken from the run's record (a resumed or re-adopting driver), not read again

    def __post_init__(self):
        if self.steps < 1 or self.chunk < 1 or not self.lengths:
            raise ValueError(f"EpochCount: steps and chunk must be >= 1 and lengths given, got {self!r}")


def steps_for_epochs(job, epochs: int) -> int:
    """The steps of `job` trained for `epochs` passes over its stream (stream_split.steps_for_passes)."""
    return count_epochs(job, epochs).steps


def count_epochs(job, epochs: int, recorded: Optional[dict] = None) -> EpochCount:
    """The steps of `epochs` passes over `job`'s stream, from the pass lengths in `recorded` (the run's
    record: flexpar/data/pass_record.py) where they were counted for this job and dataset, else counted
    here; its note says which, and what the last pass leaves out that no step meets."""
    source = describe(job.dataset)
    split = split_stream(job.virtual_workers, source.shards)
    chunk = split.chunk(job.micro_batch_size)
    expected = pass_record.fingerprint(job, source, split.groups, chunk)
    lengths, why = pass_record.reusable(recorded, expected, epochs)
    if lengths is None:
        lengths = pass_lengths(
            job.dataset, job.virtual_workers, job.micro_batch_size, epochs, job.seed, job.num_workers, source
        )
    steps = steps_for_passes(lengths, chunk, job.pass_end)
    note = epochs_note(lengths, chunk, job.pass_end, steps, epochs)
    if recorded is not None:  # a resumed driver: say whether the stream was read again, and why
        how = "counted again: " + why if why else "taken from the run's record, not read again"
        note = note.replace(" counted (", f" {how} (", 1)
    return EpochCount(steps, tuple(tuple(group) for group in lengths), chunk, expected, note, reused=not why)


def epochs_note(lengths: list, chunk: int, pass_end: str, steps: int, epochs: int) -> str:
    """e.g. "epochs=2 over a stream: 2 passes of 1 stream group counted (430-432 items a pass): 17 steps;
    the last pass's final 22 items fill no step and are left out (no step meets that pass end)"."""
    every = [length for group in lengths for length in group]
    groups = f"{len(lengths)} stream group{'s' if len(lengths) != 1 else ''}"
    sizes = f"{min(every)}" if min(every) == max(every) else f"{min(every)}-{max(every)}"
    note = f"epochs={epochs} over a stream: {epochs} passes of {groups} counted ({sizes} items a pass): {steps} steps"
    if pass_end != "drop":
        return note
    # A group whose passes fill all the steps ends its last pass in the step after the job's last:
    # that pass end, and the items it leaves out, are met by no step.
    unmet = sum(group[-1] % chunk for group in lengths if sum(length // chunk for length in group) == steps)
    if unmet:
        note += f"; the last pass's final {unmet} items fill no step and are left out (no step meets that pass end)"
    return note
