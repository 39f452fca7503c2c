"""Tests for flexpar.observe.plot: the timeline figure of a metrics file (matplotlib's Agg canvas)."""

from __future__ import annotations

import struct
import sys

import pytest
from metrics_pieces import CHANGES, REBALANCE_STEPS, START_TIME, synthetic_run, write_run

from flexpar.observe.metrics import MetricsWriter
from flexpar.observe.plot import plot_timeline, rebalance_times, stall_gaps, step_spans

pytest.importorskip("matplotlib")


@pytest.fixture
def records() -> list[dict]:
    return synthetic_run()


@pytest.fixture
def metrics_file(tmp_path, records):
    path = tmp_path / "run" / "metrics.jsonl"
    write_run(path, records)
    return path


@pytest.fixture
def drawn(monkeypatch):
    """The figures plot_timeline saves, kept for inspection."""
    from matplotlib.figure import Figure

    figures = []
    save = Figure.savefig

    def keep(figure, *args, **kwargs):
        figures.append(figure)
        return save(figure, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", keep)
    return figures


def png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def vertical_line_positions(axis) -> list[float]:
    """x of every vertical line (axvline) drawn on `axis`."""
    positions = []
    for line in axis.get_lines():
        xs = list(line.get_xdata())
        if len(xs) == 2 and xs[0] == xs[1]:
            positions.append(float(xs[0]))
    return positions


# --- pure helpers -------------------------------------------------------------------


def test_step_spans_and_stall_gaps(records):
    steps = [record for record in records if record["kind"] == "step"]
    spans = step_spans(steps)
    assert all(start < end for start, end in spans)
    assert all(previous[1] <= current[0] + 1e-12 for previous, current in zip(spans, spans[1:]))
    gaps = stall_gaps(spans)
    # Exactly the steps preceded by a stall (a rebalance without stall is no gap).
    stalled = {step for step, _event, _devices, stall in CHANGES if stall > 0}
    assert [position + 1 for position, gap in enumerate(gaps) if gap] == sorted(stalled)


def test_rebalance_times(records):
    times = rebalance_times(records, START_TIME)
    assert len(times) == len(REBALANCE_STEPS) == 5
    assert times == sorted(times) and all(time > 0 for time in times)


# --- the figure ---------------------------------------------------------------------


def test_plot_timeline_renders_a_png(tmp_path, metrics_file):
    output = tmp_path / "plots" / "timeline.png"
    output.parent.mkdir()
    plot_timeline(metrics_file, output)
    data = output.read_bytes()
    width, height = png_size(data)
    assert 800 <= width <= 3000 and 800 <= height <= 3000
    assert len(data) > 10_000


def test_rebalances_are_ticks_on_the_vw_panel_not_event_lines(tmp_path, metrics_file, records, drawn):
    plot_timeline(metrics_file, tmp_path / "timeline.png")
    [figure] = drawn
    strip, throughput, loss, busy, assignment = figure.axes[:5]
    rebalances = rebalance_times(records, START_TIME)

    # Event lines: one per join, leave and failure, across every panel, none for rebalances.
    device_set_events = [
        record["time"] - START_TIME
        for record in records
        if record["kind"] == "event" and record["event"] in ("join", "leave", "failure")
    ]
    for axis in (strip, throughput, loss, busy, assignment):
        assert vertical_line_positions(axis) == pytest.approx(device_set_events)
    labels = [text.get_text() for text in strip.texts]
    assert not any("rebalance" in label for label in labels)
    assert any("+1 join (stall 0.21 s)" in label for label in labels)

    # Ticks: one short segment per rebalance at the top of the VW panel, counted in its legend.
    ticks = [
        segment
        for collection in assignment.collections
        if hasattr(collection, "get_segments")
        for segment in collection.get_segments()
    ]
    assert sorted(float(segment[0][0]) for segment in ticks) == pytest.approx(rebalances)
    assert all(segment[0][1] >= 0.9 for segment in ticks)  # axes coordinates: the top edge
    assert [text.get_text() for text in assignment.get_legend().get_texts()] == ["5 rebalances"]


def test_plot_timeline_with_many_devices_and_no_events(tmp_path, records, drawn):
    template = next(record for record in records if record["kind"] == "step")
    path = tmp_path / "many.jsonl"
    devices = [f"sim-{index}" for index in range(20)]
    with MetricsWriter(path) as writer:
        for step in range(30):
            busy = [0.01 * (1 + index % 3) for index in range(len(devices))]
            writer.write(
                {
                    **template,
                    "step": step,
                    "time": START_TIME + 0.05 * (step + 1),
                    "elapsed_s": 0.05 * (step + 1),
                    "loss": 1.0 / (step + 1),
                    "samples_per_s": 5000.0,
                    "step_time_s": 0.05,
                    "generation": 1,
                    "devices": devices,
                    "assignment": [2] * 20,
                    "busy_s": busy,
                    "imbalance": 2 / 3,
                    "lr": 0.1,
                }
            )
    output = tmp_path / "many.png"
    plot_timeline(path, output)
    assert png_size(output.read_bytes())[0] > 800
    assignment = drawn[0].axes[4]
    assert [text.get_text() for text in assignment.get_legend().get_texts()] == ["0 rebalances"]


def test_plot_timeline_without_step_records(tmp_path, records):
    path = tmp_path / "events.jsonl"
    with MetricsWriter(path) as writer:
        writer.write(records[0])
    with pytest.raises(ValueError, match="no step records"):
        plot_timeline(path, tmp_path / "out.png")
    assert not (tmp_path / "out.png").exists()


def test_plot_timeline_without_matplotlib(tmp_path, metrics_file, monkeypatch):
    for name in [name for name in sys.modules if name == "matplotlib" or name.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ImportError, match=r'pip install -e "\.\[plot\]"'):
        plot_timeline(metrics_file, tmp_path / "out.png")
