"""The driver's loop: coordinator, metrics, display, schedule, until the job ends.

Single-threaded on purpose: each pass moves the coordinator on, relays the
records rank 0 published, fires due schedule entries, and checks for the end.
"""

from __future__ import annotations

import logging
import os
import statistics
import time

from flexpar import control, membership
from flexpar.job import TrainingError
from flexpar.metrics import LiveDisplay, MetricsWriter

_POLL_S = 0.01


class DriverLoop:
    def __init__(self, store, coordinator, options, total_steps: int, global_batch: int, address: str):
        self.store = store
        self.coordinator = coordinator
        self.options = options
        self.total_steps = total_steps
        self.global_batch = global_batch
        self.address = address
        self.metrics = control.Channel(store, "metrics")
        self.pending_schedule = sorted(options.schedule, key=lambda change: change.step)
        self.pending_speeds = sorted(options.speed_changes, key=lambda change: change.step)
        self.started = time.time()
        self.steps: list = []
        self.events: list = []
        path = options.metrics or os.path.join(
            options.run_dir, time.strftime("%Y%m%d-%H%M%S") + f"-{os.getpid()}", "metrics.jsonl"
        )
        self.metrics_path = path
        self.writer = MetricsWriter(path)
        show = options.display if options.display is not None else not options.quiet
        self.display = LiveDisplay(total_steps, log_every=options.log_every) if show else None
        if show and not self.display.uses_rich:
            logging.basicConfig(level=logging.INFO, format="%(message)s")

    def run(self) -> None:
        try:
            while True:
                self.coordinator.step()
                self._relay_metrics()
                if self.store.check(["done"]):
                    self._relay_metrics()
                    return
                self._check_errors()
                if self.coordinator.stop_reason is not None:
                    raise TrainingError(f"the job stopped: {self.coordinator.stop_reason}")
                time.sleep(_POLL_S)
        finally:
            self.writer.close()
            if self.display is not None:
                self.display.close()

    def _check_errors(self) -> None:
        members = set(self.coordinator.state.members)
        for message in self.coordinator.errors:
            if message["device_id"] in members or self.coordinator.state.generation == 0:
                self.store.set("stop", "a device reported an error")
                detail = message.get("traceback", "").strip()
                raise TrainingError(
                    f"device {message['device_id']}: {message['message']}\n\n"
                    f"--- the device's traceback ---\n{detail}"
                )
            print(f"flexpar: joining device {message['device_id']} failed and was dropped: "
                  f"{message['message']}", flush=True)
        self.coordinator.errors.clear()

    def _relay_metrics(self) -> None:
        for record in self.metrics.receive():
            if record["kind"] == "step":
                if self.steps and record["step"] <= self.steps[-1]["step"]:
                    continue  # re-sent by a new rank 0 after a change
                record["elapsed_s"] = max(0.0, record["time"] - self.started)
                self.steps.append(record)
                self._fire_schedule(record["step"] + 1)
                self.coordinator.write_status({
                    "step": record["step"] + 1, "total_steps": self.total_steps,
                    "samples_per_s": record["samples_per_s"], "loss": record["loss"],
                    "assignment": record["assignment"], "address": self.address,
                })
            else:
                self.events.append(record)
            self.writer.write(record)
            if self.display is not None:
                self.display.update(record)

    def _fire_schedule(self, committed: int) -> None:
        while self.pending_schedule and committed >= self.pending_schedule[0].step:
            change = self.pending_schedule.pop(0)
            self.coordinator.apply(membership.ScaleBy(change.delta))
        while self.pending_speeds and committed >= self.pending_speeds[0].step:
            change = self.pending_speeds.pop(0)
            self.store.set(f"speed/local-{change.device}", str(change.speed))

    def summary(self, final_step: int) -> dict:
        rates = [record["samples_per_s"] for record in self.steps[1:]] or [0.0]
        return {
            "steps": final_step,
            "samples_per_s": statistics.median(rates),
            "final_loss": self.steps[-1]["loss"] if self.steps else float("nan"),
            "wall_s": time.time() - self.started,
            "generations": self.coordinator.state.generation,
            "events": [dict(event=e["event"], step=e["step"], stall_s=e["stall_s"], detail=e["detail"])
                       for e in self.events],
            "metrics_path": self.metrics_path,
        }
