"""Reading one stream group: its live iterator, its chunks since the commit, and how a position is reached.

`GroupReader` reads a group's stream chunk by chunk under the pass-end rule (flexpar/core/stream_split.py's
`ChunkFiller`), keeping each chunk, its items' `(pass, index)` and the position after it until the commit;
`open_at` opens one at a `Position`, by the dataset's own state where it is complete, else by skipping from
the pass start, and says how (`Restore`). `VirtualWorkerStreams` (streams.py) owns one per group it reads.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from flexpar.core.stream_split import ChunkFiller, Position
from flexpar.data.sources import GroupSource


@dataclass
class Restore:
    """How a group's stream was brought to a loaded position (for the join or resume event)."""

    group: int
    step: int
    how: str  # "state": the dataset's own state_dict; "skip": skipped from the pass start; "start"
    skipped: int = 0  # items read and thrown away to get there
    seconds: float = 0.0
    replayed: int = 0  # items read forward from an older boundary's position to the one held (chunks, whole)


@dataclass
class GroupReader:
    """One group's stream as this device reads it: the live iterator and the chunks since the commit."""

    source: GroupSource
    filler: ChunkFiller
    chunks: dict = field(default_factory=dict)  # step -> the group's items of that step
    places: dict = field(default_factory=dict)  # step -> their (pass, index in the group's pass) pairs
    positions: dict = field(default_factory=dict)  # step -> Position at the boundary before it
    pass_ends: list = field(default_factory=list)
    iterator: Any = None
    read: int = 0  # items taken from the stream (the chunks', skipped ones and those of a dropped pass end)

    @property
    def next_step(self) -> int:
        """The step whose chunk the live iterator reads next."""
        return self.filler.step

    def read_chunk(self) -> None:
        filler = self.filler
        filler.begin()
        held: list = []
        places: list = []
        while not filler.full:
            try:
                item = next(self.iterator)
                self.read += 1
            except StopIteration:
                ended, drop = filler.end()
                self.pass_ends.append(ended)
                if drop:
                    held, places = [], []
                self.close()
                self.iterator = self.source.open(filler.pass_)
                continue
            places.append(filler.item())
            held.append(item)
        step = filler.step
        self.chunks[step] = held
        self.places[step] = places
        self.positions[step + 1] = filler.finish(self.source.state())

    def chunk(self, step: int) -> list:
        if step in self.chunks:
            return self.chunks[step]
        if step < self.next_step:
            raise RuntimeError(
                f"step {step} of stream group {self.filler.group} was committed and forgotten "
                f"(this reader is at step {self.next_step})"
            )
        while self.next_step <= step:
            self.read_chunk()
        return self.chunks[step]

    def forget_before(self, step: int) -> None:
        self.chunks = {s: items for s, items in self.chunks.items() if s >= step}
        self.places = {s: places for s, places in self.places.items() if s >= step}
        self.positions = {s: where for s, where in self.positions.items() if s >= step}

    def close(self) -> None:
        for name in ("close", "_shutdown_workers"):  # a generator's; a DataLoader iterator's processes
            close = getattr(self.iterator, name, None)
            if callable(close):
                close()
        self.iterator = None


def open_at(source: GroupSource, position: Position, chunk: int, pass_end: str) -> tuple:
    """A reader of `source` at `position`, and how it got there."""
    began = time.perf_counter()
    if source.stateful and position.source is None and not source.skippable and position.pass_ > 0:
        raise ValueError(
            f"stream group {position.group}'s position at step {position.step} has no dataset state, and this "
            "dataset's passes are not independent (its state carries from one to the next): load a position "
            "taken by a reader"
        )
    if position.source is not None and source.stateful:
        iterator, how, skipped = source.open(position.pass_, position.source), "state", 0
    else:
        iterator = source.open(position.pass_)
        for skipped in range(position.consumed):
            try:
                next(iterator)
            except StopIteration:
                raise RuntimeError(
                    f"stream group {position.group}'s pass {position.pass_} ended after {skipped} items, "
                    f"before the position to restore ({position.consumed} items in): the dataset is not the "
                    "same stream on every pass and device"
                ) from None
        skipped = position.consumed
        how = "skip" if skipped else "start"
    reader = GroupReader(source, ChunkFiller(position, chunk, pass_end), iterator=iterator, read=skipped)
    reader.positions[position.step] = Position(
        position.group, position.step, position.pass_, position.consumed, source.state()
    )
    return reader, Restore(position.group, position.step, how, skipped, time.perf_counter() - began)
