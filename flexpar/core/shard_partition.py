"""Which device holds which part of the optimizer state: the partition, as data (pure).

With `Job(shard_optimizer=True)` the sharded parameters (the trainable
parameters with dense gradients that the optimizer steps) of one dtype form
one flat element space, in the model's parameter order (`Space`). Each space
is cut into as many contiguous chunks as there are members, chunk `i`
primary to rank `i`, of near-equal bytes: the cuts fall on multiples of
`ALIGN` elements, or, `by="parameters"`, on the parameter boundaries nearest
to the equal cuts (an optimizer that reads whole tensors). Chunk `i` is also
held by the `redundancy - 1` ranks that follow `i` on the ring of ranks, so
every element is held by exactly `min(redundancy, members)` members, and one
lost member leaves a copy of everything it held as long as redundancy >= 2.

Why contiguous chunks in rank order: each chunk is one contiguous range of
the flat parameter buffer, so its primary sends the updated parameters with
one in-place broadcast per space (measured on 4 CPU processes: 4 in-place
broadcasts of 25 MB took 70-100 ms where an all-reduce of the 100 MB took
150 ms, and 256 broadcasts of the same bytes 245 ms), and members keep their
ranks across planned changes (joiners are appended), so a member's new chunk
overlaps its old one. The simple rule costs movement: a join shifts every
cut, so about half of the state moves beyond the newcomer's own share
(`moved_elements`, bounded in the property tests).

Speeds do not shape the partition: it balances memory. The update of a
member's chunks is a small part of a step, and the VW balancer
(flexpar/core/balance) sees it in the busy times it measures.

Intervals are `(space, start, stop)` triples; `merge`, `subtract`,
`intersect` and `total` are their arithmetic.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

DEFAULT_REDUNDANCY = 2
ALIGN = 16
"""Chunk cuts fall on multiples of this many elements (64 bytes in float32: whole cache lines)."""

BY = ("elements", "parameters")


@dataclass(frozen=True)
class Space:
    """One flat element space: the sharded parameters of one dtype, in model order.

    `parameters` are positions in the list of sharded parameters;
    `offsets[k]` is where `parameters[k]` starts in the space and
    `offsets[-1]` is the space's size.
    """

    dtype: str
    element_bytes: int
    parameters: tuple
    offsets: tuple

    @property
    def size(self) -> int:
        return self.offsets[-1]

    def segments(self, start: int, stop: int) -> list:
        """The parts of [start, stop) in each parameter: (parameter, first element, end) within it."""
        found = []
        for position, parameter in enumerate(self.parameters):
            low, high = self.offsets[position], self.offsets[position + 1]
            if low < stop and start < high:
                found.append((parameter, max(start, low) - low, min(stop, high) - low))
        return found

    def offset_of(self, parameter: int) -> int:
        """Where sharded parameter `parameter` starts in this space."""
        return self.offsets[self.parameters.index(parameter)]


def spaces_of(numels: Sequence[int], dtypes: Sequence[str], element_bytes: Sequence[int]) -> tuple:
    """The flat spaces of the sharded parameters: one per dtype, in order of first appearance."""
    if not (len(numels) == len(dtypes) == len(element_bytes)):
        raise ValueError("numels, dtypes and element_bytes must have one entry per parameter")
    order: list = []
    positions: dict = {}
    for position, dtype in enumerate(dtypes):
        if dtype not in positions:
            order.append(dtype)
            positions[dtype] = []
        positions[dtype].append(position)
    spaces = []
    for dtype in order:
        offsets = [0]
        for position in positions[dtype]:
            offsets.append(offsets[-1] + int(numels[position]))
        first = positions[dtype][0]
        spaces.append(Space(dtype, int(element_bytes[first]), tuple(positions[dtype]), tuple(offsets)))
    return tuple(spaces)


@dataclass(frozen=True)
class Chunk:
    """Elements [start, stop) of space `space`, held by `holders` (ranks; `holders[0]` is its primary)."""

    space: int
    index: int
    start: int
    stop: int
    holders: tuple

    @property
    def size(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class Partition:
    """Every space's chunks, `world_size` per space, chunk `index` primary to rank `index`."""

    world_size: int
    redundancy: int
    chunks: tuple

    def held_by(self, rank: int) -> tuple:
        return tuple(chunk for chunk in self.chunks if rank in chunk.holders)

    def primary_of(self, rank: int) -> tuple:
        return tuple(chunk for chunk in self.chunks if chunk.holders[0] == rank)

    def holdings(self, rank: int) -> tuple:
        """What `rank` holds, as merged (space, start, stop) intervals."""
        return merge((chunk.space, chunk.start, chunk.stop) for chunk in self.held_by(rank))

    @property
    def everyone_holds_everything(self) -> bool:
        """Every member holds every element (redundancy = members): nothing to broadcast after a step."""
        return self.redundancy >= self.world_size

    def everything(self) -> tuple:
        """Every element of every space, as intervals."""
        return merge((chunk.space, chunk.start, chunk.stop) for chunk in self.chunks)


def effective_redundancy(requested: Optional[int], world_size: int) -> int:
    """Copies of each element: `requested` (None: 2), at most one per member."""
    wanted = DEFAULT_REDUNDANCY if requested is None else requested
    return max(1, min(int(wanted), world_size))


def partition(
    spaces: Sequence[Space],
    world_size: int,
    redundancy: Optional[int] = None,
    by: str = "elements",
    align: int = ALIGN,
) -> Partition:
    """The holders of every element for `world_size` members (ranks 0..world_size - 1).

    by="elements": cuts at the multiples of `align` nearest to the equal
    cuts, so each chunk is within `align` elements of size / world_size.
    by="parameters": cuts on the parameter boundaries nearest to the equal
    cuts, so no parameter is split.
    """
    if world_size < 1:
        raise ValueError(f"a partition needs at least one member (got {world_size})")
    if by not in BY:
        raise ValueError(f"by={by!r}: choose one of {', '.join(BY)}")
    copies = effective_redundancy(redundancy, world_size)
    chunks = []
    for space_index, space in enumerate(spaces):
        cuts = _cuts(space, world_size, by, align)
        for index in range(world_size):
            holders = tuple((index + k) % world_size for k in range(copies))
            chunks.append(Chunk(space_index, index, cuts[index], cuts[index + 1], holders))
    return Partition(world_size, copies, tuple(chunks))


def _cuts(space: Space, world_size: int, by: str, align: int) -> list:
    size = space.size
    if by == "elements":
        inner = [min(size, int(round(size * i / world_size / align)) * align) for i in range(1, world_size)]
    else:
        inner = [_nearest(space.offsets, size * i / world_size) for i in range(1, world_size)]
    cuts = [0] + inner + [size]
    for i in range(1, len(cuts)):  # monotone by construction, whatever the rounding did
        cuts[i] = max(cuts[i], cuts[i - 1])
    return cuts


def _nearest(boundaries: Sequence[int], target: float) -> int:
    """The boundary nearest to `target` (the lower one on a tie)."""
    best = boundaries[0]
    for boundary in boundaries:
        if abs(boundary - target) < abs(best - target):
            best = boundary
    return best


# ---------------------------------------------------------------- intervals


def merge(intervals) -> tuple:
    """(space, start, stop) intervals sorted, empty ones dropped, touching or overlapping ones joined."""
    result: list = []
    for space, start, stop in sorted(item for item in intervals if item[2] > item[1]):
        if result and result[-1][0] == space and start <= result[-1][2]:
            result[-1] = (space, result[-1][1], max(result[-1][2], stop))
        else:
            result.append((space, start, stop))
    return tuple(result)


def subtract(intervals, removed) -> tuple:
    """The parts of `intervals` outside `removed` (both (space, start, stop) sequences)."""
    removed = merge(removed)
    result = []
    for space, start, stop in merge(intervals):
        cursor = start
        for other_space, other_start, other_stop in removed:
            if other_space != space or other_stop <= cursor or other_start >= stop:
                continue
            if other_start > cursor:
                result.append((space, cursor, other_start))
            cursor = max(cursor, other_stop)
        if cursor < stop:
            result.append((space, cursor, stop))
    return merge(result)


def intersect(intervals, others) -> tuple:
    """The parts of `intervals` inside `others`."""
    return subtract(intervals, subtract(intervals, others))


def total(intervals) -> int:
    return sum(stop - start for _, start, stop in intervals)


def segments_of(spaces: Sequence[Space], intervals) -> list:
    """The (parameter, start, stop) segments of (space, start, stop) intervals, in order."""
    return [segment for space, start, stop in merge(intervals) for segment in spaces[space].segments(start, stop)]


def moved_elements(before: Partition, after: Partition, survivors: Sequence[Optional[int]]) -> int:
    """Elements the members of `after` must receive: their new holdings less what they held in `before`.

    `survivors[new_rank]` is the member's rank in `before`, or None for a newcomer.
    """
    moved = 0
    for new_rank, old_rank in enumerate(survivors):
        kept = before.holdings(old_rank) if old_rank is not None else ()
        moved += total(subtract(after.holdings(new_rank), kept))
    return moved
