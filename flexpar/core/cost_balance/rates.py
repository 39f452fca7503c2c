"""Balancing by cost: each device's seconds per unit of cost, learned from busy times, frozen for plans.

The rates ``cost_assignment`` (search.py) plans with. Pure (no
clocks, processes or sockets), every computation a fixed sequence of float
operations in rank order, so every device holds the same rates after the same
steps; they are part of the training state (a joiner receives them).

Rates and plan stability
------------------------

A device's raw rate at a step is its busy seconds (which ride in the step's
statistics vector already) over the cost it ran (which every device knows from
the shared assignment): nothing new is sent. They are smoothed exactly as the
count balancer smooths per-VW times (``balance.observe`` with ``work=``: the
interquartile mean of the raw values since the device's speed last changed,
with outliers and changes of speed handled there).

The data loader prefetches along the plan of upcoming steps and restarts when
a plan changes, so the plan of step ``s + 1`` must be known during step ``s``
and must not move with every wobble of the measurements. Plans therefore use
*planned* rates (``CostRates.planned``), a frozen copy of the smoothed ones,
which move by the count balancer's rule (``balance.noise_threshold``) with
its fixed floor (the count split lowers its floor to 1% once the noise is
measured; planned rates keep 5%, because every move of them restarts the
data loader) (``replan``). After each step, the proposal is every device's smoothed rate,
for the devices with at least 3 measurements (with 1 or 2 the noise is not
known yet: such a device keeps its planned rate, or the fallback below). The
proposal is taken only if the plan it gives for the next step is predicted,
under the proposed rates, to be faster than the current plan by more than

    threshold = max(5%, min(50%, 5 x the largest standard error))

relative, the standard error (``balance.standard_error``) taken over the
devices whose rate would change. So on a noisy host the plans stay put, a
real change of speed moves them within a few steps (as ``balance.observe``
sees it, then the gain decides), and a common drift of every device (host
load) moves nothing, because it does not change which plan is faster. A restart
of the loader is accepted when they move.

A device without a planned rate (the start, a joiner) is planned at the median
planned rate of the device set; with none known, all devices get equal rates,
which plans by cost alone (right for equal devices, which then never move).
A first step's one-off costs never set a rate on their own: a proposal needs
three measurements.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, List, Mapping, Optional, Sequence

from flexpar.core import balance
from flexpar.core.balance.checks import finite_seconds, usable_seconds
from flexpar.core.balance.noise import median_for_unknown
from flexpar.core.cost_balance.costs import Assignment, checked_costs, device_costs, predicted_step_seconds
from flexpar.core.cost_balance.search import cost_assignment

_UNMEASURED_SECONDS = 1.0  # every device's rate when none is known: equal rates, any common value


@dataclass(frozen=True)
class CostRates:
    """Measured and planned seconds per unit of cost, by device id. Immutable.

    ``measured`` is a ``balance.BalanceState`` whose ``seconds_per_vw`` are
    seconds per unit of cost (its raw values, noise and changes of speed are
    handled by balance's code). ``planned`` is the frozen copy plans use
    (module docstring); read-only, in sorted key order.
    """

    measured: balance.BalanceState = field(default_factory=balance.BalanceState)
    planned: Mapping[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        planned = {}
        for device_id in sorted(self.planned):
            planned[str(device_id)] = usable_seconds(finite_seconds(self.planned[device_id], f"planned[{device_id!r}]"))
        object.__setattr__(self, "planned", MappingProxyType(planned))

    def __reduce__(self):
        return (rates_from_dict, (rates_to_dict(self),))


def rates_to_dict(rates: CostRates) -> dict:
    """Plain JSON-ready types; equal rates give equal dicts."""
    return {"measured": balance.state_to_dict(rates.measured), "planned": dict(rates.planned)}


def rates_from_dict(data: Mapping[str, Any]) -> CostRates:
    """Inverse of ``rates_to_dict``; ValueError for a malformed mapping."""
    if not isinstance(data, Mapping) or set(data) != {"measured", "planned"}:
        raise ValueError(f"cost rates must be a mapping with the keys 'measured' and 'planned', not {data!r}")
    if not isinstance(data["planned"], Mapping):
        raise ValueError(f"planned must be a mapping keyed by device id, not {type(data['planned']).__name__}")
    return CostRates(balance.state_from_dict(data["measured"]), dict(data["planned"]))


def planning_seconds(rates: CostRates, device_ids: Sequence[str]) -> List[float]:
    """The planned rates of ``device_ids`` in rank order; unknown devices at the median of the known ones.

    With none known, every device gets the same rate (a plan by cost alone).
    """
    return median_for_unknown(rates.planned, device_ids, _UNMEASURED_SECONDS)


def observe_costs(
    rates: CostRates,
    device_ids: Sequence[str],
    assignment: Sequence[Sequence[int]],
    costs: Sequence[float],
    busy_seconds: Sequence[float],
) -> CostRates:
    """Fold one step into the measured rates: device i ran ``assignment[i]`` (VWs of ``costs``) in ``busy_seconds[i]``.

    A device whose VWs cost nothing this step says nothing about its rate and
    is skipped. The planned rates do not change here (``replan`` moves them).
    """
    device_ids = tuple(device_ids)
    if not (len(device_ids) == len(assignment) == len(busy_seconds)):
        raise ValueError(
            f"device_ids ({len(device_ids)}), assignment ({len(assignment)}) and busy_seconds "
            f"({len(busy_seconds)}) must have one entry per device"
        )
    work = device_costs(assignment, checked_costs(costs))
    ran = [index for index, amount in enumerate(work) if amount > 0.0]
    if not ran:
        return rates
    measured = balance.observe(
        rates.measured,
        [device_ids[index] for index in ran],
        [len(assignment[index]) for index in ran],
        [busy_seconds[index] for index in ran],
        work=[work[index] for index in ran],
    )
    return CostRates(measured, rates.planned)


def replan(
    rates: CostRates,
    device_ids: Sequence[str],
    next_costs: Sequence[float],
    current_plan: Optional[Assignment] = None,
    hysteresis: float = balance.DEFAULT_HYSTERESIS,
    noise_factor: float = balance.NOISE_FACTOR,
) -> CostRates:
    """``rates`` with the planned rates moved to the smoothed ones, if that pays (module docstring).

    ``next_costs`` are the VW costs of the next step, on which the current
    plan (``current_plan``, else computed) and the proposed one are compared,
    both priced with the proposed rates. Returns ``rates`` itself when nothing
    moves.
    """
    device_ids = tuple(device_ids)
    measured = rates.measured
    proposal = dict(rates.planned)
    noise = 0.0
    for device_id in device_ids:
        if device_id not in measured.seconds_per_vw:
            continue
        error = balance.standard_error(measured, device_id)
        if math.isinf(error):  # 1 or 2 measurements: its noise is not known yet
            continue
        value = measured.seconds_per_vw[device_id]
        if proposal.get(device_id) != value:
            proposal[device_id] = value
            noise = max(noise, error)
    if proposal == dict(rates.planned):
        return rates
    proposed = CostRates(measured, proposal)
    proposed_seconds = planning_seconds(proposed, device_ids)
    if current_plan is None:
        current_plan = cost_assignment(next_costs, planning_seconds(rates, device_ids))
    current_time = predicted_step_seconds(current_plan, next_costs, proposed_seconds)
    proposed_time = predicted_step_seconds(cost_assignment(next_costs, proposed_seconds), next_costs, proposed_seconds)
    threshold = balance.noise_threshold(noise, hysteresis, noise_factor)
    return proposed if proposed_time < (1.0 - threshold) * current_time else rates
