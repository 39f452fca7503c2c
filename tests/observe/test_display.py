"""Tests for flexpar.observe.display: the live panel, the plain log lines and the rebalance summary."""

from __future__ import annotations

import io
import logging
import sys

import pytest
from metrics_pieces import REBALANCE_STEPS, TOTAL_STEPS, event_record, step_record, synthetic_run

from flexpar.observe.display import LiveDisplay
from flexpar.observe.log_lines import (
    estimate_remaining_s,
    format_duration,
    format_optimizer_bytes,
    format_rebalance_line,
    format_rebalance_summary,
    format_sharding,
    format_step_line,
)


@pytest.fixture
def records() -> list[dict]:
    return synthetic_run()


def flexpar_lines(caplog) -> list[logging.LogRecord]:
    return [entry for entry in caplog.records if entry.name == "flexpar"]


def run_plain(records, caplog, log_every: int, upto: int = None) -> LiveDisplay:
    """Feed `records` (the first `upto` of them) to a plain-mode display and close it."""
    caplog.set_level(logging.INFO, logger="flexpar")
    with LiveDisplay(TOTAL_STEPS, log_every=log_every, force_terminal=False) as display:
        assert not display.uses_rich
        for record in records[:upto]:
            display.update(record)
    return display


# --- pure helpers -------------------------------------------------------------------


def test_estimate_remaining_uses_the_mean_pace_since_the_first_step():
    assert estimate_remaining_s(0, 1.0, 0, 1.0, 60) is None
    # 10 steps in 5 s -> 0.5 s per step; steps 11..59 remain (49 steps).
    assert estimate_remaining_s(0, 1.0, 10, 6.0, 60) == pytest.approx(24.5)
    assert estimate_remaining_s(0, 0.0, 59, 30.0, 60) == 0.0
    assert format_duration(65.4) == "0:01:05" and format_duration(None) == "?"


def test_rebalance_line_and_summary_texts():
    assert format_rebalance_line(3, 40, ["local-0", "local-1"], [9, 7]) == (
        "3 rebalances since step 40, now local-0:9 local-1:7"
    )
    assert format_rebalance_line(1, 0, ["a"], [4]) == "1 rebalance since step 0, now a:4"
    last = {"event": "rebalance", "step": 812, "detail": "[8, 8] -> [9, 7]"}
    assert format_rebalance_summary(7, last) == "rebalances: 7 (last at step 812: 8,8 -> 9,7)"
    assert format_rebalance_summary(2, {**last, "detail": "moved"}) == "rebalances: 2 (last at step 812)"


def restarted_driver_run() -> list:
    """A driver restarted after an hour's gap: steps 0-19 at 1 s a step, an `adopt` event, then steps
    20-29 at 1 s a step (elapsed counts from the job's first start, the gap included)."""
    devices, records = ["local-0", "local-1"], []
    for step in range(30):
        if step == 20:
            adopt = event_record("adopt", 20, 3620.0, 2, devices, 0.5, "re-adopted by a restarted driver")
            records.append(dict(adopt, no_driver_s=3600.0, steps_lost=0))
        elapsed = step + 1.0 + (3600.0 if step >= 20 else 0.0)
        records.append(dict(step_record(step, 0.0, 1.0, 1, devices, [2, 2]), elapsed_s=elapsed, time=elapsed))
    return records


def test_the_eta_after_a_driver_restart_uses_the_pace_since_the_restart(caplog):
    """The remaining time after a driver restart: 30 steps remain at 1 s a step; the hour without a
    driver is no part of the pace."""
    run_plain(restarted_driver_run(), caplog, log_every=10)
    lines = [entry.getMessage() for entry in flexpar_lines(caplog) if entry.getMessage().startswith("step ")]
    assert lines[-1].startswith("step 29 (30/60 done, 50%)") and lines[-1].endswith("ETA 0:00:30"), lines
    from rich.console import Console

    display = LiveDisplay(TOTAL_STEPS, console=Console(file=io.StringIO(), width=120), force_terminal=True)
    for record in restarted_driver_run():
        display.update(record)
    text = rendered_text(display)
    display.close()
    assert "30/60" in text and "ETA 0:00:30" in text, text


# --- plain mode (no terminal, --no-display) -----------------------------------------


def test_plain_mode_logs_steps_events_and_one_rebalance_line_per_log_interval(records, caplog):
    display = run_plain(records, caplog, log_every=10)
    messages = [entry.getMessage() for entry in flexpar_lines(caplog)]
    step_lines = [line for line in messages if line.startswith("step ")]
    # Numbered as the metrics file numbers them (from 0), with the count done (the display said "step 10/60"
    # for the metrics file's step 9).
    assert [line.split("%")[0] for line in step_lines] == [
        f"step {n - 1} ({n}/60 done, {n * 100 / 60:.0f}" for n in (10, 20, 30, 40, 50, 60)
    ]
    assert "loss" in step_lines[0] and "samples/s" in step_lines[0] and "ETA" in step_lines[0]

    # Every event except rebalances has its own line, in order.
    event_lines = [line for line in messages if line.startswith("event ")]
    events = [record for record in records if record["kind"] == "event" and record["event"] != "rebalance"]
    assert [line.split()[1] for line in event_lines] == [record["event"] for record in events]
    assert not any("event rebalance" in line for line in messages)
    assert any("+hostB-1" in line and "stall 0.34 s" in line for line in event_lines)

    # Rebalances at steps 16, 17, 18, 33 and 47: one summary line with the step
    # line of each interval that had any, naming the split in force then.
    rebalance_lines = [line for line in messages if "since step" in line]
    assert rebalance_lines == [
        "3 rebalances since step 10, now local-0:4 local-1:4 local-2:8",
        "1 rebalance since step 30, now local-0:3 local-1:3 local-2:8 hostB-1:2",
        "1 rebalance since step 40, now local-0:5 local-2:9 hostB-1:2",
    ]
    # Each follows its interval's step line.
    for line in rebalance_lines:
        assert messages[messages.index(line) - 1].startswith("step ")
    assert display.rebalance_count == len(REBALANCE_STEPS) == 5


def test_plain_mode_warns_of_failures_refusals_and_schedule_entries(records, caplog):
    run_plain(records, caplog, log_every=10)
    levels = {
        entry.getMessage().split()[1]: entry.levelno
        for entry in flexpar_lines(caplog)
        if entry.getMessage().startswith("event ")
    }
    assert levels == {
        "start": logging.INFO,
        "join": logging.INFO,
        "schedule": logging.WARNING,
        "failure": logging.WARNING,
        "leave": logging.INFO,
        "end": logging.INFO,
    }
    failure = next(entry.getMessage() for entry in flexpar_lines(caplog) if "event failure" in entry.getMessage())
    assert "-local-1" in failure
    schedule = next(entry.getMessage() for entry in flexpar_lines(caplog) if "event schedule" in entry.getMessage())
    assert "was refused: over --max-devices 4" in schedule


def test_plain_mode_gives_a_stop_and_a_refused_joiner_their_own_lines(caplog):
    caplog.set_level(logging.INFO, logger="flexpar")
    stop = {
        **event_record("stop", 42, 1_700_000_010.0, 3, ["local-0"], 0.0, "SIGTERM to the driver; stopped after step 42")
    }
    refused = {**stop, "event": "refused", "detail": "hostC-0: wrong secret"}
    with LiveDisplay(60, force_terminal=False) as display:
        display.update(stop)
        display.update(refused)
    entries = flexpar_lines(caplog)
    assert [(entry.getMessage().split()[1], entry.levelno) for entry in entries] == [
        ("stop", logging.INFO),
        ("refused", logging.WARNING),
    ]
    assert "SIGTERM to the driver" in entries[0].getMessage()


def test_plain_mode_with_a_long_interval_sums_up_all_rebalances_once(records, caplog):
    run_plain(records, caplog, log_every=100)
    messages = [entry.getMessage() for entry in flexpar_lines(caplog)]
    assert [line for line in messages if line.startswith("step ")][0].startswith("step 59 (60/60 done, 100%)")
    assert [line for line in messages if "since step" in line] == ["5 rebalances since step 0, now local-0:8 local-2:8"]


def test_closing_reports_rebalances_not_yet_reported(records, caplog):
    # Stop feeding after step 17 (index 17 is the 18th step): the rebalances at
    # 16 and 17 came after the step-10 line, and the job ends before step 20.
    upto = next(index for index, record in enumerate(records) if record["kind"] == "step" and record["step"] == 17) + 1
    display = run_plain(records, caplog, log_every=10, upto=upto)
    messages = [entry.getMessage() for entry in flexpar_lines(caplog)]
    assert messages[-1] == "2 rebalances since step 10, now local-0:5 local-1:4 local-2:7"
    assert display.rebalance_count == 2
    display.close()  # closing again logs nothing more
    assert len(flexpar_lines(caplog)) == len(messages)


def test_plain_mode_is_the_default_for_a_non_terminal_console(records, caplog):
    from rich.console import Console

    caplog.set_level(logging.INFO, logger="flexpar")
    display = LiveDisplay(TOTAL_STEPS, log_every=25, console=Console(file=io.StringIO()))
    assert not display.uses_rich
    for record in records:
        display.update(record)
    display.close()
    step_lines = [entry.getMessage() for entry in caplog.records if entry.getMessage().startswith("step ")]
    assert [line.split(" (")[0] for line in step_lines] == ["step 24", "step 49", "step 59"]


def test_plain_mode_without_rich(records, caplog, monkeypatch):
    for name in [name for name in sys.modules if name == "rich" or name.startswith("rich.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "rich", None)  # makes `import rich...` raise ImportError
    caplog.set_level(logging.INFO, logger="flexpar")
    with LiveDisplay(TOTAL_STEPS, log_every=30, force_terminal=True) as display:
        assert not display.uses_rich
        for record in records:
            display.update(record)
    assert 'pip install -e ".[display]"' in caplog.text
    assert "step 29 (30/60 done, 50%)" in caplog.text and "event failure" in caplog.text
    assert "3 rebalances since step 0" in caplog.text and "2 rebalances since step 30" in caplog.text


# --- rich mode --------------------------------------------------------------------


def rendered_text(display: LiveDisplay) -> str:
    from rich.console import Console

    buffer = io.StringIO()
    Console(file=buffer, width=120).print(display._render())
    return buffer.getvalue()


def test_rich_panel_sums_up_rebalances_in_one_line(records):
    from rich.console import Console

    buffer = io.StringIO()
    display = LiveDisplay(TOTAL_STEPS, console=Console(file=buffer, width=120), force_terminal=True)
    assert display.uses_rich
    for record in records:
        display.update(record)
    text = rendered_text(display)
    display.close()
    display.close()
    last = [record for record in records if record["kind"] == "step"][-1]
    assert f"{last['loss']:.4g}" in text and "60/60" in text and "imbalance" in text
    for device_id in last["devices"]:
        assert device_id in text
    assert "local-1" not in text.split("recent events")[0]  # it left the device table
    assert display.rebalance_count == 5
    assert "rebalances: 5 (last at step 47: 6,5,5 -> 5,9,2)" in text
    # The recent events are the last five others: rebalances push nothing out.
    recent = text.split("recent events")[1]
    assert "rebalance" not in recent
    assert "+hostB-1" in recent and "schedule" in recent and "failure" in recent and "leave" in recent
    assert "rebalances: 5" in buffer.getvalue()  # the panel's final state, as drawn


def test_each_devices_optimizer_bytes_in_the_log_line_and_the_panels_device_table(records):
    from rich.console import Console

    assert format_optimizer_bytes([201_326_592] * 2) == "optimizer 201.3 MB per device"
    assert format_optimizer_bytes([134_217_728, 100_663_296, 134_217_728]) == "optimizer 100.7-134.2 MB per device"
    step = [record for record in records if record["kind"] == "step"][-1]
    assert "optimizer" not in format_step_line(step, TOTAL_STEPS, 1.0)  # a record without the key
    sharded = {**step, "optimizer_bytes": [3_145_728 * (rank + 1) for rank in range(len(step["devices"]))]}
    line = format_step_line(sharded, TOTAL_STEPS, 1.0)
    assert line.endswith(f" | optimizer 3.1-{3.145728 * len(step['devices']):.1f} MB per device"), line
    display = LiveDisplay(TOTAL_STEPS, console=Console(file=io.StringIO(), width=120), force_terminal=True)
    display.update(sharded)
    table = rendered_text(display).split("recent events")[0]
    display.close()
    assert "optimizer" in table
    for rank, device_id in enumerate(sharded["devices"]):
        row = next(row for row in table.splitlines() if row.lstrip().startswith(device_id))
        assert row.rstrip().endswith(f"{3.145728 * (rank + 1):.1f} MB"), row


def test_a_sharded_jobs_display_says_so_and_a_streaming_joiner_shows_no_optimizer_size(records):
    """The banner and display did not say that the optimizer is sharded nor its redundancy, and a joiner
    at 0% of its stream showed the full optimizer size (what it is still receiving)."""
    from rich.console import Console

    assert format_sharding(False, None) == ""
    assert format_sharding(True, None) == "sharded by elements, redundancy 2"
    assert format_sharding("parameters", 1) == "sharded by parameters, redundancy 1"
    step = [record for record in records if record["kind"] == "step"][-1]
    devices = step["devices"]
    joiner = devices[-1]
    sharded = {
        **step,
        "optimizer_bytes": [3_145_728] * (len(devices) - 1) + [12_582_912],  # the joiner: the whole state
        "joining": {joiner: 0.0},
    }
    line = format_step_line(sharded, TOTAL_STEPS, 1.0, "sharded by elements, redundancy 2")
    assert line.endswith(" | optimizer 3.1 MB per device (sharded by elements, redundancy 2)"), line
    display = LiveDisplay(
        TOTAL_STEPS,
        console=Console(file=io.StringIO(), width=160),
        force_terminal=True,
        sharding="sharded by elements, redundancy 2",
    )
    display.update(sharded)
    table = rendered_text(display).split("recent events")[0]
    display.close()
    assert "optimizer (sharded by elements, redundancy 2)" in table, table
    row = next(row for row in table.splitlines() if row.lstrip().startswith(joiner))
    assert row.rstrip().endswith("streaming") and "12.6 MB" not in row, row


def test_rich_panel_without_rebalances_shows_no_rebalance_line(records):
    from rich.console import Console

    display = LiveDisplay(TOTAL_STEPS, console=Console(file=io.StringIO(), width=120), force_terminal=True)
    for record in records:
        if record.get("event") != "rebalance":
            display.update(record)
    text = rendered_text(display)
    display.close()
    assert display.rebalance_count == 0
    assert "rebalances:" not in text


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="total_steps"):
        LiveDisplay(0, force_terminal=False)
    with pytest.raises(ValueError, match="log_every"):
        LiveDisplay(10, log_every=0, force_terminal=False)
    display = LiveDisplay(10, force_terminal=False)
    with pytest.raises(ValueError, match="'kind'"):
        display.update({"kind": "epoch"})


def test_a_listening_joiner_shows_as_joining_with_its_share_of_the_state(records):
    """A streamed join: the device with 0 VWs and a `joining` share reads `joining 45%` in the panel."""
    from rich.console import Console

    step = [record for record in records if record["kind"] == "step"][-1]
    devices = [*step["devices"], "local-9"]
    listening = {
        **step,
        "devices": devices,
        "assignment": [*step["assignment"], 0],
        "busy_s": [*step["busy_s"], 0.0],
        "joining": {"local-9": 0.45},
    }
    display = LiveDisplay(TOTAL_STEPS, console=Console(file=io.StringIO(), width=120), force_terminal=True)
    display.update(listening)
    table = rendered_text(display).split("recent events")[0]
    display.close()
    row = next(row for row in table.splitlines() if row.lstrip().startswith("local-9"))
    assert "joining 45%" in row, row


def test_a_streaming_jobs_progress_is_items_and_passes():
    from flexpar.observe.log_lines import stream_progress

    passes: dict = {}
    assert stream_progress(passes, {"step": 3}, 48) == {}  # a map-style job's record
    assert stream_progress(passes, {"step": 3, "stream_items_read": 48}, 48) == {
        "stream_items": 192,
        "stream_passes_ended": 0,
    }
    ended = [{"group": 0, "pass": 0}, {"group": 1, "pass": 0}]
    assert stream_progress(passes, {"step": 8, "stream_items_read": 72, "pass_ends": ended}, 48) == {
        "stream_items": 432,
        "stream_passes_ended": 1,
    }
    assert passes == {0: 1, 1: 1}


def _stream_steps(records, steps_per_pass: int = 9) -> list:
    """The synthetic run's records as a streaming job's: every step record with `stream_items_read`, and a
    pass end (of each of 2 groups) met every `steps_per_pass` steps."""
    streamed = []
    for record in records:
        if record["kind"] == "step":
            record = {**record, "stream_items_read": 48}
            if record["step"] and record["step"] % steps_per_pass == 0:
                ended = record["step"] // steps_per_pass - 1
                record["pass_ends"] = [{"group": g, "pass": ended, "left_out": []} for g in (0, 1)]
        streamed.append(record)
    return streamed


def test_a_streaming_jobs_display_shows_its_pass_and_items_trained(records, caplog):
    """The dataset's length is unknown: the log lines and the panel's progress line say the pass in hand
    (from 1; "pass k/N" where the job's epochs= is known) and the items trained, never an epoch."""
    from rich.console import Console

    from flexpar.observe.log_lines import format_stream_progress

    assert format_stream_progress({}) == ""  # a map-style job's
    assert format_stream_progress({"stream_items": 12480, "stream_passes_ended": 1}) == "pass 2, 12,480 items"
    assert format_stream_progress({"stream_items": 96, "stream_passes_ended": 0}, passes=3) == "pass 1/3, 96 items"
    assert format_stream_progress({"stream_items": 960, "stream_passes_ended": 3}, passes=3) == "pass 3/3, 960 items"
    streamed = _stream_steps(records)
    steps = [record for record in streamed if record["kind"] == "step"]
    caplog.set_level(logging.INFO, logger="flexpar")
    with LiveDisplay(TOTAL_STEPS, log_every=10, force_terminal=False, global_batch=48) as display:
        for record in streamed:
            display.update(record)
    lines = [entry.getMessage() for entry in flexpar_lines(caplog) if entry.getMessage().startswith("step ")]
    by_step = {int(line.split()[1]): line for line in lines}
    assert "(10/60 done, 17%; pass 2, 480 items) loss" in by_step[9], by_step[9]  # step 9 met pass 1's end
    assert f"; pass {steps[-1]['step'] // 9 + 1}, {(steps[-1]['step'] + 1) * 48:,} items)" in by_step[steps[-1]["step"]]
    assert "epoch" not in " ".join(lines)
    display = LiveDisplay(
        TOTAL_STEPS, console=Console(file=io.StringIO(), width=160), force_terminal=True, global_batch=48, passes=7
    )
    for record in streamed[: streamed.index(steps[20]) + 1]:
        display.update(record)
    text = rendered_text(display)
    display.close()
    assert "training, pass 3/7, 1,008 items" in text, text
    plain = LiveDisplay(TOTAL_STEPS, force_terminal=False, global_batch=48)  # a map-style job's records
    plain.update(records[[r["kind"] for r in records].index("step")])
    assert plain._stream == ""
    plain.close()


def test_a_restarted_driver_shows_the_pass_its_records_reached_from_its_first_step(records, caplog):
    """A resumed or re-adopting driver's pass is the one the metrics file's step records reached
    (log_lines.passes_ended), not pass 1 until the next pass end it meets."""
    from flexpar.observe.log_lines import passes_ended

    streamed = _stream_steps(records)
    before = [record for record in streamed if record["kind"] != "step" or record["step"] < 25]
    after = [record for record in streamed if record["kind"] == "step" and 25 <= record["step"] < 27]
    assert passes_ended(before) == {0: 2, 1: 2}  # the pass ends of steps 9 and 18
    assert passes_ended([{"kind": "event", "pass_ends": [{"group": 0, "pass": 4}]}]) == {}  # step records only
    caplog.set_level(logging.INFO, logger="flexpar")
    with LiveDisplay(
        TOTAL_STEPS, log_every=1, force_terminal=False, global_batch=48, stream_passes=passes_ended(before)
    ) as display:
        for record in after:
            display.update(record)
    lines = [entry.getMessage() for entry in flexpar_lines(caplog) if entry.getMessage().startswith("step ")]
    assert len(lines) == 2 and all("pass 3, " in line for line in lines), lines
