"""Input checks shared by the balancer's pieces, and the floor for per-VW times.

Small helpers so that every error shows the numbers; every per-VW time
below ``MINIMUM_SECONDS_PER_VW`` counts as that minimum.
"""

from __future__ import annotations

import math
import operator
from typing import Any, List, Sequence, Tuple

MINIMUM_SECONDS_PER_VW = 1e-9
"""Floor for a per-VW time. Non-positive or smaller measured times count as this.

One nanosecond is far below any real VW's compute time, so the floor only ever
applies to broken measurements, and it keeps every product ``count * seconds``
positive and finite.
"""


def finite_seconds(value: Any, what: str) -> float:
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


def usable_seconds(seconds: float) -> float:
    """Apply the documented floor: anything below the minimum counts as the minimum."""
    return seconds if seconds > MINIMUM_SECONDS_PER_VW else MINIMUM_SECONDS_PER_VW


def seconds_list(values: Sequence[Any], what: str) -> List[float]:
    """Finite, floored per-VW times in the given (rank) order."""
    return [usable_seconds(finite_seconds(value, f"{what}[{index}]")) for index, value in enumerate(values)]


def checked_count(value: Any, what: str, minimum: int) -> int:
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


def device_id_tuple(device_ids: Sequence[Any], what: str) -> Tuple[str, ...]:
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


def check_enough_virtual_workers(virtual_workers: int, device_count: int) -> None:
    if virtual_workers < device_count:
        raise ValueError(
            f"virtual_workers={virtual_workers} is fewer than the {device_count} devices; "
            "every device needs at least one virtual worker"
        )


def assignment_tuple(assignment: Sequence[Any], what: str, minimum: int) -> Tuple[int, ...]:
    return tuple(checked_count(count, f"{what}[{index}]", minimum) for index, count in enumerate(assignment))
