"""The driver's loop: coordinator, metrics, display, schedule, until the job ends.

Single-threaded on purpose (a `DriverWaker` thread only wakes it): each pass moves the coordinator on, relays the
records rank 0 published, fires due schedule entries, and checks for the end.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

from flexpar.callbacks import Dispatcher
from flexpar.comm.channel import Channel
from flexpar.comm.protocol import (
    ACKNOWLEDGED_KEY,
    DRIVER_NOTICE_KEY,
    SCHEDULE_HOLD_KEY,
    tell_devices,
)
from flexpar.core import ledger as sample_ledger
from flexpar.core import membership
from flexpar.core.schedule import ScheduleTracker
from flexpar.driver import stop_messages
from flexpar.driver.earlier_run import EarlierRun, read_earlier_run
from flexpar.driver.waker import DriverWaker
from flexpar.errors import TrainingError
from flexpar.observe.display import LiveDisplay, log_to_stderr
from flexpar.observe.log_lines import stream_progress
from flexpar.observe.metrics import DEVICE_SET_EVENTS, MetricsWriter
from flexpar.worker.fault_injection import die_before_writing, record_faults

# The loop runs when something was sent (DriverWaker, waker.py), and at least this often for
# what nobody sends: local processes' exits, heartbeats, the grace of a failure, the display.
_HOUSEKEEPING_S = 0.1
_READ_ALL_EVERY = 10  # passes between readings of the channels and "done" that no notice asked for


class DriverLoop:
    """The driver's one loop: it moves the coordinator on, relays the devices' records and ends the job.

    Each record reaches the metrics file, the ledger, the display and the callbacks once; schedule
    entries fire at the step that makes them due; the loop returns once rank 0 wrote "done" and
    raises `TrainingError` (worded in stop_messages.py) when the job stops otherwise.
    """

    def __init__(
        self,
        store,
        coordinator,
        options,
        total_steps: int,
        global_batch: int,
        address: str,
        run_dir: str,
        metrics_path: str,
        exit_codes=lambda: {},
        callbacks: Dispatcher = None,
        resumed_from: int = -1,
        adopted: bool = False,
        sharding: str = "",
    ):
        """`resumed_from`: the committed steps a resumed job (`--resume`: re-adopted devices or a
        checkpoint) continues from; -1 for a new job. A resumed job appends to its metrics file and
        ledger, counts `elapsed_s` from the job's first start, writes each step once (steps the file
        holds are not written again), and does not fire its schedule's entries at or before it.
        `adopted`: it re-adopted devices that outlived the earlier driver; those may have committed
        steps that driver never saw, so the entries it did not fire are those after the last step its
        metrics file holds (it fires an entry as it writes the step that makes it due).

        Each record is delivered once (flexpar.core.delivery): the devices send again what the driver
        has not acknowledged, and a resumed driver knows what was delivered from its metrics file and
        ledger, so a record its predecessor wrote is neither written nor handed to a callback again."""
        self.store = store
        self.coordinator = coordinator
        self.options = options
        self.total_steps = total_steps
        self.global_batch = global_batch
        self.address = address
        self.run_dir = run_dir
        self.exit_codes = exit_codes  # device id -> exit code of local workers that ended
        self.metrics = Channel(store, "metrics")
        self.resumed = resumed_from >= 0
        self.pending_speeds = sorted(options.speed_changes, key=lambda change: change.step)
        # A resumed job goes on from its files: the metrics file where the earlier driver stopped, the ledger.
        earlier = read_earlier_run(metrics_path, run_dir) if self.resumed else EarlierRun()
        self.started = earlier.started if earlier.started is not None else time.time()
        last_step = earlier.last_step
        self.steps: list = [last_step] if last_step is not None else []
        self.events: list = []
        self.evals: list = list(earlier.evals)  # eval records, one per evaluated step, in order
        self.callbacks = callbacks if callbacks is not None else Dispatcher()
        self.devices: list = list(last_step["devices"]) if last_step is not None else []  # the latest record's
        # The driver's own notes number above every generation the file holds.
        self.generation = earlier.generation
        self.done: dict = {}
        self.metrics_path = metrics_path
        self.writer = MetricsWriter(metrics_path, append=self.resumed)
        self.delivery = earlier.delivered
        self.ledger_steps: set = set(earlier.ledger_steps)  # steps the ledger file holds (earlier ones too)
        self.stream_passes = earlier.stream_passes  # a streaming dataset: stream group -> passes ended
        self.events_before = earlier.events  # a resumed job's event records in its metrics file
        self._acknowledged = -1  # the step the devices were last told they may forget records up to
        self.record_faults = record_faults(options.faults, resumed_from)  # tests' STEP:driver:record
        resumed_at = resumed_from if adopted else None  # where the re-adopted devices train on
        not_back = ()  # members of the generation before the driver's loss that did not come back
        if adopted:
            resumed_from = last_step["step"] + 1 if last_step is not None else -1
            not_back = coordinator.published[-1].adopted.not_back if coordinator.published else ()
        self.schedule = ScheduleTracker(
            options.schedule, resumed_from, total_steps, resumed_at=resumed_at, not_back=not_back
        )
        for record in self.events_before:  # a leave its predecessor saw apply is not decided again
            self.schedule.applied_before(record)
        self._hold = None  # the SCHEDULE_HOLD_KEY last told to the devices
        self._tell_hold()  # before any generation forms: the members know where to wait from the start
        # The first step this run writes. A job resumed from a checkpoint into a fresh metrics file (a
        # requeued SLURM job's new run directory) gets the checkpoint's kept records of earlier steps
        # from its rank 0 too: they are the earlier run's, in its own file. Into the job's own file,
        # they fill in what an earlier driver that died did not write (the file's last step rules).
        self.first_step = max(resumed_from, 0) if last_step is None else 0
        self.ledger_file = None
        self.display = None
        if not options.quiet:
            # --no-display (display=False) means plain log lines, never nothing.
            self.display = LiveDisplay(
                total_steps,
                log_every=options.log_every,
                force_terminal=False if options.display is False else None,
                sharding=sharding,  # how the optimizer state is held (log_lines.format_sharding)
                global_batch=self.global_batch,  # a streaming job's items and pass (its length unknown)
                passes=options.epochs,
                stream_passes=self.stream_passes,
            )
            if not self.display.uses_rich:
                log_to_stderr()
        adoption = coordinator.published[-1] if adopted and coordinator.published else None
        if adoption is not None:  # its generation is the newest: the notes written from here on carry it
            self.devices, self.generation = list(adoption.members), adoption.generation
        self._report_left_unseen(adoption)
        self._report_schedule(self.schedule.taken_as_done())  # a re-adopted job's leave, inferred: said

    def run(self, waker: DriverWaker = None) -> None:
        """Until the job ends; `waker` wakes the loop when a device or a command sent something.

        Without one (tests) the loop polls every 10 ms.
        """
        notice = None
        polls = 0
        try:
            while True:
                # One store round trip per pass while nobody sent anything: the channels
                # and "done" are read when DRIVER_NOTICE_KEY moved (and every
                # _READ_ALL_EVERY passes regardless). The loop itself sleeps until woken:
                # polling the store every 10 ms woke the store's thread and this one 200
                # times a second, on the cores the devices compute on (see protocol.NOTICE_KEY).
                seen = self.store.add(DRIVER_NOTICE_KEY, 0)  # first: what is sent later is read next time
                read = seen != notice or polls % _READ_ALL_EVERY == 0
                notice, polls = seen, polls + 1
                self.coordinator.step(receive=read)
                if read:
                    self._relay_metrics()
                self._tell_hold()  # a scheduled leave fired, or its generation was published
                # Once rank 0 ended (membership.Finished, then its exit), "done" is read at once: rank 0 wrote
                # it before it exited, whether or not the notice counter was read after that.
                gone = self.coordinator.state.rank_0_gone
                ended = self._end_key(read, gone)
                if ended:
                    # Rank 0 sent every record before "done"; a hole left now is a dead rank 0's.
                    self._relay_metrics(writers_done=True)
                    self.done = json.loads(self.store.get(ended))
                    self._report_schedule(self.schedule.ended(self.done.get("step", 0)))
                    return
                self._check_errors()
                if gone:  # ...and it is not there: rank 0 ended after the last step without handing it over
                    raise TrainingError(stop_messages.RANK_0_GONE)
                if self.coordinator.stop_reason is not None:
                    raise TrainingError(
                        stop_messages.stop_message(
                            self.coordinator.stop_reason, self.exit_codes(), self.coordinator.refused
                        )
                    )
                if self.coordinator.declined is not None:
                    raise TrainingError(self.coordinator.declined)
                if waker is None:
                    time.sleep(0.01)
                else:
                    waker.woken.wait(_HOUSEKEEPING_S)
                    waker.woken.clear()  # what woke it is read in the next pass (the counter first)
        finally:
            if waker is not None:
                waker.close()
            self.writer.close()
            if self.ledger_file is not None:
                self.ledger_file.close()
            if self.display is not None:
                self.display.close()

    def _check_errors(self) -> None:
        members = set(self.coordinator.state.members)
        for message in self.coordinator.errors:
            if message["device_id"] in members or self.coordinator.state.generation == 0:
                tell_devices(self.store, "stop", "a device reported an error")
                raise TrainingError(stop_messages.device_error(message, self.run_dir, self.options.verbose))
            print(
                f"flexpar: joining device {message['device_id']} failed and was dropped: {message['message']}",
                file=sys.stderr,
                flush=True,
            )
        self.coordinator.errors.clear()

    def _end_key(self, read: bool, gone: bool) -> str:
        """Where rank 0 said the job ended ("" if not yet): "done", or, a rank 0 lost in finish()'s last
        all-reduce after another member finished (every part written), "finishing": it handed the result
        and its records over before that all-reduce (flexpar/worker/lifecycle.py `finish`)."""
        if (read or gone) and self.store.check(["done"]):
            return "done"
        return "finishing" if gone and self.store.check(["finishing"]) else ""

    def _relay_metrics(self, writers_done: bool = False) -> None:
        for record in self.metrics.receive(writers_done):
            # Before `first_step`: the earlier run's, kept in the checkpoint this one resumed from into a
            # fresh metrics file (they are in that run's own file): neither written nor handed on here.
            new = self.delivery.is_new(record) and record["step"] >= self.first_step
            if record["kind"] == "step":
                if new:
                    self._relay_step(record)
                # Re-sent (a new rank 0, a re-adoption, a resume's redone or recovered step): a schedule
                # entry still fires at it.
                self._fire_schedule(record["step"] + 1)
            elif record["kind"] == "eval":
                self._relay_eval(record, new)
            else:
                if new:
                    self._relay_event(record)
                # An event's step is the committed step count: a leave at step 1 fires at the start.
                self._fire_schedule(record["step"])
        acknowledged = self.delivery.acknowledged()
        if acknowledged > self._acknowledged:  # the devices may forget what they kept up to it (core.delivery)
            self.store.set(ACKNOWLEDGED_KEY, str(acknowledged))
            self._acknowledged = acknowledged

    def _relay_event(self, record: dict) -> None:
        self.delivery.add(record)
        previous = list(self.devices)
        self.events.append(record)
        self._emit(record)
        self._notify("on_event", record)
        if record["event"] in DEVICE_SET_EVENTS:
            self._report_schedule(self.schedule.observed(previous, record))

    def _relay_step(self, record: dict) -> None:
        """A step record not delivered before: ledger, metrics file, display, callbacks, status."""
        if record["step"] in self.record_faults:
            die_before_writing(record["step"])
        record["elapsed_s"] = max(0.0, record["time"] - self.started)
        self._write_ledger(record)
        self.delivery.add(record)
        latest = not self.steps or record["step"] > self.steps[-1]["step"]
        if latest:
            self.steps.append(record)
        self._emit(record)
        self._notify("on_step", record)
        if latest:
            self.coordinator.write_status(
                {
                    "step": record["step"],  # numbered as in the metrics file, from 0
                    "total_steps": self.total_steps,
                    "samples_per_s": record["samples_per_s"],
                    "loss": record["loss"],
                    "assignment": record["assignment"],
                    "address": self.address,
                    "streaming": record.get("joining", {}),  # listening joiners: the share of the state they hold
                    # A stream's items trained and passes ended (the step records', a restarted driver's file's too)
                    **stream_progress(self.stream_passes, record, self.global_batch),
                }
            )

    def _relay_eval(self, record: dict, new: bool) -> None:
        """One record per evaluated step (a new generation, or the devices a restarted driver re-adopted,
        may evaluate a step again); then the callbacks' verdict, which the devices wait for when a
        callback's on_eval may stop the job. An evaluation delivered before (by this driver or, as its
        metrics file says, an earlier one) is not written or handed to on_eval again, but the devices
        evaluating it again still get a verdict."""
        key = f"verdict/{record['step']}"
        if not new:
            if not self.store.check([key]):
                self.store.set(key, self.callbacks.stop_reason or "")
            return
        record["elapsed_s"] = max(0.0, record["time"] - self.started)
        self.delivery.add(record)
        self.evals.append(record)
        self._emit(record)
        reason = self._notify("on_eval", record)
        self.store.set(key, reason or self.callbacks.stop_reason or "")

    def _notify(self, hook: str, record: dict):
        """The callbacks' hook; a STOP becomes a clean stop of the job (CallbackError propagates)."""
        if not self.callbacks:
            return None
        reason = self.callbacks.call(hook, record)
        if reason:
            self.coordinator.finish(reason, note=not self.options.quiet)
        return reason

    def _write_ledger(self, record: dict) -> None:
        """A step record's sample ledger (only with sample_ledger=True) goes to ledger.jsonl."""
        indices = record.pop("ledger", None)
        if indices is None or record["step"] in self.ledger_steps:  # written before a driver's death
            return
        self.ledger_steps.add(record["step"])
        if self.ledger_file is None:
            path = os.path.join(self.run_dir, "ledger.jsonl")
            self.ledger_file = open(path, "a" if self.resumed else "w", encoding="utf-8")
        sample_ledger.write_entry(self.ledger_file, record["step"], indices, record.get("pass_ends"))

    def _emit(self, record: dict) -> None:
        self.devices = list(record["devices"])
        self.generation = record["generation"]
        self.writer.write(record)
        if self.display is not None:
            self.display.update(record)

    def _fire_schedule(self, committed: int) -> None:
        """The schedule entries due now that `committed` steps have (a leave a few steps ahead of its step)."""
        while True:
            state = self.coordinator.state  # what is on its way now, after the joins just carried out
            fired = self.schedule.due(committed, on_their_way=bool(state.starting or state.waiting))
            if not fired:
                break
            for request_id, delta, at_step in fired:
                for action in self.coordinator.apply(membership.ScaleBy(delta, request_id, at_step)):
                    if isinstance(action, membership.Answer):
                        self._report_schedule(self.schedule.answered(request_id, action))
        while self.pending_speeds and committed >= self.pending_speeds[0].step:
            change = self.pending_speeds.pop(0)
            tell_devices(self.store, f"speed/local-{change.device}", str(change.speed))

    def _tell_hold(self) -> None:
        """Tell the devices where the next scheduled leave not published yet takes effect (they wait there)."""
        hold = self.schedule.hold(self.coordinator.state.leaving)
        if hold != self._hold:  # after the generation it waited for: publishing came first (device_link)
            tell_devices(self.store, SCHEDULE_HOLD_KEY, str(hold))
            self._hold = hold

    def _report_left_unseen(self, adoption) -> None:
        """A scheduled leave its members carried out while no driver was there (they crossed the boundary
        of its generation, published ahead of its step, before the driver was lost): the restarted driver
        writes the leave event nobody wrote, at the leave's step, so the timeline shows it."""
        for outcome in self.schedule.outcomes if adoption is not None else ():
            if outcome.left_unseen:
                detail = "left: " + ", ".join(outcome.left_unseen) + " (as scheduled, while no driver was there)"
                self._driver_event("leave", outcome.step, adoption.generation, adoption.members, detail)

    def _report_schedule(self, lines: list) -> None:
        """A schedule entry was late, refused or never applied: log, metrics file, summary."""
        for line in lines:
            step = self.steps[-1]["step"] + 1 if self.steps else 0
            self._driver_event("schedule", step, max(1, self.generation), self.devices, line)
            if self.display is None and not self.options.quiet:
                print(f"flexpar: {line}", file=sys.stderr, flush=True)

    def _driver_event(self, event: str, step: int, generation: int, devices, detail: str) -> None:
        """An event the driver itself writes (no device saw it): metrics file, display, callbacks."""
        record = {
            "kind": "event",
            "event": event,
            "step": step,
            "time": time.time(),
            "generation": generation,
            "devices": list(devices),
            "stall_s": 0.0,
            "detail": detail,
        }
        self.events.append(record)
        self._emit(record)
        self._notify("on_event", record)

    def summary(self, final_step: int) -> dict:
        rates = [record["samples_per_s"] for record in self.steps[1:]] or [0.0]
        # Rebalances are counted, not listed: they follow measured speeds and can be many.
        listed = [e for e in self.events if e["event"] != "rebalance"]
        return {
            "steps": final_step,
            "samples_per_s": statistics.median(rates),
            # None (not NaN, which JSON cannot carry) when this run trained no step (a resume at its last).
            "final_loss": self.steps[-1]["loss"] if self.steps else None,
            "wall_s": time.time() - self.started,
            "generations": self.coordinator.state.generation,
            "devices": list(self.devices),  # the device set of the last record
            "events": [
                dict(event=e["event"], step=e["step"], stall_s=e["stall_s"], detail=e["detail"]) for e in listed
            ],
            "rebalances": len(self.events) - len(listed),
            "schedule": self.schedule.summary(),
            "stopped": self.done.get("stopped", ""),
            "checkpoint": self.done.get("checkpoint", ""),
            "metrics_path": self.metrics_path,
            "sample_ledger": self.ledger_file.name if self.ledger_file is not None else "",
            "run_dir": self.run_dir,
            "eval": (
                {"step": self.evals[-1]["step"], "metrics": dict(self.evals[-1]["metrics"])} if self.evals else None
            ),
        }
