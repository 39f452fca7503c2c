"""Step and event records, their JSON-lines file, the live display and the timeline plot.

A training job reports what it does as plain dict records (JSON-serialisable):
one *step record* per committed step and one *event record* per change of the
job (start, join, leave, failure, rebalance, refused joiner, end). The schema is
fixed here and documented for users in ``docs/metrics.md``; ``validate_record``
enforces it, so a record that reaches a file or a display is known to be whole.

The optional extras are imported lazily: ``rich`` only when a live terminal
display is wanted (``flexpar[display]``), ``matplotlib`` only when a plot is
drawn (``flexpar[plot]``). Without them the job still runs and logs.
"""

from __future__ import annotations

import collections
import json
import logging
import math
import sys
import threading
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

STEP_KEYS: tuple[str, ...] = (
    "kind",
    "step",
    "time",
    "elapsed_s",
    "loss",
    "samples_per_s",
    "step_time_s",
    "generation",
    "devices",
    "assignment",
    "busy_s",
    "imbalance",
    "lr",
)
"""Every key of a step record, in schema order; all are required."""

EVENT_KEYS: tuple[str, ...] = (
    "kind",
    "event",
    "step",
    "time",
    "generation",
    "devices",
    "stall_s",
    "detail",
)
"""Every key of an event record, in schema order; all are required."""

EVENT_KINDS: tuple[str, ...] = ("start", "join", "leave", "failure", "rebalance", "end", "refused", "schedule", "stop")
"""The allowed values of an event record's ``event`` field."""

# Events after which the device set differs from the one before: the plot marks
# these with a vertical line, the display shows who came or went.
DEVICE_SET_EVENTS: tuple[str, ...] = ("join", "leave", "failure")

LOGGER_NAME = "flexpar"

# ---------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------


def _type_name(value: Any) -> str:
    kind = type(value)
    return kind.__name__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"


def _is_int(value: Any) -> bool:
    # bool is an int subclass, but True is never a sensible step or VW count.
    return isinstance(value, int) and not isinstance(value, bool)


def _is_float(value: Any) -> bool:
    # JSON has one number type; an int where a float is expected (0 for 0.0) is fine.
    return (isinstance(value, float) or _is_int(value)) and not isinstance(value, bool)


def _check_int(field: str, value: Any, minimum: int) -> None:
    if not _is_int(value):
        raise ValueError(f"field {field!r} must be an int, got {_type_name(value)} {value!r}")
    if value < minimum:
        raise ValueError(f"field {field!r} must be >= {minimum}, got {value}")


def _check_float(
    field: str,
    value: Any,
    *,
    minimum: Optional[float] = None,
    maximum: Optional[float] = None,
    finite: bool = True,
) -> None:
    if not _is_float(value):
        raise ValueError(f"field {field!r} must be a float, got {_type_name(value)} {value!r}")
    if finite and not math.isfinite(value):
        raise ValueError(f"field {field!r} must be finite, got {value}")
    if minimum is not None and value < minimum:
        raise ValueError(f"field {field!r} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ValueError(f"field {field!r} must be <= {maximum}, got {value}")


def _check_sequence(field: str, value: Any) -> None:
    # Tuples are accepted because the balancer hands out tuples; JSON turns them into lists.
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"field {field!r} must be a list, got {_type_name(value)} {value!r}")


def _check_devices(field: str, value: Any, *, allow_empty: bool) -> None:
    _check_sequence(field, value)
    if not value and not allow_empty:
        raise ValueError(f"field {field!r} must name at least one device, got an empty list")
    for position, device_id in enumerate(value):
        if not isinstance(device_id, str) or not device_id:
            raise ValueError(
                f"field '{field}[{position}]' must be a non-empty device id string, "
                f"got {_type_name(device_id)} {device_id!r}"
            )
    if len(set(value)) != len(value):
        repeated = sorted({device_id for device_id in value if list(value).count(device_id) > 1})
        raise ValueError(f"field {field!r} names a device more than once: {repeated}")


def _check_float_list(field: str, value: Any, *, minimum: float) -> None:
    _check_sequence(field, value)
    for position, item in enumerate(value):
        _check_float(f"{field}[{position}]", item, minimum=minimum)


def _check_int_list(field: str, value: Any, *, minimum: int) -> None:
    _check_sequence(field, value)
    for position, item in enumerate(value):
        _check_int(f"{field}[{position}]", item, minimum)


def _check_keys(kind: str, record: Mapping[str, Any], keys: Sequence[str]) -> None:
    missing = [key for key in keys if key not in record]
    if missing:
        fields = ", ".join(repr(key) for key in missing)
        raise ValueError(f"{kind} record: field {fields} is missing")
    # Unknown keys are refused rather than ignored so that a typo ("los") or a
    # field the schema does not know fails where it is written, not in a plot later.
    unknown = [key for key in record if key not in keys]
    if unknown:
        fields = ", ".join(repr(key) for key in unknown)
        raise ValueError(f"{kind} record: field {fields} is not part of the schema (allowed: {', '.join(keys)})")


def _validate_step(record: Mapping[str, Any]) -> None:
    _check_keys("step", record, STEP_KEYS)
    _check_int("step", record["step"], 0)
    _check_float("time", record["time"])
    _check_float("elapsed_s", record["elapsed_s"], minimum=0.0)
    # A diverging run must still be recorded, so the loss may be nan or inf.
    _check_float("loss", record["loss"], finite=False)
    _check_float("samples_per_s", record["samples_per_s"], minimum=0.0)
    _check_float("step_time_s", record["step_time_s"], minimum=0.0)
    _check_int("generation", record["generation"], 1)
    _check_devices("devices", record["devices"], allow_empty=False)
    _check_int_list("assignment", record["assignment"], minimum=1)
    _check_float_list("busy_s", record["busy_s"], minimum=0.0)
    _check_float("imbalance", record["imbalance"], minimum=0.0, maximum=1.0)
    _check_float("lr", record["lr"], minimum=0.0)
    device_count = len(record["devices"])
    for field in ("assignment", "busy_s"):
        if len(record[field]) != device_count:
            raise ValueError(
                f"field {field!r} has {len(record[field])} entries but 'devices' has {device_count}; "
                f"they must be aligned (one entry per device)"
            )


def _validate_event(record: Mapping[str, Any]) -> None:
    _check_keys("event", record, EVENT_KEYS)
    if record["event"] not in EVENT_KINDS:
        raise ValueError(f"field 'event' must be one of {', '.join(EVENT_KINDS)}; got {record['event']!r}")
    _check_int("step", record["step"], 0)
    _check_float("time", record["time"])
    _check_int("generation", record["generation"], 1)
    # After the last device leaves (an "end" with nobody left) the set may be empty.
    _check_devices("devices", record["devices"], allow_empty=True)
    _check_float("stall_s", record["stall_s"], minimum=0.0)
    if not isinstance(record["detail"], str):
        raise ValueError(f"field 'detail' must be a str, got {_type_name(record['detail'])} {record['detail']!r}")


def validate_record(record: dict) -> None:
    """Raise ValueError, naming the field and the problem, unless `record` follows the schema.

    Checks presence of every key (and no others), types (bool is not an int,
    an int is accepted for a float), ranges (counts >= 1, durations >= 0,
    imbalance in [0, 1]) and that ``assignment`` and ``busy_s`` align with
    ``devices``. Returns None for a valid record.
    """
    if not isinstance(record, Mapping):
        raise ValueError(f"a record must be a dict, got {_type_name(record)}")
    if "kind" not in record:
        raise ValueError("field 'kind' is missing; it must be 'step' or 'event'")
    kind = record["kind"]
    if kind == "step":
        _validate_step(record)
    elif kind == "event":
        _validate_event(record)
    else:
        raise ValueError(f"field 'kind' must be 'step' or 'event', got {kind!r}")


# ---------------------------------------------------------------------------
# JSON lines
# ---------------------------------------------------------------------------


def _encode(record: Mapping[str, Any]) -> str:
    # Compact separators keep long runs small; allow_nan because a diverged loss
    # is written as NaN (Python's json reads it back; see docs/metrics.md).
    return json.dumps(dict(record), separators=(",", ":"), allow_nan=True)


class MetricsWriter:
    """Appends validated records to a JSON-lines file, one record per line.

    The file is created (with its parent folders) and truncated on
    construction. Each record is flushed as soon as it is written, so a crashed
    job leaves every record up to the crash readable, and another process can
    follow the file while the job runs. Safe to call from several threads.
    """

    def __init__(self, path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._file = open(self.path, "w", encoding="utf-8", newline="\n")

    def write(self, record) -> None:
        """Validate `record` (ValueError if invalid; nothing is written then), append it and flush."""
        validate_record(record)
        line = _encode(record) + "\n"
        with self._lock:
            if self._file is None:
                raise ValueError(f"MetricsWriter for {self.path} is closed")
            self._file.write(line)
            self._file.flush()

    def close(self) -> None:
        """Close the file; closing twice is harmless."""
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None

    @property
    def closed(self) -> bool:
        return self._file is None

    def __enter__(self) -> "MetricsWriter":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def read_records(path) -> list[dict]:
    """All records of a JSON-lines metrics file, in file order, each validated.

    Blank lines are skipped. A last line without its newline that does not
    parse is the trace of a job killed mid-write; it is dropped with a warning
    on the "flexpar" logger. Any other bad line raises ValueError naming the
    file and the line number.
    """
    path = Path(path)
    text = path.read_text(encoding="utf-8")
    lines = text.split("\n")
    # text.split leaves "" after a final newline; anything else there is an unterminated line.
    unterminated_last = len(lines) - 1 if lines[-1] != "" else None
    records: list[dict] = []
    for index, line in enumerate(lines):
        if not line.strip():
            continue
        line_number = index + 1
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            if index == unterminated_last:
                logging.getLogger(LOGGER_NAME).warning(
                    "%s:%d: dropping a truncated last line (%s)", path, line_number, error
                )
                continue
            raise ValueError(f"{path}:{line_number}: not valid JSON ({error})") from None
        try:
            validate_record(record)
        except ValueError as error:
            raise ValueError(f"{path}:{line_number}: {error}") from None
        records.append(record)
    return records


# ---------------------------------------------------------------------------
# Pure helpers shared by the display and the plot
# ---------------------------------------------------------------------------


def device_change(previous: Sequence[str], current: Sequence[str]) -> tuple[list[str], list[str]]:
    """(added, removed) device ids going from `previous` to `current`, each in list order."""
    previous_set, current_set = set(previous), set(current)
    added = [device_id for device_id in current if device_id not in previous_set]
    removed = [device_id for device_id in previous if device_id not in current_set]
    return added, removed


def event_label(event: Mapping[str, Any], previous_devices: Sequence[str]) -> str:
    """A short label for an event, e.g. "+1 join (stall 0.21 s)" or "-2 failure (stall 0.80 s)".

    The count is the change of the device set against `previous_devices` (the
    set before the event); it is left out when the set did not change.
    """
    added, removed = device_change(previous_devices, event["devices"])
    counts = []
    if added:
        counts.append(f"+{len(added)}")
    if removed:
        counts.append(f"-{len(removed)}")
    prefix = "/".join(counts) + " " if counts else ""
    stall = f" (stall {event['stall_s']:.2f} s)" if event["stall_s"] > 0 else ""
    return f"{prefix}{event['event']}{stall}"


def estimate_remaining_s(
    first_step: int, first_elapsed_s: float, step: int, elapsed_s: float, total_steps: int
) -> Optional[float]:
    """Seconds until step `total_steps - 1` commits, at the mean pace since `first_step`.

    None while there is no pace yet (fewer than two observed steps). The pace
    includes stalls, which is what a user waiting for the job wants.
    """
    steps_done = step - first_step
    if steps_done <= 0 or elapsed_s <= first_elapsed_s:
        return None
    seconds_per_step = (elapsed_s - first_elapsed_s) / steps_done
    return max(0, total_steps - 1 - step) * seconds_per_step


def format_duration(seconds: Optional[float]) -> str:
    """"0:01:05" style; "?" when unknown."""
    if seconds is None or not math.isfinite(seconds):
        return "?"
    whole = int(round(seconds))
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}"


def _format_assignment(devices: Sequence[str], assignment: Sequence[int], limit: int = 8) -> str:
    # Beyond a handful of devices a per-device list makes the log line unreadable.
    if len(devices) > limit:
        return f"{len(devices)} devices, {min(assignment)}-{max(assignment)} VWs each"
    return " ".join(f"{device_id}:{count}" for device_id, count in zip(devices, assignment))


def format_step_line(record: Mapping[str, Any], total_steps: int, remaining_s: Optional[float]) -> str:
    """The plain log line of a step record (used without a terminal)."""
    done = record["step"] + 1
    percent = 100.0 * done / total_steps if total_steps else 0.0
    return (
        f"step {done}/{total_steps} ({percent:.0f}%) loss {record['loss']:.4g} | "
        f"{record['samples_per_s']:.1f} samples/s | step {record['step_time_s']:.3f} s | "
        f"generation {record['generation']}, VWs {_format_assignment(record['devices'], record['assignment'])} | "
        f"imbalance {100.0 * record['imbalance']:.1f}% | ETA {format_duration(remaining_s)}"
    )


def format_event_line(record: Mapping[str, Any], previous_devices: Sequence[str]) -> str:
    """The plain log line of an event record."""
    added, removed = device_change(previous_devices, record["devices"])
    change = " ".join([f"+{device_id}" for device_id in added] + [f"-{device_id}" for device_id in removed])
    parts = [
        f"event {record['event']} at step {record['step']}",
        f"generation {record['generation']}",
        f"{len(record['devices'])} devices" + (f" ({change})" if change else ""),
    ]
    if record["stall_s"] > 0:
        parts.append(f"stall {record['stall_s']:.2f} s")
    if record["detail"]:
        parts.append(record["detail"])
    return ", ".join(parts)


# ---------------------------------------------------------------------------
# Live display
# ---------------------------------------------------------------------------

_RECENT_EVENTS = 5
_EVENT_STYLES = {
    "join": "green",
    "leave": "yellow",
    "failure": "bold red",
    "rebalance": "cyan",
    "refused": "magenta",
    "start": "dim",
    "end": "dim",
}


def _is_terminal(console, force_terminal: Optional[bool]) -> bool:
    if force_terminal is not None:
        return bool(force_terminal)
    if console is not None:
        return bool(console.is_terminal)
    # Checked without importing rich, so that a CI run never pays for it.
    stream = sys.stdout
    return bool(getattr(stream, "isatty", None) and stream.isatty())


class LiveDisplay:
    """Shows a job's progress: a rich live panel on a terminal, log lines elsewhere.

    On a terminal (or with ``force_terminal=True``) and with ``rich``
    installed, a panel shows a progress bar (step / total, ETA), throughput,
    loss, generation, the device set with each device's VW count and busy time
    as bars, the imbalance, and the most recent events. It is redrawn by rich's
    refresh thread a few times a second; ``update`` only stores the record, so
    it stays cheap when called once per step.

    Otherwise (CI, a pipe, no rich) it logs through the "flexpar" logger: one
    line every `log_every` steps (and at the last step) and one line per event
    record (failures and refused joiners at WARNING, the rest at INFO).
    """

    def __init__(
        self,
        total_steps: int,
        *,
        log_every: int = 10,
        console=None,
        force_terminal: Optional[bool] = None,
    ):
        if not _is_int(total_steps) or total_steps < 1:
            raise ValueError(f"total_steps must be an int >= 1, got {total_steps!r}")
        if not _is_int(log_every) or log_every < 1:
            raise ValueError(f"log_every must be an int >= 1, got {log_every!r}")
        self.total_steps = total_steps
        self.log_every = log_every
        self._logger = logging.getLogger(LOGGER_NAME)
        self._lock = threading.Lock()
        self._last_step: Optional[Mapping[str, Any]] = None
        self._first_step: Optional[tuple[int, float]] = None
        self._devices: tuple[str, ...] = ()
        self._generation: Optional[int] = None
        self._events: collections.deque = collections.deque(maxlen=_RECENT_EVENTS)
        self._closed = False
        self._live = None
        self._progress = None
        self._task = None
        if _is_terminal(console, force_terminal):
            self._start_rich(console)

    # -- mode selection ---------------------------------------------------

    @property
    def uses_rich(self) -> bool:
        """True when the rich live panel is shown, False when logging."""
        return self._live is not None

    def _start_rich(self, console) -> None:
        try:
            from rich.console import Console
            from rich.live import Live
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )
        except ImportError:
            self._logger.info("rich is not installed, logging progress instead (pip install flexpar[display])")
            return
        if console is None:
            console = Console(force_terminal=True)
        # The progress bar is rendered inside our own Live, never started on its own.
        self._progress = Progress(
            TextColumn("[bold]training"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("steps"),
            TimeElapsedColumn(),
            TextColumn("ETA"),
            TimeRemainingColumn(),
            console=console,
            auto_refresh=False,
        )
        self._task = self._progress.add_task("training", total=self.total_steps)
        # get_renderable is called by the refresh thread; update() only stores state.
        self._live = Live(
            get_renderable=self._render,
            console=console,
            refresh_per_second=4,
            transient=False,
        )
        self._live.start()

    # -- feeding ------------------------------------------------------------

    def update(self, record: dict) -> None:
        """Take one step or event record (see the schema). Records of other kinds raise ValueError."""
        kind = record.get("kind") if isinstance(record, Mapping) else None
        if kind == "step":
            self._update_step(record)
        elif kind == "event":
            self._update_event(record)
        else:
            raise ValueError(f"LiveDisplay.update: field 'kind' must be 'step' or 'event', got {kind!r}")

    def _update_step(self, record: Mapping[str, Any]) -> None:
        with self._lock:
            if self._first_step is None:
                self._first_step = (record["step"], record["elapsed_s"])
            self._last_step = record
            self._devices = tuple(record["devices"])
            self._generation = record["generation"]
        done = record["step"] + 1
        if self._progress is not None:
            self._progress.update(self._task, completed=done)
            return
        if done % self.log_every == 0 or done == self.total_steps:
            first_step, first_elapsed = self._first_step
            remaining = estimate_remaining_s(
                first_step, first_elapsed, record["step"], record["elapsed_s"], self.total_steps
            )
            self._logger.info(format_step_line(record, self.total_steps, remaining))

    def _update_event(self, record: Mapping[str, Any]) -> None:
        with self._lock:
            previous = self._devices
            line = format_event_line(record, previous)
            self._events.append((record, line))
            self._devices = tuple(record["devices"])
            self._generation = record["generation"]
        if self._live is None:
            level = logging.WARNING if record["event"] in ("failure", "refused") else logging.INFO
            self._logger.log(level, line)

    # -- rendering (rich only) ----------------------------------------------

    def _render(self):
        from rich.bar import Bar
        from rich.console import Group
        from rich.table import Table
        from rich.text import Text

        with self._lock:
            step = self._last_step
            events = list(self._events)
            generation = self._generation
            devices = self._devices
        parts: list = [self._progress]
        if step is None:
            parts.append(Text(f"waiting for the first step; generation {generation or '-'}, {len(devices)} devices"))
        else:
            parts.append(
                Text.assemble(
                    ("loss ", "dim"),
                    (f"{step['loss']:.4g}", "bold"),
                    ("   samples/s ", "dim"),
                    f"{step['samples_per_s']:.1f}",
                    ("   step ", "dim"),
                    f"{step['step_time_s']:.3f} s",
                    ("   lr ", "dim"),
                    f"{step['lr']:.3g}",
                    ("   generation ", "dim"),
                    str(step["generation"]),
                    ("   imbalance ", "dim"),
                    (f"{100.0 * step['imbalance']:.1f}%", "bold"),
                )
            )
            parts.append(self._device_table(step, Table, Bar))
        if events:
            event_table = Table(title="recent events", title_justify="left", box=None, show_header=False, pad_edge=False)
            for record, line in events:
                event_table.add_row(Text(line, style=_EVENT_STYLES.get(record["event"], "")))
            parts.append(event_table)
        return Group(*parts)

    @staticmethod
    def _device_table(step: Mapping[str, Any], table_class, bar_class):
        table = table_class(box=None, pad_edge=False, header_style="dim")
        table.add_column("device")
        table.add_column("VWs", justify="right")
        table.add_column("busy", justify="right")
        table.add_column("", width=30)
        longest = max(step["busy_s"]) or 1.0
        for device_id, count, busy in zip(step["devices"], step["assignment"], step["busy_s"]):
            table.add_row(device_id, str(count), f"{busy:.3f} s", bar_class(longest, 0.0, busy, width=30, color="cyan"))
        return table

    # -- life cycle -----------------------------------------------------------

    def close(self) -> None:
        """Stop the live panel (its last state stays on screen); closing twice is harmless."""
        if self._closed:
            return
        self._closed = True
        if self._live is not None:
            self._live.stop()

    def __enter__(self) -> "LiveDisplay":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


# ---------------------------------------------------------------------------
# Timeline plot
# ---------------------------------------------------------------------------

_EVENT_COLORS = {"join": "#2ca02c", "leave": "#ff7f0e", "failure": "#d62728", "rebalance": "0.45"}
_MOST_LABELLED_REBALANCES = 20


def _import_matplotlib():
    try:
        import matplotlib  # noqa: F401
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise ImportError("plot_timeline needs matplotlib: pip install flexpar[plot]") from None
    return Figure, FigureCanvasAgg


def _device_order(steps: Sequence[Mapping[str, Any]]) -> list[str]:
    """Device ids in order of first appearance (stable colours and stacking)."""
    seen: dict[str, None] = {}
    for record in steps:
        for device_id in record["devices"]:
            seen.setdefault(device_id, None)
    return list(seen)


def _per_device_series(
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


def _broken_line(times: Sequence[float], values: Sequence[float], gaps: Sequence[bool]):
    """x, y with a NaN point inserted at every gap, which matplotlib draws as a break."""
    xs, ys = [times[0]], [values[0]]
    for position in range(1, len(times)):
        if gaps[position - 1]:
            xs.append(0.5 * (times[position - 1] + times[position]))
            ys.append(math.nan)
        xs.append(times[position])
        ys.append(values[position])
    return xs, ys


def _step_outline(spans, values: Sequence[float], gaps: Sequence[bool]):
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


def _labelled_events(records: Sequence[Mapping[str, Any]]) -> list[tuple[Mapping[str, Any], str]]:
    """(event, label) for each join/leave/failure/rebalance, labelled against the set before it."""
    labelled = []
    devices: Sequence[str] = ()
    for record in records:
        if record["kind"] == "event" and record["event"] in DEVICE_SET_EVENTS + ("rebalance",):
            labelled.append((record, event_label(record, devices)))
        devices = record["devices"]
    return labelled


def plot_timeline(metrics_path, output_path) -> None:
    """Draw a metrics file as a PNG (or any format matplotlib infers from `output_path`).

    Stacked panels share the x axis (wall seconds since the job started): an
    event strip, throughput, loss, per-device busy time per step (with each
    step's wall time) and the VWs per device as a stacked area. Each join,
    leave and failure is a vertical line across all panels, labelled in the
    strip with the change and the stall, e.g. "+1 join (stall 0.21 s)"; the
    stall itself, which ends at the event's time, is shaded. Lines break
    where training paused. Devices that exist in only part of the run appear
    only there; alternate generations are shaded grey.

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
    devices = _device_order(steps)
    colors = _device_colors(devices)
    events = _labelled_events(records)

    figure = Figure(figsize=(11, 11.5), dpi=110, layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(5, 1, sharex=True, height_ratios=[0.75, 1.0, 1.0, 1.3, 1.1])
    strip_axis, throughput_axis, loss_axis, busy_axis, assignment_axis = axes
    data_axes = axes[1:]

    end = max([times[-1]] + [event["time"] - origin for event, _ in events])
    assignment_axis.set_xlim(0.0, end * 1.01 if end > 0 else 1.0)
    generation_spans = _generation_spans(steps, spans)
    _shade_generations(axes, generation_spans)
    _draw_strip(strip_axis, generation_spans, end)
    _draw_throughput(throughput_axis, times, steps, gaps)
    _draw_loss(loss_axis, times, steps, gaps)
    _draw_busy(busy_axis, times, steps, gaps, devices, colors)
    _draw_assignment(assignment_axis, spans, steps, gaps, devices, colors)
    _draw_events(strip_axis, data_axes, events, origin)

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


def _generation_spans(steps, spans) -> list[tuple[int, float, float]]:
    """(generation, first step start, last step end) for each run of one generation."""
    result: list[tuple[int, float, float]] = []
    for record, (start, end) in zip(steps, spans):
        if result and result[-1][0] == record["generation"]:
            result[-1] = (result[-1][0], result[-1][1], end)
        else:
            result.append((record["generation"], start, end))
    return result


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
    axis.plot(*_broken_line(times, values, gaps), color="#1f77b4", linewidth=1.4, **_markers(len(steps)))
    axis.set_ylim(bottom=0.0, top=max(values) * 1.1 if max(values) > 0 else 1.0)
    _style(axis, "throughput\n(samples/s)")


def _draw_loss(axis, times, steps, gaps) -> None:
    values = [record["loss"] for record in steps]
    finite = [value for value in values if math.isfinite(value)]
    axis.plot(*_broken_line(times, values, gaps), color="#9467bd", linewidth=1.4, **_markers(len(steps)))
    # Loss curves spanning decades read better on a log scale.
    if finite and min(finite) > 0 and max(finite) / min(finite) > 20:
        axis.set_yscale("log")
    _style(axis, "loss")


_MOST_DEVICE_LINES = 16


def _draw_busy(axis, times, steps, gaps, devices, colors) -> None:
    if len(devices) <= _MOST_DEVICE_LINES:
        series = _per_device_series(steps, devices, "busy_s", math.nan)
        for device_id, values in zip(devices, series):
            axis.plot(
                *_broken_line(times, values, gaps),
                color=colors[device_id],
                linewidth=1.2,
                label=device_id,
                **_markers(len(steps)),
            )
    else:
        # Dozens of overlapping lines say nothing; the spread across devices does.
        lowest = [min(record["busy_s"]) for record in steps]
        highest = [max(record["busy_s"]) for record in steps]
        xs, lows = _broken_line(times, lowest, gaps)
        _, highs = _broken_line(times, highest, gaps)
        axis.fill_between(xs, lows, highs, color="#1f77b4", alpha=0.3, linewidth=0, label=f"min-max of {len(devices)} devices")
        medians = [sorted(record["busy_s"])[len(record["busy_s"]) // 2] for record in steps]
        axis.plot(*_broken_line(times, medians, gaps), color="#1f77b4", linewidth=1.0, label="median device")
    axis.plot(
        *_broken_line(times, [record["step_time_s"] for record in steps], gaps),
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

    series = _per_device_series(steps, devices, "assignment", 0.0)
    baseline = [0.0] * len(steps)
    for device_id, values in zip(devices, series):
        top = [low + count for low, count in zip(baseline, values)]
        xs, lows = _step_outline(spans, baseline, gaps)
        _, highs = _step_outline(spans, top, gaps)
        axis.fill_between(xs, lows, highs, color=colors[device_id], alpha=0.85, linewidth=0)
        baseline = top
    axis.set_ylim(0.0, max(baseline) * 1.05)
    axis.yaxis.set_major_locator(MaxNLocator(integer=True))
    _style(axis, "virtual workers\nper device")


def _draw_events(strip_axis, data_axes, events, origin: float) -> None:
    rebalances = sum(1 for event, _ in events if event["event"] == "rebalance")
    for event, label in events:
        position = event["time"] - origin
        color = _EVENT_COLORS[event["event"]]
        if event["event"] == "rebalance":
            # Rebalances change no device set: a faint mark in the strip only.
            strip_axis.axvline(position, ymax=0.35, color=color, linewidth=0.8, linestyle=":")
            if rebalances <= _MOST_LABELLED_REBALANCES:
                strip_axis.text(
                    position, 0.03, "rebalance ", rotation=90, ha="left", va="bottom",
                    fontsize=7, color=color, transform=strip_axis.get_xaxis_transform(),
                )
            continue
        for axis in (strip_axis, *data_axes):
            if event["stall_s"] > 0:
                # The event's time is when the change took effect: the stall ends there.
                axis.axvspan(position - event["stall_s"], position, color=color, alpha=0.12, linewidth=0, zorder=0.5)
            axis.axvline(position, color=color, linewidth=1.1, linestyle=(0, (4, 2)), zorder=1)
        strip_axis.text(
            position, 0.03, label + " ", rotation=90, ha="right", va="bottom",
            fontsize=8, color=color, fontweight="bold", transform=strip_axis.get_xaxis_transform(),
        )
