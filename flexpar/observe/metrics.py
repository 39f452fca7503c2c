"""Step, event and eval records: their keys, their JSON-lines file, and the helpers their readers share.

A training job reports what it does as plain dict records (JSON-serialisable):
one *step record* per committed step, one *event record* per change of the
job (start, join, leave, failure, rebalance, refused joiner, late or refused
schedule entry, early stop, a restarted driver's re-adoption, end) and one
*eval record* per evaluation. The
schema is stated once, in ``metrics.schema.json`` beside this file (a JSON
Schema), and documented for users in ``docs/metrics.md``;
``validate_record`` (record_schema.py) enforces it in the writer and the
reader, so a record that reaches a file or a display is known to be whole.

This module also holds the small pure helpers that the two readers of
records share: ``flexpar.observe.display`` (``LiveDisplay``, with
log_lines.py's lines) and ``flexpar.observe.plot`` (``plot_timeline``). Both
import from here, never the reverse, and this module needs neither ``rich``
nor ``matplotlib``.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

from flexpar.core.evaluation import means
from flexpar.core.schedule import device_change
from flexpar.observe.record_schema import RECORD_SCHEMAS, optional_keys, required_keys, validate_record

STEP_KEYS: tuple[str, ...] = required_keys("step")
"""Every key of a step record, in schema order; all are required."""

OPTIONAL_STEP_KEYS: tuple[str, ...] = optional_keys("step")
"""Keys a step record has only when balancing by cost (``Job(sample_cost=...)``)."""

EVENT_KEYS: tuple[str, ...] = required_keys("event")
"""Every key of an event record, in schema order; all are required."""

EVENT_KINDS: tuple[str, ...] = tuple(RECORD_SCHEMAS["event"]["properties"]["event"]["enum"])
"""The allowed values of an event record's ``event`` field."""

ADOPT_KEYS: tuple[str, ...] = tuple(RECORD_SCHEMAS["event"]["then"]["required"])
"""Keys an ``adopt`` event has, and no other event may: the seconds the job had no driver, and the
steps in flight lost at the loss (0 or 1)."""

EVAL_KEYS: tuple[str, ...] = required_keys("eval")
"""Every key of an eval record (one per evaluation of the model), in schema order; all are required."""

# Events after which the device set differs from the one before: the plot marks
# these with a vertical line, the display shows who came or went.
DEVICE_SET_EVENTS: tuple[str, ...] = ("join", "leave", "failure", "adopt")

# Events that call for attention: logged at WARNING by the display.
WARNING_EVENTS: tuple[str, ...] = ("failure", "refused", "schedule", "adopt")

LOGGER_NAME = "flexpar"

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
    construction, or appended to (`append=True`: a resumed job, whose earlier
    driver wrote it). Each record is flushed as soon as it is written, so a
    crashed job leaves every record up to the crash readable, and another
    process can follow the file while the job runs. Safe to call from several
    threads.
    """

    def __init__(self, path, append: bool = False):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        # A driver killed while it wrote may have left an unterminated last line: read_records drops
        # it, but appended to it would become a bad line in the middle of the file.
        if append and self.path.exists():
            _drop_unterminated_line(self.path)
        self._file = open(self.path, "a" if append else "w", encoding="utf-8", newline="\n")

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


def _drop_unterminated_line(path: Path) -> None:
    with open(path, "rb+") as handle:
        data = handle.read()
        if data and not data.endswith(b"\n"):
            handle.truncate(data.rfind(b"\n") + 1)


def resume_point(path) -> tuple:
    """(the job's start, its last step record, all its records) from a metrics file a resumed job appends to.

    The start (unix seconds) is the first record's time less its `elapsed_s`
    (None without one); the last step record is None when there is none; the
    records are what the file says was delivered (flexpar.core.delivery).
    """
    if not Path(path).exists():
        return None, None, []
    records = read_records(path)
    timed = [r for r in records if "elapsed_s" in r]
    start = timed[0]["time"] - timed[0]["elapsed_s"] if timed else None
    steps = [r for r in records if r["kind"] == "step"]
    return start, (max(steps, key=lambda r: r["step"]) if steps else None), records


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
    """Per-sample means of an eval record's sums when it holds a `count` (flexpar.core.evaluation.means)."""
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
