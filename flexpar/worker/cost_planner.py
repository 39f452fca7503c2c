"""A worker's side of balancing by cost (``Job(sample_cost=FN)``): costs, plans and rates of its steps.

The math is in ``flexpar.core.cost_balance`` and ``flexpar.core.cost_balance.rates`` (pure). This class holds what a
worker keeps between steps: the learned rates (``CostRates``, part of the
training state, so joiners and checkpoints carry them), and small caches of
each step's VW costs and plans, because the data loader asks for the plan of
upcoming steps (``StepLoop.plan``) and the step loop asks again when the step
runs. Everything it computes is a function of the job, the step, the device
set and the rates, which every member holds alike: every member computes the
same plans.

Cost units: a VW's cost is divided by the mean VW cost of step 0 (a pure
function of the job), so that a device's rate is its seconds per typical VW,
the same magnitude as the count balancer's per-VW times; whatever unit the
user's costs have (tokens, bytes, FLOPs), the rates stay well above the
balancer's floor for times (``balance.MINIMUM_SECONDS_PER_VW``).
"""

from __future__ import annotations

import collections
import math
from typing import List, Optional, Sequence, Tuple

from flexpar.core import batching, cost_balance
from flexpar.core.cost_balance import rates as cost_rates
from flexpar.errors import UserCodeError

_CACHED_STEPS = 4  # costs and plans of the step running and the next few the loader prefetches


def sample_costs(job, indices: Sequence[int], step: Optional[int] = None) -> List[float]:
    """``job.sample_cost`` of each index, checked; UserCodeError naming the index (and step) and the fix."""
    where = f" at step {step}" if step is not None else ""
    costs = []
    for index in indices:
        try:
            value = job.sample_cost(index)
        except Exception as error:
            raise UserCodeError(
                f"sample_cost({index}) raised {type(error).__name__}: {error}{where}; "
                "sample_cost(index) must return the cost of that sample (e.g. its token "
                "count) for every index of the dataset"
            ) from error
        try:
            costs.append(cost_balance.sample_cost_value(value, index))
        except ValueError as error:
            raise UserCodeError(f"{error}{where}") from None
    return costs


class CostPlanner:
    """The per-step VW sets of one job, as every member computes them."""

    def __init__(self, job, total_steps: Optional[int] = None):
        self.job = job
        self.total_steps = total_steps  # no step at or after it runs: never priced or planned
        self.rates = cost_rates.CostRates()
        self._size = len(job.dataset)
        self._orders: collections.OrderedDict = collections.OrderedDict()  # epoch -> sample order
        self._costs: collections.OrderedDict = collections.OrderedDict()  # step -> (raw, scaled) VW costs
        self._plans: collections.OrderedDict = collections.OrderedDict()  # (step, members, rates) -> sets
        self._scale: Optional[float] = None

    # ---------------------------------------------------------------- costs

    def _indices(self, step: int) -> List[List[int]]:
        """The VWs' sample indices at ``step`` (as batching.virtual_worker_indices, one permutation per epoch)."""
        epoch = batching.epoch_of(step, self._size, self.job.global_batch)
        order = self._orders.get(epoch)
        if order is None:
            order = batching.epoch_permutation(self.job.seed, epoch, self._size)
            _remember(self._orders, epoch, order, 2)
        batch = batching.batch_in_order(order, step, self._size, self.job.global_batch)
        return batching.split_global_batch(batch, self.job.virtual_workers)

    def raw_costs(self, step: int) -> Tuple[float, ...]:
        """Each VW's summed sample cost at ``step``, in the user's units."""
        return self._step_costs(step)[0]

    def _step_costs(self, step: int) -> Tuple[Tuple[float, ...], Tuple[float, ...]]:
        cached = self._costs.get(step)
        if cached is None:
            raw = tuple(math.fsum(sample_costs(self.job, indices, step)) for indices in self._indices(step))
            scale = self.scale()
            cached = (raw, tuple(cost / scale for cost in raw))
            _remember(self._costs, step, cached, _CACHED_STEPS)
        return cached

    def scale(self) -> float:
        """The cost unit: the mean VW cost of step 0 (1.0 if that is 0)."""
        if self._scale is None:
            mean = math.fsum(math.fsum(sample_costs(self.job, indices, 0)) for indices in self._indices(0))
            mean /= self.job.virtual_workers
            self._scale = mean if mean > 0.0 else 1.0
        return self._scale

    # ---------------------------------------------------------------- plans

    def assignment(self, step: int, members: Sequence[str]) -> cost_balance.Assignment:
        """For each member (rank order), the VW ids it runs at ``step``, under the planned rates."""
        members = tuple(members)
        rates = tuple(cost_rates.planning_seconds(self.rates, members))
        key = (step, members, rates)
        plan = self._plans.get(key)
        if plan is None:
            plan = cost_balance.cost_assignment(self._step_costs(step)[1], rates)
            _remember(self._plans, key, plan, 2 * _CACHED_STEPS)
        return plan

    def observe(
        self, step: int, members: Sequence[str], assignment: cost_balance.Assignment, busy_seconds: Sequence[float]
    ) -> str:
        """Fold a committed step into the rates; returns the rebalance event's detail, or "".

        A first planned rate (the start, a joiner) is not a move; a move of a
        member's planned rate changes the plans of the steps after this one,
        and is said as the planned relative speeds before and after.
        """
        members = tuple(members)
        before = self.rates
        measured = cost_rates.observe_costs(self.rates, members, assignment, self._step_costs(step)[1], busy_seconds)
        # Compared on the next step's costs, where the current plan (the one the loader
        # prefetches along, cached) would run.
        following = step + 1
        if self.total_steps is not None and following >= self.total_steps:
            self.rates = measured  # the last step: no plan follows it
            return ""
        self.rates = cost_rates.replan(
            measured, members, self._step_costs(following)[1], self.assignment(following, members)
        )
        moved = any(
            device in before.planned and self.rates.planned[device] != before.planned[device] for device in members
        )
        return describe_move(_speeds(before, members), _speeds(self.rates, members)) if moved else ""

    def observe_step(self, record: dict, step: int, members: Sequence[str], sets, busy_seconds) -> str:
        """A committed step: its costs and VW sets into its `record`, its busy times into the rates
        (`observe`). Returns the rebalance event's detail when a planned rate moved, else ""."""
        record["cost"] = self.device_costs(step, sets)
        record["virtual_worker_sets"] = [list(virtual_workers) for virtual_workers in sets]
        return self.observe(step, members, sets, busy_seconds)

    def device_costs(self, step: int, assignment: cost_balance.Assignment) -> List[float]:
        """The summed sample cost (user's units) each member ran at ``step``."""
        return list(cost_balance.device_costs(assignment, self.raw_costs(step)))

    def state(self) -> dict:
        return cost_rates.rates_to_dict(self.rates)

    def restore(self, data: dict) -> None:
        self.rates = cost_rates.rates_from_dict(data)


def _remember(cache: collections.OrderedDict, key, value, size: int) -> None:
    cache[key] = value
    while len(cache) > size:
        cache.popitem(last=False)


def _speeds(rates: cost_rates.CostRates, members: Sequence[str]) -> List[float]:
    """Planned relative speeds of ``members`` (the fastest 1.0), for people."""
    seconds = cost_rates.planning_seconds(rates, members)
    fastest = min(seconds)
    return [fastest / value for value in seconds]


def describe_move(before: Sequence[float], after: Sequence[float]) -> str:
    """The detail of a rebalance event in cost mode: planned relative speeds before and after."""

    def text(speeds):
        return "[" + ", ".join(f"{speed:.2f}" for speed in speeds) + "]"

    return f"relative speeds {text(before)} -> {text(after)} (balancing by cost)"
