"""The most even split among those nearly as fast as the fastest (pure, exact).

``flexpar.core.balance`` finds the split of V virtual workers (VWs) with the
shortest predicted step time ``T* = min max_i(c_i * s_i)``. Measured times
never tie exactly, so the fastest split by a hair can leave a slow device idle
for a third of the step while another, as fast within the measurement noise,
keeps every device busy (rule.py's module docstring has the numbers). This
module answers: among the splits with ``max_i(c_i * s_i) <= limit`` (``limit``
at or above ``T*``), which has the smallest predicted imbalance ``(max - min) /
max`` of the busy times ``c_i * s_i``? Every count is at least 1 and they sum
to V.

Method (exact; ``most_even_split``'s docstring has the proof): for a bound
``M`` on the maximum, the best achievable minimum is ``min(L(M), m0)``, where
``L(M) = min_i u_i(M) * s_i`` with ``u_i(M)`` the most VWs device i can take
within ``M``, and ``m0`` the best minimum of any split at all (no bound on the
maximum). So the smallest imbalance is the smallest ``1 - min(L(M), m0) / M``
over the values ``M = k * s_i`` in ``[T*, limit]``, which a sweep in increasing
``M`` visits in O((n + E) log n) for E such values; the split itself then takes
every device to its lower bound and fills up with the min-max greedy within
the upper bounds.

Inputs are trusted (the caller, ``flexpar.core.balance``, validates and floors
them); every value is a product ``k * s_i`` or a ratio of such products, in a
fixed order, so equal inputs give equal counts on every device.
"""

from __future__ import annotations

import heapq
import math
from typing import List, Sequence, Tuple


def most_even_split(
    seconds: Sequence[float], virtual_workers: int, optimum: Sequence[int], limit: float
) -> Tuple[int, ...]:
    """Among splits whose predicted step time is at most ``limit``, one with the smallest imbalance.

    ``seconds`` are positive per-VW times in rank order, ``optimum`` a split
    of ``virtual_workers`` with the shortest predicted step time ``T*``
    (``flexpar.core.balance.optimal_assignment``), and ``limit >= T*``. Ties in
    imbalance go to the smaller maximum (the shorter step), then to the
    min-max greedy's order (lower ranks take more), so the answer is a pure
    function of the inputs. With ``limit == T*`` the result takes exactly
    ``T*``.

    Why it is exact: a split with maximum at most M and minimum at least m
    exists iff every device can take a count between ``l_i(m)`` (the fewest
    VWs, at least 1, with ``l_i * s_i >= m``) and ``u_i(M)`` (the most, at
    most ``V - n + 1``, with ``u_i * s_i <= M``), and ``sum(l_i) <= V <=
    sum(u_i)``. The upper sum holds for every ``M >= T*``. ``l_i <= u_i`` for
    all i means ``m <= L(M)``; ``sum(l_i) <= V`` means ``m <= m0``, the
    largest minimum of any split, which does not depend on M. So for a given
    M the best minimum is ``min(L(M), m0)`` and the imbalance is at most ``1 -
    min(L(M), m0) / M``; conversely the most even split, of maximum M' and
    minimum m', has ``min(L(M'), m0) >= m'``. Between two consecutive values
    ``k * s_i`` the bound only grows with M, so sweeping those values finds
    the smallest.
    """
    count = len(seconds)
    most = virtual_workers - count + 1  # every other device keeps one VW
    fastest = max(number * device_seconds for number, device_seconds in zip(optimum, seconds))
    best_minimum = _largest_minimum(seconds, virtual_workers)
    # The sweep: each device's largest busy time within M, in a heap with lazy deletion.
    counts = [_most_within(fastest, device_seconds, most) for device_seconds in seconds]
    events = []
    for rank, device_seconds in enumerate(seconds):
        number = counts[rank] + 1
        while number <= most and number * device_seconds <= limit:
            events.append((number * device_seconds, rank, number))
            number += 1
    events.sort()
    lows = [(number * device_seconds, rank) for rank, (number, device_seconds) in enumerate(zip(counts, seconds))]
    heapq.heapify(lows)

    def lowest_top() -> float:
        while lows[0][0] != counts[lows[0][1]] * seconds[lows[0][1]]:
            heapq.heappop(lows)  # an entry from before the device's count grew
        return lows[0][0]

    best = ((fastest - min(lowest_top(), best_minimum)) / fastest, fastest)
    index = 0
    while index < len(events):
        bound = events[index][0]
        while index < len(events) and events[index][0] == bound:
            _, rank, number = events[index]
            counts[rank] = number
            heapq.heappush(lows, (number * seconds[rank], rank))
            index += 1
        candidate = ((bound - min(lowest_top(), best_minimum)) / bound, bound)
        if candidate < best:
            best = candidate
    return _split_within(seconds, virtual_workers, best[1], best_minimum)


def _split_within(seconds: Sequence[float], virtual_workers: int, bound: float, best_minimum: float) -> Tuple[int, ...]:
    """A split with maximum at most ``bound`` and the best minimum it allows; the greedy fills up."""
    most = virtual_workers - len(seconds) + 1
    uppers = [_most_within(bound, device_seconds, most) for device_seconds in seconds]
    floor = min(min(upper * device_seconds for upper, device_seconds in zip(uppers, seconds)), best_minimum)
    counts = [_fewest_reaching(floor, device_seconds) for device_seconds in seconds]
    # Fill the rest with the min-max greedy (smallest finishing time first, ties: lower
    # rank) within the upper bounds: the shortest step among the splits this even.
    following = [
        ((number + 1) * device_seconds, rank)
        for rank, (number, device_seconds) in enumerate(zip(counts, seconds))
        if number < uppers[rank]
    ]
    heapq.heapify(following)
    for _ in range(virtual_workers - sum(counts)):
        _, rank = heapq.heappop(following)
        counts[rank] += 1
        if counts[rank] < uppers[rank]:
            heapq.heappush(following, ((counts[rank] + 1) * seconds[rank], rank))
    return tuple(counts)


def _largest_minimum(seconds: Sequence[float], virtual_workers: int) -> float:
    """The largest ``min_i(c_i * s_i)`` of any split (c_i >= 1, summing to V).

    The greedy gives each VW to the device that is least busy so far (ties:
    lower rank); by the exchange argument that proves the min-max greedy
    optimal (balance.optimal_assignment), mirrored, its minimum is the largest.
    """
    counts = [1] * len(seconds)
    least = [(device_seconds, rank) for rank, device_seconds in enumerate(seconds)]
    heapq.heapify(least)
    for _ in range(virtual_workers - len(seconds)):
        _, rank = least[0]
        counts[rank] += 1
        heapq.heapreplace(least, (counts[rank] * seconds[rank], rank))
    return least[0][0]


def _most_within(bound: float, device_seconds: float, most: int) -> int:
    """The largest count k in [1, most] with ``k * device_seconds <= bound`` (1 if none)."""
    number = min(most, max(1, int(bound / device_seconds)))
    while number < most and (number + 1) * device_seconds <= bound:  # correct the division's rounding
        number += 1
    while number > 1 and number * device_seconds > bound:
        number -= 1
    return number


def _fewest_reaching(floor: float, device_seconds: float) -> int:
    """The smallest count k >= 1 with ``k * device_seconds >= floor``."""
    number = max(1, math.ceil(floor / device_seconds))
    while number > 1 and (number - 1) * device_seconds >= floor:  # correct the division's rounding
        number -= 1
    while number * device_seconds < floor:
        number += 1
    return number


def predicted_imbalance(counts: Sequence[int], seconds: Sequence[float]) -> float:
    """``(max - min) / max`` of the predicted busy times ``c_i * s_i``."""
    busy: List[float] = [number * device_seconds for number, device_seconds in zip(counts, seconds)]
    longest = max(busy)
    return (longest - min(busy)) / longest
