"""Figures of simulation results (matplotlib, imported only when a plot is asked for)."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np

from .results import SimulationResult
from .scalability import ScalabilityResult


def _pyplot():
    """matplotlib's pyplot on the file-only Agg backend; a clear error when it is missing."""
    try:
        import matplotlib
    except ImportError as error:  # pragma: no cover - depends on the environment
        raise RuntimeError('plots need matplotlib: pip install -e ".[plot]" in flexpar\'s checkout') from error
    matplotlib.use("Agg")
    import matplotlib.pyplot as pyplot

    return pyplot


def _progress_curve(result: SimulationResult):
    """(hours, committed steps) with a point at every segment end, starting at (0, 0)."""
    hours = np.concatenate([[0.0], result.segment_end_s / 3600.0])
    steps = np.concatenate([[0], result.segment_committed])
    return hours, steps


def plot_comparison(results: Sequence[SimulationResult], path) -> Path:
    """Progress (committed steps over time) and step time over time, one line per policy."""
    pyplot = _pyplot()
    figure, (progress, step_time, devices, joins) = pyplot.subplots(
        4, 1, figsize=(9, 11), sharex=True, gridspec_kw={"height_ratios": [3, 2, 1.5, 1.5]}
    )
    for index, result in enumerate(results):
        _plot_joins(joins, result, index)
    for result in results:
        hours, steps = _progress_curve(result)
        progress.plot(hours, steps, label=result.label)
        if result.segment_end_s.size:
            step_time.plot(result.segment_end_s / 3600.0, result.segment_step_s, label=result.label, linewidth=0.8)
            devices.step(result.segment_end_s / 3600.0, result.segment_devices, where="post", label=result.label)
    progress.set_ylabel("committed steps")
    progress.set_title(f"scenario {results[0].scenario}" if results else "")
    progress.legend(loc="lower right")
    step_time.set_ylabel("step time (s)")
    step_time.set_yscale("log")
    devices.set_ylabel("devices")
    joins.set_ylabel("per join (s)")
    joins.set_xlabel("wall time (hours)")
    if any(result.joins() for result in results):
        joins.set_yscale("log")
        joins.legend(loc="upper right", fontsize="small")
    figure.tight_layout()
    output = Path(path)
    figure.savefig(output, dpi=120)
    pyplot.close(figure)
    return output


def _plot_joins(axis, result: SimulationResult, index: int) -> None:
    """Each join's boundary stall (o) beside the members' lost time (x), at the join's time."""
    events = [event for event in result.joins() if event.way]
    if not events:
        return
    stalls = {event.device_ids: event.stall_s for event in result.events if event.kind == "join"}
    hours = [_join_time(result, event) / 3600.0 for event in events]
    for values, marker, label in (
        ([stalls.get(event.device_ids, 0.0) for event in events], "o", "boundary stall"),
        ([event.members_lost_s for event in events], "x", "members' lost"),
    ):
        shown = [(hour, value) for hour, value in zip(hours, values) if value > 0]  # a shared boundary: 0
        if shown:
            axis.plot(*zip(*shown), marker, color=f"C{index}", fillstyle="none", label=f"{result.policy}: {label}")


def _join_time(result: SimulationResult, event) -> float:
    """When the join (not its stream's end) took effect."""
    starts = [e.time_s for e in result.events if e.kind == "join" and e.device_ids == event.device_ids]
    return starts[-1] if starts else event.time_s


def plot_scalability(result: ScalabilityResult, path) -> Path:
    """Samples per second against device count (log-log), with the linear ideal of the best policy."""
    pyplot = _pyplot()
    figure, axis = pyplot.subplots(figsize=(8, 5))
    counts = np.array(result.device_counts, dtype=float)
    for policy in result.policies:
        axis.plot(counts, result.samples_per_s(policy), marker="o", label=result.labels[policy])
    best = max(result.policies, key=lambda policy: result.samples_per_s(policy)[0])
    ideal = np.array(result.samples_per_s(best)[0]) * counts / counts[0]
    axis.plot(counts, ideal, linestyle=":", color="grey", label=f"linear from {best} at {result.device_counts[0]}")
    axis.set_xscale("log", base=2)
    axis.set_yscale("log")
    axis.set_xlabel("devices")
    axis.set_ylabel("samples / s")
    axis.set_title(f"scalability of {result.scenario}")
    axis.legend()
    figure.tight_layout()
    output = Path(path)
    figure.savefig(output, dpi=120)
    pyplot.close(figure)
    return output
