"""The timeline plot of a metrics file: ``plot_timeline`` and its panels.

Reads the records with ``flexpar.observe.metrics.read_records`` and draws stacked
panels over wall time; what they show (step spans, pauses, per-device series,
labelled events) is worked out in timeline.py. ``matplotlib`` is imported only
when a plot is drawn (``flexpar[plot]``); the figure is drawn on an Agg canvas
directly, so pyplot's global backend is never touched.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

from flexpar.observe.metrics import eval_means, read_records
from flexpar.observe.timeline import (
    broken_line,
    device_order,
    generation_spans,
    labelled_events,
    per_device_series,
    rebalance_times,
    stall_gaps,
    step_outline,
    step_spans,
)

# ---------------------------------------------------------------------------
# Timeline plot
# ---------------------------------------------------------------------------

_EVENT_COLORS = {"join": "#2ca02c", "leave": "#ff7f0e", "failure": "#d62728"}
_REBALANCE_COLOR = "0.15"


def _import_matplotlib():
    try:
        import matplotlib  # noqa: F401
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise ImportError('plot_timeline needs matplotlib: pip install -e ".[plot]" in flexpar\'s checkout') from None
    return Figure, FigureCanvasAgg


def plot_timeline(metrics_path, output_path) -> None:
    """Draw a metrics file as a PNG (or any format matplotlib infers from `output_path`).

    Stacked panels share the x axis (wall seconds since the job started): an
    event strip, throughput, loss, per-device busy time per step (with each
    step's wall time) and the VWs per device as a stacked area. Each join,
    leave and failure is a vertical line across all panels, labelled in the
    strip with the change and the stall, e.g. "+1 join (stall 0.21 s)"; the
    stall itself, which ends at the event's time, is shaded. Rebalances are
    no event lines: each is a small tick at the top of the VW panel, whose
    legend counts them ("7 rebalances"). Evaluations are diamonds in the
    strip and, with ``loss_sum`` and ``count``, mean losses on the loss
    panel. Lines break where training paused. Devices that exist in only
    part of the run appear only there; alternate generations are shaded grey.

    Raises ValueError when the file holds no step records and ImportError
    (with the pip command) when matplotlib is missing. Draws on an Agg canvas
    directly, so pyplot's global backend is never touched.
    """
    records = read_records(metrics_path)
    steps = [record for record in records if record["kind"] == "step"]
    if not steps:
        raise ValueError(f"{metrics_path}: no step records to plot (it holds {len(records)} event records)")
    Figure, FigureCanvasAgg = _import_matplotlib()

    # elapsed_s counts from the job's start; the same origin places events (unix time).
    origin = steps[0]["time"] - steps[0]["elapsed_s"]
    times = [record["elapsed_s"] for record in steps]
    spans = step_spans(steps)
    gaps = stall_gaps(spans)
    devices = device_order(steps)
    colors = _device_colors(devices)
    events = labelled_events(records)

    figure = Figure(figsize=(11, 11.5), dpi=110, layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(5, 1, sharex=True, height_ratios=[0.75, 1.0, 1.0, 1.3, 1.1])
    strip_axis, throughput_axis, loss_axis, busy_axis, assignment_axis = axes
    data_axes = axes[1:]

    end = max([times[-1]] + [event["time"] - origin for event, _ in events])
    assignment_axis.set_xlim(0.0, end * 1.01 if end > 0 else 1.0)
    generation_runs = generation_spans(steps, spans)
    _shade_generations(axes, generation_runs)
    _draw_strip(strip_axis, generation_runs, end)
    _draw_throughput(throughput_axis, times, steps, gaps)
    _draw_loss(loss_axis, times, steps, gaps)
    _draw_busy(busy_axis, times, steps, gaps, devices, colors)
    _draw_assignment(assignment_axis, spans, steps, gaps, devices, colors)
    _draw_rebalances(assignment_axis, rebalance_times(records, origin))
    _draw_events(strip_axis, data_axes, events, origin)
    _draw_evals(strip_axis, loss_axis, [record for record in records if record["kind"] == "eval"])

    assignment_axis.set_xlabel("wall time since start (s)")
    generations = sorted({record["generation"] for record in steps})
    figure.suptitle(
        f"flexpar run: {len(steps)} steps in {times[-1]:.1f} s on {len(devices)} devices "
        f"(generations {generations[0]}-{generations[-1]})",
        fontsize=12,
    )
    figure.savefig(output_path)


def _device_colors(devices: Sequence[str]) -> dict[str, Any]:
    from matplotlib import colormaps

    palette = colormaps["tab10" if len(devices) <= 10 else "tab20"]
    return {device_id: palette(position % palette.N) for position, device_id in enumerate(devices)}


def _shade_generations(axes, generation_spans) -> None:
    # Alternate light bands make "which steps ran on which device set" readable.
    for position, (_generation, start, end) in enumerate(generation_spans):
        if position % 2 == 1:
            for axis in axes:
                axis.axvspan(start, end, color="0.94", zorder=0, linewidth=0)


def _style(axis, ylabel: str) -> None:
    axis.set_ylabel(ylabel)
    axis.set_axisbelow(True)
    axis.grid(True, axis="y", color="0.88", linewidth=0.6)
    axis.spines[["top", "right"]].set_visible(False)


def _markers(count: int) -> dict[str, Any]:
    # Markers help on short runs and only blur long ones.
    return {"marker": "o", "markersize": 2.5} if count <= 200 else {}


def _draw_strip(axis, generation_spans, end: float) -> None:
    axis.set_ylim(0.0, 1.0)
    axis.set_yticks([])
    axis.spines[["top", "right", "left"]].set_visible(False)
    axis.set_ylabel("events")
    for generation, start, stop in generation_spans:
        # Narrow generations get a short name or none: it would collide with the event labels.
        share = (stop - start) / end if end > 0 else 1.0
        name = f"generation {generation}" if share > 0.13 else f"gen {generation}" if share > 0.06 else ""
        if name:
            axis.text(0.5 * (start + stop), 0.97, name, ha="center", va="top", fontsize=8, color="0.35")


def _draw_throughput(axis, times, steps, gaps) -> None:
    values = [record["samples_per_s"] for record in steps]
    axis.plot(*broken_line(times, values, gaps), color="#1f77b4", linewidth=1.4, **_markers(len(steps)))
    axis.set_ylim(bottom=0.0, top=max(values) * 1.1 if max(values) > 0 else 1.0)
    _style(axis, "throughput\n(samples/s)")


def _draw_loss(axis, times, steps, gaps) -> None:
    values = [record["loss"] for record in steps]
    finite = [value for value in values if math.isfinite(value)]
    axis.plot(*broken_line(times, values, gaps), color="#9467bd", linewidth=1.4, **_markers(len(steps)))
    # Loss curves spanning decades read better on a log scale.
    if finite and min(finite) > 0 and max(finite) / min(finite) > 20:
        axis.set_yscale("log")
    _style(axis, "loss")


_MOST_DEVICE_LINES = 16


def _draw_busy(axis, times, steps, gaps, devices, colors) -> None:
    if len(devices) <= _MOST_DEVICE_LINES:
        series = per_device_series(steps, devices, "busy_s", math.nan)
        for device_id, values in zip(devices, series):
            axis.plot(
                *broken_line(times, values, gaps),
                color=colors[device_id],
                linewidth=1.2,
                label=device_id,
                **_markers(len(steps)),
            )
    else:
        # Dozens of overlapping lines say nothing; the spread across devices does.
        lowest = [min(record["busy_s"]) for record in steps]
        highest = [max(record["busy_s"]) for record in steps]
        xs, lows = broken_line(times, lowest, gaps)
        _, highs = broken_line(times, highest, gaps)
        axis.fill_between(
            xs, lows, highs, color="#1f77b4", alpha=0.3, linewidth=0, label=f"min-max of {len(devices)} devices"
        )
        medians = [sorted(record["busy_s"])[len(record["busy_s"]) // 2] for record in steps]
        axis.plot(*broken_line(times, medians, gaps), color="#1f77b4", linewidth=1.0, label="median device")
    axis.plot(
        *broken_line(times, [record["step_time_s"] for record in steps], gaps),
        color="black",
        linestyle=(0, (3, 2)),
        linewidth=1.0,
        label="step wall time",
    )
    mean_imbalance = sum(record["imbalance"] for record in steps) / len(steps)
    axis.legend(
        title=f"mean imbalance {100.0 * mean_imbalance:.1f}%",
        loc="upper left",
        bbox_to_anchor=(1.005, 1.0),
        fontsize=8,
        title_fontsize=8,
        frameon=False,
        alignment="left",
    )
    axis.set_ylim(bottom=0.0)
    _style(axis, "busy time\nper step (s)")


def _draw_assignment(axis, spans, steps, gaps, devices, colors) -> None:
    from matplotlib.ticker import MaxNLocator

    series = per_device_series(steps, devices, "assignment", 0.0)
    baseline = [0.0] * len(steps)
    for device_id, values in zip(devices, series):
        top = [low + count for low, count in zip(baseline, values)]
        xs, lows = step_outline(spans, baseline, gaps)
        _, highs = step_outline(spans, top, gaps)
        axis.fill_between(xs, lows, highs, color=colors[device_id], alpha=0.85, linewidth=0)
        baseline = top
    axis.set_ylim(0.0, max(baseline) * 1.1)  # headroom for the rebalance ticks at the top
    axis.yaxis.set_major_locator(MaxNLocator(integer=True))
    _style(axis, "virtual workers\nper device")


def _draw_rebalances(axis, times: Sequence[float]) -> None:
    """A short tick at the top of the VW panel per rebalance, and their count in its legend.

    Rebalances change no device set and may be many; as event lines they
    would hide the joins and leaves. The ticks hang from the top edge (axes
    coordinates), so they never cover the stacked areas' values.
    """
    from matplotlib.lines import Line2D

    count = len(times)
    if times:
        axis.vlines(
            times, 0.94, 1.0, transform=axis.get_xaxis_transform(), color=_REBALANCE_COLOR, linewidth=0.8, zorder=3
        )
    noun = "rebalance" if count == 1 else "rebalances"
    handle = Line2D([], [], color=_REBALANCE_COLOR, marker="|", linestyle="none", markersize=8)
    axis.legend(
        [handle],
        [f"{count} {noun}"],
        loc="upper left",
        bbox_to_anchor=(1.005, 1.0),
        fontsize=8,
        frameon=False,
        handletextpad=0.3,
    )


def _draw_events(strip_axis, data_axes, events, origin: float) -> None:
    for event, label in events:
        position = event["time"] - origin
        color = _EVENT_COLORS[event["event"]]
        for axis in (strip_axis, *data_axes):
            if event["stall_s"] > 0:
                # The event's time is when the change took effect: the stall ends there.
                axis.axvspan(position - event["stall_s"], position, color=color, alpha=0.12, linewidth=0, zorder=0.5)
            axis.axvline(position, color=color, linewidth=1.1, linestyle=(0, (4, 2)), zorder=1)
        strip_axis.text(
            position,
            0.03,
            label + " ",
            rotation=90,
            ha="right",
            va="bottom",
            fontsize=8,
            color=color,
            fontweight="bold",
            transform=strip_axis.get_xaxis_transform(),
        )


def _draw_evals(strip_axis, loss_axis, evals: Sequence[Mapping[str, Any]]) -> None:
    """Evaluations: a diamond in the event strip at each, and on the loss panel the evaluation's mean
    loss (`loss_sum / count`) where it has one, labelled in a legend."""
    if not evals:
        return
    times = [record["elapsed_s"] for record in evals]
    left, right = strip_axis.get_xlim()
    if max(times) * 1.01 > right:  # the evaluation after the last step ends after it
        strip_axis.set_xlim(left, max(times) * 1.01)
    strip_axis.plot(
        times,
        [0.55] * len(times),
        linestyle="none",
        marker="D",
        markersize=4,
        color="#2ca02c",
        transform=strip_axis.get_xaxis_transform(),
        label="evaluation",
    )
    strip_axis.legend(loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=8, frameon=False)
    losses = [(position, eval_means(record["metrics"]).get("loss")) for record, position in zip(evals, times)]
    losses = [(position, value) for position, value in losses if value is not None and math.isfinite(value)]
    if losses:
        loss_axis.plot(
            [position for position, _ in losses],
            [value for _, value in losses],
            linestyle="none",
            marker="D",
            markersize=5,
            color="#2ca02c",
            label="evaluation (loss_sum / count)",
        )
        loss_axis.plot([], [], color="#9467bd", label="training (global batch)")
        loss_axis.legend(loc="upper right", fontsize=8, frameon=False)
