"""The simulated stream's course (flexpar/sim/stream_course.py) against the engine's own re-sizing.

The property: for the same member step times, the simulator's stream takes
the rounds, and sends the slice sizes, that the engine's
`StreamedJoin._resize` and its round bookkeeping (flexpar/worker/streaming.py)
give; the engine's code is driven here on a `Stream` of the same plan, with
no processes.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flexpar.core import stream_plan
from flexpar.sim.stream_course import STATE_BYTES_PER_ELEMENT, CourseInputs, course, state_tensors
from flexpar.worker import stream_rules
from flexpar.worker.stream_session import Stream, StreamSession
from flexpar.worker.streaming import StreamedJoin


def engine_rounds(inputs: CourseInputs, step_times: list) -> tuple:
    """The rounds and slice sizes the engine's loop gives for these member step times (listener last).

    `step_times[0]` is the step before the join (what round 0's statistics carry); `step_times[r]` the
    `r`-th listening step's (round `r + 1`'s statistics). As `StreamedJoin.round`: re-size, send round
    `rounds_done`, count it, end once the plan's rounds are done.
    """
    senders = tuple(f"sender-{index}" for index in range(inputs.senders))
    tensors = list(inputs.tensors) or state_tensors(inputs.state_bytes)
    plan = stream_plan.plan(tensors, senders, inputs.first_sender_bytes, True)
    sizing = stream_plan.first_sizing(plan.sender_bytes)
    join = StreamedJoin.__new__(StreamedJoin)  # only `_resize` is driven: it reads `streams` alone
    join.streams = StreamSession()
    listener = inputs.senders
    join.streams.current = Stream(plan, (listener,), {}, 0.0, step_times[0], senders=senders, sizing=sizing)
    stream, sizes = join.streams.current, []
    while True:
        assert stream.rounds_done < len(step_times), "the engine's stream runs longer than the simulated one"
        stream.member_step_s = (step_times[stream.rounds_done],) * inputs.senders + (0.0,)  # the listener: none
        join._resize()
        sizes.append(stream.plan.sender_bytes)
        stream.rounds_done += 1
        if stream.rounds_done >= stream.plan.rounds:
            return stream.rounds_done, tuple(sizes)


@settings(max_examples=60, deadline=None)
@given(
    rounds=st.integers(0, 80),
    remainder=st.floats(0.0, 1.0),
    senders=st.integers(1, 4),
    compute_s=st.floats(0.005, 2.0),
    other_s=st.floats(0.0, 2.0),
    slowdown=st.floats(1.0, 2.0),
    link=st.floats(1e8, 1e10),
    baseline_ratio=st.floats(0.7, 1.6),
    noise=st.sampled_from([0.0, 0.05, 0.15, 0.3]),
    seed=st.integers(0, 1000),
    shares=st.lists(st.floats(0.01, 1.0), min_size=0, max_size=6),
    bytes_per_element=st.sampled_from([4, 12, 13]),
)
def test_the_simulated_stream_takes_the_engines_rounds(
    rounds,
    remainder,
    senders,
    compute_s,
    other_s,
    slowdown,
    link,
    baseline_ratio,
    noise,
    seed,
    shares,
    bytes_per_element,
):
    first = stream_plan.sender_bytes(1e9, compute_s, stream_rules.STREAM_SHARE)
    state_bytes = max(0, int((rounds - remainder) * senders * first))  # about `rounds` planned rounds
    # Several tensors (the state split by `shares`), as a model has them: the plan packs and cuts them.
    total = sum(shares)
    tensors = tuple(
        stream_plan.Tensor(f"t{index}", int(state_bytes * share / total) // bytes_per_element, bytes_per_element)
        for index, share in enumerate(shares)
    )
    inputs = CourseInputs(
        state_bytes=state_bytes,
        senders=senders,
        first_sender_bytes=first,
        step_s=compute_s + other_s,
        slowdown=slowdown,
        link_bytes_per_s=link,
        share=stream_rules.STREAM_SHARE,
        baseline_ratio=baseline_ratio,
        noise_sigma=noise,
        seed=seed,
        tensors=tensors,
    )
    simulated = course(inputs)
    rounds, sizes = engine_rounds(inputs, [simulated.before_step_s, *simulated.member_step_s])
    assert (simulated.rounds, simulated.sender_bytes) == (rounds, sizes)
    if tensors:
        return
    pieces = math.ceil(math.ceil(state_bytes / STATE_BYTES_PER_ELEMENT) / (first // STATE_BYTES_PER_ELEMENT))
    assert simulated.planned_rounds == math.ceil(pieces / senders)


def shared_host(**changes) -> CourseInputs:
    values = dict(
        state_bytes=480_000_000,
        senders=2,
        first_sender_bytes=24_000_000,
        step_s=0.5,
        slowdown=1.3,
        link_bytes_per_s=1e9,
        share=0.1,
    )
    values.update(changes)
    return CourseInputs(**values)


def test_on_a_shared_host_the_halving_is_undone_and_costs_two_rounds():
    # The listener's work makes the members' steps 30% longer: over twice the 0.1 target in two steps in a
    # row (rounds 2 and 3's readings), so the slices are halved at round 3; the two steps that carry the
    # smaller slices (read at rounds 5 and 6) show the slowdown has not fallen by half the excess, so they
    # are doubled back at round 6 and stay: three rounds at half size, 10 planned rounds become 12.
    simulated = course(shared_host())
    assert simulated.planned_rounds == 10 and simulated.rounds == 12
    assert simulated.sender_bytes[:7] == (24_000_000,) * 3 + (12_000_000,) * 3 + (24_000_000,)
    # Each listening step: the step times the listener's slowdown, plus the largest slice in flight over the link.
    assert simulated.member_step_s[0] == pytest.approx(0.65)
    assert simulated.member_step_s[1] == pytest.approx(0.65 + 0.024)
    assert simulated.member_step_s[4] == pytest.approx(0.65 + 0.012)
    assert simulated.lost_s(0.5) == pytest.approx(sum(t - 0.5 for t in simulated.member_step_s))


def test_a_baseline_the_joiner_slowed_makes_the_slices_grow():
    # The engine's baseline is the members' last step before the boundary; where the joiner's start-up
    # slowed it by 40%, the listening steps look faster than before (1.3 / 1.4 - 1 < 0.05) and the rule
    # doubles the slices every round from the second such step on: the stream ends early.
    simulated = course(shared_host(baseline_ratio=1.4))
    assert simulated.rounds < simulated.planned_rounds == 10
    assert simulated.sender_bytes[2:5] == (24_000_000, 48_000_000, 96_000_000)


def test_without_resizing_the_stream_keeps_its_plan():
    simulated = course(shared_host(resizes=False))
    assert simulated.rounds == simulated.planned_rounds == 10
    assert set(simulated.sender_bytes) == {24_000_000}


@pytest.mark.parametrize(
    "change",
    [dict(state_bytes=-1), dict(senders=0), dict(step_s=0.0), dict(slowdown=float("nan")), dict(noise_sigma=-0.1)],
)
def test_bad_inputs_are_refused(change):
    with pytest.raises(ValueError, match="stream course"):
        shared_host(**change)


def test_the_lost_time_leaves_the_steps_noise_out():
    # Own cores (no slowdown) and noisy steps: the rule reads the noisy steps, but what the members lose is
    # the slices' cost alone (a noisy step's excursion above the step is not the stream's).
    simulated = course(shared_host(slowdown=1.0, noise_sigma=0.3, seed=3))
    assert simulated.member_step_s != simulated.expected_step_s
    sends = [size / 1e9 for size in simulated.sender_bytes[:-1]]  # round r's slices slow listening step r + 1
    assert simulated.lost_s(0.5) == pytest.approx(sum(sends))
