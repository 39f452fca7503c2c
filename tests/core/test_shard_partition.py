"""The optimizer-state partition under random parameter sizes, dtypes, member counts and redundancies."""

from hypothesis import given, settings
from hypothesis import strategies as st

from flexpar.core.shard_partition import (
    ALIGN,
    effective_redundancy,
    merge,
    moved_elements,
    partition,
    segments_of,
    spaces_of,
    subtract,
    total,
)

SIZES = st.lists(st.integers(1, 5000), min_size=1, max_size=12)
DTYPES = st.sampled_from(["float32", "bfloat16"])
BYTES = {"float32": 4, "bfloat16": 2}


@st.composite
def models(draw):
    sizes = draw(SIZES)
    dtypes = [draw(DTYPES) for _ in sizes]
    return spaces_of(sizes, dtypes, [BYTES[d] for d in dtypes])


def _holders_of(part, space_index, element):
    return [
        holder
        for chunk in part.chunks
        if chunk.space == space_index and chunk.start <= element < chunk.stop
        for holder in chunk.holders
    ]


@settings(max_examples=200, deadline=None)
@given(models(), st.integers(1, 9), st.none() | st.integers(1, 4), st.sampled_from(["elements", "parameters"]))
def test_every_element_is_held_by_exactly_redundancy_members(spaces, world, redundancy, by):
    part = partition(spaces, world, redundancy, by=by)
    copies = effective_redundancy(redundancy, world)
    assert copies == min(2 if redundancy is None else redundancy, world)
    for space_index, space in enumerate(spaces):
        chunks = [chunk for chunk in part.chunks if chunk.space == space_index]
        assert [chunk.index for chunk in chunks] == list(range(world))
        assert chunks[0].start == 0 and chunks[-1].stop == space.size
        assert all(a.stop == b.start for a, b in zip(chunks, chunks[1:])), "contiguous, in rank order"
        for chunk in chunks:
            assert chunk.holders[0] == chunk.index and len(set(chunk.holders)) == copies
        for element in {0, space.size // 2, space.size - 1}:
            holders = _holders_of(part, space_index, element)
            assert len(holders) == len(set(holders)) == copies
    held = sum(total(part.holdings(rank)) for rank in range(world))
    assert held == copies * sum(space.size for space in spaces)
    assert part.everything() == merge((index, 0, space.size) for index, space in enumerate(spaces))


@settings(max_examples=200, deadline=None)
@given(models(), st.integers(1, 9))
def test_chunks_are_balanced_by_bytes_and_parameters_mode_never_splits_one(spaces, world):
    elements = partition(spaces, world, 1, by="elements")
    parameters = partition(spaces, world, 1, by="parameters")
    for space_index, space in enumerate(spaces):
        largest = max(b - a for a, b in zip(space.offsets, space.offsets[1:]))
        for chunk in elements.chunks:
            if chunk.space == space_index:
                assert abs(chunk.size - space.size / world) <= ALIGN
                assert chunk.start % ALIGN == 0 or chunk.start == space.size
        for chunk in parameters.chunks:
            if chunk.space == space_index:
                assert chunk.size <= space.size / world + largest
                assert chunk.start in space.offsets and chunk.stop in space.offsets, "no parameter is split"
    sizes = {k: b - a for space in spaces for k, a, b in zip(space.parameters, space.offsets, space.offsets[1:])}
    for chunk in parameters.chunks:
        for k, start, stop in segments_of(spaces, [(chunk.space, chunk.start, chunk.stop)]):
            assert (start, stop) == (0, sizes[k]), "whole parameters"


@settings(max_examples=150, deadline=None)
@given(models(), st.integers(1, 8), st.integers(1, 3), st.data())
def test_a_change_of_members_moves_at_most_half_the_state_beyond_the_unavoidable(spaces, world, redundancy, data):
    """Ranks stay (joiners append, leavers drop out): what must move is the newcomer's share, or a
    re-copy of the leaver's holdings, plus at most half of the state for the shifted cuts."""
    size = sum(space.size for space in spaces)
    slack = 2 * ALIGN * len(spaces) * world
    before = partition(spaces, world, redundancy)
    grown = partition(spaces, world + 1, redundancy)
    newcomer = total(grown.holdings(world))
    moved = moved_elements(before, grown, list(range(world)) + [None])
    assert newcomer <= moved <= newcomer + size / 2 + slack
    if world > 1:
        leaver = data.draw(st.integers(0, world - 1))
        shrunk = partition(spaces, world - 1, redundancy)
        survivors = [rank for rank in range(world) if rank != leaver]
        moved = moved_elements(before, shrunk, survivors)
        assert moved <= total(before.holdings(leaver)) + size / 2 + slack


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 2), st.integers(0, 60), st.integers(0, 60)), max_size=8),
    st.lists(st.tuples(st.integers(0, 2), st.integers(0, 60), st.integers(0, 60)), max_size=8),
)
def test_interval_arithmetic_matches_sets_of_elements(first, second):
    def elements(intervals):
        return {(space, e) for space, start, stop in intervals for e in range(start, stop)}

    a, b = [(s, min(x, y), max(x, y)) for s, x, y in first], [(s, min(x, y), max(x, y)) for s, x, y in second]
    assert elements(merge(a)) == elements(a)
    assert elements(subtract(a, b)) == elements(a) - elements(b)
    assert total(merge(a)) == len(elements(a))
    merged = merge(a)
    assert all(x[2] < y[1] or x[0] != y[0] for x, y in zip(merged, merged[1:])), "disjoint, not touching"
