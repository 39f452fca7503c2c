"""Tests for flexpar.metrics: record schema, JSON lines, live display, timeline plot."""

from __future__ import annotations

import io
import json
import logging
import struct
import sys

import pytest

from flexpar.metrics import (
    EVENT_KEYS,
    EVENT_KINDS,
    STEP_KEYS,
    LiveDisplay,
    MetricsWriter,
    device_change,
    estimate_remaining_s,
    event_label,
    plot_timeline,
    read_records,
    stall_gaps,
    step_spans,
    validate_record,
)

START_TIME = 1_700_000_000.0
GLOBAL_BATCH = 256
VIRTUAL_WORKERS = 16
TOTAL_STEPS = 60

# Compute seconds per VW of each device: hostB-1 is slow, local-2 fast.
SECONDS_PER_VW = {"local-0": 0.020, "local-1": 0.022, "local-2": 0.012, "hostB-1": 0.045}

# (step at which the change applies, event, device set after it, stall seconds)
CHANGES = [
    (15, "join", ["local-0", "local-1", "local-2"], 0.21),
    (16, "rebalance", ["local-0", "local-1", "local-2"], 0.0),
    (30, "join", ["local-0", "local-1", "local-2", "hostB-1"], 0.34),
    (42, "failure", ["local-0", "local-2", "hostB-1"], 0.80),
    (52, "leave", ["local-0", "local-2"], 0.05),
]


def proportional_assignment(devices: list[str]) -> list[int]:
    """VWs inversely proportional to per-VW time, at least one each, summing to V."""
    speeds = [1.0 / SECONDS_PER_VW[device_id] for device_id in devices]
    shares = [max(1, int(VIRTUAL_WORKERS * speed / sum(speeds))) for speed in speeds]
    shares[shares.index(max(shares))] += VIRTUAL_WORKERS - sum(shares)
    return shares


def even_assignment(devices: list[str]) -> list[int]:
    base, extra = divmod(VIRTUAL_WORKERS, len(devices))
    return [base + (1 if rank < extra else 0) for rank in range(len(devices))]


def synthetic_run() -> list[dict]:
    """A realistic recorded run: 60 steps, two joins, a failure, a leave, a rebalance."""
    devices = ["local-0", "local-1"]
    assignment = even_assignment(devices)
    clock = START_TIME
    records = [
        {
            "kind": "event", "event": "start", "step": 0, "time": clock, "generation": 1,
            "devices": list(devices), "stall_s": 0.0, "detail": "2 local devices",
        }
    ]
    changes = {step: (event, members, stall) for step, event, members, stall in CHANGES}
    generation = 1
    loss = 2.3
    for step in range(TOTAL_STEPS):
        if step in changes:
            event, members, stall = changes[step]
            clock += stall
            if event == "rebalance":
                assignment = proportional_assignment(devices)
                detail = "assignment " + " ".join(map(str, assignment))
            else:
                generation += 1
                devices = list(members)
                # A new device set starts from an even split until it is measured.
                assignment = even_assignment(devices)
                detail = f"{event} at step {step}"
            records.append(
                {
                    "kind": "event", "event": event, "step": step, "time": clock,
                    "generation": generation, "devices": list(devices), "stall_s": stall,
                    "detail": detail,
                }
            )
        if step in (31, 43, 53):
            assignment = proportional_assignment(devices)
        # Deterministic jitter keeps the series realistic without a random generator.
        jitter = 1.0 + 0.05 * ((step * 7919) % 11 - 5) / 5
        busy = [round(count * SECONDS_PER_VW[d] * jitter, 6) for d, count in zip(devices, assignment)]
        step_time = max(busy) + 0.004
        clock += step_time
        loss = loss * 0.96 + 0.01
        records.append(
            {
                "kind": "step", "step": step, "time": clock, "elapsed_s": clock - START_TIME,
                "loss": loss, "samples_per_s": GLOBAL_BATCH / step_time, "step_time_s": step_time,
                "generation": generation, "devices": list(devices), "assignment": list(assignment),
                "busy_s": busy, "imbalance": (max(busy) - min(busy)) / max(busy), "lr": 0.001,
            }
        )
    records.append(
        {
            "kind": "event", "event": "end", "step": TOTAL_STEPS, "time": clock + 0.01,
            "generation": generation, "devices": list(devices), "stall_s": 0.0, "detail": "done",
        }
    )
    return records


@pytest.fixture
def records() -> list[dict]:
    return synthetic_run()


@pytest.fixture
def metrics_file(tmp_path, records):
    path = tmp_path / "run" / "metrics.jsonl"
    with MetricsWriter(path) as writer:
        for record in records:
            writer.write(record)
    return path


def step_record() -> dict:
    return next(record for record in synthetic_run() if record["kind"] == "step" and record["step"] == 35)


def event_record() -> dict:
    return next(record for record in synthetic_run() if record["kind"] == "event" and record["event"] == "join")


# --- schema -------------------------------------------------------------------


def test_synthetic_records_cover_the_schema_and_validate(records):
    for record in records:
        validate_record(record)
        expected = STEP_KEYS if record["kind"] == "step" else EVENT_KEYS
        assert tuple(record) == expected
    assert {record["event"] for record in records if record["kind"] == "event"} <= set(EVENT_KINDS)
    assert [record["step"] for record in records if record["kind"] == "step"] == list(range(TOTAL_STEPS))


STEP_BREAKAGES = [
    ("missing loss", lambda r: r.pop("loss"), "'loss'"),
    ("unknown key", lambda r: r.update(los=1.0), "'los'"),
    ("bool step", lambda r: r.update(step=True), "'step'"),
    ("negative step", lambda r: r.update(step=-1), "'step'"),
    ("string loss", lambda r: r.update(loss="0.5"), "'loss'"),
    ("generation zero", lambda r: r.update(generation=0), "'generation'"),
    ("nan throughput", lambda r: r.update(samples_per_s=float("nan")), "'samples_per_s'"),
    ("negative step time", lambda r: r.update(step_time_s=-0.1), "'step_time_s'"),
    ("devices not a list", lambda r: r.update(devices="local-0"), "'devices'"),
    ("no devices", lambda r: r.update(devices=[], assignment=[], busy_s=[]), "'devices'"),
    ("integer device id", lambda r: r["devices"].__setitem__(0, 3), "'devices[0]'"),
    ("repeated device", lambda r: r["devices"].__setitem__(1, r["devices"][0]), "'devices'"),
    ("zero VWs", lambda r: r["assignment"].__setitem__(0, 0), "'assignment[0]'"),
    ("float VWs", lambda r: r["assignment"].__setitem__(1, 2.0), "'assignment[1]'"),
    ("short busy", lambda r: r["busy_s"].pop(), "'busy_s'"),
    ("short assignment", lambda r: r["assignment"].pop(), "'assignment'"),
    ("negative busy", lambda r: r["busy_s"].__setitem__(0, -1.0), "'busy_s[0]'"),
    ("imbalance above one", lambda r: r.update(imbalance=1.5), "'imbalance'"),
    ("negative lr", lambda r: r.update(lr=-0.1), "'lr'"),
    ("unknown kind", lambda r: r.update(kind="steps"), "'kind'"),
    ("missing kind", lambda r: r.pop("kind"), "'kind'"),
]


@pytest.mark.parametrize("breakage", STEP_BREAKAGES, ids=[name for name, _, _ in STEP_BREAKAGES])
def test_bad_step_records_are_rejected_naming_the_field(breakage):
    _name, damage, field = breakage
    record = step_record()
    validate_record(record)
    damage(record)
    with pytest.raises(ValueError, match=field.replace("[", r"\[").replace("]", r"\]")):
        validate_record(record)


EVENT_BREAKAGES = [
    ("unknown event", lambda r: r.update(event="crash"), "'event'"),
    ("missing stall", lambda r: r.pop("stall_s"), "'stall_s'"),
    ("negative stall", lambda r: r.update(stall_s=-0.5), "'stall_s'"),
    ("detail not text", lambda r: r.update(detail=None), "'detail'"),
    ("infinite time", lambda r: r.update(time=float("inf")), "'time'"),
    ("step record key", lambda r: r.update(loss=0.1), "'loss'"),
]


@pytest.mark.parametrize("breakage", EVENT_BREAKAGES, ids=[name for name, _, _ in EVENT_BREAKAGES])
def test_bad_event_records_are_rejected_naming_the_field(breakage):
    _name, damage, field = breakage
    record = event_record()
    validate_record(record)
    damage(record)
    with pytest.raises(ValueError, match=field):
        validate_record(record)


def test_tolerated_values():
    record = step_record()
    record.update(loss=float("nan"), lr=0, devices=tuple(record["devices"]))
    validate_record(record)  # diverged loss, an int for a float, tuples from the balancer
    event = event_record()
    event.update(event="end", devices=[])
    validate_record(event)  # nobody left at the end
    with pytest.raises(ValueError, match="must be a dict"):
        validate_record([("kind", "step")])


# --- JSON lines -----------------------------------------------------------------


def test_writer_writes_one_flushed_line_per_record_and_creates_folders(tmp_path, records):
    path = tmp_path / "a" / "b" / "metrics.jsonl"
    writer = MetricsWriter(path)
    writer.write(records[0])
    writer.write(records[1])
    # Flushed: readable by another reader before close.
    assert read_records(path) == records[:2]
    writer.close()
    writer.close()
    lines = path.read_text().splitlines()
    assert [json.loads(line) for line in lines] == records[:2]
    with pytest.raises(ValueError, match="closed"):
        writer.write(records[2])


def test_writer_refuses_an_invalid_record_without_writing(tmp_path):
    path = tmp_path / "metrics.jsonl"
    with MetricsWriter(path) as writer:
        bad = step_record()
        bad["imbalance"] = 2.0
        with pytest.raises(ValueError, match="'imbalance'"):
            writer.write(bad)
        writer.write(step_record())
    assert len(path.read_text().splitlines()) == 1


def test_read_records_round_trips_nan_loss(tmp_path):
    record = step_record()
    record["loss"] = float("nan")
    path = tmp_path / "metrics.jsonl"
    with MetricsWriter(path) as writer:
        writer.write(record)
    [read] = read_records(path)
    assert read["loss"] != read["loss"]


def test_read_records_drops_a_truncated_last_line_only(tmp_path, metrics_file, records, caplog):
    text = metrics_file.read_text()
    truncated = tmp_path / "truncated.jsonl"
    truncated.write_text(text + json.dumps(step_record())[:40])
    with caplog.at_level(logging.WARNING, logger="flexpar"):
        assert read_records(truncated) == records
    assert "truncated" in caplog.text

    lines = text.splitlines()
    lines[3] = lines[3][:30]
    corrupt = tmp_path / "corrupt.jsonl"
    corrupt.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=r"corrupt\.jsonl:4: not valid JSON"):
        read_records(corrupt)

    invalid = tmp_path / "invalid.jsonl"
    bad = step_record()
    bad["generation"] = 0
    invalid.write_text(lines[0] + "\n" + json.dumps(bad) + "\n")
    with pytest.raises(ValueError, match=r"invalid\.jsonl:2: field 'generation'"):
        read_records(invalid)


# --- pure helpers -----------------------------------------------------------------


def test_device_change_and_event_labels():
    assert device_change(["a", "b"], ["b", "c", "d"]) == (["c", "d"], ["a"])
    join = {"event": "join", "devices": ["a", "b", "c"], "stall_s": 0.2149}
    assert event_label(join, ["a", "b"]) == "+1 join (stall 0.21 s)"
    failure = {"event": "failure", "devices": ["a"], "stall_s": 0.8}
    assert event_label(failure, ["a", "b", "c"]) == "-2 failure (stall 0.80 s)"
    assert event_label({"event": "leave", "devices": ["a"], "stall_s": 0.0}, ["a"]) == "leave"


def test_estimate_remaining_uses_the_mean_pace_since_the_first_step():
    assert estimate_remaining_s(0, 1.0, 0, 1.0, 60) is None
    # 10 steps in 5 s -> 0.5 s per step; steps 11..59 remain (49 steps).
    assert estimate_remaining_s(0, 1.0, 10, 6.0, 60) == pytest.approx(24.5)
    assert estimate_remaining_s(0, 0.0, 59, 30.0, 60) == 0.0


def test_step_spans_and_stall_gaps(records):
    steps = [record for record in records if record["kind"] == "step"]
    spans = step_spans(steps)
    assert all(start < end for start, end in spans)
    assert all(previous[1] <= current[0] + 1e-12 for previous, current in zip(spans, spans[1:]))
    gaps = stall_gaps(spans)
    # Exactly the steps preceded by a stall (a rebalance without stall is no gap).
    stalled = {step for step, _event, _devices, stall in CHANGES if stall > 0}
    assert [position + 1 for position, gap in enumerate(gaps) if gap] == sorted(stalled)


# --- live display -------------------------------------------------------------------


def test_live_display_logs_every_n_steps_and_every_event_without_a_terminal(records, caplog):
    caplog.set_level(logging.INFO, logger="flexpar")
    with LiveDisplay(TOTAL_STEPS, log_every=10, force_terminal=False) as display:
        assert not display.uses_rich
        for record in records:
            display.update(record)
    messages = [entry.getMessage() for entry in caplog.records if entry.name == "flexpar"]
    step_lines = [line for line in messages if line.startswith("step ")]
    assert [line.split()[1] for line in step_lines] == [f"{n}/60" for n in (10, 20, 30, 40, 50, 60)]
    assert "loss" in step_lines[0] and "samples/s" in step_lines[0] and "ETA" in step_lines[0]
    event_lines = [line for line in messages if line.startswith("event ")]
    events = [record for record in records if record["kind"] == "event"]
    assert [line.split()[1] for line in event_lines] == [record["event"] for record in events]
    assert any("+hostB-1" in line and "stall 0.34 s" in line for line in event_lines)
    failures = [entry for entry in caplog.records if "event failure" in entry.getMessage()]
    assert [entry.levelno for entry in failures] == [logging.WARNING]
    assert "-local-1" in failures[0].getMessage()


def test_live_display_defaults_to_logging_for_a_non_terminal_console(records, caplog):
    from rich.console import Console

    caplog.set_level(logging.INFO, logger="flexpar")
    display = LiveDisplay(TOTAL_STEPS, log_every=25, console=Console(file=io.StringIO()))
    assert not display.uses_rich
    for record in records:
        display.update(record)
    display.close()
    step_lines = [entry.getMessage() for entry in caplog.records if entry.getMessage().startswith("step ")]
    assert [line.split()[1] for line in step_lines] == ["25/60", "50/60", "60/60"]


def test_live_display_falls_back_to_logging_without_rich(records, caplog, monkeypatch):
    for name in [name for name in sys.modules if name == "rich" or name.startswith("rich.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "rich", None)  # makes `import rich...` raise ImportError
    caplog.set_level(logging.INFO, logger="flexpar")
    with LiveDisplay(TOTAL_STEPS, log_every=30, force_terminal=True) as display:
        assert not display.uses_rich
        for record in records:
            display.update(record)
    assert "pip install flexpar[display]" in caplog.text
    assert "step 30/60" in caplog.text and "event failure" in caplog.text


def test_live_display_renders_a_rich_panel_when_forced(records):
    from rich.console import Console

    buffer = io.StringIO()
    console = Console(file=buffer, width=120)
    display = LiveDisplay(TOTAL_STEPS, console=console, force_terminal=True)
    assert display.uses_rich
    for record in records:
        display.update(record)
    display.close()
    display.close()
    text = buffer.getvalue()
    last = [record for record in records if record["kind"] == "step"][-1]
    assert f"{last['loss']:.4g}" in text
    for device_id in last["devices"]:
        assert device_id in text
    assert "60/60" in text
    assert "imbalance" in text
    assert "failure" in text and "leave" in text  # recent events
    assert "local-1" not in text.split("recent events")[0]  # left the device table


def test_live_display_rejects_bad_arguments():
    with pytest.raises(ValueError, match="total_steps"):
        LiveDisplay(0, force_terminal=False)
    with pytest.raises(ValueError, match="log_every"):
        LiveDisplay(10, log_every=0, force_terminal=False)
    display = LiveDisplay(10, force_terminal=False)
    with pytest.raises(ValueError, match="'kind'"):
        display.update({"kind": "epoch"})


# --- plot -------------------------------------------------------------------------


def png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_plot_timeline_renders_a_png(tmp_path, metrics_file):
    output = tmp_path / "plots" / "timeline.png"
    output.parent.mkdir()
    plot_timeline(metrics_file, output)
    data = output.read_bytes()
    width, height = png_size(data)
    assert 800 <= width <= 3000 and 800 <= height <= 3000
    assert len(data) > 10_000


def test_plot_timeline_with_many_devices_and_no_events(tmp_path):
    path = tmp_path / "many.jsonl"
    devices = [f"sim-{index}" for index in range(20)]
    with MetricsWriter(path) as writer:
        for step in range(30):
            busy = [0.01 * (1 + index % 3) for index in range(len(devices))]
            writer.write(
                {
                    "kind": "step", "step": step, "time": START_TIME + 0.05 * (step + 1),
                    "elapsed_s": 0.05 * (step + 1), "loss": 1.0 / (step + 1), "samples_per_s": 5000.0,
                    "step_time_s": 0.05, "generation": 1, "devices": devices, "assignment": [2] * 20,
                    "busy_s": busy, "imbalance": 2 / 3, "lr": 0.1,
                }
            )
    output = tmp_path / "many.png"
    plot_timeline(path, output)
    assert png_size(output.read_bytes())[0] > 800


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
    with pytest.raises(ImportError, match=r"pip install flexpar\[plot\]"):
        plot_timeline(metrics_file, tmp_path / "out.png")
