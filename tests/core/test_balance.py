"""Tests of flexpar.core.balance: exact min-max assignment, smoothing, hysteresis.

The optimum is checked two independent ways: against brute force over every
split for small cases, and against a threshold certificate (no split can finish
every device strictly earlier) for large ones.
"""

from __future__ import annotations

import copy
import itertools
import json
import math
import os
import pickle
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flexpar.core.balance import (
    MAXIMUM_THRESHOLD,
    MEASURED_HYSTERESIS_SHARE,
    MINIMUM_SECONDS_PER_VW,
    NOISE_FACTOR,
    NOISE_WINDOW,
    BalanceState,
    change_threshold,
    imbalance,
    most_even_assignment,
    next_assignment,
    noise_known,
    observe,
    optimal_assignment,
    predicted_step_seconds,
    relative_noise,
    state_from_dict,
    state_to_dict,
    tie_tolerance,
)

BALANCE_MODULE = "flexpar.core.balance"  # imported afresh in each subprocess

# Per-VW times: arbitrary floats, plus a few round values so that ties (equal
# products k * s_i on different devices) come up often and the tie-break is
# exercised.
seconds_values = st.one_of(
    st.floats(min_value=1e-3, max_value=1e3, allow_nan=False, allow_infinity=False),
    st.sampled_from([0.25, 0.5, 1.0, 1.5, 2.0, 3.0]),
)


@st.composite
def small_problems(draw):
    """(seconds, V) with at most 4 devices and V <= 9: small enough for brute force."""
    seconds = draw(st.lists(seconds_values, min_size=1, max_size=4))
    virtual_workers = draw(st.integers(min_value=len(seconds), max_value=9))
    return seconds, virtual_workers


@st.composite
def problems(draw, max_devices=32, max_extra=200):
    seconds = draw(st.lists(seconds_values, min_size=1, max_size=max_devices))
    virtual_workers = len(seconds) + draw(st.integers(min_value=0, max_value=max_extra))
    return seconds, virtual_workers


def device_names(count):
    return tuple(f"local-{index}" for index in range(count))


def all_splits(virtual_workers, device_count):
    """Every tuple of device_count counts >= 1 that sums to virtual_workers."""
    for cuts in itertools.combinations(range(1, virtual_workers), device_count - 1):
        bounds = (0,) + cuts + (virtual_workers,)
        yield tuple(high - low for low, high in zip(bounds, bounds[1:]))


def brute_force_best(seconds, virtual_workers):
    return min(predicted_step_seconds(split, seconds) for split in all_splits(virtual_workers, len(seconds)))


def is_certified_optimal(assignment, seconds):
    """True when no split of sum(assignment) VWs can have a smaller maximum.

    With maximum M, a split finishing strictly before M can give device i only
    the k with k * s_i < M (at least 1 VW, so M must exceed every s_i). If those
    add up to fewer than V, no split beats M. Independent of the greedy.
    """
    virtual_workers = sum(assignment)
    maximum = predicted_step_seconds(assignment, seconds)
    if maximum <= max(seconds):
        return True  # every split pays max(s) for the slowest device's first VW
    fits = 0
    for device_seconds in seconds:
        count = max(0, math.ceil(maximum / device_seconds) - 1)
        while (count + 1) * device_seconds < maximum:  # correct any float slop of ceil
            count += 1
        while count > 0 and count * device_seconds >= maximum:
            count -= 1
        fits += count
    return fits < virtual_workers


def run_steps(state, device_ids, virtual_workers, true_seconds, rounds, hysteresis=0.05):
    """Feed exact busy times (count * true seconds) through observe/next_assignment."""
    history = []
    for _ in range(rounds):
        assignment = next_assignment(state, device_ids, virtual_workers, hysteresis=hysteresis)
        history.append(assignment)
        busy = [count * seconds for count, seconds in zip(assignment, true_seconds)]
        state = observe(state, device_ids, assignment, busy)
    return state, history


# --------------------------------------------------------------------------
# optimal_assignment
# --------------------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(small_problems())
def test_optimal_assignment_matches_brute_force(problem):
    seconds, virtual_workers = problem
    assignment = optimal_assignment(seconds, virtual_workers)
    assert predicted_step_seconds(assignment, seconds) == brute_force_best(seconds, virtual_workers)


@settings(max_examples=200, deadline=None)
@given(problems())
def test_optimal_assignment_is_a_valid_certified_optimum(problem):
    seconds, virtual_workers = problem
    assignment = optimal_assignment(seconds, virtual_workers)
    assert len(assignment) == len(seconds)
    assert all(isinstance(count, int) and count >= 1 for count in assignment)
    assert sum(assignment) == virtual_workers
    assert is_certified_optimal(assignment, seconds)


def test_certificate_rejects_a_suboptimal_split():
    # The certificate itself must be able to fail, or the test above proves nothing.
    assert not is_certified_optimal((3, 1), [1.0, 1.0])
    assert is_certified_optimal((2, 2), [1.0, 1.0])


def test_optimal_assignment_at_the_stated_scale():
    device_count, virtual_workers = 1024, 4096
    seconds = [0.5 + (rank * 7919 % 1000) / 1000 for rank in range(device_count)]
    assignment = optimal_assignment(seconds, virtual_workers)
    assert sum(assignment) == virtual_workers and min(assignment) >= 1
    assert is_certified_optimal(assignment, seconds)


def test_faster_device_gets_proportionally_more():
    assert optimal_assignment([1.0, 2.0], 12) == (8, 4)
    assert optimal_assignment([1.0, 1.0, 2.0, 1.0], 16) == (5, 5, 2, 4)


def test_ties_go_to_the_lower_rank():
    assert optimal_assignment([1.0, 1.0, 1.0], 5) == (2, 2, 1)
    assert optimal_assignment([1.0, 1.0, 1.0], 3) == (1, 1, 1)
    assert optimal_assignment([2.0, 1.0], 3) == (1, 2)


def test_every_device_gets_one_even_when_hopelessly_slow():
    assert optimal_assignment([1.0, 1000.0, 1.0], 10) == (5, 1, 4)


def test_non_positive_times_count_as_the_minimum():
    zero = optimal_assignment([0.0, 1.0], 4)
    negative = optimal_assignment([-3.0, 1.0], 4)
    floor = optimal_assignment([MINIMUM_SECONDS_PER_VW, 1.0], 4)
    assert zero == negative == floor == (3, 1)
    assert optimal_assignment([0.0, 0.0, 0.0], 7) == (3, 2, 2)
    assert predicted_step_seconds((2, 1), [0.0, -1.0]) == 2 * MINIMUM_SECONDS_PER_VW


# --------------------------------------------------------------------------
# determinism
# --------------------------------------------------------------------------


@settings(max_examples=100, deadline=None)
@given(problems(max_devices=16, max_extra=64))
def test_equal_input_gives_equal_output(problem):
    seconds, virtual_workers = problem
    first = optimal_assignment(list(seconds), virtual_workers)
    second = optimal_assignment(tuple(float(value) for value in seconds), virtual_workers)
    assert first == second


def test_state_does_not_depend_on_insertion_order():
    ids = device_names(5)
    values = {device_id: 0.1 * (index + 1) for index, device_id in enumerate(ids)}
    forward = BalanceState(dict(values))
    backward = BalanceState(dict(reversed(list(values.items()))))
    assert forward == backward
    assert list(forward.seconds_per_vw) == list(backward.seconds_per_vw) == sorted(ids)
    assert next_assignment(forward, ids, 23) == next_assignment(backward, ids, 23)
    assert json.dumps(state_to_dict(forward)) == json.dumps(state_to_dict(backward))


_DETERMINISM_SCRIPT = r"""
import importlib, sys
balance = importlib.import_module(sys.argv[1])
ids = tuple(f"host{index % 3}-{index}" for index in range(12))
state = balance.BalanceState({device_id: 0.01 * (1 + index % 5) for index, device_id in enumerate(ids[:9])})
results = [balance.optimal_assignment([0.013 * (1 + index % 4) for index in range(12)], 101)]
for step in range(5):
    assignment = balance.next_assignment(state, ids, 101)
    results.append(assignment)
    busy = [count * 0.011 * (1 + index % 3) for index, count in enumerate(assignment)]
    state = balance.observe(state, ids, assignment, busy, smoothing=0.3)
print(repr(results), repr(balance.state_to_dict(state)))
"""


def test_same_result_under_different_hash_seeds():
    # Every device computes the assignment independently; a result that depended
    # on string hashing (set or dict order) would differ between processes.
    outputs = set()
    for hash_seed in ("1", "2", "12345"):
        environment = dict(os.environ, PYTHONHASHSEED=hash_seed)
        completed = subprocess.run(
            [sys.executable, "-c", _DETERMINISM_SCRIPT, BALANCE_MODULE],
            env=environment,
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        outputs.add(completed.stdout)
    assert len(outputs) == 1


# --------------------------------------------------------------------------
# next_assignment: hysteresis, device-set changes, unknown devices
# --------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(
    problems(max_devices=16, max_extra=100),
    st.data(),
)
def test_small_noise_keeps_the_current_optimum(problem, data):
    seconds, virtual_workers = problem
    ids = device_names(len(seconds))
    current = optimal_assignment(seconds, virtual_workers)
    factors = data.draw(
        st.lists(st.floats(min_value=0.99, max_value=1.01), min_size=len(seconds), max_size=len(seconds))
    )
    noisy = {device_id: value * factor for device_id, value, factor in zip(ids, seconds, factors)}
    state = BalanceState(noisy, ids, current)
    assert next_assignment(state, ids, virtual_workers, hysteresis=0.05) == current


def test_hysteresis_keeps_a_near_optimal_assignment_and_drops_a_poor_one():
    ids = device_names(2)
    state_near = BalanceState({"local-0": 1.0, "local-1": 1.04}, ids, (4, 4))
    # (4, 4) costs 4.16 and is the optimum itself (5 * 1.0 > 4.16): kept.
    assert next_assignment(state_near, ids, 8) == (4, 4)
    # Current (5, 3) costs 5.0; optimum (4, 4) costs 4.16: 16.8% better -> switch.
    state_poor = BalanceState({"local-0": 1.0, "local-1": 1.04}, ids, (5, 3))
    assert next_assignment(state_poor, ids, 8, hysteresis=0.05) == (4, 4)
    # Same situation, but a 20% hysteresis tolerates it.
    assert next_assignment(state_poor, ids, 8, hysteresis=0.2) == (5, 3)


def test_hysteresis_boundary_is_relative_to_the_current_time():
    ids = device_names(2)
    # Current (3, 1) costs 3.0, optimum (2, 2) costs 2.0: 1/3 better.
    state = BalanceState({"local-0": 1.0, "local-1": 1.0}, ids, (3, 1))
    assert next_assignment(state, ids, 4, hysteresis=0.3) == (2, 2)
    assert next_assignment(state, ids, 4, hysteresis=0.34) == (3, 1)


def test_zero_hysteresis_switches_whenever_strictly_better_but_not_on_a_tie():
    ids = device_names(3)
    # (1, 2, 1) and the greedy's (2, 1, 1) both cost 2.0: keep the current one.
    tied = BalanceState({device_id: 1.0 for device_id in ids}, ids, (1, 2, 1))
    assert next_assignment(tied, ids, 4, hysteresis=0.0) == (1, 2, 1)
    worse = BalanceState({"local-0": 1.0, "local-1": 1.0, "local-2": 1.01}, ids, (1, 1, 2))
    assert next_assignment(worse, ids, 4, hysteresis=0.0) == (2, 1, 1)


def test_changed_device_set_always_gets_the_optimum():
    seconds = {"local-0": 1.0, "local-1": 1.0, "local-2": 1.0}
    state = BalanceState(seconds, ("local-0", "local-1"), (3, 3))
    # A device left: its VWs go to the rest even though hysteresis is huge.
    assert next_assignment(state, ("local-0",), 6, hysteresis=0.99) == (6,)
    # A device joined.
    assert next_assignment(state, ("local-0", "local-1", "local-2"), 6, hysteresis=0.99) == (2, 2, 2)
    # Same members, different rank order: counts are aligned by rank, so recompute.
    skewed = BalanceState({"local-0": 1.0, "local-1": 3.0}, ("local-0", "local-1"), (4, 2))
    assert next_assignment(skewed, ("local-1", "local-0"), 6, hysteresis=0.99) == (1, 5)


def test_no_previous_assignment_or_new_virtual_worker_count_gets_the_optimum():
    ids = device_names(2)
    fresh = BalanceState({"local-0": 1.0, "local-1": 2.0})
    assert next_assignment(fresh, ids, 12, hysteresis=0.99) == (8, 4)
    previous = BalanceState({"local-0": 1.0, "local-1": 2.0}, ids, (3, 3))
    assert next_assignment(previous, ids, 12, hysteresis=0.99) == (8, 4)
    assert next_assignment(BalanceState(), ids, 5) == (3, 2)


def test_unknown_devices_get_the_median_of_the_known_ones():
    known = {"a": 1.0, "b": 3.0, "c": 2.0}
    state = BalanceState(known)
    # Odd count: median 2.0.
    assert next_assignment(state, ("a", "b", "c", "new"), 40) == optimal_assignment([1.0, 3.0, 2.0, 2.0], 40)
    # Even count: mean of the middle two, (1 + 3) / 2 = 2.0; a device of another
    # generation ("c") does not count towards this set's median.
    assert next_assignment(state, ("a", "new", "b"), 40) == optimal_assignment([1.0, 2.0, 3.0], 40)
    # Odd median differs from the mean: 1, 2, 9 -> 2, not 4.
    skewed = BalanceState({"a": 1.0, "b": 2.0, "c": 9.0})
    assert next_assignment(skewed, ("a", "b", "c", "new"), 60) == optimal_assignment([1.0, 2.0, 9.0, 2.0], 60)


def test_no_known_device_gives_the_uniform_split():
    state = BalanceState({"departed": 0.5})
    assert next_assignment(state, ("x", "y", "z"), 7) == (3, 2, 2)
    assert next_assignment(BalanceState(), ("x", "y", "z"), 9) == (3, 3, 3)


# --------------------------------------------------------------------------
# observe: smoothing
# --------------------------------------------------------------------------


def test_observe_applies_the_smoothing_formula_and_records_the_step():
    state = BalanceState({"a": 1.0, "b": 2.0, "gone": 7.0})
    updated = observe(state, ("a", "b", "new"), (2, 4, 5), (3.0, 4.0, 2.5), smoothing=0.25)
    assert updated.seconds_per_vw["a"] == 0.25 * 1.5 + 0.75 * 1.0
    assert updated.seconds_per_vw["b"] == 0.25 * 1.0 + 0.75 * 2.0
    assert updated.seconds_per_vw["new"] == 0.5  # first measurement taken as is
    assert updated.seconds_per_vw["gone"] == 7.0  # not observed: untouched
    assert updated.device_ids == ("a", "b", "new")
    assert updated.assignment == (2, 4, 5)
    assert state.seconds_per_vw["a"] == 1.0  # the input state is not modified


def test_observe_with_full_smoothing_trusts_the_latest_step():
    state = BalanceState({"a": 10.0})
    assert observe(state, ("a",), (4,), (2.0,), smoothing=1.0).seconds_per_vw["a"] == 0.5


def test_observe_survives_zero_and_negative_busy_times():
    updated = observe(BalanceState(), ("a", "b"), (1, 2), (0.0, -0.5))
    assert updated.seconds_per_vw["a"] == MINIMUM_SECONDS_PER_VW
    assert updated.seconds_per_vw["b"] == MINIMUM_SECONDS_PER_VW
    # Both floored times are equal, so the current (1, 2) ties the greedy's (2, 1): kept.
    assert next_assignment(updated, ("a", "b"), 3) == (1, 2)


@settings(max_examples=100, deadline=None)
@given(
    st.floats(min_value=1e-3, max_value=1e3),
    st.floats(min_value=1e-3, max_value=1e3),
    st.floats(min_value=0.05, max_value=0.95),
)
def test_smoothing_converges_geometrically_toward_a_new_speed(old, new, smoothing):
    state = BalanceState({"a": old}, ("a",), (3,))
    gap = initial_gap = abs(old - new)
    for _ in range(60):
        state = observe(state, ("a",), (3,), (3 * new,), smoothing=smoothing)
        remaining = abs(state.seconds_per_vw["a"] - new)
        # Each step removes a `smoothing` share of the gap (up to float rounding).
        assert remaining <= (1 - smoothing) * gap + 1e-12 * max(old, new)
        gap = remaining
    assert gap <= (1 - smoothing) ** 60 * initial_gap + 1e-10 * max(old, new)


# --------------------------------------------------------------------------
# convergence of the whole loop after a slowdown
# --------------------------------------------------------------------------


def test_device_slowing_by_half_reaches_the_new_optimum_within_ten_rounds():
    ids = device_names(4)
    virtual_workers = 16
    before = [1.0, 1.0, 1.0, 1.0]
    state = BalanceState(dict(zip(ids, before)), ids, optimal_assignment(before, virtual_workers))
    after = [1.0, 1.0, 2.0, 1.0]
    target = optimal_assignment(after, virtual_workers)
    assert target == (5, 5, 2, 4) != state.assignment
    state, history = run_steps(state, ids, virtual_workers, after, rounds=10)
    assert target in history
    # Once reached, it stays: the following assignments are all the target.
    assert all(assignment == target for assignment in history[history.index(target) :])
    assert next_assignment(state, ids, virtual_workers) == target


@settings(max_examples=100, deadline=None)
@given(problems(max_devices=12, max_extra=60), st.data())
def test_device_slowing_by_half_gets_within_hysteresis_of_the_optimum(problem, data):
    # Hysteresis may legitimately keep a split that is slightly worse than the
    # exact optimum, so the general promise is: after 10 rounds of exact
    # measurements the split is within the hysteresis (plus the remaining
    # smoothing error, 2**-11 relative) of the optimum for the true speeds.
    before, virtual_workers = problem
    ids = device_names(len(before))
    slowed = data.draw(st.integers(min_value=0, max_value=len(before) - 1))
    after = [seconds * (2.0 if rank == slowed else 1.0) for rank, seconds in enumerate(before)]
    state = BalanceState(dict(zip(ids, before)), ids, optimal_assignment(before, virtual_workers))
    hysteresis = 0.05
    state, _ = run_steps(state, ids, virtual_workers, after, rounds=10, hysteresis=hysteresis)
    final = next_assignment(state, ids, virtual_workers, hysteresis=hysteresis)
    best = predicted_step_seconds(optimal_assignment(after, virtual_workers), after)
    error = 2.0**-10
    assert predicted_step_seconds(final, after) <= best * (1 + error) / ((1 - hysteresis) * (1 - error))


# --------------------------------------------------------------------------
# imbalance and predicted_step_seconds
# --------------------------------------------------------------------------


def test_imbalance_examples():
    assert imbalance([2.0, 1.0]) == 0.5
    assert imbalance([3.0, 3.0, 3.0]) == 0.0
    assert imbalance([4.0, 1.0, 3.0]) == 0.75
    assert imbalance([0.0, 0.0]) == 0.0
    assert imbalance([5.0]) == 0.0
    assert imbalance([2.0, -1.0]) == 1.0  # a negative busy time counts as 0


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(min_value=0.0, max_value=1e6), min_size=1, max_size=20))
def test_imbalance_formula(busy):
    value = imbalance(busy)
    if max(busy) == 0.0:
        assert value == 0.0
    else:
        assert value == (max(busy) - min(busy)) / max(busy)
    assert 0.0 <= value <= 1.0


def test_predicted_step_seconds_is_the_slowest_device():
    assert predicted_step_seconds((3, 1, 2), [1.0, 5.0, 2.0]) == 5.0
    assert predicted_step_seconds((3, 1, 2), [1.0, 0.5, 2.0]) == 4.0


# --------------------------------------------------------------------------
# state: round trips and validation
# --------------------------------------------------------------------------


@st.composite
def states(draw):
    ids = draw(st.lists(st.text(min_size=1, max_size=8), unique=True, max_size=6))
    seconds = {
        device_id: draw(st.floats(min_value=1e-6, max_value=1e6, allow_nan=False, allow_infinity=False))
        for device_id in ids
    }
    active = tuple(draw(st.permutations(ids)))[: draw(st.integers(min_value=0, max_value=len(ids)))]
    assignment = tuple(draw(st.integers(min_value=1, max_value=50)) for _ in active)
    return BalanceState(seconds, active, assignment)


@settings(max_examples=200, deadline=None)
@given(states())
def test_state_dict_round_trip(state):
    data = state_to_dict(state)
    assert state_from_dict(data) == state
    assert state_from_dict(json.loads(json.dumps(data))) == state  # plain JSON types only
    assert pickle.loads(pickle.dumps(state)) == state
    assert copy.deepcopy(state) == state


def test_state_is_immutable():
    state = BalanceState({"a": 1.0}, ("a",), (2,))
    with pytest.raises(AttributeError):
        state.assignment = (3,)
    with pytest.raises(TypeError):
        state.seconds_per_vw["a"] = 2.0


def test_state_floors_non_positive_times():
    state = BalanceState({"a": 0.0, "b": -2.0, "c": 0.5})
    assert dict(state.seconds_per_vw) == {"a": MINIMUM_SECONDS_PER_VW, "b": MINIMUM_SECONDS_PER_VW, "c": 0.5}


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: optimal_assignment([1.0, 1.0, 1.0], 2), r"virtual_workers=2 is fewer than the 3 devices"),
        (lambda: optimal_assignment([], 4), r"seconds_per_vw is empty"),
        (lambda: optimal_assignment([1.0, float("nan")], 4), r"seconds_per_vw\[1\]=nan is not finite"),
        (lambda: optimal_assignment([1.0, float("inf")], 4), r"seconds_per_vw\[1\]=inf is not finite"),
        (lambda: optimal_assignment([1.0, "2"], 4), r"seconds_per_vw\[1\]='2' is not a number"),
        (lambda: optimal_assignment([1.0], 2.5), r"virtual_workers=2.5 is not an integer"),
        (lambda: optimal_assignment([1.0], 0), r"virtual_workers=0 is below the minimum of 1"),
        (lambda: predicted_step_seconds((1, 2), [1.0]), r"assignment has 2 entries but seconds_per_vw has 1"),
        (lambda: imbalance([]), r"busy_seconds is empty"),
        (lambda: imbalance([1.0, float("nan")]), r"busy_seconds\[1\]=nan"),
        (lambda: next_assignment(BalanceState(), ("a", "b", "c"), 2), r"virtual_workers=2 is fewer than the 3 devices"),
        (lambda: next_assignment(BalanceState(), ("a", "a"), 4), r"more than once: \['a'\]"),
        (lambda: next_assignment(BalanceState(), (), 4), r"device_ids is empty"),
        (lambda: next_assignment(BalanceState(), "ab", 4), r"not one string"),
        (lambda: next_assignment(BalanceState(), ("a",), 4, hysteresis=1.0), r"hysteresis=1.0 must be"),
        (lambda: next_assignment(BalanceState(), ("a",), 4, hysteresis=-0.1), r"hysteresis=-0.1 must be"),
        (lambda: observe(BalanceState(), ("a", "b"), (1,), (1.0, 1.0)), r"device_ids \(2\), assignment \(1\)"),
        (lambda: observe(BalanceState(), ("a",), (0,), (1.0,)), r"assignment\[0\]=0 is below the minimum of 1"),
        (lambda: observe(BalanceState(), ("a",), (1,), (1.0,), smoothing=0.0), r"smoothing=0.0 must be"),
        (lambda: observe(BalanceState(), ("a",), (1,), (1.0,), smoothing=1.5), r"smoothing=1.5 must be"),
        (lambda: BalanceState({"a": 1.0}, ("a", "b"), (1,)), r"assignment has 1 entries but device_ids has 2"),
        (lambda: BalanceState({"a": float("nan")}), r"seconds_per_vw\['a'\]=nan"),
        (lambda: BalanceState({3: 1.0}), r"seconds_per_vw keys\[0\]=3 is not a string"),
        (lambda: BalanceState({}, ("a",), (0,)), r"assignment\[0\]=0 is below the minimum"),
        (lambda: state_from_dict({"seconds_per_vw": {}, "device_ids": []}), r"lacks the key\(s\) \['assignment'\]"),
        (
            lambda: state_from_dict({"seconds_per_vw": {}, "device_ids": [], "assignment": [], "extra": 1}),
            r"unknown key\(s\) \['extra'\]",
        ),
        (lambda: state_from_dict([1, 2]), r"must be a mapping"),
    ],
)
def test_bad_input_is_refused_with_the_numbers(call, message):
    with pytest.raises(ValueError, match=message):
        call()


from flexpar.core import balance  # noqa: E402  (module-level helpers below use the namespace)


def test_one_outlier_step_does_not_move_the_assignment():
    devices = ("a", "b", "c")
    true_seconds = [1.0, 2.0, 4.0]
    state = balance.BalanceState(seconds_per_vw={})
    assignment = balance.next_assignment(state, devices, 8)
    for step in range(12):
        busy = [count * seconds for count, seconds in zip(assignment, true_seconds)]
        if step == 6:
            busy[0] *= 3.0  # the host stalled device a for one step
        state = balance.observe(state, devices, assignment, busy)
        following = balance.next_assignment(state, devices, 8)
        if step >= 2:
            assert following == balance.optimal_assignment(true_seconds, 8), step
        assignment = following


def test_equally_fast_splits_prefer_the_most_even_one():
    # (12, 12, 6, 2) and (12, 11, 6, 3) both take 12 units; the second leaves nobody idle.
    assert balance.optimal_assignment([1.0, 1.0, 2.0, 4.0], 32) == (12, 11, 6, 3)
    assert balance.imbalance([12.0, 11.0, 12.0, 12.0]) < balance.imbalance([12.0, 12.0, 12.0, 8.0])


# --------------------------------------------------------------------------
# near ties: the most even split within the measurement noise of the fastest
# --------------------------------------------------------------------------


def alternating_window(seconds, spread, count=NOISE_WINDOW // 2):
    """Raw times around `seconds`, alternating -spread / +spread: relative_noise 2 * spread."""
    return [seconds * (1.0 - spread if index % 2 else 1.0 + spread) for index in range(count)]


def measured_state(seconds, spread, assignment=None):
    """A state whose devices have `seconds` smoothed and a window of 16 raw times each.

    Each device's standard error is then 2 * spread / sqrt(16) = spread / 2.
    """
    ids = device_names(len(seconds))
    recent = {device_id: alternating_window(value, spread) for device_id, value in zip(ids, seconds)}
    return ids, BalanceState(dict(zip(ids, seconds)), ids if assignment else (), assignment or (), recent=recent)


def all_splits_within(seconds, virtual_workers, tolerance):
    limit = predicted_step_seconds(optimal_assignment(seconds, virtual_workers), seconds) * (1.0 + tolerance)
    return [
        split for split in all_splits(virtual_workers, len(seconds)) if predicted_step_seconds(split, seconds) <= limit
    ]


def busy_imbalance(split, seconds):
    return imbalance([count * value for count, value in zip(split, seconds)])


def test_tie_tolerance_is_the_noise_part_of_the_threshold_capped_at_the_floor():
    ids, state = measured_state([1.0, 2.0], 0.004)  # standard errors 0.002
    assert tie_tolerance(state, ids) == pytest.approx(NOISE_FACTOR * 0.002)
    assert tie_tolerance(state, ids, noise_factor=2.0) == pytest.approx(0.004)
    _, noisy = measured_state([1.0, 2.0], 0.1)  # standard errors 0.05: 25%, capped at the 5% floor
    assert tie_tolerance(noisy, ids) == 0.05 and tie_tolerance(noisy, ids, hysteresis=0.2) == 0.2
    assert tie_tolerance(BalanceState({"local-0": 1.0, "local-1": 2.0}), ids) == 0.0  # no raw times: exact ties
    unknown = BalanceState(recent={"local-0": [1.0, 1.1]})  # 2 raw times: noise unknown, the floor
    assert tie_tolerance(unknown, ids) == 0.05


@settings(max_examples=150, deadline=None)
@given(small_problems(), st.lists(st.sampled_from([0.0, 0.001, 0.004, 0.01, 0.03]), min_size=4, max_size=4))
def test_a_placement_is_the_most_even_split_within_the_tie_tolerance(problem, spreads):
    # Brute force: the chosen split's predicted time is within the tolerance of the
    # optimum, and no split within the tolerance has a smaller predicted imbalance.
    seconds, virtual_workers = problem
    ids = device_names(len(seconds))
    recent = {
        device_id: alternating_window(value, spread)
        for device_id, value, spread in zip(ids, seconds, spreads)
        if spread
    }
    state = BalanceState(dict(zip(ids, seconds)), recent=recent)
    tolerance = tie_tolerance(state, ids)
    chosen = next_assignment(state, ids, virtual_workers)
    candidates = all_splits_within(seconds, virtual_workers, tolerance)
    assert chosen in candidates
    assert not [split for split in candidates if busy_imbalance(split, seconds) < busy_imbalance(chosen, seconds)]


@settings(max_examples=150, deadline=None)
@given(small_problems(), st.sampled_from([0.0, 0.002, 0.01, 0.03]), st.data())
def test_a_move_goes_to_that_split_and_only_for_a_gain_beyond_the_threshold(problem, spread, data):
    seconds, virtual_workers = problem
    current = data.draw(st.sampled_from(list(all_splits(virtual_workers, len(seconds)))))
    ids, state = measured_state(seconds, spread, current)
    chosen = next_assignment(state, ids, virtual_workers)
    if chosen == current:
        return
    assert chosen == most_even_assignment(seconds, virtual_workers, tie_tolerance(state, ids))
    # Every device has a window of raw times (measured_state), so the floor is the measured share,
    # spread 0 included: noise measured as zero, not unknown.
    floor = 0.05 * MEASURED_HYSTERESIS_SHARE
    threshold = change_threshold(state, ids, current, chosen, hysteresis=floor)
    assert predicted_step_seconds(chosen, seconds) < (1.0 - threshold) * predicted_step_seconds(current, seconds)


def test_a_near_tie_inside_the_noise_fills_the_slowest_device():
    # Balance to the whole-VW ceiling: speeds 1, 1, 0.5, 0.245 (per-VW 1, 1, 2, 4.08), V = 32. The fastest
    # split (12, 12, 6, 2) leaves the slowest device idle a third of the step;
    # (12, 11, 6, 3) is 2% slower. Inside the noise it is chosen, outside it is not.
    seconds = [1.0, 1.0, 2.0, 4.08]
    ids, noisy = measured_state(seconds, 0.01)  # tie tolerance 5 x 0.005 = 2.5%
    assert next_assignment(noisy, ids, 32) == (12, 11, 6, 3)
    ids, precise = measured_state(seconds, 0.002)  # 0.5%: a 2% difference is resolved
    assert next_assignment(precise, ids, 32) == (12, 12, 6, 2)
    # Kept once there: moving from the tie to the fastest gains 2%, less than the 2.5% noise.
    _, kept = measured_state(seconds, 0.01, (12, 11, 6, 3))
    assert next_assignment(kept, ids, 32) == (12, 11, 6, 3)


def test_a_gain_below_the_floor_is_taken_once_every_device_involved_is_measured():
    # V = 128 over per-VW 1, 1, 2, 4: (46, 46, 24, 12) takes 48 units, the optimum
    # (47, 47, 23, 11) 47: a 2.1% gain. Measured to 0.05% it beats the 1% floor of
    # measured devices; built by hand (no raw times) it meets the full 5% floor.
    seconds = [1.0, 1.0, 2.0, 4.0]
    ids, measured = measured_state(seconds, 0.001, (46, 46, 24, 12))
    assert next_assignment(measured, ids, 128) == (47, 47, 23, 11)
    unmeasured = BalanceState(dict(zip(ids, seconds)), ids, (46, 46, 24, 12))
    assert next_assignment(unmeasured, ids, 128) == (46, 46, 24, 12)
    # Measured, but noisy: the 2.1% is within 5 standard errors (5%), so nothing moves.
    _, noisy = measured_state(seconds, 0.02, (46, 46, 24, 12))
    assert next_assignment(noisy, ids, 128) == (46, 46, 24, 12)


def test_nominal_speeds_with_noise_settle_on_the_most_even_fastest_split():
    # The balance benchmark's devices: speeds 1, 1, 0.5, 0.25, +-2% noise. Every
    # split of 12 units is as fast; the rule before balancing to the whole-VW ceiling followed the noise to
    # (12, 12, 6, 2) in about half the runs (imbalance 1/3), this one to an even
    # one (imbalance 1/12) in all 100 of a sample.
    speeds, nominal = [1.0, 1.0, 0.5, 0.25], [1.0, 1.0, 2.0, 4.0]
    for seed in range(30):
        history, _ = simulate(speeds, 32, 40, uniform_noise(0.02), seed)
        assert all(predicted_step_seconds(split, nominal) == 12.0 for split in history[3:]), seed
        assert all(busy_imbalance(split, nominal) == pytest.approx(1 / 12) for split in history[3:]), seed
        assert changes(history) == 1, seed


def test_a_split_one_vw_off_the_optimum_is_corrected_once_measured():
    # V = 128: the first placement (3 raw times, the noise large) may land on a
    # 48-unit split, 2.1% slower than (47, 47, 23, 11) and within the 5% floor;
    # the 1% floor of measured devices corrects it once the noise is resolved.
    # The rule before balancing to the whole-VW ceiling kept such a split for good (21 of 100 runs here).
    speeds = [1.0, 1.0, 0.5, 0.25]
    for seed in range(20):
        history, _ = simulate(speeds, 128, 100, uniform_noise(0.02), seed)
        assert all(split == (47, 47, 23, 11) for split in history[70:]), (seed, history[-1])
        assert changes(history) <= 2, seed


# --------------------------------------------------------------------------
# noise-aware hysteresis: the split changes only when the gain beats the noise
# --------------------------------------------------------------------------


def uniform_noise(width):
    """Multiplicative noise drawn uniformly from [1 - width, 1 + width]."""
    return lambda rng: 1.0 + rng.uniform(-width, width)


def lognormal_noise(sigma):
    return lambda rng: math.exp(rng.gauss(0.0, sigma))


NOISES = {"uniform 40%": uniform_noise(0.4), "lognormal 0.3": lognormal_noise(0.3)}


def simulate(speeds, virtual_workers, steps, noise, seed, change=None, state=None):
    """observe -> next_assignment with measured busy = count / speed * noise; the assignment of each step.

    ``change=(step, new_speeds)`` changes the true speeds from that step on.
    Deterministic: the noise comes from ``random.Random(seed)``. Returns
    (assignments, final state).
    """
    import random

    rng = random.Random(seed)
    ids = device_names(len(speeds))
    state = BalanceState() if state is None else state
    speeds = list(speeds)
    history = []
    for step in range(steps):
        if change is not None and step == change[0]:
            speeds = list(change[1])
        assignment = next_assignment(state, ids, virtual_workers)
        history.append(assignment)
        busy = [count / speed * noise(rng) for count, speed in zip(assignment, speeds)]
        state = observe(state, ids, assignment, busy)
    return history, state


def changes(history):
    return sum(1 for before, after in zip(history, history[1:]) if before != after)


def within_one_vw(assignment, target):
    return all(abs(count - best) <= 1 for count, best in zip(assignment, target))


@settings(max_examples=30, deadline=None, derandomize=True)
@given(
    seed=st.integers(min_value=0, max_value=2**32 - 1),
    device_count=st.sampled_from([2, 3]),
    virtual_workers=st.sampled_from([4, 16, 32]),
    noise=st.sampled_from(sorted(NOISES)),
)
def test_equal_devices_with_noisy_timings_keep_their_split(seed, device_count, virtual_workers, noise):
    # Quiet rebalancing: two equal CPU devices on a busy host switched split 1,462 times
    # in 5,000 steps under the fixed 5% hysteresis.
    history, _ = simulate([1.0] * device_count, virtual_workers, 1000, NOISES[noise], seed)
    assert changes(history) <= 5


def test_the_noise_rule_is_what_keeps_equal_devices_quiet():
    # The same run with the threshold reduced to its fixed 5% floor keeps
    # switching (even with the smoothed times of a 32-step window), so the test
    # above measures the rule, not an easy case.
    import random

    ids = device_names(3)
    rng = random.Random(3)
    state, history = BalanceState(), []
    for _ in range(1000):
        assignment = next_assignment(state, ids, 16, noise_factor=0.0)
        history.append(assignment)
        state = observe(state, ids, assignment, [count * (1 + rng.uniform(-0.4, 0.4)) for count in assignment])
    assert changes(history) > 20
    quiet, _ = simulate([1.0, 1.0, 1.0], 16, 1000, uniform_noise(0.4), 3)
    assert changes(quiet) <= 5


def test_unequal_speeds_reach_the_optimum_in_three_steps_and_stay():
    speeds, virtual_workers = [1.0, 1.0, 0.5, 0.25], 32
    target = optimal_assignment([1 / speed for speed in speeds], virtual_workers)
    assert target == (12, 11, 6, 3)
    # Exact timings: the first move waits for three measurements (the noise is
    # unknown before), then lands on the optimum and stays.
    exact, _ = simulate(speeds, virtual_workers, 100, lambda rng: 1.0, seed=0)
    assert exact[:3] == [(8, 8, 8, 8)] * 3 and exact[3:] == [target] * 97
    # +-10% noise: the split of step 3 comes from 3 measurements per device; a
    # VW too many or too few is then the noise's doing, two too many happen in
    # some draws (the estimate is off by ~8%), and the split gets within one VW
    # as the measurements accumulate. Once within one VW, it stays there.
    first_move_on_target = 0
    for seed in range(30):
        history, _ = simulate(speeds, virtual_workers, 200, uniform_noise(0.1), seed)
        assert history[:3] == [(8, 8, 8, 8)] * 3, seed
        assert all(abs(count - best) <= 2 for count, best in zip(history[3], target)), seed
        reached = next(step for step, assignment in enumerate(history) if within_one_vw(assignment, target))
        assert reached <= 60, seed
        assert all(within_one_vw(assignment, target) for assignment in history[reached:]), seed
        first_move_on_target += reached == 3
    assert first_move_on_target >= 27  # 28 of these 30 draws; about 93% of all


@settings(max_examples=20, deadline=None, derandomize=True)
@given(seed=st.integers(min_value=0, max_value=2**32 - 1))
def test_a_device_becoming_twice_as_slow_is_followed_within_three_steps(seed):
    # The balance benchmark's scenario: local-0 drops from speed 1 to 0.5 at step 100.
    before, after = [1.0, 1.0, 0.5, 0.25], [0.5, 1.0, 0.5, 0.25]
    target = optimal_assignment([1 / speed for speed in after], 32)
    history, _ = simulate(before, 32, 160, uniform_noise(0.1), seed, change=(100, after))
    assert all(within_one_vw(assignment, target) for assignment in history[103:])
    # Two equal devices, one of which halves its speed.
    target = optimal_assignment([1.0, 2.0], 16)
    history, _ = simulate([1.0, 1.0], 16, 160, uniform_noise(0.1), seed, change=(100, [1.0, 0.5]))
    assert history[99] == (8, 8)
    assert all(within_one_vw(assignment, target) for assignment in history[103:])


def test_exact_timings_follow_a_change_of_speed_in_two_steps():
    history, _ = simulate([1.0, 1.0], 12, 40, lambda rng: 1.0, seed=0, change=(20, [1.0, 0.5]))
    # Step 20 runs slow; the median of the last 3 measurements shows it after
    # step 21, so the split of step 22 is the new optimum (one hiccup never counts).
    assert history[:22] == [(6, 6)] * 22
    assert history[22:] == [(8, 4)] * 18


@settings(max_examples=20, deadline=None)
@given(
    seed=st.integers(min_value=0, max_value=2**32 - 1),
    speeds=st.lists(st.sampled_from([0.25, 0.5, 1.0, 2.0]), min_size=1, max_size=5),
    extra=st.integers(min_value=0, max_value=30),
    split_at=st.integers(min_value=1, max_value=59),
)
def test_same_timings_give_the_same_splits_and_states(seed, speeds, extra, split_at):
    virtual_workers = len(speeds) + extra
    noise = uniform_noise(0.3)
    first, first_state = simulate(speeds, virtual_workers, 60, noise, seed)
    second, second_state = simulate(list(speeds), virtual_workers, 60, noise, seed)
    assert first == second
    assert json.dumps(state_to_dict(first_state)) == json.dumps(state_to_dict(second_state))
    # A state that went through JSON (a checkpoint, a joiner) continues identically.
    import random

    rng = random.Random(seed)
    ids = device_names(len(speeds))
    state, history = BalanceState(), []
    for step in range(60):
        if step == split_at:
            state = state_from_dict(json.loads(json.dumps(state_to_dict(state))))
        assignment = next_assignment(state, ids, virtual_workers)
        history.append(assignment)
        busy = [count / speed * noise(rng) for count, speed in zip(assignment, speeds)]
        state = observe(state, ids, assignment, busy)
    assert history == first
    assert state == first_state


def test_relative_noise_is_the_typical_step_to_step_change():
    assert relative_noise([1.0, 1.1, 1.0, 1.1]) == pytest.approx(0.1 / 1.05)
    assert relative_noise([2.0, 2.0, 2.0]) == 0.0
    assert relative_noise([1.0, 5.0]) == 0.0  # too few to tell
    # A lasting change of speed is one large difference: it does not look like noise.
    assert relative_noise([1.0] * 8 + [2.0] * 8) == 0.0
    assert relative_noise([1.0, 1.1, 1.0, 1.1, 1.0, 3.0]) == pytest.approx(0.1 / 1.05)  # one hiccup


def test_change_threshold_follows_the_documented_rule():
    ids = device_names(2)
    values = [1.0, 1.1] * 4  # relative_noise 0.1 / 1.05
    noise = relative_noise(values)
    state = BalanceState(
        {"local-0": 1.05, "local-1": 1.05},
        ids,
        (4, 4),
        recent={"local-0": values, "local-1": values[:2]},
        steady={"local-0": 4},
    )
    # Only devices whose count changes count; local-0 stands on 4 steady measurements.
    moved_first = (5, 4)
    assert change_threshold(state, ids, (4, 4), moved_first) == pytest.approx(NOISE_FACTOR * noise / 2)
    # local-1 has only 2 measurements: its noise is unknown, so nothing involving it moves.
    assert change_threshold(state, ids, (4, 4), (3, 5)) == math.inf
    assert not noise_known(state, ids) and noise_known(state, ids[:1])
    # The floor and the cap.
    assert change_threshold(state, ids, (4, 4), moved_first, noise_factor=0.0) == 0.05
    assert change_threshold(state, ids, (4, 4), moved_first, hysteresis=0.3) == 0.3
    assert change_threshold(state, ids, (4, 4), moved_first, noise_factor=100.0) == MAXIMUM_THRESHOLD
    # A device without measurements (a state built from smoothed times) counts as noise-free.
    assert change_threshold(BalanceState({"local-0": 1.0, "local-1": 1.0}, ids, (4, 4)), ids, (4, 4), (5, 3)) == 0.05


def test_observe_keeps_a_window_and_jumps_to_a_new_speed():
    ids = ("a",)
    state = BalanceState()
    for _ in range(40):
        state = observe(state, ids, (2,), (2.0,))
    assert state.recent["a"] == (1.0,) * NOISE_WINDOW and state.steady["a"] == NOISE_WINDOW
    state = observe(state, ids, (2,), (6.0,))  # one slow step: a hiccup, ignored
    assert state.seconds_per_vw["a"] == 1.0
    state = observe(state, ids, (2,), (6.0,))  # a second one: the speed changed
    assert state.seconds_per_vw["a"] == 3.0 and state.steady["a"] == 2


def test_states_of_older_versions_still_load():
    legacy = {"seconds_per_vw": {"a": 1.0, "b": 2.0}, "device_ids": ["a", "b"], "assignment": [8, 4]}
    state = state_from_dict(legacy)
    assert state.recent == {} and state.steady == {}
    assert next_assignment(state, ("a", "b"), 12) == (8, 4)
    with_window = state_from_dict({**legacy, "recent": {"a": [1.0, 1.1, 0.9], "b": [2.0, 2.1, 1.9]}})
    assert with_window.steady == {} and noise_known(with_window, ("a", "b"))
    following = observe(with_window, ("a", "b"), (8, 4), (8.0, 8.0))
    assert following.recent["a"] == (1.0, 1.1, 0.9, 1.0) and following.steady["a"] == 4
    assert state_from_dict(state_to_dict(following)) == following


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: next_assignment(BalanceState(), ("a",), 4, noise_factor=-1.0), r"noise_factor=-1.0 must be"),
        (lambda: BalanceState(recent={"a": [1.0, float("nan")]}), r"recent\['a'\]\[1\]=nan"),
        (lambda: BalanceState(recent={"a": "fast"}), r"must be a sequence of seconds"),
        (lambda: BalanceState(steady={"a": -1}), r"steady\['a'\]=-1 is below the minimum of 0"),
        (
            lambda: state_from_dict({"seconds_per_vw": {}, "device_ids": [], "assignment": [], "recent": []}),
            r"recent must be a mapping",
        ),
    ],
)
def test_bad_windows_are_refused(call, message):
    with pytest.raises(ValueError, match=message):
        call()


# --------------------------------------------------------------------------
# observe(work=...) and standard_error (balancing by cost, flexpar/core/cost_balance/)
# --------------------------------------------------------------------------


def test_observe_with_work_divides_by_the_work_not_the_count():
    state = observe(BalanceState(), ["a", "b"], [2, 3], [4.0, 3.0], work=[8.0, 1.5])
    assert state.seconds_per_vw == {"a": 0.5, "b": 2.0}
    assert state.assignment == (2, 3), "the VW counts are still recorded"
    assert state.recent == {"a": (0.5,), "b": (2.0,)}
    with pytest.raises(ValueError, match=r"work\[1\]=0.0 must be above 0"):
        observe(BalanceState(), ["a", "b"], [1, 1], [1.0, 1.0], work=[1.0, 0.0])
    with pytest.raises(ValueError, match="one per device"):
        observe(BalanceState(), ["a", "b"], [1, 1], [1.0, 1.0], work=[1.0])


def test_standard_error_is_unknown_below_three_times_and_shrinks_with_more():
    from flexpar.core.balance import standard_error

    assert standard_error(BalanceState(seconds_per_vw={"a": 1.0}), "a") == 0.0  # built by hand: noise-free
    state = BalanceState()
    errors = []
    for value in [1.0, 1.1, 0.9, 1.05, 0.95, 1.0, 1.1, 0.9, 1.0, 1.05, 0.95, 1.0]:
        state = observe(state, ["a"], [1], [value])
        errors.append(standard_error(state, "a"))
    assert errors[0] == errors[1] == math.inf
    assert 0.0 < errors[-1] < errors[2]
    assert errors[-1] == pytest.approx(relative_noise(state.recent["a"]) / math.sqrt(len(state.recent["a"])))
