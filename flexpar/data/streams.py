"""One device's virtual-worker streams over an iterable dataset: batches by (step, VW), positions as data.

`VirtualWorkerStreams` is what a device owns for a streaming dataset: given the dataset, `V`, the
per-VW batch and the VWs it runs, it yields each VW's batch of a step (collated as the map-style
path's), reading each stream group it needs once (flexpar/core/stream_split.py has the split and
the pass-end rule) and keeping only its VWs' items.

Positions are training state. At every step boundary the reader knows each of its groups'
`Position`; `state(step)` returns those of the boundary before `step` as plain picklable data, and
`load(state)` puts them in another reader (a position of an earlier boundary is read forward to
the one held), so a VW's stream can move to another device, be restored to the last committed
boundary after a failure, or be checkpointed. Between commits the reader keeps the chunks it read,
so a redone step gets the same items without reading; `commit(step)` forgets what came before.

The promise the tests keep: a step's items (VW by VW) are the same whichever readers hold which
VWs, however VWs move between readers at boundaries, and equal to those of one reader holding every VW.
"""

from __future__ import annotations

import random
import time
from typing import Callable, Iterable, Optional, Sequence

import numpy as np
import torch
from torch.utils.data._utils.collate import default_collate

from flexpar.core import batching
from flexpar.core.stream_split import (
    PASS_ENDS,
    PassEnd,
    Position,
    StreamSplit,
    lane_items,
    position_at,
    split_stream,
    start,
)
from flexpar.data.group_reader import open_at
from flexpar.data.sources import StreamSource, describe
from flexpar.errors import ArgumentError

STATE_FORMAT = 2  # 2: a num_workers stream's loader hands over a per-VW batch at a time


class VirtualWorkerStreams:
    """The VW streams of an iterable dataset, as one device reads them.

    dataset:         the iterable dataset (checked by flexpar/data/sources.py: what is refused raises
                     ArgumentError with one line)
    virtual_workers: V of the job
    batch:           items per VW per step (global_batch / V)
    seed:            the job's seed (each VW's batch is collated under its data seed, as map-style batches)
    collate_fn:      as Job(collate_fn=...); default: torch's default_collate
    num_workers:     DataLoader worker processes per stream group read here (0: read in this process).
                     With k > 0 a group's stream is the order of DataLoader(group's dataset, batch_size=batch,
                     num_workers=k), item by item: the same on every device for the job's k, positioned
                     by skipping
    pass_end:        "drop" (default) or "carry": flexpar/core/stream_split.py
    virtual_worker_ids, step: the VWs held from the boundary before `step` (default: none yet; `hold`)
    """

    def __init__(
        self,
        dataset,
        virtual_workers: int,
        batch: int,
        seed: int = 0,
        collate_fn: Optional[Callable] = None,
        num_workers: int = 0,
        pass_end: str = "drop",
        virtual_worker_ids: Iterable[int] = (),
        step: int = 0,
        source: Optional[StreamSource] = None,
    ):
        if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 0:
            raise ArgumentError(f"num_workers={num_workers!r} must be a whole number >= 0")
        if pass_end not in PASS_ENDS:
            raise ArgumentError(f"pass_end={pass_end!r} must be one of {', '.join(PASS_ENDS)}")
        if batch < 1 or virtual_workers < 1:
            raise ArgumentError(f"batch={batch} and virtual_workers={virtual_workers} must be >= 1")
        self.source = source if source is not None else describe(dataset)
        self.split: StreamSplit = split_stream(virtual_workers, self.source.shards)
        self.batch_size = batch
        self.chunk = self.split.chunk(batch)
        self.seed = seed
        self.collate = collate_fn or default_collate
        self.pass_end = pass_end
        self.num_workers = num_workers
        self.restores: list = []  # Restore records, in order (the caller reports and clears them)
        self._readers: dict = {}
        self._retired_ends: list = []  # pass ends met by group readers closed since
        self._read_retired = 0  # items read by group readers closed since
        self._loaded: dict = {}  # group -> Position loaded, not yet opened
        self._held: tuple = ()
        self._committed = step
        self.hold(virtual_worker_ids, step)

    # -- which VWs this device holds -------------------------------------------------------------

    @property
    def held(self) -> tuple:
        return self._held

    def hold(self, virtual_workers: Iterable[int], step: int) -> None:
        """Run `virtual_workers` from the boundary before `step` on.

        A group this device did not read must have a position for `step` or an
        earlier boundary (from `load`; from an earlier one, the group's stream is
        read forward to `step`, which is exact), except at step 0, where it starts.
        Groups no longer needed are closed.
        """
        wanted = tuple(sorted(set(int(v) for v in virtual_workers)))
        for v in wanted:
            if not 0 <= v < self.split.virtual_workers:
                raise ValueError(f"virtual worker {v} is not one of the job's {self.split.virtual_workers}")
        groups = set(self.split.groups_of(wanted))
        for group in list(self._readers):
            if group not in groups:
                self._retire(group)
        for group in sorted(groups):
            reader = self._readers.get(group)
            if reader is not None and (step in reader.positions or step in reader.chunks):
                self._loaded.pop(group, None)
                continue
            if reader is not None:
                self._retire(group)
            position = self._loaded.pop(group, None)
            if position is None or position.step > step:
                if step != 0:
                    raise RuntimeError(
                        f"no position of stream group {group} (VWs {list(self.split.members(group))}) "
                        f"at step {step}: load() it from the device that held it, or from position_at()"
                    )
                position = start(group)
            began = time.perf_counter()
            source = self.source.group(self.split, group, self.num_workers, self.seed, self.batch_size)
            reader, restore = open_at(source, position, self.chunk, self.pass_end)
            if position.step < step:  # an older boundary's position: read forward, chunk by chunk (exact)
                reader.chunk(step - 1)
                reader.forget_before(step)
                restore.replayed = (step - position.step) * self.chunk
                restore.seconds = time.perf_counter() - began
            self._readers[group] = reader
            self.restores.append(restore)
        self._held = wanted

    # -- batches ------------------------------------------------------------------------------------

    def items(self, step: int, virtual_worker: int) -> list:
        """The raw items of `virtual_worker` at `step` (in its stream's order)."""
        if virtual_worker not in self._held:
            raise KeyError(f"virtual worker {virtual_worker} is not held here (held: {list(self._held)})")
        reader = self._readers[self.split.group_of(virtual_worker)]
        return lane_items(reader.chunk(step), self.split.lane_of(virtual_worker), self.split.lanes)

    def item_ids(self, step: int, virtual_worker: int) -> list:
        """What `items(step, virtual_worker)` are, as `(group, pass, index)` triples: the index in the
        group's stream of that pass (the dataset's order without shards; its shards one after another
        with). The sample ledger's names for streamed items, matching `PassEnd.left_out`."""
        group = self.split.group_of(virtual_worker)
        self.items(step, virtual_worker)
        places = lane_items(self._readers[group].places[step], self.split.lane_of(virtual_worker), self.split.lanes)
        return [(group, pass_, index) for pass_, index in places]

    def batch(self, step: int, virtual_worker: int):
        """The batch of `virtual_worker` at `step`, collated under its data seed (as the map-style path)."""
        samples = self.items(step, virtual_worker)
        data_seed = batching.data_seed(self.seed, step, virtual_worker)
        torch.default_generator.manual_seed(data_seed)
        random.seed(data_seed)
        np.random.seed(data_seed % (1 << 32))
        return self.collate(samples)

    def batches(self, step: int, virtual_workers: Optional[Sequence[int]] = None):
        """(VW, batch) for the held VWs (or those given) at `step`, in VW order."""
        for virtual_worker in sorted(self._held if virtual_workers is None else virtual_workers):
            yield virtual_worker, self.batch(step, virtual_worker)

    # -- positions ------------------------------------------------------------------------------------

    def commit(self, step: int) -> None:
        """The boundary before `step` is committed: chunks and positions before it are forgotten."""
        if step < self._committed:
            raise ValueError(f"commit({step}) goes back before the committed step {self._committed}")
        self._committed = step
        for reader in self._readers.values():
            reader.forget_before(step)

    @property
    def committed(self) -> int:
        return self._committed

    def state(self, step: Optional[int] = None, virtual_workers: Optional[Iterable[int]] = None) -> dict:
        """The positions at the boundary before `step` (default: the committed one) of the groups of
        `virtual_workers` (default: those held), as plain picklable data for `load`."""
        step = self._committed if step is None else step
        chosen = self._held if virtual_workers is None else tuple(virtual_workers)
        positions = []
        for group in self.split.groups_of(chosen):
            reader = self._readers.get(group)
            if reader is None:
                raise KeyError(f"stream group {group} is not read here")
            if step not in reader.positions:
                raise KeyError(
                    f"stream group {group} has no position at step {step} here (known: {sorted(reader.positions)})"
                )
            positions.append(reader.positions[step].to_dict())
        return {**self.header(), "step": step, "groups": positions}

    def load(self, state: dict) -> None:
        """Take the positions in `state` (from `state()` here or on another device).

        A group read here already at the same place is left as it is; any other
        is (re)opened at the loaded position when `hold` next needs it.
        """
        read_before = state.get("format") == 1 and not self.num_workers  # format 1: the same without loaders
        if state.get("format") != STATE_FORMAT and not read_before:
            raise ValueError(f"stream state format {state.get('format')!r}, expected {STATE_FORMAT}")
        mine = self.header()
        mine.pop("format")
        theirs = {key: state.get(key) for key in mine}
        if theirs != mine:
            raise ValueError(f"the stream state is of another split or stream: {theirs}, here {mine}")
        for data in state["groups"]:
            position = Position.from_dict(data)
            reader = self._readers.get(position.group)
            known = None if reader is None else reader.positions.get(position.step)
            if known is not None and known.same_place(position):
                continue
            if reader is not None:
                self._retire(position.group)
            self._loaded[position.group] = position

    @property
    def items_read(self) -> int:
        """Items taken from the streams by this reader since it was made (groups closed since included)."""
        return self._read_retired + sum(reader.read for reader in self._readers.values())

    def reading(self) -> list:
        """The groups read here now."""
        return sorted(self._readers)

    def newest_position(self, group: int, step: int) -> Optional[Position]:
        """The newest position of `group` known here at a boundary up to `step` (None: not read here)."""
        reader = self._readers.get(group)
        if reader is None:
            return None
        known = [at for at in reader.positions if at <= step]
        return reader.positions[max(known)] if known else None

    def drop_group(self, group: int) -> None:
        """Stop reading `group` here (a later `hold` opens it from a loaded position)."""
        if group in self._readers:
            self._retire(group)

    def pass_ends(self) -> list:
        """The pass ends met so far by the groups read here (PassEnd records, one per group and pass), oldest first.

        Every device reading a group meets its pass ends: the records are the same
        data wherever they come from, so a ledger keeps one per (group, pass).
        """
        met = [ended for reader in self._readers.values() for ended in reader.pass_ends] + self._retired_ends
        unique = {(ended.group, ended.pass_): ended for ended in met}
        return sorted(unique.values(), key=lambda ended: (ended.step, ended.group, ended.pass_))

    def position_at(self, group: int, step: int, pass_ends: Sequence[PassEnd]) -> dict:
        """A state holding `group`'s position at `step`, computed from its pass ends (no reading, no
        source state: loading it skips from the pass start). For a group whose reader was lost."""
        lengths = [ended.items for ended in sorted(pass_ends, key=lambda e: e.pass_) if ended.group == group]
        position = position_at(group, step, lengths, self.chunk, self.pass_end)
        return {**self.header(), "step": step, "groups": [position.to_dict()]}

    def header(self) -> dict:
        """What a position means: the split, the chunk, the pass-end rule, and the stream's order
        (which num_workers, and with it the seed of the loader processes, decides)."""
        return {
            "format": STATE_FORMAT,
            "split": self.split.to_dict(),
            "batch": self.batch_size,
            "pass_end": self.pass_end,
            "num_workers": self.num_workers,
            "seed": self.seed if self.num_workers else None,
        }

    def _retire(self, group: int) -> None:
        reader = self._readers.pop(group)
        self._retired_ends.extend(reader.pass_ends)
        self._read_retired += reader.read
        reader.close()

    def close(self) -> None:
        """Close every stream read here (and the DataLoader processes behind them)."""
        for group in list(self._readers):
            self._retire(group)
