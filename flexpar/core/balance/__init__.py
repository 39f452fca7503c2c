"""Speed-proportional load balancing: measured timings -> VW assignment (DESIGN.md section 5).

Every device runs these functions on the same shared timings and must reach
the same assignment bit for bit, with no central decision: all of it is pure
(no clocks, processes or sockets), a fixed sequence of float operations on
values in rank order, every tie broken towards the lower rank.

This package's face is what the rest of flexpar calls
(`from flexpar.core import balance; balance.next_assignment(...)`); its pieces:

- `rule.py`: when the split changes (``next_assignment``) and how measured
  busy times fold into smoothed per-VW times (``observe``); its docstring
  states the rule and its numbers;
- `split.py`: the exact min-max split (``optimal_assignment``), the most even
  split within a tolerance of it (``most_even_assignment``, with
  `even_split.py`), ``predicted_step_seconds`` and ``imbalance``;
- `noise.py`: the measurement noise and the thresholds built on it;
- `state.py`: ``BalanceState`` and its plain-dict form;
- `checks.py`: input checks, and the floor for per-VW times.

Balancing by per-sample cost is flexpar/core/cost_balance/.
"""

from flexpar.core.balance.checks import MINIMUM_SECONDS_PER_VW
from flexpar.core.balance.noise import (
    DEFAULT_HYSTERESIS,
    MAXIMUM_THRESHOLD,
    MEASURED_HYSTERESIS_SHARE,
    MINIMUM_NOISE_SAMPLES,
    NOISE_FACTOR,
    NOISE_WINDOW,
    change_threshold,
    noise_known,
    noise_threshold,
    relative_noise,
    standard_error,
    tie_tolerance,
)
from flexpar.core.balance.rule import SHIFT_FACTOR, SHIFT_MINIMUM, SHIFT_SAMPLES, next_assignment, observe
from flexpar.core.balance.split import imbalance, most_even_assignment, optimal_assignment, predicted_step_seconds
from flexpar.core.balance.state import BalanceState, state_from_dict, state_to_dict

__all__ = [
    "BalanceState",
    "DEFAULT_HYSTERESIS",
    "MAXIMUM_THRESHOLD",
    "MEASURED_HYSTERESIS_SHARE",
    "MINIMUM_NOISE_SAMPLES",
    "MINIMUM_SECONDS_PER_VW",
    "NOISE_FACTOR",
    "NOISE_WINDOW",
    "SHIFT_FACTOR",
    "SHIFT_MINIMUM",
    "SHIFT_SAMPLES",
    "change_threshold",
    "imbalance",
    "most_even_assignment",
    "next_assignment",
    "noise_known",
    "noise_threshold",
    "observe",
    "optimal_assignment",
    "predicted_step_seconds",
    "relative_noise",
    "standard_error",
    "state_from_dict",
    "state_to_dict",
    "tie_tolerance",
]
