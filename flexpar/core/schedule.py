"""What became of each scripted device change (`--schedule 30:+1,80:-1`).

A schedule entry fires when its step has committed; the coordinator then
accepts it (devices start, or leave at the next boundary) or refuses it (a
limit). An accepted join still has to wait for its new device to warm up, so
it may apply many steps after its step; a job may even end first. Nothing of
that may pass in silence: `ScheduleTracker` follows each entry from firing to
the step at which the device set really changed, and says when it was late,
refused, or never applied.

Pure bookkeeping (no store, no clock): the driver loop feeds it the
coordinator's answers and the job's event records, and writes the reports it
returns to the log, the metrics file and the summary.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

# A change fires once its step has committed, and the step in flight then
# carries the agreement on it: it applies up to this many steps after its
# step and still counts as on time. Later than that is reported as late.
ON_TIME_STEPS = 2


def device_change(previous: Sequence[str], current: Sequence[str]) -> tuple[list[str], list[str]]:
    """(added, removed) device ids going from `previous` to `current`, each in list order.

    Also what the metrics readers label events with (flexpar/observe/metrics.py).
    """
    previous_set, current_set = set(previous), set(current)
    added = [device_id for device_id in current if device_id not in previous_set]
    removed = [device_id for device_id in previous if device_id not in current_set]
    return added, removed


@dataclass
class Outcome:
    """One schedule entry and what became of it."""

    step: int
    delta: int
    status: str = "pending"  # pending, waiting (accepted, not applied yet), on time, late, refused, not applied
    applied_step: Optional[int] = None
    detail: str = ""
    devices: set = field(default_factory=set)  # devices still to come (join) or go (leave)

    def as_dict(self) -> dict:
        return {
            "step": self.step,
            "delta": self.delta,
            "status": self.status,
            "applied_step": self.applied_step,
            "detail": self.detail,
        }

    @property
    def label(self) -> str:
        return f"scheduled {self.delta:+d} for step {self.step}"


class ScheduleTracker:
    def __init__(self, schedule, after_step: int = -1) -> None:
        """`after_step`: a resumed job's committed steps; its earlier driver fired the entries at or
        before it (they are not followed again)."""
        ordered = sorted(schedule, key=lambda change: change.step)
        self.outcomes = [Outcome(change.step, change.delta) for change in ordered if change.step > after_step]
        self._next = 0

    def due(self, committed: int) -> list:
        """(request_id, delta) of the entries whose step has now committed, in order."""
        fired = []
        while self._next < len(self.outcomes) and committed >= self.outcomes[self._next].step:
            outcome = self.outcomes[self._next]
            outcome.status = "waiting"
            fired.append((f"schedule-{self._next}", outcome.delta))
            self._next += 1
        return fired

    def answered(self, request_id: str, answer) -> list:
        """The coordinator's `membership.Answer` to a fired entry; returns report lines (refusals)."""
        outcome = self.outcomes[int(request_id.rsplit("-", 1)[1])]
        if not answer.accepted:
            outcome.status = "refused"
            outcome.detail = f"{outcome.label} was refused: {answer.message}"
            return [outcome.detail]
        outcome.devices = set(answer.started) | set(answer.leaving)
        reports = []
        for cancelled in answer.cancelled:
            # A leave that cancels a device still warming up: the join it belonged to never applies.
            for other in self.outcomes:
                if cancelled in other.devices and other.delta > 0:
                    other.devices.discard(cancelled)
                    other.status = "not applied"
                    other.detail = (
                        f"{other.label} never applied: {cancelled} was still warming up when {outcome.label} removed it"
                    )
                    reports.append(other.detail)
        if not outcome.devices:  # it only cancelled devices on their way: done at once
            outcome.status, outcome.applied_step = "on time", outcome.step
        return reports

    def observed(self, previous_devices, record: dict) -> list:
        """An event record changed the device set: returns report lines for entries that applied late."""
        added, removed = device_change(previous_devices, record["devices"])
        reports = []
        for outcome in self.outcomes:
            if outcome.status != "waiting" or not outcome.devices:
                continue
            outcome.devices -= set(added if outcome.delta > 0 else removed)
            if outcome.devices:
                continue
            outcome.applied_step = record["step"]
            late = outcome.applied_step - outcome.step
            if late <= ON_TIME_STEPS:
                outcome.status = "on time"
                outcome.detail = f"{outcome.label} applied at step {outcome.applied_step}"
            else:
                outcome.status = "late"
                # A leave fires once the driver has seen its step commit; steps faster than that
                # view (a few ms of polling per record) move on before it reaches a boundary.
                why = (
                    " (the new device was warming up)"
                    if outcome.delta > 0
                    else " (the steps ran on before the driver's request reached a step boundary)"
                )
                outcome.detail = f"{outcome.label} applied at step {outcome.applied_step}, {late} steps late{why}"
                reports.append(outcome.detail)
        return reports

    def ended(self, final_step: int) -> list:
        """The job ended: report every entry that never applied, and why."""
        reports = []
        for outcome in self.outcomes:
            if outcome.status == "pending":
                outcome.status = "not applied"
                outcome.detail = f"{outcome.label} never applied: the job ended at step {final_step} first"
                reports.append(outcome.detail)
            elif outcome.status == "waiting":
                outcome.status = "not applied"
                why = "its device was still warming up" if outcome.delta > 0 else "it had not reached a step boundary"
                outcome.detail = f"{outcome.label} never applied: the job ended at step {final_step} while {why}"
                reports.append(outcome.detail)
        return reports

    def summary(self) -> list:
        return [outcome.as_dict() for outcome in self.outcomes]
