"""Tests of flexpar.core.cost_balance.rates: rates from busy times, and when the planned rates move."""

from __future__ import annotations

import json
import pickle
import random

import pytest

from flexpar.core import balance
from flexpar.core.cost_balance import cost_assignment, device_costs
from flexpar.core.cost_balance.rates import (
    CostRates,
    observe_costs,
    planning_seconds,
    rates_from_dict,
    rates_to_dict,
    replan,
)


def step(rates, device_ids, costs, true_rates, next_costs, noise=None):
    """One step: plan with the planned rates, measure exact (or noisy) busy times, observe, replan."""
    sets = cost_assignment(costs, planning_seconds(rates, device_ids))
    loads = device_costs(sets, costs)
    busy = [rate * load * (1.0 if noise is None else noise()) for rate, load in zip(true_rates, loads)]
    rates = observe_costs(rates, device_ids, sets, costs, busy)
    return replan(rates, device_ids, next_costs), sets


def test_unknown_devices_plan_at_the_median_and_equal_rates_without_any():
    assert planning_seconds(CostRates(), ["a", "b"]) == [1.0, 1.0]
    rates = CostRates(balance.BalanceState(), {"a": 2.0, "b": 4.0, "c": 3.0})
    assert planning_seconds(rates, ["a", "b", "new"]) == [2.0, 4.0, 3.0]
    assert planning_seconds(rates, ["new", "a"]) == [2.0, 2.0]


def test_observe_divides_busy_time_by_the_cost_each_device_ran():
    sets = ((0, 2), (1,))
    rates = observe_costs(CostRates(), ["a", "b"], sets, [10.0, 4.0, 30.0], [2.0, 2.0])
    assert rates.measured.seconds_per_vw == {"a": 2.0 / 40.0, "b": 2.0 / 4.0}
    assert rates.planned == {}, "observe only measures; replan moves the planned rates"
    # A device whose VWs cost nothing this step learns nothing.
    again = observe_costs(rates, ["a", "b"], ((0,), (1,)), [0.0, 4.0], [1.0, 1.0])
    assert again.measured.seconds_per_vw["a"] == 2.0 / 40.0
    assert again.measured.recent["a"] == rates.measured.recent["a"]


def test_rates_are_learned_on_the_third_step_and_then_stay():
    generator = random.Random(0)
    true_rates = [1.0, 2.0]  # the second device is half as fast
    rates = CostRates()
    planned = []
    for _ in range(30):
        costs = [float(generator.randint(1, 300)) for _ in range(16)]
        rates, _ = step(rates, ["a", "b"], costs, true_rates, costs)
        planned.append(dict(rates.planned))
    assert planned[0] == planned[1] == {}, "1 or 2 measurements: no noise known yet, nothing moves"
    assert planned[2] == {"a": pytest.approx(1.0), "b": pytest.approx(2.0)}
    assert all(entry == planned[2] for entry in planned[2:]), "exact measurements: nothing moves again"


def test_equal_devices_on_a_noisy_host_keep_their_plan():
    generator = random.Random(1)
    rates = CostRates()
    moves = 0
    for _ in range(300):
        costs = [float(generator.randint(1, 300)) for _ in range(16)]
        before = dict(rates.planned)
        rates, _ = step(rates, ["a", "b"], costs, [1.0, 1.0], costs, noise=lambda: generator.uniform(0.6, 1.4))
        moves += bool(before) and dict(rates.planned) != before
    assert moves <= 3, f"the planned rates of two equal devices moved {moves} times in 300 noisy steps"


def test_a_device_that_slows_down_is_followed_within_a_few_steps():
    generator = random.Random(2)
    rates = CostRates()
    true_rates = [1.0, 1.0]
    seen = None
    for index in range(40):
        if index == 20:
            true_rates = [1.0, 2.0]
        costs = [float(generator.randint(1, 300)) for _ in range(16)]
        rates, _ = step(rates, ["a", "b"], costs, true_rates, costs, noise=lambda: generator.uniform(0.95, 1.05))
        if index >= 20 and seen is None and rates.planned.get("b", 0) > 1.5 * rates.planned.get("a", 1):
            seen = index - 20
    assert seen is not None and seen <= 4, seen


def test_a_common_drift_of_every_device_moves_nothing():
    generator = random.Random(4)
    rates = CostRates()
    for index in range(40):
        factor = 1.0 if index < 20 else 1.6  # the whole host slows down
        costs = [float(generator.randint(1, 300)) for _ in range(16)]
        before = dict(rates.planned)
        rates, _ = step(rates, ["a", "b"], costs, [factor, factor], costs)
        if index >= 20:
            assert dict(rates.planned) == before


def test_a_joiner_plans_at_the_median_until_its_third_step():
    generator = random.Random(6)
    rates = CostRates()
    for _ in range(5):
        costs = [float(generator.randint(1, 300)) for _ in range(12)]
        rates, _ = step(rates, ["a", "b"], costs, [1.0, 1.0], costs)
    members = ["a", "b", "c"]
    for index in range(4):
        assert ("c" in rates.planned) == (index >= 3)
        costs = [float(generator.randint(1, 300)) for _ in range(12)]
        rates, sets = step(rates, members, costs, [1.0, 1.0, 3.0], costs)
    assert rates.planned["c"] == pytest.approx(3.0)


def test_rates_round_trip_through_json_and_pickle():
    generator = random.Random(7)
    rates = CostRates()
    for _ in range(4):
        costs = [float(generator.randint(1, 300)) for _ in range(8)]
        rates, _ = step(rates, ["a", "b"], costs, [1.0, 0.5], costs)
    again = rates_from_dict(json.loads(json.dumps(rates_to_dict(rates))))
    assert rates_to_dict(again) == rates_to_dict(rates)
    assert rates_to_dict(pickle.loads(pickle.dumps(rates))) == rates_to_dict(rates)
    with pytest.raises(ValueError, match="'measured' and 'planned'"):
        rates_from_dict({"planned": {}})
