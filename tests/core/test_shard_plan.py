"""The levelling plan of a sharded job's boundary under random failures, leaves, joins and broken commits."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flexpar.core.shard_partition import merge, partition, spaces_of, subtract, total
from flexpar.core.shard_plan import Report, lost_description, plan_levelling, received_elements

BYTES = {"float32": 4, "bfloat16": 2}


@st.composite
def models(draw):
    sizes = draw(st.lists(st.integers(1, 3000), min_size=1, max_size=8))
    dtypes = [draw(st.sampled_from(sorted(BYTES))) for _ in sizes]
    return spaces_of(sizes, dtypes, [BYTES[d] for d in dtypes])


@st.composite
def boundaries(draw):
    """A levelled generation, then a change: members die (two at most), join, one departs (hands off).

    Survivors are at the latest step, their parameters complete or not (a broadcast that broke off);
    `stale` members are a step behind without the gradient to catch up (never seen in practice:
    the worker brings such a member level itself; the plan must still treat them safely).
    """
    spaces = draw(models())
    world = draw(st.integers(1, 6))
    redundancy = draw(st.integers(1, 3))
    before = partition(spaces, world, redundancy)
    step = draw(st.integers(0, 50))
    pristine = step == 0 and draw(st.booleans())
    dead = draw(st.sets(st.integers(0, world - 1), max_size=min(2, world - 1)))
    departing = draw(st.sampled_from([None] + [r for r in range(world) if r not in dead])) if world > 1 else None
    joiners = draw(st.integers(0, 2))
    survivors = [rank for rank in range(world) if rank not in dead and rank != departing]
    stale = draw(st.sets(st.sampled_from(survivors), max_size=1)) if survivors and draw(st.booleans()) else set()
    everything = before.everything()

    def report(rank, training):
        holdings = everything if pristine else before.holdings(rank)
        if rank in stale:
            return Report(step - 1, holdings=holdings, training=training)
        return Report(step, complete=draw(st.booleans()), holdings=holdings, training=training)

    reports = [report(rank, True) for rank in survivors]
    reports += [Report(-1, complete=False) for _ in range(joiners)]
    if departing is not None:
        reports.append(report(departing, False))
    return spaces, redundancy, dead, departing, stale, reports


def _valid(plan, report):
    return merge(report.holdings) if report.committed == plan.latest else ()


@settings(max_examples=300, deadline=None)
@given(boundaries())
def test_the_plan_levels_every_member_onto_its_chunks_sending_each_part_once(case):
    spaces, redundancy, dead, departing, stale, reports = case
    training = sum(report.training for report in reports)
    if training == 0:
        return
    target = partition(spaces, training, redundancy)
    plan = plan_levelling(reports, target, [space.element_bytes for space in spaces])
    assert plan.latest == max(report.committed for report in reports)
    assert reports[plan.state_source].committed == plan.latest
    assert set(plan.state_receivers) == {r for r in range(training) if reports[r].committed < plan.latest}
    needed_in_all, needed_sizes = [], 0
    for rank in range(training):
        valid = _valid(plan, reports[rank])
        state_in = [(t.space, t.start, t.stop) for t in plan.received_by(rank) if t.state]
        values_in = [(t.space, t.start, t.stop) for t in plan.received_by(rank) if not t.state]
        assert total(merge(state_in)) == total(state_in), "no state part is received twice"
        assert not subtract(state_in, subtract(state_in, valid)), "nothing a member holds is sent to it"
        needed = subtract(target.holdings(rank), valid)
        needed_in_all += list(needed)
        needed_sizes += total(subtract(needed, plan.lost))
        assert not subtract(subtract(needed, state_in), plan.lost), "all of its chunks arrives, but what is lost"
        if rank in plan.parameter_receivers:
            has = merge(list(valid) + state_in + values_in)
            assert total(merge(list(valid) + state_in)) + total(values_in) == total(has), "values arrive once"
            assert not subtract(subtract(target.everything(), has), plan.lost), "every parameter value arrives"
        else:
            assert not values_in and reports[rank].complete and reports[rank].committed == plan.latest
    for transfer in plan.transfers:
        source = reports[transfer.source]
        assert source.committed == plan.latest, "sources hold the latest step"
        held = target.everything() if (source.complete and not transfer.state) else _valid(plan, source)
        assert not subtract([(transfer.space, transfer.start, transfer.stop)], held), "sources hold what they send"
        assert transfer.destination < training, "departing members only send"
    # Lost is exactly what some member needs and no member holds at the latest step.
    all_valid = merge(h for report in reports for h in _valid(plan, report))
    assert plan.lost == merge(subtract(needed_in_all, all_valid))
    state_sent = sum(t.size for t in plan.transfers if t.state)
    assert state_sent == received_elements(plan) == needed_sizes, "every needed byte once, nothing more"
    if not stale and (not dead or (redundancy >= 2 and len(dead) <= 1)):
        assert not plan.lost, "one failure, a planned leave, or a join loses nothing"


@settings(max_examples=100, deadline=None)
@given(models(), st.integers(3, 6))
def test_two_failures_of_a_chunks_holders_lose_it_and_every_member_knows(spaces, world):
    before = partition(spaces, world, 2)
    dead = {0, 1}  # chunk 0 of every space is held by ranks 0 and 1 only
    reports = [Report(10, holdings=before.holdings(rank)) for rank in range(world) if rank not in dead]
    plan = plan_levelling(reports, partition(spaces, len(reports), 2))
    lost_chunks = merge((c.space, c.start, c.stop) for c in before.chunks if c.index == 0)
    assert merge(plan.lost) == lost_chunks
    names = [f"p{k}" for k in range(sum(len(space.parameters) for space in spaces))]
    if lost_chunks:
        assert lost_description(plan.lost, spaces, names).startswith("elements 0-")


def test_a_fresh_job_moves_nothing_and_a_joiner_gets_its_chunks_and_every_value():
    spaces = spaces_of([100, 60], ["float32", "float32"], [4, 4])
    everything = ((0, 0, 160),)
    fresh = [Report(0, holdings=everything) for _ in range(3)]
    assert not plan_levelling(fresh, partition(spaces, 3, 2)).transfers
    before = partition(spaces, 2, 1)
    reports = [Report(5, holdings=before.holdings(r)) for r in range(2)] + [Report(-1, complete=False)]
    plan = plan_levelling(reports, partition(spaces, 3, 1))
    assert plan.state_receivers == (2,) and plan.parameter_receivers == (2,) and not plan.lost
    joined = merge((t.space, t.start, t.stop) for t in plan.received_by(2))
    assert joined == everything, "the joiner's chunk with its values, and the rest of the values"
    assert {t.source for t in plan.received_by(2)} == {0, 1}, "several sources at once"


def test_the_training_members_must_come_first():
    spaces = spaces_of([10], ["float32"], [4])
    with pytest.raises(ValueError, match="training members must be ranks 0..0"):
        plan_levelling([Report(1, training=False), Report(1)], partition(spaces, 1))
