"""The split itself: V virtual workers over devices of given per-VW times.

``optimal_assignment`` is the exact min-max split (every device at least one
VW); ``most_even_assignment`` the most even of the splits within a tolerance
of it (near ties, flexpar/core/balance/even_split.py); ``predicted_step_seconds``
and ``imbalance`` are the figures both are judged by.
"""

from __future__ import annotations

import heapq
from typing import List, Sequence, Tuple

from flexpar.core.balance.checks import (
    assignment_tuple,
    check_enough_virtual_workers,
    checked_count,
    finite_seconds,
    seconds_list,
)
from flexpar.core.balance.even_split import most_even_split


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
    seconds = seconds_list(seconds_per_vw, "seconds_per_vw")
    if not seconds:
        raise ValueError("seconds_per_vw is empty; an assignment needs at least one device")
    virtual_workers = checked_count(virtual_workers, "virtual_workers", minimum=1)
    check_enough_virtual_workers(virtual_workers, len(seconds))

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
    caps = [
        count + 1 if (count + 1) * device_seconds <= step else count for count, device_seconds in zip(counts, seconds)
    ]
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
    counts = assignment_tuple(assignment, "assignment", minimum=0)
    seconds = seconds_list(seconds_per_vw, "seconds_per_vw")
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
    busy = [max(0.0, finite_seconds(value, f"busy_seconds[{index}]")) for index, value in enumerate(busy_seconds)]
    if not busy:
        raise ValueError("busy_seconds is empty; imbalance needs at least one device")
    longest = max(busy)
    if longest == 0.0:
        return 0.0
    return (longest - min(busy)) / longest


def most_even_assignment(seconds_per_vw: Sequence[float], virtual_workers: int, tolerance: float) -> Tuple[int, ...]:
    """Among splits whose predicted step time is within ``tolerance`` of the optimum's, the most even.

    Every count at least 1, summing to ``virtual_workers``;
    ``predicted_step_seconds`` at most ``(1 + tolerance)`` times that of
    ``optimal_assignment``, and no such split has a smaller predicted
    imbalance ``(max - min) / max`` of ``count * seconds`` (ties: the
    shorter step, then lower ranks take more). ``tolerance`` 0 gives
    ``optimal_assignment`` itself (whose tie-break is already the most even of
    the fastest). flexpar/core/balance/even_split.py has the method and the proof.
    """
    seconds = seconds_list(seconds_per_vw, "seconds_per_vw")
    if not seconds:
        raise ValueError("seconds_per_vw is empty; an assignment needs at least one device")
    virtual_workers = checked_count(virtual_workers, "virtual_workers", minimum=1)
    check_enough_virtual_workers(virtual_workers, len(seconds))
    tolerance = finite_seconds(tolerance, "tolerance")
    if not 0.0 <= tolerance < 1.0:
        raise ValueError(f"tolerance={tolerance} must be at least 0 and below 1 (it is a relative step time)")
    return most_even(seconds, virtual_workers, optimal_assignment(seconds, virtual_workers), tolerance)


def most_even(seconds: List[float], virtual_workers: int, optimum: Tuple[int, ...], tolerance: float):
    if tolerance == 0.0:
        return optimum
    limit = predicted_step_seconds(optimum, seconds) * (1.0 + tolerance)
    return most_even_split(seconds, virtual_workers, optimum, limit)
