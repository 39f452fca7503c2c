"""Step, event and eval records: their schema, validation and JSON-lines file.

A training job reports what it does as plain dict records (JSON-serialisable):
one *step record* per committed step, one *event record* per change of the
job (start, join, leave, failure, rebalance, refused joiner, late or refused
schedule entry, early stop, end) and one *eval record* per evaluation. The
schema is fixed here and documented for users in ``docs/metrics.md``;
``validate_record`` enforces it, so a record that reaches a file or a display
is known to be whole.

This module also holds the small pure helpers that the two readers of
records share: ``flexpar.display`` (``LiveDisplay``, the live panel and the
log lines) and ``flexpar.plot`` (``plot_timeline``). Both import from here,
never the reverse, and this module needs neither ``rich`` nor ``matplotlib``.
"""

from __future__ import annotations

import json
import logging
import math
import re
import threading
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

from flexpar.core.evaluation import means
from flexpar.core.schedule import device_change

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
    "grad_norm",
)
"""Every key of a step record, in schema order; all are required."""

OPTIONAL_STEP_KEYS: tuple[str, ...] = ("cost", "virtual_worker_sets")
"""Keys a step record has only when balancing by cost (``Job(sample_cost=...)``)."""

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

EVAL_KEYS: tuple[str, ...] = (
    "kind",
    "step",
    "time",
    "elapsed_s",
    "generation",
    "devices",
    "eval_s",
    "metrics",
)
"""Every key of an eval record (one per evaluation of the model), in schema order; all are required."""

# Events after which the device set differs from the one before: the plot marks
# these with a vertical line, the display shows who came or went.
DEVICE_SET_EVENTS: tuple[str, ...] = ("join", "leave", "failure")

# Events that call for attention: logged at WARNING by the display.
WARNING_EVENTS: tuple[str, ...] = ("failure", "refused", "schedule")

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


def _check_keys(kind: str, record: Mapping[str, Any], keys: Sequence[str], optional: Sequence[str] = ()) -> None:
    missing = [key for key in keys if key not in record]
    if missing:
        fields = ", ".join(repr(key) for key in missing)
        raise ValueError(f"{kind} record: field {fields} is missing")
    # Unknown keys are refused rather than ignored so that a typo ("los") or a
    # field the schema does not know fails where it is written, not in a plot later.
    unknown = [key for key in record if key not in keys and key not in optional]
    if unknown:
        fields = ", ".join(repr(key) for key in unknown)
        raise ValueError(
            f"{kind} record: field {fields} is not part of the schema "
            f"(allowed: {', '.join(tuple(keys) + tuple(optional))})"
        )


def _validate_step(record: Mapping[str, Any]) -> None:
    _check_keys("step", record, STEP_KEYS, OPTIONAL_STEP_KEYS)
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
    # The applied gradient's norm before clipping; inf or nan marks a step fp16 skipped.
    _check_float("grad_norm", record["grad_norm"], minimum=0.0, finite=False)
    device_count = len(record["devices"])
    if "cost" in record:
        _check_float_list("cost", record["cost"], minimum=0.0)
    if "virtual_worker_sets" in record:
        _check_virtual_worker_sets(record)
    for field in ("assignment", "busy_s") + tuple(key for key in OPTIONAL_STEP_KEYS if key in record):
        if len(record[field]) != device_count:
            raise ValueError(
                f"field {field!r} has {len(record[field])} entries but 'devices' has {device_count}; "
                f"they must be aligned (one entry per device)"
            )


def _check_virtual_worker_sets(record: Mapping[str, Any]) -> None:
    """Each device's VW ids: ints >= 0, as many as its ``assignment`` count, each VW once over all."""
    sets = record["virtual_worker_sets"]
    _check_sequence("virtual_worker_sets", sets)
    for position, members in enumerate(sets):
        _check_int_list(f"virtual_worker_sets[{position}]", members, minimum=0)
        counts = record["assignment"]
        if position < len(counts) and len(members) != counts[position]:
            raise ValueError(
                f"field 'virtual_worker_sets[{position}]' has {len(members)} VWs but "
                f"'assignment[{position}]' is {counts[position]}"
            )
    every = sorted(member for members in sets for member in members)
    if every != list(range(len(every))):
        raise ValueError("field 'virtual_worker_sets' must hold every VW id 0..V-1 exactly once")


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


def _validate_eval(record: Mapping[str, Any]) -> None:
    _check_keys("eval", record, EVAL_KEYS)
    _check_int("step", record["step"], 0)
    _check_float("time", record["time"])
    _check_float("elapsed_s", record["elapsed_s"], minimum=0.0)
    _check_int("generation", record["generation"], 1)
    _check_devices("devices", record["devices"], allow_empty=False)
    _check_float("eval_s", record["eval_s"], minimum=0.0)
    metrics = record["metrics"]
    if not isinstance(metrics, Mapping) or not metrics:
        raise ValueError(
            f"field 'metrics' must be a non-empty dict of metric name -> number, got {_type_name(metrics)} {metrics!r}"
        )
    for name, value in metrics.items():
        if not isinstance(name, str) or not name:
            raise ValueError(f"field 'metrics' has the key {name!r}; metric names are non-empty strings")
        # A diverged model's sums may be nan or inf, as a step's loss may.
        _check_float(f"metrics[{name!r}]", value, finite=False)


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
        raise ValueError("field 'kind' is missing; it must be 'step', 'event' or 'eval'")
    kind = record["kind"]
    if kind == "step":
        _validate_step(record)
    elif kind == "event":
        _validate_event(record)
    elif kind == "eval":
        _validate_eval(record)
    else:
        raise ValueError(f"field 'kind' must be 'step', 'event' or 'eval', got {kind!r}")


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


def eval_means(metrics: Mapping[str, Any]) -> dict:
    """Per-sample means of an eval record's sums when it holds a `count` (flexpar.evaluation.means)."""
    return means(metrics)


_SPLIT = re.compile(r"\[\s*(\d+(?:\s*,\s*\d+)*)\s*\]\s*->\s*\[\s*(\d+(?:\s*,\s*\d+)*)\s*\]")


def rebalance_change(event: Mapping[str, Any]) -> Optional[tuple[list[int], list[int]]]:
    """(split before, split after) of a rebalance event, read from its detail; None if it has none.

    The worker writes the detail as ``"[8, 8] -> [9, 7]"`` (VWs per device in
    rank order, aligned with the event's ``devices``). Any other text gives
    None, so a reader copes with records from elsewhere.
    """
    if event.get("event") != "rebalance":
        return None
    match = _SPLIT.search(str(event.get("detail", "")))
    if match is None:
        return None
    before, after = ([int(count) for count in group.split(",")] for group in match.groups())
    return before, after


def format_split(counts: Sequence[int]) -> str:
    """VWs per device as a compact text, e.g. "9,7"."""
    return ",".join(str(count) for count in counts)
