"""Balancing by cost: VW costs checked, what an assignment of VW sets costs, and the count split's sets.

A device's predicted time is its rate (seconds per unit of cost) times the
``math.fsum`` of its VWs' costs (exactly rounded, so independent of the order
they were added in): the same number on every device.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, List, Optional, Sequence, Tuple

import torch

from flexpar.core import balance
from flexpar.core.balance.checks import seconds_list

Assignment = Tuple[Tuple[int, ...], ...]
"""For each device (rank order), the ids of the VWs it runs, ascending."""


def sample_cost_value(value: Any, index: int) -> float:
    """``sample_cost(index)``'s result as a float; ValueError naming the index and the fix.

    A cost is a finite real number >= 0: an int, a float, a numpy number or a
    one-element tensor. A bool, a string, NaN, an infinity or a negative
    number is refused.
    """
    number: Optional[float] = None
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        number = float(value)
    elif (
        isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_complex() and value.dtype != torch.bool
    ):
        number = float(value.item())
    if number is None:
        raise ValueError(
            f"sample_cost({index}) returned {value!r} ({type(value).__name__}); it must return a number >= 0, "
            f"for example the token count of sample {index}"
        )
    if not math.isfinite(number) or number < 0:
        raise ValueError(
            f"sample_cost({index}) returned {number!r}; a cost must be a finite number >= 0 (for example the "
            f"token count of sample {index}); fix sample_cost for that sample"
        )
    return number


def checked_costs(costs: Sequence[Any]) -> List[float]:
    """VW costs as floats; ValueError naming the first that is not a finite number >= 0."""
    result = []
    for index, value in enumerate(costs):
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise ValueError(f"costs[{index}]={value!r} is not a number")
        number = float(value)
        if not math.isfinite(number) or number < 0:
            raise ValueError(f"costs[{index}]={number!r} must be a finite number >= 0")
        result.append(number)
    return result


def checked_rates(seconds_per_cost: Sequence[Any]) -> List[float]:
    """Finite rates in rank order; values below balance's minimum count as that minimum."""
    return seconds_list(seconds_per_cost, "seconds_per_cost")


def check_shape(virtual_workers: int, devices: int) -> None:
    if devices == 0:
        raise ValueError("seconds_per_cost is empty; an assignment needs at least one device")
    if virtual_workers < devices:
        raise ValueError(
            f"{virtual_workers} virtual workers are fewer than the {devices} devices; "
            "every device needs at least one virtual worker"
        )


# --------------------------------------------------------------------------
# step times of an assignment
# --------------------------------------------------------------------------


def device_costs(assignment: Sequence[Sequence[int]], costs: Sequence[float]) -> Tuple[float, ...]:
    """The summed cost of each device's VWs (``math.fsum``: exactly rounded, order-free)."""
    return tuple(math.fsum(costs[virtual_worker] for virtual_worker in members) for members in assignment)


def predicted_step_seconds(
    assignment: Sequence[Sequence[int]], costs: Sequence[float], seconds_per_cost: Sequence[float]
) -> float:
    """``max_d(rate_d * cost of device d's VWs)``, the figure ``cost_assignment`` minimises."""
    rates = checked_rates(seconds_per_cost)
    if len(assignment) != len(rates):
        raise ValueError(f"the assignment has {len(assignment)} devices but seconds_per_cost has {len(rates)}")
    return max(rate * load for rate, load in zip(rates, device_costs(assignment, checked_costs(costs))))


def step_seconds(owner: Sequence[int], costs: Sequence[float], rates: Sequence[float]) -> float:
    """Predicted step time of ``owner`` (VW -> device), computed as ``predicted_step_seconds`` does."""
    groups: List[List[float]] = [[] for _ in rates]
    for virtual_worker, device in enumerate(owner):
        groups[device].append(costs[virtual_worker])
    return max(rate * math.fsum(group) for rate, group in zip(rates, groups))


def sets(owner: Sequence[int], devices: int) -> Assignment:
    groups: List[List[int]] = [[] for _ in range(devices)]
    for virtual_worker, device in enumerate(owner):  # ascending VW ids
        groups[device].append(virtual_worker)
    return tuple(tuple(group) for group in groups)


def count_based_sets(costs: Sequence[float], seconds_per_cost: Sequence[float]) -> Assignment:
    """The count balancer's split for these rates: contiguous ranges, counts by ``balance.optimal_assignment``.

    What flexpar does without ``sample_cost`` (where a device's per-VW time is
    its rate times the mean VW cost): the baseline ``cost_assignment`` never
    does worse than.
    """
    rates = checked_rates(seconds_per_cost)
    check_shape(len(costs), len(rates))
    return sets(contiguous_owner(rates, len(costs)), len(rates))


def contiguous_owner(rates: Sequence[float], virtual_workers: int) -> List[int]:
    # Relative rates (the fastest 1.0): optimal_assignment is scale-free, and its
    # floor then never applies to a fast device's small absolute rate.
    fastest = min(rates)
    counts = balance.optimal_assignment([rate / fastest for rate in rates], virtual_workers)
    owner: List[int] = []
    for device, count in enumerate(counts):
        owner.extend([device] * count)
    return owner
