"""The measurement noise of per-VW times, and the thresholds a change of split must beat.

``rule.py``'s docstring explains the rule these numbers feed; here are the
medians, the relative noise of a device's raw times, its standard error, the
change threshold and the tie tolerance.
"""

from __future__ import annotations

import math
from typing import Any, List, Mapping, Sequence

from flexpar.core.balance.checks import device_id_tuple, finite_seconds, usable_seconds
from flexpar.core.balance.state import BalanceState

DEFAULT_HYSTERESIS = 0.05
"""The fixed floor of the change threshold: a relative gain of the predicted step time."""

NOISE_FACTOR = 5.0
"""How many standard errors of a device's smoothed time a change of split must beat."""

MAXIMUM_THRESHOLD = 0.5
"""Cap of the noise part of the threshold: a predicted gain above 50% is always taken."""

NOISE_WINDOW = 32
"""Raw per-VW times kept per device (``BalanceState.recent``); the noise is measured on them."""

MINIMUM_NOISE_SAMPLES = 3
"""Raw times a device needs before its noise counts as known."""

MEASURED_HYSTERESIS_SHARE = 0.2
"""The floor of the change threshold for a move whose devices all have measured noise:
this share of ``hysteresis`` (1% by default); the full ``hysteresis`` otherwise."""


def median(values: Sequence[float]) -> float:
    """Median by sorting; the mean of the two middle values for an even count."""
    ordered = sorted(values)
    middle = len(ordered) // 2
    if len(ordered) % 2:
        return ordered[middle]
    return (ordered[middle - 1] + ordered[middle]) / 2


def median_for_unknown(values: Mapping[str, float], device_ids: Sequence[str], fallback: float) -> List[float]:
    """Each device's value in rank order; a device without one gets the median of the known ones of
    ``device_ids``, and every device gets ``fallback`` when none of them is known."""
    known = [values[device_id] for device_id in device_ids if device_id in values]
    filler = median(known) if known else fallback
    return [values.get(device_id, filler) for device_id in device_ids]


def middle_mean(values: Sequence[float]) -> float:
    """The interquartile mean: the mean of the middle half of the sorted values (the median below 4).

    Robust like the median (a hiccup in a quarter of the values moves it
    little), but it uses half the values, so its own noise is close to the
    mean's: about sigma / sqrt(n) for uniform or normal noise, where the
    median's is 1.25 to 1.7 times that.
    """
    ordered = sorted(values)
    if len(ordered) < 4:
        return median(ordered)
    quarter = len(ordered) // 4
    middle = ordered[quarter : len(ordered) - quarter]
    return math.fsum(middle) / len(middle)


def check_hysteresis(hysteresis: Any) -> float:
    value = finite_seconds(hysteresis, "hysteresis")
    if not 0.0 <= value < 1.0:
        raise ValueError(f"hysteresis={value} must be at least 0 and below 1 (it is a relative improvement)")
    return value


def check_noise_factor(noise_factor: Any) -> float:
    value = finite_seconds(noise_factor, "noise_factor")
    if not value >= 0.0:
        raise ValueError(f"noise_factor={value} must be at least 0 (it multiplies the measured noise)")
    return value


def relative_noise(measurements: Sequence[float]) -> float:
    """The relative noise of one device's raw per-VW times, oldest first.

    ``median(|x[i] - x[i-1]|) / median(x)``: the typical change from one
    step's measurement to the next, as a share of the typical measurement.
    For independent noise of relative standard deviation sigma it is about
    0.95 sigma (normal noise) or 1.0 sigma (uniform noise); a lasting change
    of speed inside the window is a single large difference and hardly moves
    the median, so a real slowdown does not inflate the threshold that has to
    let it through. 0.0 with fewer than ``MINIMUM_NOISE_SAMPLES`` values
    (``change_threshold`` treats such a device as not yet known).
    """
    return relative_noise_of(
        [usable_seconds(finite_seconds(value, f"measurements[{index}]")) for index, value in enumerate(measurements)]
    )


def relative_noise_of(values: Sequence[float]) -> float:
    """``relative_noise`` of values already checked and floored (those of a state)."""
    if len(values) < MINIMUM_NOISE_SAMPLES:
        return 0.0
    changes = [abs(later - earlier) for earlier, later in zip(values, values[1:])]
    return median(changes) / median(values)


def noise_known(state: BalanceState, device_ids: Sequence[str]) -> bool:
    """True unless a device of ``device_ids`` has only 1 or 2 raw times in the state.

    While this is False, ``next_assignment`` keeps the current split for
    every move that involves such a device, and one more measurement can lift
    that (the simulator checks it before it skips identical steps).
    """
    for device_id in device_id_tuple(device_ids, "device_ids"):
        if 0 < len(state.recent.get(device_id, ())) < MINIMUM_NOISE_SAMPLES:
            return False
    return True


def change_threshold(
    state: BalanceState,
    device_ids: Sequence[str],
    current: Sequence[int],
    proposed: Sequence[int],
    hysteresis: float = DEFAULT_HYSTERESIS,
    noise_factor: float = NOISE_FACTOR,
) -> float:
    """The relative gain of predicted step time a move from ``current`` to ``proposed`` must beat.

    ``max(hysteresis, min(MAXIMUM_THRESHOLD, noise_factor * noise))`` (the
    module docstring explains it), where ``noise`` is the largest standard
    error ``relative_noise(recent) / sqrt(n)`` among the devices whose counts
    differ between the two splits (``n``: the raw times behind the device's
    smoothed time, ``BalanceState.steady``). ``math.inf`` when one of them
    has only 1 or 2 raw times (its noise is not known yet, so the split
    waits); a device without any counts as noise-free.
    """
    hysteresis = check_hysteresis(hysteresis)
    noise_factor = check_noise_factor(noise_factor)
    device_ids = device_id_tuple(device_ids, "device_ids")
    noise = 0.0
    for device_id, before, after in zip(device_ids, current, proposed):
        if before == after:
            continue
        error = standard_error(state, device_id)
        if math.isinf(error):
            return math.inf
        noise = max(noise, error)
    return noise_threshold(noise, hysteresis, noise_factor)


def noise_threshold(noise: float, floor: float, noise_factor: float = NOISE_FACTOR) -> float:
    """``max(floor, min(MAXIMUM_THRESHOLD, noise_factor * noise))``: the gain a move must beat.

    The one form of the rule, shared by the count split (``change_threshold``)
    and the cost balancer's planned rates (``flexpar.core.cost_balance.rates.replan``).
    """
    return max(floor, min(MAXIMUM_THRESHOLD, noise_factor * noise))


def standard_error(state: BalanceState, device_id: str) -> float:
    """The relative standard error of ``device_id``'s smoothed time: ``relative_noise(recent) / sqrt(n)``.

    ``n`` is the number of raw times behind the smoothed one (``steady``).
    0.0 for a device without raw times (a state built by hand: noise-free),
    ``math.inf`` for one with only 1 or 2 (its noise is not known yet).
    """
    measurements = state.recent.get(device_id, ())
    if not measurements:
        return 0.0
    if len(measurements) < MINIMUM_NOISE_SAMPLES:
        return math.inf
    behind = min(state.steady.get(device_id, len(measurements)), len(measurements))
    return relative_noise_of(measurements) / math.sqrt(max(1, behind))


def tie_tolerance(
    state: BalanceState,
    device_ids: Sequence[str],
    hysteresis: float = DEFAULT_HYSTERESIS,
    noise_factor: float = NOISE_FACTOR,
) -> float:
    """How much longer a split's predicted step time may be than the optimum's and still count as a tie.

    ``min(hysteresis, noise_factor * noise)``, where ``noise`` is the largest
    ``standard_error`` among ``device_ids``: the noise part of the change
    threshold, over every device of the set. A difference the measurements
    cannot resolve is no evidence that one split is faster; above
    ``hysteresis`` the change rule would act on it, so it is no tie. 0.0 for
    devices without raw times (exact ties only), ``hysteresis`` while one has
    only 1 or 2. The module docstring gives the numbers.
    """
    hysteresis = check_hysteresis(hysteresis)
    noise_factor = check_noise_factor(noise_factor)
    noise = max(standard_error(state, device_id) for device_id in device_id_tuple(device_ids, "device_ids"))
    if math.isinf(noise):
        return hysteresis  # (noise_factor 0 would make 0 * inf a NaN)
    return min(hysteresis, noise_factor * noise)
