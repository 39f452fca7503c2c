"""Speed-proportional load balancing: measured timings -> VW assignment.

DESIGN.md section 5. Every device runs these functions on the same shared
timings and must reach the same assignment bit for bit, with no central
decision. So this module is pure (no clocks, processes or sockets), and every
computation is a fixed sequence of float operations on values in rank order
and in the state: nothing depends on hash order, set iteration or dict
insertion order, and every tie is broken towards the lower rank.

The pieces:

- ``optimal_assignment``: the exact min-max split of V virtual workers (VWs)
  over devices of given speeds, every device at least one VW.
- ``observe``: folds one step's measured busy times into smoothed per-VW times
  (the interquartile mean of the raw per-VW times since the device's speed
  last changed, up to 32 of them, exponentially smoothed) and keeps each
  device's last ``NOISE_WINDOW`` raw per-VW times.
- ``next_assignment``: the most even of the splits that are as fast as the
  optimum within the measurement noise (``most_even_assignment``,
  ``tie_tolerance``; below), unless it does not beat the current split by more
  than the measurement noise (below).
- ``imbalance``: the reported figure ``(max - min) / max`` of busy time.

When the split changes (the rule)
---------------------------------

A change of split costs nothing in state, but changes which device runs which
VW and makes step times jump, and on a noisy host a rule that follows every
wobble of the measured times reshuffles every few steps (with a fixed 5%
hysteresis, two equal CPU devices of a busy 2-core host switched split 1,462
times in 5,000 steps). So for the same device set and V, the current split is
kept unless the preferred split's (the next section) predicted step time is
shorter by more than

    threshold = max(floor, min(MAXIMUM_THRESHOLD, NOISE_FACTOR * noise))
              = max(floor, min(0.5,               5 * noise))

relative to the current split's, that is unless ``preferred < (1 - threshold)
* current``. ``floor`` is ``hysteresis`` (5%) while a device whose count would
change has no measured noise (fewer than 3 raw times, or none: a state built
by hand), and ``MEASURED_HYSTERESIS_SHARE * hysteresis`` (1%) once all of them
have: then the noise term decides, and a split that is measurably 1-5% slower
(say one VW off at V = 128) no longer stays for good. ``noise`` is the largest
*standard error* among the devices whose VW count would change: for a
device, ``relative_noise(raw) / sqrt(n)``, where ``raw`` are its last
``NOISE_WINDOW`` = 32 raw per-VW times, ``relative_noise`` =
``median(|x[i] - x[i-1]|) / median(x)`` (about the
relative standard deviation of one measurement; a lasting change of speed is
one large difference and hardly moves it), and ``n`` is the number of raw
times behind its smoothed time (those measured since its speed last changed,
at most 32). So:

- noise-free or steady devices: the floor, 5% until the noise is measured,
  1% after;
- the threshold is large right after a start or a change of speed (little
  evidence) and shrinks as measurements accumulate: with uniform +-10% noise
  (``relative_noise`` about 0.058) it is 17% three steps after a start or a
  change and 5% (the floor) after 32; with +-40% (about 0.23), 50% (the cap)
  and 20%;
- a device with only 1 or 2 raw times (a start, a joiner) has no known noise:
  no change involving it is made (``change_threshold`` is infinite) until its
  third measurement; a device with none at all (a state built by hand from
  smoothed times) counts as noise-free;
- a predicted gain of more than 50% (the cap: a step at least twice as fast)
  is always taken once the noise is known.

A change of device set or of V, or a state without an assignment, always
yields the preferred split at once. A lasting change of a device's speed is seen
within two steps (``observe``: its smoothed time jumps to the new level when
the median of its last 3 raw times leaves it by more than ``max(5%, 3 *
relative_noise)``), and then moves the split at once if the gain beats the
threshold.

Near ties: the most even of the near-fastest splits
---------------------------------------------------

Measured times never tie exactly, so the fastest split is often fastest by a
hair and leaves a slow device idle for much of the step: at per-VW times 1, 1,
2, 4.08 (speeds 1, 1, 0.5, 0.245) and V = 32, (12, 12, 6, 2) takes 12 units
with imbalance 0.32, (12, 11, 6, 3) 12.24 units (2% more) with 0.10. A
difference the measurements cannot resolve is no evidence that one split is
faster, so the preferred split is the one with the smallest predicted
imbalance (``(max - min) / max`` of ``count * seconds``; ties: the shorter
step, then lower ranks take more) among those whose predicted step time is at
most ``(1 + tolerance)`` times the optimum's, with

    tolerance = min(hysteresis, NOISE_FACTOR * noise) = min(0.05, 5 * noise)

``noise`` the largest standard error of any device of the set (the noise part
of the threshold, over every device): 0 for devices without raw times (exact
ties only, the tie-break of ``optimal_assignment``), 5% while one has only 1 or
2. Above the floor a gain is acted on, so it is never a tie. The balance
benchmark's devices measure a relative noise of 0.5-2.5% a step, so the
tolerance is 1.4-5% after 3 steps and 0.5-2.2% after 32; its nominal ties
(whole-VW splits of the same 12 units, measured 0.2-1% apart) come out as
ties, and the 2% above is one when the noise is 0.4% or more per standard
error, and resolved otherwise. ``flexpar/core/balance/even_split.py`` finds that split
exactly in O((n + E) log n) (E: multiples ``k * s_i`` inside the tolerance,
about ``tolerance * V``); it only runs when a move is possible at all.

The numbers, from simulating ``observe`` -> ``next_assignment`` (the tests
check them): equal devices with multiplicative noise of +-40% (uniform) or
lognormal sigma 0.3, 2 or 3 devices, V in {4, 16, 32}, 1,000 steps: at most 4
changes of split in 720 runs (typically none; 106 in all), where the old rule
(the median of 3 measurements and a fixed 5%) made 100 to 660; speeds 1, 1,
0.5, 0.25 with V = 32 and +-10% noise: the first move comes at the fourth step
(after 3 measurements) and lands within one VW of the optimum in 299 of 300
runs (the rest get there within about 35 steps), and the split never leaves
that neighbourhood; with +-2% noise every one of 100 runs settles on a split of
imbalance 1/12 at the fourth step (the rule without near ties: half of them on
(12, 12, 6, 2), imbalance 1/3); with +-10%, 85 of 100 (47 without). At V =
128, +-2%: every run of 100 ends on the optimum (47, 47, 23, 11), by step 18
in half of them and 61 at most (the rule before, with its 5% floor and no near
ties: 21 kept a 48-unit split for good). One device becoming 2x slower is followed 2 steps after the change
with +-10% noise (3 in a few runs, 44 in 1 of 300), and typically 5 to 30 steps
after it with +-40% noise (when the estimate's standard error has become small
enough to be sure; rarely much later).

Times that are zero or negative (a coarse clock, a clock step) do not crash
anything: every per-VW time below ``MINIMUM_SECONDS_PER_VW`` is treated as
``MINIMUM_SECONDS_PER_VW``. Times that are NaN or infinite are rejected with a
``ValueError``, because no sensible assignment follows from them.
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple

from flexpar.core.balance.checks import (
    assignment_tuple,
    check_enough_virtual_workers,
    checked_count,
    device_id_tuple,
    finite_seconds,
    usable_seconds,
)
from flexpar.core.balance.noise import (
    DEFAULT_HYSTERESIS,
    MEASURED_HYSTERESIS_SHARE,
    MINIMUM_NOISE_SAMPLES,
    NOISE_FACTOR,
    NOISE_WINDOW,
    change_threshold,
    check_hysteresis,
    check_noise_factor,
    median,
    median_for_unknown,
    middle_mean,
    relative_noise_of,
    tie_tolerance,
)
from flexpar.core.balance.split import most_even, optimal_assignment, predicted_step_seconds
from flexpar.core.balance.state import BalanceState

# Seconds given to every device when none of them has a measurement yet. Any
# common value gives the uniform split; 1.0 just keeps predicted times readable.
_UNMEASURED_SECONDS_PER_VW = 1.0

SHIFT_FACTOR = 3.0
SHIFT_MINIMUM = 0.05
SHIFT_SAMPLES = 2
"""A change of speed: the median of the last SHIFT_SAMPLES + 1 raw times leaves the smoothed
time by more than max(SHIFT_MINIMUM, SHIFT_FACTOR * relative noise); the new level is then the
median of the last SHIFT_SAMPLES raw times."""


def _seconds_for_devices(state: BalanceState, device_ids: Tuple[str, ...]) -> List[float]:
    """Per-VW times for ``device_ids`` in rank order, filling in unknown devices.

    A device without a measurement (a joiner) is assumed to be as fast as the
    median measured device of this device set: its first step then measures it
    and the balancer corrects. When no device of the set is measured, all get
    the same time, which gives the uniform split.
    """
    return median_for_unknown(state.seconds_per_vw, device_ids, _UNMEASURED_SECONDS_PER_VW)


def next_assignment(
    state: BalanceState,
    device_ids: Sequence[str],
    virtual_workers: int,
    hysteresis: float = DEFAULT_HYSTERESIS,
    noise_factor: float = NOISE_FACTOR,
) -> Tuple[int, ...]:
    """The assignment for the next step of ``device_ids`` (rank order).

    The preferred split is the most even one (``most_even_assignment``) among
    those whose predicted step time, for the state's smoothed per-VW times, is
    within ``tie_tolerance`` of the optimum's; unknown devices are assumed at
    the median of the known ones. A change of device set, a change of V, or a
    state without an assignment yields it at once. Otherwise, to avoid
    oscillation, the current split is kept unless the preferred one's
    predicted step time is shorter by more than the measurement noise allows
    to be sure of: unless ``preferred < (1 - threshold) * current`` with
    ``threshold = change_threshold(...)``, whose floor is ``hysteresis`` or,
    when every device whose count would change has measured noise (3 raw
    times or more), ``MEASURED_HYSTERESIS_SHARE * hysteresis``. The module
    docstring gives the rule and the numbers.
    """
    device_ids = device_id_tuple(device_ids, "device_ids")
    if not device_ids:
        raise ValueError("device_ids is empty; an assignment needs at least one device")
    virtual_workers = checked_count(virtual_workers, "virtual_workers", minimum=1)
    check_enough_virtual_workers(virtual_workers, len(device_ids))
    hysteresis = check_hysteresis(hysteresis)
    noise_factor = check_noise_factor(noise_factor)

    seconds = _seconds_for_devices(state, device_ids)
    optimum = optimal_assignment(seconds, virtual_workers)
    current = state.assignment
    if device_ids != state.device_ids or sum(current) != virtual_workers:
        return most_even(seconds, virtual_workers, optimum, tie_tolerance(state, device_ids, hysteresis, noise_factor))
    current_seconds = predicted_step_seconds(current, seconds)
    # The common case, decided without the noise: nothing beats the current split by
    # even the smallest floor (the preferred split is never faster than the optimum).
    if not predicted_step_seconds(optimum, seconds) < (1.0 - MEASURED_HYSTERESIS_SHARE * hysteresis) * current_seconds:
        return current
    preferred = most_even(seconds, virtual_workers, optimum, tie_tolerance(state, device_ids, hysteresis, noise_factor))
    if preferred == current:
        return current
    floor = hysteresis
    if all(
        len(state.recent.get(device_id, ())) >= MINIMUM_NOISE_SAMPLES
        for device_id, before, after in zip(device_ids, current, preferred)
        if before != after
    ):
        floor = MEASURED_HYSTERESIS_SHARE * hysteresis
    threshold = change_threshold(state, device_ids, current, preferred, floor, noise_factor)
    if predicted_step_seconds(preferred, seconds) < (1.0 - threshold) * current_seconds:
        return preferred
    return current


def _changed_speed(measurements: Sequence[float], smoothed: float) -> bool:
    """True when the newest measurements left the smoothed time by far more than their noise.

    Compares the median of the last ``SHIFT_SAMPLES + 1`` measurements (so one
    hiccup never counts) with the smoothed time: a change of more than
    ``max(SHIFT_MINIMUM, SHIFT_FACTOR * relative_noise)`` relative is a new
    speed, not noise.
    """
    if len(measurements) < MINIMUM_NOISE_SAMPLES:
        return False
    change = abs(median(measurements[-(SHIFT_SAMPLES + 1) :]) - smoothed)
    if change <= SHIFT_MINIMUM * smoothed:
        return False  # the common case, decided without sorting the window
    return change > SHIFT_FACTOR * relative_noise_of(measurements) * smoothed


def observe(
    state: BalanceState,
    device_ids: Sequence[str],
    assignment: Sequence[int],
    busy_seconds: Sequence[float],
    smoothing: float = 0.5,
    window: int = NOISE_WINDOW,
    work: Optional[Sequence[float]] = None,
) -> BalanceState:
    """Fold one step's measurements into a new state.

    ``busy_seconds[i]`` is the compute time device ``device_ids[i]`` spent on
    its ``assignment[i]`` VWs (not time waiting in collectives). Its raw
    per-VW time is ``busy_seconds[i] / assignment[i]`` (floored at
    ``MINIMUM_SECONDS_PER_VW``); the last ``NOISE_WINDOW`` of them are kept in
    ``recent``. What is smoothed is the interquartile mean (the mean of the
    middle half; the median below 4 values) of the raw times measured since
    the device's speed last changed, at most ``window`` of them: ``smoothing *
    that + (1 - smoothing) * old``; a device seen for the first time takes it
    as is. ``smoothing=1`` trusts only the latest such mean. Devices
    not in ``device_ids`` keep their old values. The returned state records
    ``device_ids`` and ``assignment`` as the last assignment.

    Outliers and changes of speed: one step slowed by a hiccup of the host
    moves neither that mean nor the check below. When the median of the
    newest ``SHIFT_SAMPLES + 1`` raw times differs from the smoothed time by
    more than ``max(SHIFT_MINIMUM, SHIFT_FACTOR * noise)`` relative (see the
    module docstring), the device's speed has changed: the smoothed time is
    set to the median of the newest ``SHIFT_SAMPLES`` raw times at once and
    the older ones stop counting for it. So a lasting change shows fully
    after ``SHIFT_SAMPLES`` steps, while in a steady state the mean of up to
    ``window`` raw times keeps the estimate (and so the split) quiet: its noise
    is about the raw noise / sqrt(n), which ``change_threshold`` relies on.
    ``window=1`` smooths the raw values.

    ``work`` (balancing by cost, flexpar/core/cost_balance/): the units of work
    each device ran, finite and > 0, in place of its VW count; the raw value
    is then ``busy_seconds[i] / work[i]`` (seconds per unit of work) and
    ``seconds_per_vw`` holds those. ``assignment`` is still recorded.
    """
    device_ids = device_id_tuple(device_ids, "device_ids")
    counts = assignment_tuple(assignment, "assignment", minimum=1)
    busy = [finite_seconds(value, f"busy_seconds[{index}]") for index, value in enumerate(busy_seconds)]
    if not (len(device_ids) == len(counts) == len(busy)):
        raise ValueError(
            f"device_ids ({len(device_ids)}), assignment ({len(counts)}) and busy_seconds ({len(busy)}) "
            "must have one entry per device"
        )
    weight = finite_seconds(smoothing, "smoothing")
    if not 0.0 < weight <= 1.0:
        raise ValueError(f"smoothing={weight} must be above 0 and at most 1 (it is the weight of the new measurement)")
    window = checked_count(window, "window", minimum=1)
    units = counts if work is None else _work_list(work, len(counts))

    kept = max(window, NOISE_WINDOW)
    seconds = dict(state.seconds_per_vw)
    recent = dict(state.recent)
    steady = dict(state.steady)
    for device_id, count, device_busy in zip(device_ids, units, busy):
        earlier = recent.get(device_id, ())
        values = (earlier + (usable_seconds(device_busy / count),))[-kept:]
        level = min(steady.get(device_id, len(earlier)) + 1, len(values))
        old = seconds.get(device_id)
        if old is not None and _changed_speed(values, old):
            level = min(SHIFT_SAMPLES, len(values))
            seconds[device_id] = median(values[-level:])
        else:
            measured = middle_mean(values[-min(level, window) :])
            seconds[device_id] = measured if old is None else weight * measured + (1.0 - weight) * old
        recent[device_id] = values
        steady[device_id] = level
    return BalanceState._trusted(seconds, device_ids, counts, recent, steady)


def _work_list(work: Sequence[Any], devices: int) -> List[float]:
    """``observe``'s ``work``: one finite amount > 0 per device."""
    amounts = [finite_seconds(value, f"work[{index}]") for index, value in enumerate(work)]
    if len(amounts) != devices:
        raise ValueError(f"work has {len(amounts)} entries for {devices} devices; give one per device")
    for index, amount in enumerate(amounts):
        if not amount > 0.0:
            raise ValueError(f"work[{index}]={amount} must be above 0 (a device that did no work has no rate)")
    return amounts
