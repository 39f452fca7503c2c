"""What the timeline plot (plot.py) shows of a metrics file's records: pure geometry, no matplotlib.

Each step's span on the wall-time axis, where training paused, the runs of
one generation, each device's series, the labelled device-set events and the
rebalances' times; and the x, y lines that break at a pause. plot.py draws
these on its panels.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

from flexpar.observe.metrics import DEVICE_SET_EVENTS, event_label


def device_order(steps: Sequence[Mapping[str, Any]]) -> list[str]:
    """Device ids in order of first appearance (stable colours and stacking)."""
    seen: dict[str, None] = {}
    for record in steps:
        for device_id in record["devices"]:
            seen.setdefault(device_id, None)
    return list(seen)


def per_device_series(
    steps: Sequence[Mapping[str, Any]], devices: Sequence[str], field: str, absent: float
) -> list[list[float]]:
    """For each device, `field` per step; `absent` where the device was not in the step."""
    series = {device_id: [absent] * len(steps) for device_id in devices}
    for position, record in enumerate(steps):
        for device_id, value in zip(record["devices"], record[field]):
            series[device_id][position] = float(value)
    return [series[device_id] for device_id in devices]


def step_spans(steps: Sequence[Mapping[str, Any]]) -> list[tuple[float, float]]:
    """(start, end) wall seconds of each step: end is its commit, start end - step_time_s.

    A start is clamped to the previous end, so spans never overlap even when a
    step's own clock read slightly more than the wall time between commits.
    """
    spans: list[tuple[float, float]] = []
    previous_end = -math.inf
    for record in steps:
        end = record["elapsed_s"]
        start = max(end - record["step_time_s"], min(previous_end, end))
        spans.append((start, end))
        previous_end = end
    return spans


def stall_gaps(spans: Sequence[tuple[float, float]]) -> list[bool]:
    """For each step after the first: did training pause before it?

    A pause is a gap between the previous commit and this step's start longer
    than a quarter of this step (stalls, checkpoints, a hung peer). Lines and
    areas are broken there instead of being drawn across time nothing ran.
    """
    gaps = []
    for (_, previous_end), (start, end) in zip(spans, spans[1:]):
        gaps.append(start - previous_end > 0.25 * max(end - start, 1e-9))
    return gaps


def broken_line(times: Sequence[float], values: Sequence[float], gaps: Sequence[bool]):
    """x, y with a NaN point inserted at every gap, which matplotlib draws as a break."""
    xs, ys = [times[0]], [values[0]]
    for position in range(1, len(times)):
        if gaps[position - 1]:
            xs.append(0.5 * (times[position - 1] + times[position]))
            ys.append(math.nan)
        xs.append(times[position])
        ys.append(values[position])
    return xs, ys


def step_outline(spans, values: Sequence[float], gaps: Sequence[bool]):
    """x, y tracing a piecewise constant value over each step's span, NaN across gaps."""
    xs: list[float] = []
    ys: list[float] = []
    for position, ((start, end), value) in enumerate(zip(spans, values)):
        if position > 0 and gaps[position - 1]:
            xs.append(0.5 * (spans[position - 1][1] + start))
            ys.append(math.nan)
        xs.extend((start, end))
        ys.extend((value, value))
    return xs, ys


def labelled_events(records: Sequence[Mapping[str, Any]]) -> list[tuple[Mapping[str, Any], str]]:
    """(event, label) for each join/leave/failure, labelled against the set before it."""
    labelled = []
    devices: Sequence[str] = ()
    for record in records:
        if record["kind"] == "event" and record["event"] in DEVICE_SET_EVENTS:
            labelled.append((record, event_label(record, devices)))
        devices = record["devices"]
    return labelled


def rebalance_times(records: Sequence[Mapping[str, Any]], origin: float) -> list[float]:
    """Wall seconds since the start (``time - origin``) of each rebalance event, in file order."""
    return [
        record["time"] - origin for record in records if record["kind"] == "event" and record["event"] == "rebalance"
    ]


def generation_spans(steps, spans) -> list[tuple[int, float, float]]:
    """(generation, first step start, last step end) for each run of one generation."""
    result: list[tuple[int, float, float]] = []
    for record, (start, end) in zip(steps, spans):
        if result and result[-1][0] == record["generation"]:
            result[-1] = (result[-1][0], result[-1][1], end)
        else:
            result.append((record["generation"], start, end))
    return result
