"""Timing: rounds that alternate ours and the baseline, medians, ratios.

Every benchmark measures "ours vs baseline" side by side in one invocation,
alternating the runs, and reports medians: on a shared machine a slow drift
(thermal, someone else's work) then lands on both sides alike.
"""

from __future__ import annotations

import math
import statistics
import time
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple


def median(values: Sequence[float]) -> float:
    """The median of a non-empty sequence of numbers."""
    if not values:
        raise ValueError("median of an empty sequence")
    return float(statistics.median(values))


def measured(value: Any) -> bool:
    """Whether `value` is a measurement: not missing (None) and not NaN."""
    return value is not None and not (isinstance(value, float) and math.isnan(value))


def median_of(items: Iterable[Mapping[str, Any]], key: str) -> Optional[float]:
    """The median of `item[key]` over the items that measured it (see `measured`); None if none did."""
    values = [item[key] for item in items if measured(item.get(key))]
    return median(values) if values else None


def ratio(numerator: Optional[float], denominator: Optional[float]) -> Optional[float]:
    """numerator / denominator, or None when either is missing or the denominator is 0."""
    if numerator is None or denominator is None or denominator == 0:
        return None
    return float(numerator) / float(denominator)


def ratio_of_medians(
    runs: Mapping[str, Sequence[Mapping[str, Any]]],
    key: str,
    numerator: Tuple[str, str],
    denominator: Tuple[str, str],
    name: str,
    best_rounds: bool = False,
) -> Dict[str, Optional[float]]:
    """One comparison of `alternate`'s results, as figures: each side's median of `key`, and their ratio.

    `numerator` and `denominator` are (side in `runs`, the name of its median
    figure); `name` names the ratio of the medians. With `best_rounds`, also
    `name + "_best_rounds"`: the ratio of each side's best (largest) round, a
    cross-check for shared machines, where other work only ever slows a run.
    """
    (top, top_name), (bottom, bottom_name) = numerator, denominator
    figures = {top_name: median_of(runs[top], key), bottom_name: median_of(runs[bottom], key)}
    figures[name] = ratio(figures[top_name], figures[bottom_name])
    if best_rounds:
        best = {side: max(run[key] for run in runs[side]) for side in (top, bottom)}
        figures[f"{name}_best_rounds"] = ratio(best[top], best[bottom])
    return figures


def timed(function: Callable[[], Any]) -> Tuple[Any, float]:
    """(what `function()` returns, the wall-clock seconds it took)."""
    started = time.perf_counter()
    value = function()
    return value, time.perf_counter() - started


def alternate(
    runners: Mapping[str, Callable[[int], Any]], rounds: int, budget_s: Optional[float] = None
) -> Dict[str, List[Any]]:
    """Call each runner once per round, in the mapping's order; returns `{name: [result, ...]}`.

    A runner is called with the round's index. Alternating (A, B, A, B, ...)
    rather than (A, A, B, B) spreads slow drifts of the machine over both
    sides evenly. With `budget_s`, no round starts after the second that
    would, at the pace so far, end the rounds past `budget_s` seconds (a line
    says so): every side then has as many rounds as the others.
    """
    results: Dict[str, List[Any]] = {name: [] for name in runners}
    started = time.perf_counter()
    for index in range(rounds):
        elapsed = time.perf_counter() - started
        if budget_s is not None and index >= 2 and elapsed * (index + 1) / index > budget_s:
            print(f"  stopping after {index} rounds: another would pass the {budget_s:.0f} s budget")
            break
        for name, runner in runners.items():
            results[name].append(runner(index))
    return results


def step_durations(commit_times: Sequence[float], skip: int) -> List[float]:
    """Seconds of steps `skip .. len-1`: gaps between consecutive commit times.

    `commit_times[i]` is when step `i` committed; step `i` lasted
    `commit_times[i] - commit_times[i - 1]`. Steps before `skip` (start-up)
    are left out; `skip` must be at least 1 and below `len(commit_times)`.
    """
    if skip < 1 or len(commit_times) <= skip:
        raise ValueError(f"{len(commit_times)} steps committed; need skip >= 1 and more steps than skip={skip}")
    return [later - earlier for earlier, later in zip(commit_times[skip - 1 :], commit_times[skip:])]


def slowest_rank(seconds: float) -> float:
    """The largest of every rank's `seconds` in the current process group (a MAX all-reduce).

    A collective ends when its last member is done: each rank times its own
    part, and the slowest rank's time is the figure.
    """
    import torch
    import torch.distributed as dist

    value = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return float(value.item())
