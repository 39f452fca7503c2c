"""Exact sums (flexpar/core/exact_sum.py): any grouping and order gives the same bits; accuracy vs float64."""

import math
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flexpar.core import exact_sum


def _contributions(seed: int, virtual_workers: int, size: int, spread: int) -> list:
    generator = torch.Generator().manual_seed(seed)
    result = []
    for _ in range(virtual_workers):
        values = torch.randn(size, generator=generator)
        magnitudes = torch.randint(-spread, 1, (size,), generator=generator).to(torch.float32)
        result.append(values * torch.pow(2.0, magnitudes))
    return result


def _grouped_sum(contributions, exponent, groups) -> torch.Tensor:
    """Each group summed locally (in its own order), then the group sums summed in the given order."""
    partials = []
    for group in groups:
        accumulator = torch.zeros(contributions[0].shape, dtype=torch.int64)
        for index in group:
            exact_sum.add_fixed(accumulator, contributions[index], exponent)
        partials.append(accumulator)
    total = torch.zeros_like(partials[0])
    for partial in partials:
        total += partial
    return exact_sum.to_float(total, exponent, torch.float32)


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    virtual_workers=st.integers(1, 24),
    spread=st.integers(0, 40),
    shuffle_seed=st.integers(0, 2**31 - 1),
    cuts=st.lists(st.integers(1, 23), max_size=5),
)
def test_any_grouping_and_order_gives_the_same_bits(seed, virtual_workers, spread, shuffle_seed, cuts):
    contributions = _contributions(seed, virtual_workers, 64, spread)
    largest = max(float(c.abs().max()) for c in contributions)
    exponent = exact_sum.exponent_for(largest, virtual_workers)
    assert all(exact_sum.fits(float(c.abs().max()), exponent, virtual_workers) for c in contributions)
    reference = _grouped_sum(contributions, exponent, [list(range(virtual_workers))])
    order = list(range(virtual_workers))
    random.Random(shuffle_seed).shuffle(order)
    points = sorted({cut for cut in cuts if cut < virtual_workers})
    groups = [order[start:stop] for start, stop in zip([0, *points], [*points, virtual_workers])]
    assert torch.equal(_grouped_sum(contributions, exponent, groups), reference)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), virtual_workers=st.integers(1, 32), spread=st.integers(0, 30))
def test_as_accurate_as_float32_within_2_to_the_24_of_the_largest(seed, virtual_workers, spread):
    """For V <= 32, every element within 2**24 of the largest contribution: error <= float32 rounding."""
    contributions = _contributions(seed, virtual_workers, 128, spread)
    largest = max(float(c.abs().max()) for c in contributions)
    exponent = exact_sum.exponent_for(largest, virtual_workers)
    exact = _grouped_sum(contributions, exponent, [list(range(virtual_workers))])
    reference = torch.stack([c.double() for c in contributions]).sum(0)
    error = (exact.double() - reference).abs()
    # The fixed-point error (bounded by error_bound) plus the final rounding to float32.
    assert float((error - reference.abs() * 2.0**-24).max()) <= exact_sum.error_bound(exponent, virtual_workers)
    assert exact_sum.error_bound(exponent, virtual_workers) <= largest * 2.0**-48
    considered = reference.abs() >= largest * 2.0**-24
    assert bool((error[considered] <= reference.abs()[considered] * 2.0**-23).all())


def test_v_contributions_at_the_limit_do_not_overflow():
    for virtual_workers in (1, 2, 3, 7, 64, 1000):
        exponent = exact_sum.exponent_for(1.0, virtual_workers)
        below = math.nextafter(exact_sum.limit(exponent, virtual_workers), 0.0)
        accumulator = torch.zeros(1, dtype=torch.int64)
        for _ in range(virtual_workers):
            exact_sum.add_fixed(accumulator, torch.tensor([below], dtype=torch.float64), exponent)
        assert 0 < int(accumulator) < 2**63 - 1
        assert exact_sum.fits(8.0 * 0.999, exponent, virtual_workers)  # the headroom: 8x the previous largest


def test_redo_when_a_gradient_outgrows_the_headroom_or_has_no_exponent_yet():
    exponents = exact_sum.learned([1.0, 0.0], [None, None], 4)
    assert exponents[0] is not None and exponents[1] is None
    assert not exact_sum.needs_redo([7.9, 0.0], exponents, 4)
    assert exact_sum.needs_redo([1e6, 0.0], exponents, 4)  # a spike
    assert exact_sum.needs_redo([1.0, 1e-9], exponents, 4)  # a tensor's first gradient
    assert not exact_sum.needs_redo([float("inf"), 0.0], exponents, 4)  # overflow: redoing changes nothing
    relearned = exact_sum.learned([1e6, 0.0], exponents, 4)
    assert not exact_sum.needs_redo([1e6, 0.0], relearned, 4)
    assert exact_sum.learned([0.0, float("nan")], relearned, 4) == relearned  # no information: kept


def test_bad_virtual_worker_count():
    with pytest.raises(ValueError, match="virtual_workers"):
        exact_sum.contribution_bits(0)


def test_the_mixed_kinds_note_names_the_devices():
    from flexpar.core.step_statistics import StatsLayout, mixed_kinds_message

    text = mixed_kinds_message("cpu", "local-0", ["hostB-1"])
    assert text.startswith("devices of different kinds train together (local-0 is cpu, hostB-1 is not)")
    assert "matches a run on the same kinds" in text
    layout = StatsLayout(3, virtual_workers=6, tensors=4)
    assert layout.kinds.stop == layout.size and layout.kinds.stop - layout.kinds.start == 3
    assert StatsLayout(3).size == StatsLayout(3).kinds.stop == 5 * 3 + 7  # without the exact sums' slots
