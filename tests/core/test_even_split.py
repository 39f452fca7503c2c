"""Tests of the most even near-fastest split (flexpar/core/balance/even_split.py, balance.most_even_assignment).

Checked against brute force over every split for small cases: the answer's
predicted step time is within the tolerance of the optimum, and no split
within the tolerance has a smaller predicted imbalance.
"""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flexpar.core.balance import most_even_assignment, optimal_assignment, predicted_step_seconds
from flexpar.core.balance.even_split import predicted_imbalance

# Arbitrary floats plus round values, so that exact ties (equal products on
# different devices) and near ties both come up.
seconds_values = st.one_of(
    st.floats(min_value=1e-3, max_value=1e3, allow_nan=False, allow_infinity=False),
    st.sampled_from([0.25, 0.5, 1.0, 1.5, 2.0, 3.0, 4.08]),
)
tolerances = st.one_of(st.sampled_from([0.0, 0.01, 0.021, 0.05, 0.2, 0.5]), st.floats(min_value=0.0, max_value=0.9))


def all_splits(virtual_workers, device_count):
    """Every tuple of device_count counts >= 1 that sums to virtual_workers."""
    for cuts in itertools.combinations(range(1, virtual_workers), device_count - 1):
        bounds = (0,) + cuts + (virtual_workers,)
        yield tuple(high - low for low, high in zip(bounds, bounds[1:]))


def within(seconds, virtual_workers, tolerance):
    """The splits whose predicted step time is at most (1 + tolerance) x the optimum's (the code's own bound)."""
    limit = predicted_step_seconds(optimal_assignment(seconds, virtual_workers), seconds) * (1.0 + tolerance)
    return [
        split for split in all_splits(virtual_workers, len(seconds)) if predicted_step_seconds(split, seconds) <= limit
    ]


@settings(max_examples=400, deadline=None)
@given(st.lists(seconds_values, min_size=1, max_size=4), st.integers(min_value=0, max_value=8), tolerances)
def test_the_most_even_split_within_the_tolerance_matches_brute_force(seconds, extra, tolerance):
    virtual_workers = len(seconds) + extra
    chosen = most_even_assignment(seconds, virtual_workers, tolerance)
    assert len(chosen) == len(seconds) and min(chosen) >= 1 and sum(chosen) == virtual_workers
    candidates = within(seconds, virtual_workers, tolerance)
    assert chosen in candidates  # its predicted step time is within the tolerance of the optimum
    assert not [
        split for split in candidates if predicted_imbalance(split, seconds) < predicted_imbalance(chosen, seconds)
    ]


@settings(max_examples=200, deadline=None)
@given(st.lists(seconds_values, min_size=1, max_size=4), st.integers(min_value=0, max_value=8))
def test_zero_tolerance_is_the_optimum_itself(seconds, extra):
    virtual_workers = len(seconds) + extra
    assert most_even_assignment(seconds, virtual_workers, 0.0) == optimal_assignment(seconds, virtual_workers)
    # ... which is the most even of the fastest splits (the tolerance 0 case of the test above).
    chosen = optimal_assignment(seconds, virtual_workers)
    assert not [
        split
        for split in within(seconds, virtual_workers, 0.0)
        if predicted_imbalance(split, seconds) < predicted_imbalance(chosen, seconds)
    ]


@settings(max_examples=100, deadline=None)
@given(st.lists(seconds_values, min_size=1, max_size=24), st.integers(min_value=0, max_value=150), tolerances)
def test_larger_cases_stay_within_the_tolerance(seconds, extra, tolerance):
    # Too big for brute force: the bound, the counts, and never less even than the optimum.
    virtual_workers = len(seconds) + extra
    chosen = most_even_assignment(seconds, virtual_workers, tolerance)
    optimum = optimal_assignment(seconds, virtual_workers)
    assert min(chosen) >= 1 and sum(chosen) == virtual_workers
    assert predicted_step_seconds(chosen, seconds) <= predicted_step_seconds(optimum, seconds) * (1.0 + tolerance)
    assert predicted_imbalance(chosen, seconds) <= predicted_imbalance(optimum, seconds)


def test_a_near_tie_fills_the_slowest_device():
    # The whole-VW ceiling's case: speeds 1, 1, 0.5, 0.245. (12, 12, 6, 2) takes 12 units and
    # leaves the slowest device idle a third of the step; (12, 11, 6, 3) takes
    # 12.24 (2% longer) and leaves nobody idle for more than 1/12.
    seconds = [1.0, 1.0, 2.0, 4.08]
    assert optimal_assignment(seconds, 32) == (12, 12, 6, 2)
    assert predicted_imbalance((12, 12, 6, 2), seconds) == pytest.approx(0.32)
    assert most_even_assignment(seconds, 32, 0.01) == (12, 12, 6, 2)  # 2% is no tie at 1%
    assert most_even_assignment(seconds, 32, 0.025) == (12, 11, 6, 3)
    assert predicted_imbalance((12, 11, 6, 3), seconds) == pytest.approx(1.24 / 12.24)
    # V = 128, speeds 1, 1, 0.5, 0.25: the next more even split (imbalance 0.042
    # instead of 0.064) is a whole fast VW (2.1%) slower, a tie only from 2.13% on.
    exact = [1.0, 1.0, 2.0, 4.0]
    assert most_even_assignment(exact, 128, 0.02) == optimal_assignment(exact, 128) == (47, 47, 23, 11)
    assert predicted_step_seconds(most_even_assignment(exact, 128, 0.025), exact) == 48.0


def test_the_stated_scale_is_handled():
    # 1,024 devices, V = 4,096 (balance.py's stated scale) with the widest tolerance
    # the balancer uses (5%): a few thousand heap operations.
    seconds = [0.5 + (rank * 7919 % 1000) / 1000 for rank in range(1024)]
    chosen = most_even_assignment(seconds, 4096, 0.05)
    optimum = optimal_assignment(seconds, 4096)
    assert sum(chosen) == 4096 and min(chosen) >= 1
    assert predicted_step_seconds(chosen, seconds) <= predicted_step_seconds(optimum, seconds) * 1.05
    assert predicted_imbalance(chosen, seconds) <= predicted_imbalance(optimum, seconds)


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: most_even_assignment([1.0, 1.0], 4, -0.1), r"tolerance=-0.1 must be at least 0"),
        (lambda: most_even_assignment([1.0, 1.0], 4, 1.0), r"tolerance=1.0 must be at least 0 and below 1"),
        (lambda: most_even_assignment([1.0, 1.0], 4, float("nan")), r"tolerance=nan is not finite"),
        (lambda: most_even_assignment([1.0, 1.0, 1.0], 2, 0.1), r"virtual_workers=2 is fewer than the 3 devices"),
        (lambda: most_even_assignment([], 2, 0.1), r"seconds_per_vw is empty"),
    ],
)
def test_bad_input_is_refused_with_the_numbers(call, message):
    with pytest.raises(ValueError, match=message):
        call()
