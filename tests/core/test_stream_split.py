"""The stream split and the pass-end rule (flexpar/core/stream_split.py) under random V, shards, batches and passes."""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flexpar.core.stream_split import (
    ChunkFiller,
    EmptyPass,
    Position,
    StreamSplit,
    job_end_pass_ends,
    lane_items,
    plan_chunks,
    position_at,
    read_amplification,
    split_stream,
    start,
    steps_for_passes,
)

V = st.integers(1, 24)
SHARDS = st.one_of(st.none(), st.integers(1, 60))
POLICY = st.sampled_from(["drop", "carry"])


@given(V, SHARDS)
@settings(max_examples=50)
def test_groups_cut_vws_and_shards_evenly(virtual_workers, shards):
    split = split_stream(virtual_workers, shards)
    assert split.groups * split.lanes == virtual_workers
    members = [v for g in range(split.groups) for v in split.members(g)]
    assert members == list(range(virtual_workers))
    assert all(split.group_of(v) == g for g in range(split.groups) for v in split.members(g))
    assert [split.lane_of(v) for v in split.members(0)] == list(range(split.lanes))
    if shards is None:
        assert split.groups == 1 and not split.sharded
        return
    assert split.groups == math.gcd(shards, virtual_workers)
    read = [s for g in range(split.groups) for s in split.shards_of(g)]
    assert read == list(range(shards))  # every shard read by exactly one group, none split or dropped
    assert len({len(split.shards_of(g)) for g in range(split.groups)}) == 1  # equal shard counts
    if shards % virtual_workers == 0:
        assert split.lanes == 1  # one VW per group: every item read once
    assert StreamSplit.from_dict(split.to_dict()) == split


@given(V, st.integers(1, 5), st.integers(0, 6))
@settings(max_examples=50)
def test_round_robin_step_s_takes_items_s_b_to_s_plus_1_b(virtual_workers, batch, step):
    """No shards: VW v takes items v, v + V, ...; step s trains on items s*B .. (s+1)*B - 1 of the pass."""
    split = split_stream(virtual_workers)
    chunk = split.chunk(batch)
    chunks, ends = plan_chunks([10**9], chunk, step + 1)
    assert not ends
    items = [index for _, index in chunks[step]]
    global_batch = batch * virtual_workers
    assert sorted(items) == list(range(step * global_batch, (step + 1) * global_batch))
    for v in range(virtual_workers):
        mine = lane_items(items, split.lane_of(v), split.lanes)
        assert mine == [v + virtual_workers * (step * batch + j) for j in range(batch)]


@given(st.lists(st.integers(1, 40), min_size=1, max_size=6), st.integers(1, 9), st.integers(1, 30), POLICY)
@settings(max_examples=60, deadline=None)
def test_pass_ends_leave_out_only_what_they_say(lengths, chunk, steps, policy):
    if policy == "drop":
        lengths = [max(length, chunk) for length in lengths]
    chunks, ends = plan_chunks(lengths, chunk, steps, policy)
    assert all(len(items) == chunk for items in chunks)
    trained = [where for items in chunks for where in items]
    assert len(trained) == len(set(trained))  # nothing twice
    length_of = {ended.pass_: ended.items for ended in ends}
    for ended in ends:
        assert ended.items == lengths[min(ended.pass_, len(lengths) - 1)]
        in_pass = sorted(index for pass_, index in trained if pass_ == ended.pass_)
        left = list(range(*ended.left_out)) if ended.left_out else []
        assert sorted(in_pass + left) == list(range(ended.items))  # trained + left out = the whole pass
        if policy == "drop":
            assert ended.left_out_count < chunk
        else:
            assert not ended.left_out
    if policy == "carry":
        # one stream: the passes one after another, in order
        assert trained == sorted(trained)
    else:
        # every pass starts a chunk
        for items in chunks:
            passes = [pass_ for pass_, _ in items]
            assert len(set(passes)) == 1
    for pass_, index in trained:
        assert index < length_of.get(pass_, lengths[min(pass_, len(lengths) - 1)])


@given(st.lists(st.integers(1, 40), min_size=1, max_size=6), st.integers(1, 9), st.integers(1, 30), POLICY)
@settings(max_examples=60, deadline=None)
def test_position_at_is_where_a_reader_stands(lengths, chunk, steps, policy):
    """Any group's position follows from the step and the lengths of its passes that ended: no items needed."""
    if policy == "drop":
        lengths = [max(length, chunk) for length in lengths]
    filler = ChunkFiller(start(3), chunk, policy)
    ends = []
    for step in range(steps):
        known = [ended.items for ended in ends]  # pass ends met before this boundary
        expected = Position(3, step, filler.pass_, filler.consumed)
        assert position_at(3, step, known, chunk, policy) == expected
        assert (
            position_at(3, step, lengths + [lengths[-1]] * (steps * chunk + 1), chunk, policy) == expected
        )  # later ends change nothing
        filler.begin()
        while not filler.full:
            if filler.consumed < lengths[min(filler.pass_, len(lengths) - 1)]:
                filler.item()
            else:
                ends.append(filler.end()[0])
        filler.finish()


@given(st.integers(1, 9), POLICY)
def test_a_pass_too_short_for_one_step_is_an_error(chunk, policy):
    short = chunk - 1 if policy == "drop" else 0
    with pytest.raises(EmptyPass):
        plan_chunks([short], chunk, 3, policy)
    with pytest.raises(EmptyPass):
        position_at(0, 2, [short], chunk, policy)


@given(V, SHARDS, st.integers(1, 6), st.data())
@settings(max_examples=50)
def test_read_amplification(virtual_workers, shards, devices, data):
    split = split_stream(virtual_workers, shards)
    devices = min(devices, virtual_workers)
    cuts = sorted(
        data.draw(st.sets(st.integers(1, max(1, virtual_workers - 1)), min_size=devices - 1, max_size=devices - 1))
    )
    bounds = [0, *cuts, virtual_workers]
    holdings = [range(bounds[i], bounds[i + 1]) for i in range(devices)]
    amplification = read_amplification(split, holdings)
    assert 1.0 <= amplification <= devices
    if split.lanes == 1:
        assert amplification == 1.0  # sharded, one VW per group: each item read once
    if split.groups == 1:
        assert amplification == devices  # round-robin: every device reads the whole stream
    # contiguous VW ranges spread a group over at most (devices) readers, and only at the cuts
    assert amplification * split.groups <= split.groups + devices - 1 + 1e-9


def test_positions_and_pass_ends_are_plain_data():
    position = Position(2, 7, 1, 30, {"offset": 4})
    assert Position.from_dict(position.to_dict()) == position
    _, ends = plan_chunks([10], 4, 4)
    assert ends[0].to_dict() == {"group": 0, "pass": 0, "items": 10, "step": 2, "left_out": [8, 10]}


@given(
    st.lists(st.lists(st.integers(1, 40), min_size=1, max_size=4), min_size=1, max_size=3), st.integers(1, 9), POLICY
)
@settings(max_examples=60, deadline=None)
def test_the_job_end_meets_the_pass_ends_no_step_meets(pass_lengths, chunk, policy):
    """epochs=N: with the pass ends the steps meet and those the job's end meets (dated `steps`), every item
    of a group's N passes is trained once or left out, for every group whose passes fill the job; the job's
    end is exactly where the step after the last would meet a pass end of those N passes."""
    if policy == "drop":
        pass_lengths = [[max(length, chunk) for length in lengths] for lengths in pass_lengths]
    steps = steps_for_passes(pass_lengths, chunk, policy)
    final = job_end_pass_ends(pass_lengths, chunk, steps, policy)
    for group, lengths in enumerate(pass_lengths):
        chunks, ends = plan_chunks(lengths + [chunk * (steps + 2)], chunk, steps + 1, policy, group)
        after = [ended for ended in ends if ended.step == steps and ended.pass_ < len(lengths)]
        assert [ended for ended in final if ended.group == group] == after
        named = [ended for ended in ends if ended.step < steps] + after
        if len(named) == len(lengths):  # the group's N passes all ended (in a step or at the job's end)
            trained = [where for items in chunks[:steps] for where in items if where[0] < len(lengths)]
            left = sum(ended.left_out_count for ended in named)
            assert len(trained) == len(set(trained)) and len(trained) + left == sum(lengths)
    assert final or policy == "carry"  # with "drop", the group that fills the steps always has one
