"""The live display of a running job: a rich panel on a terminal, log lines elsewhere.

``LiveDisplay`` takes the job's records (``flexpar.observe.metrics``: step, event and
eval records) one at a time. The line formatting of the plain log mode lives
in flexpar/observe/log_lines.py (``format_step_line``, ``format_event_line``,
``format_eval_line``, ``format_rebalance_line``). ``rich`` is imported only when a live panel is
wanted (``flexpar[display]``); without it the display logs.

Rebalances are summarised, not listed: they follow measured speeds and can be
many, so they never push joins, leaves and failures out of view.
"""

from __future__ import annotations

import collections
import logging
import sys
import threading
from typing import Any, Mapping, Optional

from flexpar.observe.log_lines import (
    estimate_remaining_s,
    format_duration,
    format_eval_line,
    format_event_line,
    format_megabytes,
    format_rebalance_line,
    format_rebalance_summary,
    format_step_line,
    format_stream_progress,
    stream_progress,
)
from flexpar.observe.metrics import (
    LOGGER_NAME,
    WARNING_EVENTS,
)


def _is_int(value: Any) -> bool:
    # bool is an int subclass, but True is never a sensible step count.
    return isinstance(value, int) and not isinstance(value, bool)


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
    "schedule": "magenta",
    "stop": "bold yellow",
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
    loss, generation, the device set with each device's VW count, busy time
    as bars and optimizer-state size (MB; a sharded job's devices hold parts),
    the imbalance, the latest evaluation, one summary line of the
    rebalances (``rebalances: 7 (last at step 812: 8,8 -> 9,7)``) and the most
    recent other events (joins, leaves, failures, ...; rebalances never enter
    that table). It is redrawn by rich's refresh thread a few times a second;
    ``update`` only stores the record, so it stays cheap when called once per
    step.

    Otherwise (CI, a pipe, no rich, or ``force_terminal=False``) it logs
    through the "flexpar" logger: one line every `log_every` steps (and at the
    last step); one line per event record except rebalances (failures,
    refused joiners and schedule entries at WARNING, the rest at INFO); one
    line per evaluation; and at most one rebalance line per `log_every` steps,
    logged with the step line when rebalances happened since the previous one
    (``3 rebalances since step 40, now local-0:9 local-1:7``; ``close`` logs
    any not yet reported). This is the ``--no-display`` mode: the driver
    constructs ``LiveDisplay(total_steps, log_every=..., force_terminal=False)``
    and points the "flexpar" logger at stderr (level INFO, bare messages)
    unless the user configured logging.
    """

    def __init__(
        self,
        total_steps: int,
        *,
        log_every: int = 10,
        console=None,
        force_terminal: Optional[bool] = None,
        sharding: str = "",
        global_batch: Optional[int] = None,
        passes: Optional[int] = None,
        stream_passes: Optional[dict] = None,
    ):
        if not _is_int(total_steps) or total_steps < 1:
            raise ValueError(f"total_steps must be an int >= 1, got {total_steps!r}")
        if not _is_int(log_every) or log_every < 1:
            raise ValueError(f"log_every must be an int >= 1, got {log_every!r}")
        self.total_steps = total_steps
        self.log_every = log_every
        self.sharding = sharding  # log_lines.format_sharding's phrase: "" unless the optimizer is sharded
        # A streaming job's step records carry its progress in items and passes (its length is unknown):
        # shown in the panel's progress line and the log lines (log_lines.format_stream_progress).
        self.global_batch = global_batch
        self.passes = passes  # the job's epochs= where known
        # group -> passes ended, from the step records' pass_ends (a restarted driver's: its file's, given)
        self._stream_passes: dict = dict(stream_passes or {})
        self._stream = ""
        self._logger = logging.getLogger(LOGGER_NAME)
        self._lock = threading.Lock()
        self._last_step: Optional[Mapping[str, Any]] = None
        self._first_step: Optional[tuple[int, float]] = None
        self._devices: tuple[str, ...] = ()
        self._generation: Optional[int] = None
        self._events: collections.deque = collections.deque(maxlen=_RECENT_EVENTS)
        self._last_eval: Optional[str] = None  # the line of the latest eval record
        self._rebalances = 0  # rebalance events seen
        self._last_rebalance: Optional[Mapping[str, Any]] = None
        self._rebalances_unreported = 0  # plain mode: rebalances since the last rebalance line
        self._rebalance_mark = 0  # plain mode: the step count at that line (or at the first step)
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

    @property
    def rebalance_count(self) -> int:
        """How many rebalance event records the display has taken."""
        with self._lock:
            return self._rebalances

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
            )
        except ImportError:
            self._logger.info(
                'rich is not installed, logging progress instead (pip install -e ".[display]" in flexpar\'s checkout)'
            )
            return
        if console is None:
            console = Console(force_terminal=True)
        # The progress bar is rendered inside our own Live, never started on its own.
        self._progress = Progress(
            TextColumn("[bold]{task.description}"),  # "training", a stream's "training, pass 2, 12,480 items"
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("steps"),
            TimeElapsedColumn(),
            TextColumn("ETA"),
            # The same estimate as the log lines' (`_remaining_s`): rich's own column would count a
            # resumed job's first jump to its step, and a restarted driver's gap, as progress or pace.
            TextColumn("{task.fields[eta]}"),
            console=console,
            auto_refresh=False,
        )
        self._task = self._progress.add_task("training", total=self.total_steps, eta="?")
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
        """Take one step, event or eval record (see the schema). Records of other kinds raise ValueError."""
        kind = record.get("kind") if isinstance(record, Mapping) else None
        if kind == "step":
            self._update_step(record)
        elif kind == "event":
            self._update_event(record)
        elif kind == "eval":
            self._update_eval(record)
        else:
            raise ValueError(f"LiveDisplay.update: field 'kind' must be 'step', 'event' or 'eval', got {kind!r}")

    def _update_eval(self, record: Mapping[str, Any]) -> None:
        line = format_eval_line(record)
        with self._lock:
            self._last_eval = line
        if self._live is None:
            self._logger.info(line)

    def _update_step(self, record: Mapping[str, Any]) -> None:
        with self._lock:
            if self._first_step is None:
                self._first_step = (record["step"], record["elapsed_s"])
                self._rebalance_mark = record["step"]
            self._last_step = record
            self._devices = tuple(record["devices"])
            self._generation = record["generation"]
            if self.global_batch:
                progress = stream_progress(self._stream_passes, record, self.global_batch)
                self._stream = format_stream_progress(progress, self.passes)
            stream = self._stream
        done = record["step"] + 1
        if self._progress is not None:
            description = f"training, {stream}" if stream else "training"
            self._progress.update(
                self._task, completed=done, eta=format_duration(self._remaining_s(record)), description=description
            )
            return
        if done % self.log_every == 0 or done == self.total_steps:
            remaining = self._remaining_s(record)
            self._logger.info(format_step_line(record, self.total_steps, remaining, self.sharding, stream))
            self._report_rebalances(record, done)

    def _remaining_s(self, record: Mapping[str, Any]) -> Optional[float]:
        """The ETA at the pace since the first step this display saw, or since the last re-adoption (a
        restarted driver's gap and the steps its predecessor trained are no part of the pace)."""
        with self._lock:
            first_step, first_elapsed = self._first_step
        return estimate_remaining_s(first_step, first_elapsed, record["step"], record["elapsed_s"], self.total_steps)

    def _report_rebalances(self, step: Optional[Mapping[str, Any]], done: int) -> None:
        """Plain mode: one line for the rebalances since the last such line, with the split now in force."""
        with self._lock:
            count, since = self._rebalances_unreported, self._rebalance_mark
            self._rebalances_unreported, self._rebalance_mark = 0, done
        if count == 0 or step is None:
            return
        self._logger.info(format_rebalance_line(count, since, step["devices"], step["assignment"]))

    def _update_event(self, record: Mapping[str, Any]) -> None:
        rebalance = record["event"] == "rebalance"
        with self._lock:
            if record["event"] == "adopt":  # the pace starts again at the next step (`_remaining_s`)
                self._first_step = None
            previous = self._devices
            line = format_event_line(record, previous)
            if rebalance:
                self._rebalances += 1
                self._rebalances_unreported += 1
                self._last_rebalance = record
            else:
                self._events.append((record, line))
            self._devices = tuple(record["devices"])
            self._generation = record["generation"]
        if self._live is None and not rebalance:
            level = logging.WARNING if record["event"] in WARNING_EVENTS else logging.INFO
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
            parts.append(self._device_table(step, Table, Bar, self.sharding))
        with self._lock:
            last_eval = self._last_eval
            rebalances, last_rebalance = self._rebalances, self._last_rebalance
        if last_eval is not None:
            parts.append(Text(last_eval, style="green"))
        if rebalances:
            parts.append(Text(format_rebalance_summary(rebalances, last_rebalance), style=_EVENT_STYLES["rebalance"]))
        if events:
            event_table = Table(
                title="recent events", title_justify="left", box=None, show_header=False, pad_edge=False
            )
            for record, line in events:
                event_table.add_row(Text(line, style=_EVENT_STYLES.get(record["event"], "")))
            parts.append(event_table)
        return Group(*parts)

    @staticmethod
    def _device_table(step: Mapping[str, Any], table_class, bar_class, sharding: str = ""):
        table = table_class(box=None, pad_edge=False, header_style="dim")
        table.add_column("device")
        table.add_column("VWs", justify="right")
        table.add_column("busy", justify="right")
        table.add_column("", width=30)
        # Each device's optimizer-state bytes (a sharded job's devices hold parts of it, as its header says).
        optimizer = step.get("optimizer_bytes")
        if optimizer is not None:
            table.add_column(f"optimizer ({sharding})" if sharding else "optimizer", justify="right")
        longest = max(step["busy_s"]) or 1.0
        joining = step.get("joining", {})  # a streamed join: the listener runs no VW yet
        for rank, (device_id, count, busy) in enumerate(zip(step["devices"], step["assignment"], step["busy_s"])):
            vws = f"joining {joining[device_id]:.0%}" if device_id in joining else str(count)
            cells = [device_id, vws, f"{busy:.3f} s", bar_class(longest, 0.0, busy, width=30, color="cyan")]
            if optimizer is not None:
                # A streamed joiner reports the size of the state still coming to it: not shown as held.
                cells.append("streaming" if device_id in joining else format_megabytes(optimizer[rank]))
            table.add_row(*cells)
        return table

    # -- life cycle -----------------------------------------------------------

    def close(self) -> None:
        """Stop the live panel (its last state stays on screen), or log rebalances not yet reported.

        Closing twice is harmless.
        """
        if self._closed:
            return
        self._closed = True
        if self._live is not None:
            self._live.stop()
            return
        with self._lock:
            step = self._last_step
        self._report_rebalances(step, step["step"] + 1 if step is not None else 0)

    def __enter__(self) -> "LiveDisplay":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def log_to_stderr() -> None:
    """Plain log lines of the "flexpar" logger go to stderr, or to the user's logging set-up.

    Without any handler configured, one of ours prints the bare lines; with
    one, the lines go through it. Either way progress (INFO) is not dropped
    by logging's default WARNING level, unless the user set a level on the
    "flexpar" logger.
    """
    logger = logging.getLogger(LOGGER_NAME)
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)
    if not logger.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(handler)
        logger.propagate = False
