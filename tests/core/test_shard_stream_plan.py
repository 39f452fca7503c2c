"""The rounds of a sharded streamed join (flexpar/core/shard_stream_plan.py) for random models and joins."""

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flexpar.core import shard_stream_plan
from flexpar.core.shard_partition import merge, partition, spaces_of, subtract
from flexpar.core.shard_plan import Report, Transfer, plan_levelling


@st.composite
def joins(draw):
    """A levelled generation of `world` members, then `joiners` more: the levelling plan's state transfers."""
    sizes = draw(st.lists(st.integers(1, 2000), min_size=1, max_size=6))
    dtypes = [draw(st.sampled_from(["float32", "bfloat16"])) for _ in sizes]
    spaces = spaces_of(sizes, dtypes, [4 if dtype == "float32" else 2 for dtype in dtypes])
    world = draw(st.integers(1, 5))
    redundancy = draw(st.integers(1, 3))
    by = draw(st.sampled_from(["elements", "parameters"]))
    old = partition(spaces, world, redundancy, by=by)
    joiners = draw(st.integers(1, 2))
    reports = [Report(9, True, old.holdings(rank)) for rank in range(world)] + [Report(-1)] * joiners
    new = partition(spaces, world + joiners, redundancy, by=by)
    levelling = plan_levelling(reports, new, [space.element_bytes for space in spaces])
    holdings = {rank: old.holdings(rank) for rank in range(world)}
    return spaces, by, levelling, holdings


@settings(max_examples=150, deadline=None)
@given(joins(), st.integers(1, 3000), st.booleans())
def test_every_range_travels_once_from_a_holder_within_the_round_size(join, sender_bytes, striped):
    spaces, by, levelling, holdings = join
    transfers = [transfer for transfer in levelling.transfers if transfer.state]
    plan = shard_stream_plan.plan(
        transfers, spaces, [8] * len(spaces), sender_bytes, by == "elements", holdings if striped else None
    )
    for destination in {transfer.destination for transfer in transfers}:
        wanted = merge((t.space, t.start, t.stop) for t in transfers if t.destination == destination)
        moved = [move for move in plan.moves if move.destination == destination]
        intervals = [_interval(spaces, move) for move in moved]
        assert merge(intervals) == wanted
        assert sum(stop - start for _, start, stop in intervals) == sum(stop - start for _, start, stop in wanted)
    for move in plan.moves:
        assert move.source != move.destination
        assert not subtract([_interval(spaces, move)], holdings[move.source]), "a source holds what it sends"
        if by == "parameters":  # whole parameters only
            assert (move.start, move.stop) == (0, _parameter_size(spaces, move.parameter))
    for number in range(plan.rounds):
        for source in {move.source for move in plan.in_round(number)}:
            sizes = [move.size for move in plan.in_round(number) if move.source == source]
            assert sum(sizes) <= sender_bytes or len(sizes) == 1
    assert plan.delivered_share(0) == (0.0 if plan.moves else 1.0) and plan.delivered_share(plan.rounds) == 1.0


def test_every_holder_of_the_range_streams_at_once():
    """Two members hold everything; the joiner's one contiguous range comes half from each."""
    spaces = spaces_of([1000], ["float32"], [4])
    transfers = [Transfer(0, 2, 0, 0, 1000)]
    everything = ((0, 0, 1000),)
    plan = shard_stream_plan.plan(transfers, spaces, [8], 800, True, {0: everything, 1: everything})
    sent = {source: sum(move.size for move in plan.moves if move.source == source) for source in (0, 1)}
    assert sent == {0: 4000, 1: 4000}
    assert plan.rounds == 5 and plan.size == 8000


def test_a_round_needs_at_least_a_byte():
    with pytest.raises(ValueError, match="sender_bytes=0 must be >= 1"):
        shard_stream_plan.plan([], spaces_of([4], ["float32"], [4]), [8], 0, True)


def _interval(spaces, move) -> tuple:
    for number, space in enumerate(spaces):
        if move.parameter in space.parameters:
            offset = space.offset_of(move.parameter)
            return (number, offset + move.start, offset + move.stop)
    raise AssertionError(move)


def _parameter_size(spaces, parameter) -> int:
    for space in spaces:
        if parameter in space.parameters:
            position = space.parameters.index(parameter)
            return space.offsets[position + 1] - space.offsets[position]
    raise AssertionError(parameter)


SPACES = spaces_of([100, 60], ["float32", "float32"], [4, 4])
OLD = partition(SPACES, 2, 2)
MEMBERS = [shard_stream_plan.MemberReport(7, holdings=OLD.holdings(rank)) for rank in range(2)]
JOINER = shard_stream_plan.MemberReport(-1)


def test_a_join_streams_when_the_members_hold_their_partition_at_the_latest_step():
    assert shard_stream_plan.refusal([*MEMBERS, JOINER], OLD) is None
    assert shard_stream_plan.refusal([*MEMBERS, JOINER, JOINER], OLD) is None


@pytest.mark.parametrize(
    "reports,reason",
    [
        ([MEMBERS[0], JOINER, MEMBERS[1]], "the joiners are not the last ranks"),
        ([MEMBERS[0], dataclasses.replace(MEMBERS[1], committed=6), JOINER], "a member is behind the latest step"),
        ([MEMBERS[0], dataclasses.replace(MEMBERS[1], complete=False), JOINER], "a member is behind the latest step"),
        ([dataclasses.replace(MEMBERS[0], pristine=True), MEMBERS[1], JOINER], "the optimizer has not stepped yet"),
        ([MEMBERS[0], dataclasses.replace(MEMBERS[1], streamable=False), JOINER], "some optimizer state is empty"),
        ([MEMBERS[1], MEMBERS[0], JOINER], None),  # at redundancy 2 both hold everything: ranks may swap
        ([MEMBERS[0], dataclasses.replace(MEMBERS[1], holdings=((0, 0, 96),)), JOINER], "a rank changed"),
    ],
)
def test_a_join_blocks_and_says_why(reports, reason):
    got = shard_stream_plan.refusal(reports, OLD)
    assert got is None if reason is None else reason in got, got


def test_three_members_at_redundancy_2_must_keep_their_ranks():
    old = partition(SPACES, 3, 2)
    members = [shard_stream_plan.MemberReport(7, holdings=old.holdings(rank)) for rank in range(3)]
    assert shard_stream_plan.refusal([*members, JOINER], old) is None
    swapped = [members[1], members[0], members[2], JOINER]
    assert "a rank changed" in shard_stream_plan.refusal(swapped, old)
