"""The join's way as every member decides it (flexpar/worker/join_way.py): from one all-reduce's sums only."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flexpar.core import join_choice
from flexpar.core.balance import BalanceState
from flexpar.worker import join_way
from flexpar.worker.settings import RunSettings

pytestmark = pytest.mark.filterwarnings("ignore")


def _settings(**changes):
    base = RunSettings(
        total_steps=10,
        backend="gloo",
        timeout_s=5,
        bucket_mb=25,
        checkpoint_every=None,
        checkpoint_dir=None,
        resume_path=None,
    )
    return RunSettings(**{**base.__dict__, **changes})


def _place(host, cores=2, threads=1, cpu=True):
    return [join_way.host_digest(host), float(cores), float(threads), 1.0 if cpu else 0.0]


def _slots(places, source):
    return [value for place in places for value in place] + source


SOURCE = [0.5, 0.2, 5e8, 1e4, 1e9, 0.02, 12.0]  # step, compute, state, small state, link, boundary, steps


def test_a_cpu_joiner_on_a_members_host_shares_its_cores_counted_in_threads():
    group = ("local-0", "local-1", "local-2")
    places = [_place("a"), _place("a"), _place("a")]
    shared = join_way.shared_cores(places, group, (2,))
    assert shared == join_choice.SharedCores("local-0", 2.0, 2) and shared.oversubscribed
    # 16 cores, 5 threads each: 3.2 joiner-sized shares, 2 busy members: room for the joiner.
    places = [_place("a", 16, 5), _place("a", 16, 5), _place("a", 16, 5)]
    assert not join_way.shared_cores(places, group, (2,)).oversubscribed
    # A member of 4 threads is two busy processes to a joiner of 2.
    places = [_place("a", 4, 4), _place("b", 4, 4), _place("a", 4, 2)]
    assert join_way.shared_cores(places, group, (2,)) == join_choice.SharedCores("local-0", 2.0, 2)


def test_a_joiner_on_its_own_host_or_accelerator_shares_nothing():
    group = ("local-0", "local-1", "h-1")
    assert join_way.shared_cores([_place("a"), _place("a"), _place("b")], group, (2,)) is None
    assert join_way.shared_cores([_place("a"), _place("a"), _place("a", cpu=False)], group, (2,)) is None


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from("abc"), st.integers(1, 64), st.integers(1, 8), st.booleans()), min_size=2, max_size=6
    ),
    st.sampled_from(join_choice.MODES),
)
def test_every_member_reading_the_same_sums_takes_the_same_way(places, mode):
    """The sums are all a member reads: the same sums, the same choice (a divergent one would hang)."""
    group = tuple(f"d-{rank}" for rank in range(len(places)))
    receivers = (len(places) - 1,)
    slots = _slots([_place(host, cores, threads, cpu) for host, cores, threads, cpu in places], SOURCE)
    choices = {
        join_choice.choose(join_way.inputs_of(list(slots), group, receivers), mode, join_way.MAX_FIRST_VW_S)
        for _ in range(3)
    }
    assert len(choices) == 1
    (choice,) = choices
    if mode != "auto":
        assert choice.way == mode
    shared = join_way.shared_cores([slots[4 * r : 4 * r + 4] for r in range(len(places))], group, receivers)
    if mode == "auto" and shared is not None and shared.oversubscribed:
        assert choice.way == "blocking"


def test_the_sources_numbers_come_from_the_balancer_and_the_link_default():
    state = BalanceState(
        seconds_per_vw={"local-0": 0.1, "local-1": 0.1}, device_ids=("local-0", "local-1"), assignment=(3, 3)
    )
    numbers = join_way.source_numbers(_settings(), state, 0.5, (4e8, 1e3), 0.0, 0.03, 2)
    step, compute, streamed, rest, link, boundary, steps = numbers
    assert (step, streamed, rest, boundary) == (0.5, 4e8, 1e3, 0.03)
    assert compute == pytest.approx(0.3) and link == 1e9  # gloo's conservative figure: none measured yet
    assert steps >= 1
    # No step measured yet: the balancer's prediction (or a default) stands in; never compute > step.
    numbers = join_way.source_numbers(_settings(join_stream_mb=1.0), state, 0.0, (4e8, 0.0), 2e9, 0.0, 2)
    assert numbers[0] >= numbers[1] and numbers[4] == 2e9 and numbers[6] == 191  # 4e8 / (2 x 1 MiB), rounded up


def test_one_member_gathers_without_a_group():
    slots = join_way.gather(1, 0, 0, _place("a"), SOURCE, torch.device("cpu"), None)
    assert slots == _place("a") + SOURCE


def test_the_events_record_the_way_and_both_predictions():
    inputs = join_choice.JoinInputs(
        step_s=1.0, compute_s=0.5, state_bytes=2e9, link_bytes_per_s=1e9, boundary_s=0.01, stream_steps=10, senders=2
    )
    fields = join_way.event_fields(join_choice.choose(inputs))
    assert fields == {"join_way": "stream", "predicted_stream_lost_s": 1.01, "predicted_blocking_lost_s": 2.01}
    assert join_way.event_fields(None) == {}
