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
error, and resolved otherwise. ``flexpar/even_split.py`` finds that split
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

import heapq
import math
import operator
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from flexpar.core.even_split import most_even_split

MINIMUM_SECONDS_PER_VW = 1e-9
"""Floor for a per-VW time. Non-positive or smaller measured times count as this.

One nanosecond is far below any real VW's compute time, so the floor only ever
applies to broken measurements, and it keeps every product ``count * seconds``
positive and finite.
"""

# Seconds given to every device when none of them has a measurement yet. Any
# common value gives the uniform split; 1.0 just keeps predicted times readable.
_UNMEASURED_SECONDS_PER_VW = 1.0

_STATE_KEYS = ("seconds_per_vw", "device_ids", "assignment")
_OPTIONAL_STATE_KEYS = ("recent", "steady")

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

SHIFT_FACTOR = 3.0
SHIFT_MINIMUM = 0.05
SHIFT_SAMPLES = 2
"""A change of speed: the median of the last SHIFT_SAMPLES + 1 raw times leaves the smoothed
time by more than max(SHIFT_MINIMUM, SHIFT_FACTOR * relative noise); the new level is then the
median of the last SHIFT_SAMPLES raw times."""


# --------------------------------------------------------------------------
# input validation (small helpers so that every error shows the numbers)
# --------------------------------------------------------------------------


def _finite_seconds(value: Any, what: str) -> float:
    """``value`` as a float; ValueError unless it is a finite real number."""
    if isinstance(value, (str, bytes, bool)):
        raise ValueError(f"{what}={value!r} is not a number of seconds")
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{what}={value!r} is not a number of seconds") from None
    if not math.isfinite(seconds):
        raise ValueError(f"{what}={seconds!r} is not finite; timings must be finite numbers of seconds")
    return seconds


def _usable_seconds(seconds: float) -> float:
    """Apply the documented floor: anything below the minimum counts as the minimum."""
    return seconds if seconds > MINIMUM_SECONDS_PER_VW else MINIMUM_SECONDS_PER_VW


def _seconds_list(values: Sequence[Any], what: str) -> List[float]:
    """Finite, floored per-VW times in the given (rank) order."""
    return [_usable_seconds(_finite_seconds(value, f"{what}[{index}]")) for index, value in enumerate(values)]


def _count(value: Any, what: str, minimum: int) -> int:
    """``value`` as an int >= ``minimum``; floats and bools are refused, not rounded."""
    if isinstance(value, bool):
        raise ValueError(f"{what}={value!r} is not an integer")
    try:
        count = operator.index(value)
    except TypeError:
        raise ValueError(f"{what}={value!r} is not an integer") from None
    if count < minimum:
        raise ValueError(f"{what}={count} is below the minimum of {minimum}")
    return count


def _device_id_tuple(device_ids: Sequence[Any], what: str) -> Tuple[str, ...]:
    """Device ids as a tuple of distinct strings, order kept (it is the rank order)."""
    if isinstance(device_ids, str):
        raise ValueError(f"{what}={device_ids!r} must be a sequence of device ids, not one string")
    result = tuple(device_ids)
    for index, device_id in enumerate(result):
        if not isinstance(device_id, str):
            raise ValueError(f"{what}[{index}]={device_id!r} is not a string device id")
    if len(set(result)) != len(result):
        repeated = sorted({device_id for device_id in result if result.count(device_id) > 1})
        raise ValueError(f"{what} name a device more than once: {repeated}")
    return result


def _check_enough_virtual_workers(virtual_workers: int, device_count: int) -> None:
    if virtual_workers < device_count:
        raise ValueError(
            f"virtual_workers={virtual_workers} is fewer than the {device_count} devices; "
            "every device needs at least one virtual worker"
        )


def _assignment_tuple(assignment: Sequence[Any], what: str, minimum: int) -> Tuple[int, ...]:
    return tuple(_count(count, f"{what}[{index}]", minimum) for index, count in enumerate(assignment))


# --------------------------------------------------------------------------
# state
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class BalanceState:
    """What the balancer remembers between steps. Immutable; replaced, not edited.

    ``seconds_per_vw`` holds the smoothed compute seconds per VW of every device
    ever observed (device ids are never reused within a job, so entries of
    departed devices are harmless; they are kept so that a state stays valid
    whatever device set asks about it). It is stored as a read-only mapping in
    sorted key order; values below ``MINIMUM_SECONDS_PER_VW`` are stored as the
    minimum. ``device_ids`` and ``assignment`` are the device set and
    assignment of the last step, aligned by rank; both empty before the first.

    ``recent`` holds each observed device's last ``NOISE_WINDOW`` raw per-VW
    times, oldest first: its noise is measured on them. ``steady`` says how
    many of the newest of them were taken since the device's speed last
    changed (a device missing there counts all of them). Both are empty in a
    state built by hand from smoothed times, which then count as noise-free.
    """

    seconds_per_vw: Mapping[str, float] = field(default_factory=dict)
    device_ids: Tuple[str, ...] = ()
    assignment: Tuple[int, ...] = ()
    recent: Mapping[str, Tuple[float, ...]] = field(default_factory=dict)
    steady: Mapping[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        seconds: Dict[str, float] = {}
        for device_id in sorted(_device_id_tuple(list(self.seconds_per_vw), "seconds_per_vw keys")):
            value = _finite_seconds(self.seconds_per_vw[device_id], f"seconds_per_vw[{device_id!r}]")
            seconds[device_id] = _usable_seconds(value)
        device_ids = _device_id_tuple(self.device_ids, "device_ids")
        assignment = _assignment_tuple(self.assignment, "assignment", minimum=1)
        if len(assignment) != len(device_ids):
            raise ValueError(
                f"assignment has {len(assignment)} entries but device_ids has {len(device_ids)}; "
                "they must be aligned by rank"
            )
        recent = {}
        for device_id in sorted(_device_id_tuple(list(self.recent), "recent keys")):
            values = self.recent[device_id]
            if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
                raise ValueError(f"recent[{device_id!r}]={values!r} must be a sequence of seconds")
            recent[device_id] = tuple(
                _usable_seconds(_finite_seconds(value, f"recent[{device_id!r}][{index}]"))
                for index, value in enumerate(values)
            )
        steady = {
            device_id: _count(self.steady[device_id], f"steady[{device_id!r}]", minimum=0)
            for device_id in sorted(_device_id_tuple(list(self.steady), "steady keys"))
        }
        # Frozen: the normalised values go in through object.__setattr__.
        object.__setattr__(self, "seconds_per_vw", MappingProxyType(seconds))
        object.__setattr__(self, "device_ids", device_ids)
        object.__setattr__(self, "assignment", assignment)
        object.__setattr__(self, "recent", MappingProxyType(recent))
        object.__setattr__(self, "steady", MappingProxyType(steady))

    @classmethod
    def _trusted(cls, seconds_per_vw, device_ids, assignment, recent, steady) -> "BalanceState":
        """A state from values that are already checked (``observe``'s): no second validation.

        Checking every kept raw time again would cost most of ``observe`` at
        a thousand devices. The mappings are stored in sorted key order, as
        ``__post_init__`` stores them.
        """
        state = object.__new__(cls)
        for name, mapping in (("seconds_per_vw", seconds_per_vw), ("recent", recent), ("steady", steady)):
            object.__setattr__(state, name, MappingProxyType({key: mapping[key] for key in sorted(mapping)}))
        object.__setattr__(state, "device_ids", device_ids)
        object.__setattr__(state, "assignment", assignment)
        return state

    def __reduce__(self):
        # A mapping proxy cannot be pickled; go through the plain-dict form so
        # that a state can be pickled and deep-copied like any value.
        return (state_from_dict, (state_to_dict(self),))


def state_to_dict(state: BalanceState) -> dict:
    """The state as plain JSON-ready types (dict, list, str, int, float).

    Keys of the mappings come out sorted, so equal states give equal dicts
    and equal JSON text.
    """
    return {
        "seconds_per_vw": dict(state.seconds_per_vw),
        "device_ids": list(state.device_ids),
        "assignment": list(state.assignment),
        "recent": {device_id: list(values) for device_id, values in state.recent.items()},
        "steady": dict(state.steady),
    }


def state_from_dict(data: Mapping[str, Any]) -> BalanceState:
    """Inverse of ``state_to_dict``; ValueError naming a missing or unknown key.

    ``recent`` and ``steady`` may be missing (a state saved by an older
    flexpar): they then start empty, and fill within a few steps.
    """
    if not isinstance(data, Mapping):
        raise ValueError(f"a balance state must be a mapping, not {type(data).__name__}")
    missing = [key for key in _STATE_KEYS if key not in data]
    if missing:
        raise ValueError(f"balance state lacks the key(s) {missing}; it needs {list(_STATE_KEYS)}")
    allowed = _STATE_KEYS + _OPTIONAL_STATE_KEYS
    unknown = sorted(str(key) for key in data if key not in allowed)
    if unknown:
        raise ValueError(f"balance state has unknown key(s) {unknown}; it takes only {list(allowed)}")
    for key in ("seconds_per_vw",) + _OPTIONAL_STATE_KEYS:
        if not isinstance(data.get(key, {}), Mapping):
            raise ValueError(f"{key} must be a mapping keyed by device id, not {type(data[key]).__name__}")
    return BalanceState(
        seconds_per_vw=dict(data["seconds_per_vw"]),
        device_ids=tuple(data["device_ids"]),
        assignment=tuple(data["assignment"]),
        recent=dict(data.get("recent", {})),
        steady=dict(data.get("steady", {})),
    )


# --------------------------------------------------------------------------
# the assignment itself
# --------------------------------------------------------------------------


def optimal_assignment(seconds_per_vw: Sequence[float], virtual_workers: int) -> Tuple[int, ...]:
    """Split ``virtual_workers`` VWs over devices so that the slowest finishes first.

    Returns counts aligned with ``seconds_per_vw`` (rank order): every count is
    at least 1, they sum to ``virtual_workers``, and ``max_i(count_i *
    seconds_i)`` is as small as any such split allows. Raises ValueError when
    there are fewer VWs than devices, or a time is not a finite number.

    Method: start every device at one VW, then hand out the rest one at a time,
    each to the device whose finishing time after taking it, ``(count + 1) *
    seconds``, is smallest (ties: lower rank). Why this is optimal: device i
    holding c VWs "pays" the values 1*s_i, 2*s_i, ..., c*s_i, and its finishing
    time is the largest of them. Every split pays each device's 1*s_i, plus
    exactly V - n values of the form k*s_i with k >= 2, where device i's values
    must be taken in increasing k. The greedy pays the V - n smallest such
    values overall (each device's values increase with k, so its next one is
    always its smallest unpaid one). Any other split pays V - n such values too,
    so its largest is at least the greedy's largest; and both pay every 1*s_i.
    Hence no split has a smaller maximum.

    Cost: O(n + (V - n) log n) with a heap of one entry per device. The result
    depends only on the float products ``k * seconds`` and the ranks, so every
    device computing it from the same timings gets the same counts.
    """
    seconds = _seconds_list(seconds_per_vw, "seconds_per_vw")
    if not seconds:
        raise ValueError("seconds_per_vw is empty; an assignment needs at least one device")
    virtual_workers = _count(virtual_workers, "virtual_workers", minimum=1)
    _check_enough_virtual_workers(virtual_workers, len(seconds))

    counts = [1] * len(seconds)
    # One entry per device: (finishing time if it took one more VW, rank). The
    # rank in the tuple is the tie-break, and with one entry per rank the tuples
    # are all distinct, so the heap order is fully determined.
    next_finish = [(2 * device_seconds, rank) for rank, device_seconds in enumerate(seconds)]
    heapq.heapify(next_finish)
    for _ in range(virtual_workers - len(seconds)):
        _, rank = next_finish[0]
        counts[rank] += 1
        # Recompute as a product (not a running sum) so the value is exactly
        # (count + 1) * seconds, the same float the proof and the tests use.
        heapq.heapreplace(next_finish, ((counts[rank] + 1) * seconds[rank], rank))
    return _raise_the_minimum(counts, seconds, virtual_workers)


def _raise_the_minimum(counts: List[int], seconds: List[float], virtual_workers: int) -> Tuple[int, ...]:
    """Among splits as fast as `counts`, the one whose least busy device is busiest.

    Many splits often share the optimal step time; the greedy's tie-break
    picks one that may leave a device idle much of the step, which the
    reported imbalance then shows although nothing runs slower. Give every
    device one more VW where that stays within the optimal step time, then take
    back the surplus one VW at a time from the device that stays busiest
    without it (ties: higher rank, so lower ranks keep more, as in the greedy).
    The step time never grows.
    """
    step = max(count * device_seconds for count, device_seconds in zip(counts, seconds))
    # Each device may take at most one VW more than the greedy gave it: that covers
    # the ties the greedy breaks badly and keeps this pass O(n log n).
    caps = [count + 1 if (count + 1) * device_seconds <= step else count
            for count, device_seconds in zip(counts, seconds)]
    # A heap of (minus the busy time left after giving one back, minus rank).
    candidates = [(-(cap - 1) * seconds[rank], -rank) for rank, cap in enumerate(caps) if cap > 1]
    heapq.heapify(candidates)
    for _ in range(sum(caps) - virtual_workers):
        _, negative_rank = heapq.heappop(candidates)
        rank = -negative_rank
        caps[rank] -= 1
        if caps[rank] > 1:
            heapq.heappush(candidates, (-(caps[rank] - 1) * seconds[rank], -rank))
    return tuple(caps)


def predicted_step_seconds(assignment: Sequence[int], seconds_per_vw: Sequence[float]) -> float:
    """Predicted compute time of a step: ``max_i(assignment_i * seconds_i)``.

    Per-VW times are floored at ``MINIMUM_SECONDS_PER_VW`` exactly as in
    ``optimal_assignment``, so the two always agree on what a split costs.
    """
    counts = _assignment_tuple(assignment, "assignment", minimum=0)
    seconds = _seconds_list(seconds_per_vw, "seconds_per_vw")
    if len(counts) != len(seconds):
        raise ValueError(
            f"assignment has {len(counts)} entries but seconds_per_vw has {len(seconds)}; they must be aligned by rank"
        )
    if not counts:
        raise ValueError("assignment is empty; a step needs at least one device")
    return max(count * device_seconds for count, device_seconds in zip(counts, seconds))


def imbalance(busy_seconds: Sequence[float]) -> float:
    """The reported imbalance of one step: ``(max - min) / max`` of device busy time.

    0.0 means every device was busy equally long; values near 1.0 mean some
    device sat idle almost all step. 0.0 when the maximum is 0 (nothing was
    measured). Negative busy times (clock trouble) count as 0, which keeps the
    figure within [0, 1].
    """
    busy = [max(0.0, _finite_seconds(value, f"busy_seconds[{index}]")) for index, value in enumerate(busy_seconds)]
    if not busy:
        raise ValueError("busy_seconds is empty; imbalance needs at least one device")
    longest = max(busy)
    if longest == 0.0:
        return 0.0
    return (longest - min(busy)) / longest


def _median(values: Sequence[float]) -> float:
    """Median by sorting; the mean of the two middle values for an even count."""
    ordered = sorted(values)
    middle = len(ordered) // 2
    if len(ordered) % 2:
        return ordered[middle]
    return (ordered[middle - 1] + ordered[middle]) / 2


def _middle_mean(values: Sequence[float]) -> float:
    """The interquartile mean: the mean of the middle half of the sorted values (the median below 4).

    Robust like the median (a hiccup in a quarter of the values moves it
    little), but it uses half the values, so its own noise is close to the
    mean's: about sigma / sqrt(n) for uniform or normal noise, where the
    median's is 1.25 to 1.7 times that.
    """
    ordered = sorted(values)
    if len(ordered) < 4:
        return _median(ordered)
    quarter = len(ordered) // 4
    middle = ordered[quarter:len(ordered) - quarter]
    return math.fsum(middle) / len(middle)


def _seconds_for_devices(state: BalanceState, device_ids: Tuple[str, ...]) -> List[float]:
    """Per-VW times for ``device_ids`` in rank order, filling in unknown devices.

    A device without a measurement (a joiner) is assumed to be as fast as the
    median measured device of this device set: its first step then measures it
    and the balancer corrects. When no device of the set is measured, all get
    the same time, which gives the uniform split.
    """
    known = [state.seconds_per_vw[device_id] for device_id in device_ids if device_id in state.seconds_per_vw]
    fallback = _median(known) if known else _UNMEASURED_SECONDS_PER_VW
    return [state.seconds_per_vw.get(device_id, fallback) for device_id in device_ids]


def _check_hysteresis(hysteresis: Any) -> float:
    value = _finite_seconds(hysteresis, "hysteresis")
    if not 0.0 <= value < 1.0:
        raise ValueError(f"hysteresis={value} must be at least 0 and below 1 (it is a relative improvement)")
    return value


def _check_noise_factor(noise_factor: Any) -> float:
    value = _finite_seconds(noise_factor, "noise_factor")
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
    return _relative_noise([_usable_seconds(_finite_seconds(value, f"measurements[{index}]"))
                            for index, value in enumerate(measurements)])


def _relative_noise(values: Sequence[float]) -> float:
    """``relative_noise`` of values already checked and floored (those of a state)."""
    if len(values) < MINIMUM_NOISE_SAMPLES:
        return 0.0
    changes = [abs(later - earlier) for earlier, later in zip(values, values[1:])]
    return _median(changes) / _median(values)


def noise_known(state: BalanceState, device_ids: Sequence[str]) -> bool:
    """True unless a device of ``device_ids`` has only 1 or 2 raw times in the state.

    While this is False, ``next_assignment`` keeps the current split for
    every move that involves such a device, and one more measurement can lift
    that (the simulator checks it before it skips identical steps).
    """
    for device_id in _device_id_tuple(device_ids, "device_ids"):
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
    hysteresis = _check_hysteresis(hysteresis)
    noise_factor = _check_noise_factor(noise_factor)
    device_ids = _device_id_tuple(device_ids, "device_ids")
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
    and the cost balancer's planned rates (``cost_rates.replan``).
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
    return _relative_noise(measurements) / math.sqrt(max(1, behind))


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
    hysteresis = _check_hysteresis(hysteresis)
    noise_factor = _check_noise_factor(noise_factor)
    noise = max(standard_error(state, device_id) for device_id in _device_id_tuple(device_ids, "device_ids"))
    if math.isinf(noise):
        return hysteresis  # (noise_factor 0 would make 0 * inf a NaN)
    return min(hysteresis, noise_factor * noise)


def most_even_assignment(seconds_per_vw: Sequence[float], virtual_workers: int, tolerance: float) -> Tuple[int, ...]:
    """Among splits whose predicted step time is within ``tolerance`` of the optimum's, the most even.

    Every count at least 1, summing to ``virtual_workers``;
    ``predicted_step_seconds`` at most ``(1 + tolerance)`` times that of
    ``optimal_assignment``, and no such split has a smaller predicted
    imbalance ``(max - min) / max`` of ``count * seconds`` (ties: the
    shorter step, then lower ranks take more). ``tolerance`` 0 gives
    ``optimal_assignment`` itself (whose tie-break is already the most even of
    the fastest). flexpar/even_split.py has the method and the proof.
    """
    seconds = _seconds_list(seconds_per_vw, "seconds_per_vw")
    if not seconds:
        raise ValueError("seconds_per_vw is empty; an assignment needs at least one device")
    virtual_workers = _count(virtual_workers, "virtual_workers", minimum=1)
    _check_enough_virtual_workers(virtual_workers, len(seconds))
    tolerance = _finite_seconds(tolerance, "tolerance")
    if not 0.0 <= tolerance < 1.0:
        raise ValueError(f"tolerance={tolerance} must be at least 0 and below 1 (it is a relative step time)")
    return _most_even(seconds, virtual_workers, optimal_assignment(seconds, virtual_workers), tolerance)


def _most_even(seconds: List[float], virtual_workers: int, optimum: Tuple[int, ...], tolerance: float):
    if tolerance == 0.0:
        return optimum
    limit = predicted_step_seconds(optimum, seconds) * (1.0 + tolerance)
    return most_even_split(seconds, virtual_workers, optimum, limit)


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
    device_ids = _device_id_tuple(device_ids, "device_ids")
    if not device_ids:
        raise ValueError("device_ids is empty; an assignment needs at least one device")
    virtual_workers = _count(virtual_workers, "virtual_workers", minimum=1)
    _check_enough_virtual_workers(virtual_workers, len(device_ids))
    hysteresis = _check_hysteresis(hysteresis)
    noise_factor = _check_noise_factor(noise_factor)

    seconds = _seconds_for_devices(state, device_ids)
    optimum = optimal_assignment(seconds, virtual_workers)
    current = state.assignment
    if device_ids != state.device_ids or sum(current) != virtual_workers:
        return _most_even(seconds, virtual_workers, optimum,
                          tie_tolerance(state, device_ids, hysteresis, noise_factor))
    current_seconds = predicted_step_seconds(current, seconds)
    # The common case, decided without the noise: nothing beats the current split by
    # even the smallest floor (the preferred split is never faster than the optimum).
    if not predicted_step_seconds(optimum, seconds) < (1.0 - MEASURED_HYSTERESIS_SHARE * hysteresis) * current_seconds:
        return current
    preferred = _most_even(seconds, virtual_workers, optimum, tie_tolerance(state, device_ids, hysteresis, noise_factor))
    if preferred == current:
        return current
    floor = hysteresis
    if all(len(state.recent.get(device_id, ())) >= MINIMUM_NOISE_SAMPLES
           for device_id, before, after in zip(device_ids, current, preferred) if before != after):
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
    change = abs(_median(measurements[-(SHIFT_SAMPLES + 1):]) - smoothed)
    if change <= SHIFT_MINIMUM * smoothed:
        return False  # the common case, decided without sorting the window
    return change > SHIFT_FACTOR * _relative_noise(measurements) * smoothed


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

    ``work`` (balancing by cost, flexpar/cost_balance.py): the units of work
    each device ran, finite and > 0, in place of its VW count; the raw value
    is then ``busy_seconds[i] / work[i]`` (seconds per unit of work) and
    ``seconds_per_vw`` holds those. ``assignment`` is still recorded.
    """
    device_ids = _device_id_tuple(device_ids, "device_ids")
    counts = _assignment_tuple(assignment, "assignment", minimum=1)
    busy = [_finite_seconds(value, f"busy_seconds[{index}]") for index, value in enumerate(busy_seconds)]
    if not (len(device_ids) == len(counts) == len(busy)):
        raise ValueError(
            f"device_ids ({len(device_ids)}), assignment ({len(counts)}) and busy_seconds ({len(busy)}) "
            "must have one entry per device"
        )
    weight = _finite_seconds(smoothing, "smoothing")
    if not 0.0 < weight <= 1.0:
        raise ValueError(f"smoothing={weight} must be above 0 and at most 1 (it is the weight of the new measurement)")
    window = _count(window, "window", minimum=1)
    units = counts if work is None else _work_list(work, len(counts))

    kept = max(window, NOISE_WINDOW)
    seconds = dict(state.seconds_per_vw)
    recent = dict(state.recent)
    steady = dict(state.steady)
    for device_id, count, device_busy in zip(device_ids, units, busy):
        earlier = recent.get(device_id, ())
        values = (earlier + (_usable_seconds(device_busy / count),))[-kept:]
        level = min(steady.get(device_id, len(earlier)) + 1, len(values))
        old = seconds.get(device_id)
        if old is not None and _changed_speed(values, old):
            level = min(SHIFT_SAMPLES, len(values))
            seconds[device_id] = _median(values[-level:])
        else:
            measured = _middle_mean(values[-min(level, window):])
            seconds[device_id] = measured if old is None else weight * measured + (1.0 - weight) * old
        recent[device_id] = values
        steady[device_id] = level
    return BalanceState._trusted(seconds, device_ids, counts, recent, steady)


def _work_list(work: Sequence[Any], devices: int) -> List[float]:
    """``observe``'s ``work``: one finite amount > 0 per device."""
    amounts = [_finite_seconds(value, f"work[{index}]") for index, value in enumerate(work)]
    if len(amounts) != devices:
        raise ValueError(f"work has {len(amounts)} entries for {devices} devices; give one per device")
    for index, amount in enumerate(amounts):
        if not amount > 0.0:
            raise ValueError(f"work[{index}]={amount} must be above 0 (a device that did no work has no rate)")
    return amounts
