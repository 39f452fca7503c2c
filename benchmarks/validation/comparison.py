"""A predicted figure against its measurement, and the verdict over all of them (pure)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from flexpar.sim import relative_error

GOAL = 0.15
FLOOR_S = 0.25
"""A row's error is in units of max(measured, FLOOR_S): a 25 ms stall predicted as 50 ms is 0.1, not 100%
(issue 49: a boundary of milliseconds is judged against what a cluster plan can feel)."""


@dataclass
class Comparison:
    """One predicted figure against its measurement."""

    figure: str
    predicted: float | None
    measured: float | None
    counted: bool
    model: str  # what the prediction is made of
    # Where the measured median could have landed with another draw of as many
    # single changes (`median_interval`); None where the figure is not a median of changes.
    measured_interval: tuple | None = None
    # The error's unit: max(measured, floor) (FLOOR_S for seconds; 0 for counts: plain relative error).
    floor: float = FLOOR_S
    goal: float = GOAL  # this row's own goal (the members' lost time: 0.25)
    relative_error: float | None = field(init=False)

    def __post_init__(self) -> None:
        self.relative_error = error_of(self.predicted, self.measured, self.floor)


def error_of(predicted: float | None, measured: float | None, floor: float = 0.0) -> float | None:
    """|predicted - measured| / max(|measured|, floor); None when either is missing or the unit is 0."""
    if predicted is None or measured is None or max(abs(measured), floor) == 0:
        return None
    if not (math.isfinite(predicted) and math.isfinite(measured)):
        return None
    if abs(measured) < floor:
        return abs(predicted - measured) / floor
    return relative_error(predicted, measured)


def verdict(comparisons: Sequence[Comparison], goal: float = GOAL) -> dict:
    """The headline: the largest relative error of the counted rows, and whether the goal holds.

    A counted row without a relative error (a missing input, or a measured 0)
    makes the goal not met: it cannot be shown to hold.
    """
    counted = [row for row in comparisons if row.counted]
    own = [row for row in counted if row.goal == GOAL]  # the rows held to the common goal
    errors = [row.relative_error for row in own if row.relative_error is not None]
    every = [row.relative_error for row in comparisons if row.relative_error is not None]
    undefined = [row.figure for row in counted if row.relative_error is None]
    worst = max(errors) if errors else None
    row_goal = {row.figure: (goal if row.goal == GOAL else row.goal) for row in counted}
    over = [
        row.figure for row in counted if row.relative_error is not None and row.relative_error > row_goal[row.figure]
    ]
    return {
        "max_relative_error": worst,
        "max_relative_error_all_rows": max(every) if every else None,
        "goal": f"<= {goal:g} in units of max(measured, {FLOOR_S:g} s); rows with their own goal: "
        + (", ".join(f"{row.figure} <= {row.goal:g}" for row in counted if row.goal != GOAL) or "none"),
        "goal_met": bool(counted) and not undefined and not over,
        "rows_over_goal": over,
        "rows_without_error": undefined,
    }


def median_interval(
    values: Sequence[float], coverage: float = 0.9, resamples: int = 4000, seed: int = 0
) -> tuple | None:
    """Bootstrap interval of the median of `values`: (low, high) holding `coverage` of resampled medians.

    A measured stall is the median over a run's single changes, and those
    spread widely (a scale-in read 2 to 11 ms in one run): this says how far
    that median could move with another draw of as many changes, i.e. how
    finely the measurement itself can judge a prediction. None with fewer
    than 3 values. Deterministic for a given seed.
    """
    if len(values) < 3:
        return None
    draws = np.random.default_rng(seed).choice(np.asarray(values, dtype=float), size=(resamples, len(values)))
    medians = np.median(draws, axis=1)
    tail = (1.0 - coverage) / 2.0
    low, high = np.quantile(medians, [tail, 1.0 - tail])
    return float(low), float(high)
