"""Speed-proportional load balancing: measured timings -> VW assignment.

DESIGN.md section 5. Every device runs these functions on the same shared
timings and must reach the same assignment bit for bit, with no central
decision. So this module is pure (no clocks, processes or sockets), and every
computation is a fixed sequence of float operations on values in rank order:
nothing depends on hash order, set iteration or dict insertion order, and every
tie is broken towards the lower rank.

The pieces:

- ``optimal_assignment``: the exact min-max split of V virtual workers (VWs)
  over devices of given speeds, every device at least one VW.
- ``observe``: folds one step's measured busy times into smoothed per-VW times.
- ``next_assignment``: the optimum for the smoothed times, unless the current
  assignment is within ``hysteresis`` of it (so small noise never reshuffles
  work; a reshuffle costs nothing in state, but changes which device runs which
  VW and makes step times jump around).
- ``imbalance``: the reported figure ``(max - min) / max`` of busy time.

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
from typing import Any, Dict, List, Mapping, Sequence, Tuple

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
    """

    seconds_per_vw: Mapping[str, float] = field(default_factory=dict)
    device_ids: Tuple[str, ...] = ()
    assignment: Tuple[int, ...] = ()
    recent: Mapping[str, Tuple[float, ...]] = field(default_factory=dict)  # last raw measurements

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
        recent = {
            device_id: tuple(_finite_seconds(v, f"recent[{device_id!r}]") for v in self.recent[device_id])
            for device_id in sorted(_device_id_tuple(list(self.recent), "recent keys"))
        }
        object.__setattr__(self, "recent", MappingProxyType(recent))
        # Frozen: the normalised values go in through object.__setattr__.
        object.__setattr__(self, "seconds_per_vw", MappingProxyType(seconds))
        object.__setattr__(self, "device_ids", device_ids)
        object.__setattr__(self, "assignment", assignment)

    def __reduce__(self):
        # A mapping proxy cannot be pickled; go through the plain-dict form so
        # that a state can be pickled and deep-copied like any value.
        return (state_from_dict, (state_to_dict(self),))


def state_to_dict(state: BalanceState) -> dict:
    """The state as plain JSON-ready types (dict, list, str, int, float).

    Keys of ``seconds_per_vw`` come out sorted, so equal states give equal
    dicts and equal JSON text.
    """
    return {
        "seconds_per_vw": dict(state.seconds_per_vw),
        "device_ids": list(state.device_ids),
        "assignment": list(state.assignment),
        "recent": {device_id: list(values) for device_id, values in state.recent.items()},
    }


def state_from_dict(data: Mapping[str, Any]) -> BalanceState:
    """Inverse of ``state_to_dict``; ValueError naming a missing or unknown key."""
    if not isinstance(data, Mapping):
        raise ValueError(f"a balance state must be a mapping, not {type(data).__name__}")
    missing = [key for key in _STATE_KEYS if key not in data]
    if missing:
        raise ValueError(f"balance state lacks the key(s) {missing}; it needs {list(_STATE_KEYS)}")
    unknown = sorted(str(key) for key in data if key not in _STATE_KEYS + ("recent",))
    if unknown:
        raise ValueError(f"balance state has unknown key(s) {unknown}; it takes only {list(_STATE_KEYS)}")
    if not isinstance(data["seconds_per_vw"], Mapping):
        raise ValueError(
            f"seconds_per_vw must be a mapping of device id to seconds, not {type(data['seconds_per_vw']).__name__}"
        )
    return BalanceState(
        seconds_per_vw=dict(data["seconds_per_vw"]),
        device_ids=tuple(data["device_ids"]),
        assignment=tuple(data["assignment"]),
        recent={device_id: tuple(values) for device_id, values in dict(data.get("recent", {})).items()},
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


def next_assignment(
    state: BalanceState,
    device_ids: Sequence[str],
    virtual_workers: int,
    hysteresis: float = 0.05,
) -> Tuple[int, ...]:
    """The assignment for the next step of ``device_ids`` (rank order).

    Returns the optimum (``optimal_assignment``) for the state's smoothed
    per-VW times, with unknown devices assumed at the median of the known ones.
    Exception, to avoid oscillation: when ``device_ids`` equal the state's
    device set and its assignment is still a valid split of
    ``virtual_workers``, that assignment is kept unless the optimum's predicted
    step time is better by more than ``hysteresis`` relative to it, that is
    unless ``optimum < (1 - hysteresis) * current``. So a change of device set,
    a change of V, or a state without an assignment always yields the optimum.
    """
    device_ids = _device_id_tuple(device_ids, "device_ids")
    if not device_ids:
        raise ValueError("device_ids is empty; an assignment needs at least one device")
    virtual_workers = _count(virtual_workers, "virtual_workers", minimum=1)
    _check_enough_virtual_workers(virtual_workers, len(device_ids))
    hysteresis = _check_hysteresis(hysteresis)

    seconds = _seconds_for_devices(state, device_ids)
    optimum = optimal_assignment(seconds, virtual_workers)
    current = state.assignment
    if device_ids != state.device_ids or sum(current) != virtual_workers or current == optimum:
        return optimum
    optimum_seconds = predicted_step_seconds(optimum, seconds)
    current_seconds = predicted_step_seconds(current, seconds)
    if optimum_seconds < (1.0 - hysteresis) * current_seconds:
        return optimum
    return current


def observe(
    state: BalanceState,
    device_ids: Sequence[str],
    assignment: Sequence[int],
    busy_seconds: Sequence[float],
    smoothing: float = 0.5,
    window: int = 3,
) -> BalanceState:
    """Fold one step's measurements into a new state.

    ``busy_seconds[i]`` is the compute time device ``device_ids[i]`` spent on
    its ``assignment[i]`` VWs (not time waiting in collectives). Its measured
    per-VW time is ``busy_seconds[i] / assignment[i]`` (floored at
    ``MINIMUM_SECONDS_PER_VW``), smoothed as ``smoothing * measured + (1 -
    smoothing) * old``; a device seen for the first time takes the measured
    value as is. ``smoothing=1`` trusts only the latest step. Devices not in
    ``device_ids`` keep their old values. The returned state records
    ``device_ids`` and ``assignment`` as the last assignment.

    Outliers: what is smoothed is the median of the device's last ``window``
    raw measurements (kept in ``recent``), so one step slowed by a hiccup of
    the host does not move the assignment, while a lasting change of speed
    shows after ``window // 2 + 1`` steps. ``window=1`` smooths the raw values.
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
    seconds = dict(state.seconds_per_vw)
    recent = dict(state.recent)
    for device_id, count, device_busy in zip(device_ids, counts, busy):
        recent[device_id] = (recent.get(device_id, ()) + (_usable_seconds(device_busy / count),))[-window:]
        measured = _median(recent[device_id])
        old = seconds.get(device_id)
        seconds[device_id] = measured if old is None else weight * measured + (1.0 - weight) * old
    return BalanceState(seconds_per_vw=seconds, device_ids=device_ids, assignment=counts, recent=recent)
