"""How ``cost_assignment`` finds the sets: two starts, a local search, then branch and bound.


1. Two starts: the longest-processing-time greedy (VWs by decreasing cost,
   each to the device that would finish it earliest; the last VWs go to
   devices still empty, so every device gets one) and the count balancer's
   contiguous split for the same rates. The better is kept (the greedy on a tie).
2. Local search from it: move one VW off the slowest device, or swap one of
   its VWs for a cheaper one of another device, whichever lowers the larger
   of the two devices' times most; repeat while a move helps (at most
   ``LOCAL_SEARCH_ROUNDS`` per VW).
3. Depth-first branch and bound over all assignments (VWs by decreasing cost,
   devices in greedy order, equal devices with equal loads tried once), with
   the result so far as the bound to beat, and pruning when the remaining cost
   cannot fit under it. It is exhaustive, so the result is optimal, whenever
   the whole tree has at most ``EXHAUSTIVE_NODES`` nodes (V <= 8 VWs on 3
   devices, V <= 13 on 2, V <= 6 on 4, ...); otherwise it stops after
   ``NODE_BUDGET`` nodes and keeps the best found. It also stops at once when
   the result reaches the continuous lower bound (total cost over the sum of
   speeds).

Each stage only takes a strictly shorter predicted step, so the result is
never worse than either start, the count balancer's split included. Cost:
about 1-3 ms for V = 128 on 8 devices (pure Python).
"""

from __future__ import annotations

import bisect
import math
from typing import List, Sequence, Tuple

from flexpar.core.cost_balance.costs import (
    Assignment,
    check_shape,
    checked_costs,
    checked_rates,
    contiguous_owner,
    sets,
    step_seconds,
)

NODE_BUDGET = 600
"""Nodes the branch and bound may visit when the whole tree is larger than EXHAUSTIVE_NODES."""

EXHAUSTIVE_NODES = 20_000
"""Trees of at most this many nodes are searched to the end: the result is then optimal."""

LOCAL_SEARCH_ROUNDS = 4
"""Improving moves the local search may make, per VW."""

_EPSILON = 1e-9
"""Relative slack of the pruning tests: they prune only what is worse by more than float rounding."""


def cost_assignment(
    costs: Sequence[float], seconds_per_cost: Sequence[float], node_budget: int = NODE_BUDGET
) -> Assignment:
    """For each device (rank order) the ascending ids of the VWs it runs.

    ``costs[v]`` is VW v's cost (finite, >= 0), ``seconds_per_cost[d]`` device
    d's seconds per unit of cost. Every VW is in exactly one set, every device
    gets at least one, and ``predicted_step_seconds`` is as small as the
    search finds (optimal when the tree is small: module docstring), never
    larger than that of ``count_based_sets``. A pure function of the floats:
    the same inputs give the same sets on every device. ValueError for fewer
    VWs than devices or values that are not finite (or negative costs).
    """
    return cost_assignment_with_proof(costs, seconds_per_cost, node_budget)[0]


def cost_assignment_with_proof(
    costs: Sequence[float], seconds_per_cost: Sequence[float], node_budget: int = NODE_BUDGET
) -> Tuple[Assignment, bool]:
    """``cost_assignment`` and whether the result is proven optimal (the search completed)."""
    costs = checked_costs(costs)
    rates = checked_rates(seconds_per_cost)
    devices, virtual_workers = len(rates), len(costs)
    check_shape(virtual_workers, devices)
    if devices == 1:
        return (tuple(range(virtual_workers)),), True
    order = sorted(range(virtual_workers), key=lambda virtual_worker: (-costs[virtual_worker], virtual_worker))
    best = _greedy_owner(costs, rates, order)
    best_seconds = step_seconds(best, costs, rates)
    contiguous = contiguous_owner(rates, virtual_workers)
    contiguous_seconds = step_seconds(contiguous, costs, rates)
    if contiguous_seconds < best_seconds:
        best, best_seconds = contiguous, contiguous_seconds
    searched = _local_search(best, costs, rates, LOCAL_SEARCH_ROUNDS * virtual_workers)
    searched_seconds = step_seconds(searched, costs, rates)
    if searched_seconds < best_seconds:
        best, best_seconds = searched, searched_seconds
    best, best_seconds, complete = _branch_and_bound(
        costs, rates, order, best, best_seconds, _node_budget(virtual_workers, devices, node_budget)
    )
    return sets(best, devices), complete


def _node_budget(virtual_workers: int, devices: int, node_budget: int) -> int:
    """EXHAUSTIVE_NODES or more when the whole tree fits in it (exhaustive search), else node_budget."""
    tree = 0
    level = 1
    for _ in range(virtual_workers):
        level *= devices
        tree += level
        if tree > EXHAUSTIVE_NODES:
            return node_budget
    return max(tree, node_budget)


def _greedy_owner(costs: Sequence[float], rates: Sequence[float], order: Sequence[int]) -> List[int]:
    """Longest processing time first: each VW to the device that would finish it earliest.

    Ties: fewer VWs, then lower rank (so zero-cost VWs spread out). When as
    many VWs remain as devices are still empty, each goes to an empty device,
    so every device gets at least one.
    """
    devices = len(rates)
    loads = [0.0] * devices
    counts = [0] * devices
    owner = [0] * len(costs)
    empty = devices
    for position, virtual_worker in enumerate(order):
        cost = costs[virtual_worker]
        must_fill = len(order) - position <= empty
        best_device, best_key = -1, None
        for device in range(devices):
            if must_fill and counts[device]:
                continue
            key = (rates[device] * (loads[device] + cost), counts[device])
            if best_key is None or key < best_key:
                best_device, best_key = device, key
        owner[virtual_worker] = best_device
        if counts[best_device] == 0:
            empty -= 1
        counts[best_device] += 1
        loads[best_device] += cost
    return owner


def _local_search(owner: Sequence[int], costs: Sequence[float], rates: Sequence[float], rounds: int) -> List[int]:
    """Improve ``owner`` by moves and swaps off the slowest device (module docstring, step 2).

    Each round takes the single best move or swap between the slowest device
    (lowest rank among equals) and another one, if it brings both below the
    slowest's time; deterministic, since every candidate is scanned in a fixed
    order and only a strictly better one replaces the one found so far.
    """
    devices = len(rates)
    owner = list(owner)
    members: List[List[Tuple[float, int]]] = [[] for _ in range(devices)]
    for virtual_worker, device in enumerate(owner):
        members[device].append((costs[virtual_worker], virtual_worker))
    for group in members:
        group.sort()
    loads = [math.fsum(cost for cost, _ in group) for group in members]
    for _ in range(rounds):
        times = [rate * load for rate, load in zip(rates, loads)]
        slowest = max(range(devices), key=lambda device: (times[device], -device))
        limit = times[slowest]
        found = None  # (new time of the two devices, other device, VW out, VW in or -1)
        for other in range(devices):
            if other == slowest:
                continue
            rate_out, rate_in = rates[slowest], rates[other]
            # The shift of cost that would make both devices finish together.
            target = (times[slowest] - times[other]) / (rate_out + rate_in)
            if not target > 0.0:
                continue
            group_in = members[other]
            for cost_out, leaving in members[slowest]:
                candidates = []
                if len(members[slowest]) > 1:
                    candidates.append((cost_out, -1))
                # Swaps: a VW of `other` costing about cost_out - target comes back.
                position = bisect.bisect_left(group_in, (cost_out - target, -1))
                for neighbour in (position - 1, position):
                    if 0 <= neighbour < len(group_in) and group_in[neighbour][0] < cost_out:
                        candidates.append((cost_out - group_in[neighbour][0], group_in[neighbour][1]))
                for shift, coming in candidates:
                    value = max(rate_out * (loads[slowest] - shift), rate_in * (loads[other] + shift))
                    if value < limit and (found is None or value < found[0]):
                        found = (value, other, leaving, coming)
        if found is None:
            break
        _, other, leaving, coming = found
        _move(members, owner, costs, leaving, slowest, other)
        if coming >= 0:
            _move(members, owner, costs, coming, other, slowest)
        for device in (slowest, other):
            loads[device] = math.fsum(cost for cost, _ in members[device])
    return owner


def _move(members, owner, costs, virtual_worker: int, source: int, destination: int) -> None:
    members[source].remove((costs[virtual_worker], virtual_worker))
    bisect.insort(members[destination], (costs[virtual_worker], virtual_worker))
    owner[virtual_worker] = destination


def _branch_and_bound(costs, rates, order, incumbent, incumbent_seconds, budget):
    """Depth-first search for an assignment strictly faster than ``incumbent``.

    Returns (owner, its predicted step seconds, whether the search completed).
    Iterative (no recursion limit for large V). Prunes a node when a device
    already finishes after the incumbent, or when the remaining cost cannot
    fit under the incumbent's time on all devices together; both tests carry
    a relative slack of ``_EPSILON`` so that float rounding never prunes a
    better assignment.
    """
    devices, count = len(rates), len(order)
    speeds = math.fsum(1.0 / rate for rate in rates)
    total = math.fsum(costs)
    bound = max(total / speeds, costs[order[0]] * min(rates))  # no assignment beats this
    best, best_seconds = list(incumbent), incumbent_seconds
    if best_seconds <= bound * (1.0 + _EPSILON):
        return best, best_seconds, True
    remaining = [0.0] * (count + 1)  # cost of the VWs at positions >= i of `order`
    for position in range(count - 1, -1, -1):
        remaining[position] = remaining[position + 1] + costs[order[position]]
    loads = [0.0] * devices
    counts = [0] * devices
    owner = [0] * count
    chosen = [-1] * count  # the device of each position on the current path
    options: List[List[int]] = [[] for _ in range(count)]
    cursor = [0] * count
    empty = devices
    nodes = 0

    def children(position: int) -> List[int]:
        """Devices to try for the VW at `position`, best first, pruned and de-duplicated."""
        cost = costs[order[position]]
        limit = best_seconds * (1.0 + _EPSILON)
        capacity = 0.0
        for device in range(devices):
            room = best_seconds / rates[device] - loads[device]
            if room > 0.0:
                capacity += room
        if remaining[position] > capacity * (1.0 + _EPSILON):
            return []
        must_fill = count - position <= empty
        keyed = []
        for device in range(devices):
            if must_fill and counts[device]:
                continue
            finish = rates[device] * (loads[device] + cost)
            if finish > limit:
                continue
            keyed.append((finish, counts[device], device))
        keyed.sort()
        picked: List[int] = []
        seen = []
        for _, _, device in keyed:
            signature = (rates[device], loads[device], counts[device] == 0)
            if signature in seen:  # an equal device with an equal load: the same subtree
                continue
            seen.append(signature)
            picked.append(device)
        return picked

    position = 0
    options[0], cursor[0] = children(0), 0
    complete = True
    while position >= 0:
        if chosen[position] >= 0:  # undo the last choice at this position
            device = chosen[position]
            loads[device] -= costs[order[position]]
            counts[device] -= 1
            if counts[device] == 0:
                empty += 1
            chosen[position] = -1
        if cursor[position] >= len(options[position]):
            position -= 1
            continue
        if nodes >= budget:
            complete = False
            break
        nodes += 1
        device = options[position][cursor[position]]
        cursor[position] += 1
        chosen[position] = device
        if counts[device] == 0:
            empty -= 1
        counts[device] += 1
        loads[device] += costs[order[position]]
        if position + 1 == count:
            for index in range(count):
                owner[order[index]] = chosen[index]
            seconds = step_seconds(owner, costs, rates)
            if seconds < best_seconds:
                best, best_seconds = list(owner), seconds
                if best_seconds <= bound * (1.0 + _EPSILON):
                    return best, best_seconds, True
            continue
        position += 1
        options[position], cursor[position] = children(position), 0
    # Loads are running sums here; after an undo they may differ from a fresh sum in
    # the last bits, which only widens the pruning slack a little: never wrong.
    return best, best_seconds, complete
