"""Who reads which stream group and when positions are exchanged (flexpar/core/stream_holding.py)."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flexpar.core import batching
from flexpar.core.stream_holding import exchange_due, groups_by_member, newest
from flexpar.core.stream_split import Position, read_amplification, split_stream


@st.composite
def assignments(draw):
    """A split (V, shards) and the contiguous VW counts of 1..4 devices (a listener may have 0)."""
    virtual_workers = draw(st.integers(1, 16))
    shards = draw(st.one_of(st.none(), st.integers(1, 48)))
    devices = draw(st.integers(1, 4))
    counts = [0] * devices
    for _ in range(virtual_workers):
        counts[draw(st.integers(0, devices - 1))] += 1
    return split_stream(virtual_workers, shards), tuple(counts)


def _holdings(counts):
    return [batching.virtual_workers_of(counts, rank) for rank in range(len(counts))]


@given(assignments())
@settings(max_examples=100)
def test_every_group_is_read_by_the_devices_of_its_vws_and_sharded_one_per_vw_reads_once(case):
    split, counts = case
    groups = groups_by_member(split, _holdings(counts))
    assert set().union(*map(set, groups)) == set(range(split.groups))  # every group read somewhere
    for rank, held in enumerate(_holdings(counts)):
        assert groups[rank] == tuple(sorted({split.group_of(v) for v in held}))
    amplification = read_amplification(split, _holdings(counts))
    if split.lanes == 1:
        assert amplification == 1.0
    if split.groups == 1:
        assert amplification == sum(1 for count in counts if count)


@given(assignments(), assignments(), st.integers(0, 200), st.integers(1, 40))
@settings(max_examples=100)
def test_an_exchange_comes_before_any_member_opens_a_group(before, after, step, every):
    (split, old), (_, new) = before, after
    if len(old) != len(new) or split.virtual_workers != sum(new):
        return
    previous = (3, groups_by_member(split, _holdings(old)))
    current = (3, groups_by_member(split, _holdings(new)))
    due = exchange_due(previous, current, step, every)
    opens = any(not set(now) <= set(was) for was, now in zip(previous[1], current[1]))
    assert due == (opens or step % every == 0)
    assert exchange_due(None, current, step, every)  # no step before in this process
    assert exchange_due((2, current[1]), current, step, every)  # another generation


def test_exchange_every_must_be_positive():
    with pytest.raises(ValueError, match="every"):
        exchange_due(None, (0, ()), 0, 0)


@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 30), st.booleans()), max_size=20), st.integers(0, 30))
@settings(max_examples=100)
def test_newest_keeps_each_groups_newest_position_up_to_the_step(heard, step):
    positions = [Position(group, at, 0, at * 4, {"at": at} if stateful else None) for group, at, stateful in heard]
    merged = newest({}, positions, step)
    for group in {group for group, _, _ in heard}:
        eligible = [p for p in positions if p.group == group and p.step <= step]
        if not eligible:
            assert group not in merged
            continue
        top = max(p.step for p in eligible)
        assert merged[group].step == top
        if any(p.source is not None for p in eligible if p.step == top):
            assert merged[group].source is not None
    assert newest(merged, positions, step) == merged  # hearing the same again changes nothing
