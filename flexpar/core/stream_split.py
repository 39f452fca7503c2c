"""An iterable dataset cut into virtual-worker streams, and where each stands (pure).

A streaming (iterable) dataset has no indices to permute: its items come in the
dataset's own order, and flexpar never reorders them. So the split is fixed for
the job, by VW, and independent of the devices:

- **Groups.** The `V` VWs are cut into `G` groups of `V / G` consecutive VWs
  (the *lanes* of the group). Each group reads its own stream; the VWs of a
  group take that stream's items in turn: item `i` of a group's stream goes to
  lane `i % lanes`. Step `s` takes the next `batch * lanes` items of every group
  (`batch` = the per-VW batch, `global_batch / V`), its *chunk*.
- **Without shards** (a dataset that says nothing about them) there is one
  group (`G = 1`, `lanes = V`): the stream is the dataset's own order, dealt
  round-robin, so VW `v` takes items `v, v + V, v + 2V, ...` and step `s`
  trains on items `s*B .. (s+1)*B - 1` of the pass (B the global batch). Every
  device that holds a VW reads the whole stream and keeps its VWs' items.
- **With `n` shards**, `G = gcd(n, V)`: group `g` reads the `n / G`
  consecutive shards `g*n/G .. (g+1)*n/G - 1`, and only the devices holding one
  of its VWs read them. `n` a multiple of `V` gives one VW per group: every
  item is read once in the whole job. Otherwise the `lanes = V / G` VWs of a
  group share one stream, read once by each device that holds any of them
  (`read_amplification`): `n = 12, V = 8` gives 4 groups of 2 VWs; `n` prime to
  `V` gives `G = 1`, the round-robin split. Shards are never split or
  dropped, and the groups read equal numbers of shards, so groups of equal
  shards run out together.

A group's stream is its passes one after another (the dataset iterated anew
for each pass, with `set_epoch(pass)` where it has one). When a pass ends in
the middle of a chunk (`pass_end`):

- `"drop"` (the default, as the map-style path's `drop_last`): the items of
  the unfinished chunk are left out and the next pass starts the chunk. A
  group's pass then always starts at a step boundary (with `G = 1`, passes and
  steps line up exactly as for a map-style dataset), and at most
  `batch * lanes - 1` items of each group are left out per pass, named by
  `PassEnd.left_out`.
- `"carry"`: the chunk is filled from the next pass; nothing is left out, and
  a step may hold the end of one pass and the start of the next.

Either way each group decides alone, from its own stream: no device needs to
hear of another group's pass end for a step's items to be the same on any
device set. Groups of unequal streams drift apart in passes (a group of
shorter shards starts its next pass earlier).

A group's position at a step boundary (`Position`) is plain data: the pass,
the items of that pass read before the boundary, and the dataset's own
`state_dict()` at that point where it has one whose state is complete (else
`None`: the position is then reached by skipping `consumed` items of a fresh
pass). Every VW of a group has its group's position.
"""

from __future__ import annotations

import hashlib
import math
import struct
from dataclasses import dataclass
from typing import Any, Iterable, Optional, Sequence

PASS_ENDS = ("drop", "carry")


@dataclass(frozen=True)
class StreamSplit:
    """How the `virtual_workers` VW streams come from the dataset: `groups` streams, each dealt to its lanes."""

    virtual_workers: int
    groups: int
    shards: Optional[int] = None  # the dataset's shard count; None: it has none (one group, round-robin)

    @property
    def lanes(self) -> int:
        """VWs per group (they take a group's items in turn)."""
        return self.virtual_workers // self.groups

    @property
    def sharded(self) -> bool:
        return self.groups > 1

    def group_of(self, virtual_worker: int) -> int:
        return virtual_worker // self.lanes

    def lane_of(self, virtual_worker: int) -> int:
        return virtual_worker % self.lanes

    def members(self, group: int) -> range:
        """The VWs of `group` (consecutive: the VW ranges devices hold keep a group on few devices)."""
        return range(group * self.lanes, (group + 1) * self.lanes)

    def shards_of(self, group: int) -> range:
        """The dataset shards `group` reads (all of a dataset without shards for its one group)."""
        if self.shards is None:
            return range(0)
        per_group = self.shards // self.groups
        return range(group * per_group, (group + 1) * per_group)

    def groups_of(self, virtual_workers: Iterable[int]) -> list:
        """The groups a device holding these VWs reads, in order."""
        return sorted({self.group_of(v) for v in virtual_workers})

    def chunk(self, batch: int) -> int:
        """Items a group's stream gives each step: `batch` per lane."""
        return batch * self.lanes

    def to_dict(self) -> dict:
        return {"virtual_workers": self.virtual_workers, "groups": self.groups, "shards": self.shards}

    @staticmethod
    def from_dict(data: dict) -> StreamSplit:
        return StreamSplit(int(data["virtual_workers"]), int(data["groups"]), data["shards"])


def split_stream(virtual_workers: int, shards: Optional[int] = None) -> StreamSplit:
    """The split of a dataset with `shards` shards (None or 0: none) into `virtual_workers` VW streams."""
    if virtual_workers < 1:
        raise ValueError(f"virtual_workers={virtual_workers} must be >= 1")
    if not shards:
        return StreamSplit(virtual_workers, 1, None)
    if shards < 0:
        raise ValueError(f"shards={shards} must be >= 0")
    return StreamSplit(virtual_workers, math.gcd(shards, virtual_workers), shards)


def pass_seed(seed: int, group: int, pass_: int) -> int:
    """A 63-bit seed for pass `pass_` of `group`'s stream (its DataLoader's processes draw from it)."""
    words = (0x5354524541, seed, group, pass_)  # a domain tag ("STREA") apart from batching's seed streams
    packed = struct.pack("<4Q", *(int(word) & 0xFFFFFFFFFFFFFFFF for word in words))
    return int.from_bytes(hashlib.blake2b(packed, digest_size=8).digest(), "little") >> 1


def lane_items(chunk: Sequence, lane: int, lanes: int) -> list:
    """The items of one lane (one VW) in its group's chunk: positions lane, lane + lanes, ..."""
    return list(chunk[lane::lanes])


def read_amplification(split: StreamSplit, holdings: Sequence[Iterable[int]]) -> float:
    """Items read per item trained when device `i` holds the VWs `holdings[i]`.

    A device reads every item of each group it holds a VW of, and every group's
    items are trained once: (sum over devices of the groups each reads) / G.
    1.0 when no group is spread over two devices (always with one VW per group).
    """
    read = sum(len(split.groups_of(held)) for held in holdings)
    return read / split.groups


@dataclass(frozen=True)
class Position:
    """Where a group's stream stands at the boundary before `step` (plain data)."""

    group: int
    step: int
    pass_: int = 0
    consumed: int = 0  # items of pass `pass_` read before the boundary
    source: Any = None  # the dataset's state_dict() at the boundary when complete; None: skip `consumed`

    def to_dict(self) -> dict:
        return {
            "group": self.group,
            "step": self.step,
            "pass": self.pass_,
            "consumed": self.consumed,
            "source": self.source,
        }

    @staticmethod
    def from_dict(data: dict) -> Position:
        return Position(int(data["group"]), int(data["step"]), int(data["pass"]), int(data["consumed"]), data["source"])

    def same_place(self, other: Position) -> bool:
        """The same boundary of the same stream (the source states may differ in form, not in place)."""
        return (self.group, self.step, self.pass_, self.consumed) == (
            other.group,
            other.step,
            other.pass_,
            other.consumed,
        )


def start(group: int) -> Position:
    """A group's position before step 0: the start of pass 0."""
    return Position(group, 0)


@dataclass(frozen=True)
class PassEnd:
    """A group's pass ended while the chunk of `step` was read (plain data, for the ledger and records)."""

    group: int
    pass_: int
    items: int  # the pass's length
    step: int  # the step whose chunk it ended in
    left_out: tuple = ()  # (first, stop) of the pass's items left out ("drop"), or ()

    @property
    def left_out_count(self) -> int:
        return self.left_out[1] - self.left_out[0] if self.left_out else 0

    def to_dict(self) -> dict:
        return {
            "group": self.group,
            "pass": self.pass_,
            "items": self.items,
            "step": self.step,
            "left_out": list(self.left_out),
        }


class EmptyPass(ValueError):
    """A pass too short to fill one chunk (or empty): the stream could never fill a step."""


class ChunkFiller:
    """Reading one group's chunks, item by item (the state machine; the caller does the reading).

    From a boundary position: `begin()`, then for each item read `item()` (it
    returns the item's `(pass, index)`) until `full`, or `end()` when the pass
    runs out (it returns the `PassEnd`, and whether the caller drops the items it
    holds for this chunk; the caller then opens the next pass). `finish(source)`
    is the boundary after a full chunk.
    """

    def __init__(self, position: Position, chunk: int, pass_end: str = "drop"):
        if pass_end not in PASS_ENDS:
            raise ValueError(f"pass_end={pass_end!r} must be one of {PASS_ENDS}")
        if chunk < 1:
            raise ValueError(f"chunk={chunk} must be >= 1")
        self.group = position.group
        self.step = position.step
        self.pass_ = position.pass_
        self.consumed = position.consumed
        self.chunk = chunk
        self.pass_end = pass_end
        self.held = 0  # items of the current chunk held so far

    @property
    def full(self) -> bool:
        return self.held == self.chunk

    def begin(self) -> None:
        self.held = 0

    def item(self) -> tuple:
        where = (self.pass_, self.consumed)
        self.consumed += 1
        self.held += 1
        return where

    def end(self) -> tuple:
        """The pass ended: (PassEnd, drop_held): drop_held says the caller drops the chunk's items held so far."""
        too_short(self.group, self.pass_, self.consumed, self.chunk, self.pass_end)
        if self.pass_end == "drop" and self.held:
            left_out = (self.consumed - self.held, self.consumed)
            self.held = 0
            drop = True
        else:
            left_out, drop = (), False
        ended = PassEnd(self.group, self.pass_, self.consumed, self.step, left_out)
        self.pass_ += 1
        self.consumed = 0
        return ended, drop

    def finish(self, source: Any = None) -> Position:
        """The boundary after this chunk (call when `full`); the filler moves on to the next step."""
        if not self.full:
            raise RuntimeError("the chunk is not full")
        self.step += 1
        self.held = 0
        return Position(self.group, self.step, self.pass_, self.consumed, source)


def too_short(group: int, pass_: int, length: int, chunk: int, pass_end: str) -> None:
    """EmptyPass if a pass of `length` items cannot be used: empty, or ("drop") shorter than one chunk."""
    if length == 0 or (pass_end == "drop" and length < chunk):
        raise EmptyPass(
            f"pass {pass_} of stream group {group} has {length} items, fewer than the "
            f"{chunk if pass_end == 'drop' else 1} a step needs from it"
        )


def position_at(group: int, step: int, ended: Sequence[int], chunk: int, pass_end: str = "drop") -> Position:
    """A group's position at the boundary before `step`, from the lengths of its passes that ended (no items).

    `ended[p]` is the length of pass `p` (from the `PassEnd`s met so far); the
    passes after them are taken as long enough. The same place a reader that read
    every chunk reaches (`ChunkFiller`), with no source state: reached again by
    skipping `consumed` items of a fresh pass. So every device can tell any
    group's position from the step and the pass ends, which are few and small.
    """
    if pass_end not in PASS_ENDS:
        raise ValueError(f"pass_end={pass_end!r} must be one of {PASS_ENDS}")
    for pass_, length in enumerate(ended):
        too_short(group, pass_, length, chunk, pass_end)
    if pass_end == "drop":
        remaining = step
        for pass_, length in enumerate(ended):
            steps = length // chunk
            if remaining <= steps:
                return Position(group, step, pass_, remaining * chunk)
            remaining -= steps
        return Position(group, step, len(ended), remaining * chunk)
    before = step * chunk  # items read before the boundary, over all passes
    for pass_, length in enumerate(ended):
        if before <= length:
            return Position(group, step, pass_, before)
        before -= length
    return Position(group, step, len(ended), before)


def plan_chunks(
    pass_lengths: Sequence[int], chunk: int, steps: int, pass_end: str = "drop", group: int = 0
) -> tuple[list, list]:
    """The spec of a group's stream: its first `steps` chunks as `(pass, index)` lists, and the pass ends met.

    `pass_lengths[p]` is the length of pass `p` (passes beyond the list repeat its last length).
    """
    filler = ChunkFiller(start(group), chunk, pass_end)
    chunks, ends = [], []
    for _ in range(steps):
        filler.begin()
        held: list = []
        while not filler.full:
            length = pass_lengths[min(filler.pass_, len(pass_lengths) - 1)]
            if filler.consumed < length:
                held.append(filler.item())
                continue
            ended, drop = filler.end()
            ends.append(ended)
            if drop:
                held = []
        filler.finish()
        chunks.append(held)
    return chunks, ends


def steps_for_passes(pass_lengths: Sequence[Sequence[int]], chunk: int, pass_end: str = "drop") -> int:
    """The steps of a job of `epochs=N` over a stream whose groups' first N passes have the lengths given.

    `pass_lengths[g]` lists group g's N pass lengths. The job ends with the step that trains the last item
    of pass N that any group trains: with "drop", group g's N passes fill `sum(length // chunk)` steps (the
    last `length % chunk` items of each pass are left out); with "carry", `ceil(sum(length) / chunk)` steps
    (the last of them may start pass N + 1). A group whose passes end sooner starts its pass N + 1 in the
    steps the others still need (those items train, under pass N + 1).
    """
    if pass_end not in PASS_ENDS:
        raise ValueError(f"pass_end={pass_end!r} must be one of {PASS_ENDS}")
    steps = 0
    for group, lengths in enumerate(pass_lengths):
        for pass_, length in enumerate(lengths):
            too_short(group, pass_, length, chunk, pass_end)
        if pass_end == "drop":
            steps = max(steps, sum(length // chunk for length in lengths))
        else:
            steps = max(steps, -(-sum(lengths) // chunk))
    return steps


def job_end_pass_ends(pass_lengths: Sequence[Sequence[int]], chunk: int, steps: int, pass_end: str = "drop") -> list:
    """The pass ends of `epochs=N` (`pass_lengths[g]`: group g's N pass lengths) that the job's end meets
    rather than a step: a group whose passes fill the job's `steps` exactly notices its last pass's end only
    when it reads for the step after the last, which no device runs. Each is dated `steps` (that step), so
    that with the pass ends the steps met, every item of the N passes is either trained once or named as
    left out ("drop": the last pass's final `length % chunk` items). With "carry" only a group whose items
    fill the steps exactly has one (nothing left out): any other starts pass N + 1 in the last step."""
    if pass_end not in PASS_ENDS:
        raise ValueError(f"pass_end={pass_end!r} must be one of {PASS_ENDS}")
    ends = []
    for group, lengths in enumerate(pass_lengths):
        last = lengths[-1]
        if pass_end == "drop":
            filled = sum(length // chunk for length in lengths) == steps
            left_out = (last - last % chunk, last) if last % chunk else ()
        else:
            filled = sum(lengths) == steps * chunk
            left_out = ()
        if filled:
            ends.append(PassEnd(group, len(lengths) - 1, last, steps, left_out))
    return ends
