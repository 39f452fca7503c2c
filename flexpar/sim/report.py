"""Tables and JSON for simulation results (plain text: readable in a log and a test)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import List, Sequence

from .results import SimulationResult
from .scalability import ScalabilityResult


def _format_seconds(seconds: float) -> str:
    """Seconds, with the unit that keeps the number short (s, min or h)."""
    if not math.isfinite(seconds):
        return "-"
    if seconds < 120:
        return f"{seconds:.2f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.2f} h"


def _render(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Columns padded to their widest cell; the first column left-aligned, the rest right."""
    widths = [max(len(str(row[column])) for row in [header, *rows]) for column in range(len(header))]

    def line(cells: Sequence[str]) -> str:
        parts = [str(cells[0]).ljust(widths[0])]
        parts += [str(cell).rjust(width) for cell, width in zip(cells[1:], widths[1:])]
        return "  ".join(parts).rstrip()

    rule = "  ".join("-" * width for width in widths)
    return "\n".join([line(header), rule, *(line(row) for row in rows)])


def comparison_table(results: Sequence[SimulationResult]) -> str:
    """One row per policy: throughput, time to N steps, stall, lost work, imbalance."""
    header = [
        "policy",
        "samples/s",
        "time to N steps",
        "stall",
        "joins' lost",
        "lost work",
        "imbalance (median)",
        "step (median)",
        "joins/leaves/failures",
    ]
    rows: List[List[str]] = []
    for result in results:
        time_to_n = _format_seconds(result.total_time_s)
        if not result.completed:
            time_to_n = f"incomplete ({result.completed_steps}/{result.target_steps})"
        rows.append(
            [
                result.label,
                f"{result.samples_per_s:,.0f}",
                time_to_n,
                _format_seconds(result.stall_s),
                _format_seconds(result.join_lost_s),
                _format_seconds(result.lost_work_s),
                f"{result.imbalance_median:.3f}",
                _format_seconds(result.step_time_median_s),
                f"{result.count('join')}/{result.count('leave')}/{result.count('failure')}",
            ]
        )
    title = (
        f"scenario {results[0].scenario}: {results[0].target_steps} steps of {results[0].global_batch} samples"
        if results
        else "no results"
    )
    return title + "\n" + _render(header, rows)


def joins_table(result: SimulationResult) -> str:
    """One row per join of a run: the way it took, the boundary stall beside the members' lost time."""
    header = ["join", "at", "way", "boundary stall", "members' lost", "stream steps", "joiner's first VW"]
    stalls = {event.device_ids: event.stall_s for event in result.events if event.kind == "join"}
    rows = [
        [
            ", ".join(event.device_ids),
            _format_seconds(event.time_s),
            event.way,
            _format_seconds(stalls.get(event.device_ids, event.stall_s)),
            _format_seconds(event.members_lost_s),
            str(event.stream_steps) if event.way == "stream" else "-",
            _format_seconds(event.first_vw_s),
        ]
        for event in result.joins()
    ]
    return f"joins of {result.label}\n" + _render(header, rows)


def scalability_table(result: ScalabilityResult) -> str:
    """Samples per second per policy and device count, with the efficiency against linear scaling.

    Efficiency of a point = its samples/s per device over the same policy's
    samples/s per device at the smallest count.
    """
    header = ["devices"]
    for policy in result.policies:
        header += [f"{policy} samples/s", f"{policy} eff."]
    rows = []
    for index, count in enumerate(result.device_counts):
        row = [str(count)]
        for policy in result.policies:
            throughput = result.samples_per_s(policy)
            base_per_device = throughput[0] / result.device_counts[0]
            efficiency = throughput[index] / count / base_per_device if base_per_device > 0 else math.nan
            row += [f"{throughput[index]:,.0f}", f"{efficiency:.2f}"]
        rows.append(row)
    legend = ", ".join(f"{policy} = {result.labels[policy]}" for policy in result.policies)
    return f"scalability of {result.scenario} ({legend})\n" + _render(header, rows)


def comparison_summary(results: Sequence[SimulationResult]) -> dict:
    """JSON-ready: per policy summary and its event log."""
    return {
        "scenario": results[0].scenario if results else "",
        "policies": {
            result.policy: {**result.summary(), "events": [event.to_dict() for event in result.events]}
            for result in results
        },
    }


def write_json(data: dict, path) -> None:
    """Write ``data`` as indented JSON (non-finite floats as null, so any reader can load it)."""
    Path(path).write_text(json.dumps(_finite(data), indent=2, sort_keys=False) + "\n")


def _finite(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(item) for item in value]
    return value
