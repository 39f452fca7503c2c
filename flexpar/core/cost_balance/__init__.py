"""Balancing by per-sample cost: VW costs and device rates -> which VWs each device runs.

With ``Job(sample_cost=FN)``, a virtual worker's (VW's) cost at a step is the
sum of ``FN(index)`` over its samples (for text, its token count), and a
device's rate is its measured seconds per unit of cost. The predicted time of
a device is ``rate * (cost of its VWs)``; this package picks, for each step,
the set of VWs each device runs so that the slowest device finishes first. Any
set, not only a contiguous range: with variable costs, contiguous ranges of
equal count leave equally fast devices waiting on each other.

Every device computes the assignment from the same floats and must get the
same sets bit for bit, with no central decision. So this package is pure (no
clocks, processes or sockets), and everything is a fixed sequence of float
operations over lists in VW or rank order: no set or dict iteration, every tie
broken towards the lower VW id or rank. A device's load is ``math.fsum`` of
its VWs' costs (exactly rounded, so independent of the order they were added
in), and the step time compared between candidates is that load times the
rate: the same number on every device.

The pieces (this package's face re-exports what the rest of flexpar calls):

- `search.py`: ``cost_assignment``, every VW exactly once, every device at
  least one (its docstring has the method);
- `costs.py`: the checks of costs, ``predicted_step_seconds``,
  ``device_costs``, ``count_based_sets`` (the count balancer's contiguous
  split, the baseline the search never does worse than);
- `rates.py`: the rates it takes, learned from busy times and frozen for
  planning (``CostRates``).

A worker's side of it (caches, the rates in the training state) is
flexpar/worker/cost_planner.py.
"""

from flexpar.core.cost_balance.costs import (
    Assignment,
    checked_costs,
    count_based_sets,
    device_costs,
    predicted_step_seconds,
    sample_cost_value,
)
from flexpar.core.cost_balance.rates import (
    CostRates,
    observe_costs,
    planning_seconds,
    rates_from_dict,
    rates_to_dict,
    replan,
)
from flexpar.core.cost_balance.search import (
    EXHAUSTIVE_NODES,
    LOCAL_SEARCH_ROUNDS,
    NODE_BUDGET,
    cost_assignment,
    cost_assignment_with_proof,
)

__all__ = [
    "Assignment",
    "CostRates",
    "EXHAUSTIVE_NODES",
    "LOCAL_SEARCH_ROUNDS",
    "NODE_BUDGET",
    "checked_costs",
    "cost_assignment",
    "cost_assignment_with_proof",
    "count_based_sets",
    "device_costs",
    "observe_costs",
    "planning_seconds",
    "predicted_step_seconds",
    "rates_from_dict",
    "rates_to_dict",
    "replan",
    "sample_cost_value",
]
