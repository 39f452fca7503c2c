"""A predicted figure against its measurement, and the verdict over all of them (pure)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from flexpar.sim import relative_error

GOAL = 0.15


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
    relative_error: float | None = field(init=False)

    def __post_init__(self) -> None:
        self.relative_error = error_of(self.predicted, self.measured)


def error_of(predicted: float | None, measured: float | None) -> float | None:
    """|predicted - measured| / |measured|; None when either is missing or the measurement is 0."""
    if predicted is None or measured is None or measured == 0:
        return None
    if not (math.isfinite(predicted) and math.isfinite(measured)):
        return None
    return relative_error(predicted, measured)


def verdict(comparisons: Sequence[Comparison], goal: float = GOAL) -> dict:
    """The headline: the largest relative error of the counted rows, and whether the goal holds.

    A counted row without a relative error (a missing input, or a measured 0)
    makes the goal not met: it cannot be shown to hold.
    """
    counted = [row for row in comparisons if row.counted]
    errors = [row.relative_error for row in counted if row.relative_error is not None]
    every = [row.relative_error for row in comparisons if row.relative_error is not None]
    undefined = [row.figure for row in counted if row.relative_error is None]
    worst = max(errors) if errors else None
    return {
        "max_relative_error": worst,
        "max_relative_error_all_rows": max(every) if every else None,
        "goal": f"<= {goal:g}",
        "goal_met": bool(counted) and not undefined and worst is not None and worst <= goal,
        "rows_over_goal": [
            row.figure for row in counted if row.relative_error is not None and row.relative_error > goal
        ],
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
