"""What became of each scripted device change (`--schedule 30:+1,80:-1`), and when it is decided.

A join fires when its step has committed; the coordinator then accepts it
(devices start) or refuses it (a limit). An accepted join still has to wait
for its new device to warm up, so it may apply many steps after its step; a
job may even end first.

A leave needs no warm-up (every member holds the whole state), so it is exact:
a leave at step N takes effect at the boundary before N (its devices train
the steps before N, not step N), whatever the step time. It fires
`LEAVE_LEAD_STEPS` ahead of its step, and the coordinator publishes the
generation without its devices with N as its first step (`ScaleBy.at_step`,
`Publish.from_step`): the members go on in the current generation until then.
Should the driver lag behind the steps, the members wait for it at that
boundary: `ScheduleTracker.hold` is the step of the first leave not decided
and published yet, which the driver tells the devices (protocol.SCHEDULE_HOLD_KEY).
A leave can still land late (a join or a failure forming the device set at
that boundary, or a join at the same step that must fire first) or early (a
failure re-formed the device set before its step): either is reported.

Nothing of that may pass in silence: `ScheduleTracker` follows each entry
from firing to the step at which the device set really changed, and says when
it was late, early, refused, or never applied.

Pure bookkeeping (no store, no clock): the driver loop feeds it the
coordinator's answers and the job's event records, and writes the reports it
returns to the log, the metrics file and the summary.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

# A join fires once its step has committed, and its device then warms up: it applies up to
# this many steps after its step and still counts as on time. Later is reported as late.
ON_TIME_STEPS = 2

# A leave fires once this many steps before its step have committed (the driver has seen step
# N - 3 commit), so that its generation is usually published before the members reach step N - 1:
# they wait at that boundary only when the driver lags further behind.
LEAVE_LEAD_STEPS = 2

# `ScheduleTracker.hold` when no leave is waiting to be decided.
NO_HOLD = -1


def fire_points(changes) -> list:
    """The committed step count at which each of `changes` (in step order) fires.

    A join at its step, a leave `LEAVE_LEAD_STEPS` ahead of its step, but
    never before an earlier entry: they fire in order, since a leave may
    cancel an earlier join's device still warming up.
    """
    points, earliest = [], -(10**9)
    for change in changes:
        own = change.step - LEAVE_LEAD_STEPS if change.delta < 0 else change.step
        earliest = max(earliest, own)
        points.append(earliest)
    return points


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
    fire_at: int = 0  # the committed step count at which it fires (`fire_points`)
    unsure: bool = False  # a leave at a re-adopted job's step: it may have applied before (`applied_before`)
    status: str = "pending"  # pending, waiting (accepted, not applied yet), on time, late, early, refused, not applied
    applied_step: Optional[int] = None
    detail: str = ""
    devices: set = field(default_factory=set)  # devices still to come (join) or go (leave)
    # A leave carried out while no driver was there: the members that left (`ScheduleTracker`'s not_back).
    left_unseen: tuple = ()

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

    @property
    def exact(self) -> bool:
        """A leave decided before its step's boundary: it takes effect at that boundary exactly."""
        return self.delta < 0 and self.fire_at < self.step


class ScheduleTracker:
    def __init__(
        self,
        schedule,
        after_step: int = -1,
        total_steps: Optional[int] = None,
        resumed_at: Optional[int] = None,
        not_back: Sequence[str] = (),
    ) -> None:
        """`after_step`: a resumed job's committed steps; the entries at or before it are its earlier run's
        (they are not followed again). `total_steps`: the job's; an entry at or after it never fires
        (there is no boundary before it to change the device set at) and is reported as never applied
        when the job ends.

        `resumed_at`: a re-adopted job's (a restarted driver's) step, where its devices train on;
        `after_step` is then the steps its predecessor wrote, whose joins that one fired. A leave after
        `resumed_at` has not applied, whatever the predecessor decided: the generation it published
        ahead of the leave's step did not outlive it. A leave at `resumed_at` may have: its devices
        crossed that boundary (the leaver left; the others could not form their generation without a
        driver: the leaver is among `not_back`, the members that did not come back), or stopped at it
        when they lost the driver. With a member not back it counts as applied; otherwise it fires once
        the first step of this run has committed, unless the leave event at its step arrived first
        (`applied_before`).
        """
        ordered = sorted(schedule, key=lambda change: change.step)
        self.outcomes = []
        for change, fire_at in zip(ordered, fire_points(ordered)):
            if resumed_at is not None and change.delta < 0:
                if change.step >= resumed_at:
                    unsure = change.step == resumed_at
                    outcome = Outcome(change.step, change.delta, max(fire_at, resumed_at + 1) if unsure else fire_at)
                    outcome.unsure = unsure
                    if unsure and not_back:
                        outcome.status, outcome.applied_step = "on time", outcome.step
                        outcome.left_unseen = tuple(not_back)
                        outcome.detail = (
                            f"{outcome.label} applied at step {outcome.step}, taken as done: "
                            f"{', '.join(not_back)} did not come back to the restarted driver"
                        )
                    self.outcomes.append(outcome)
            elif change.step > after_step:
                self.outcomes.append(Outcome(change.step, change.delta, fire_at))
        self._firing = len(self.outcomes)  # entries before it may fire
        if total_steps is not None:
            self._firing = sum(1 for outcome in self.outcomes if outcome.step < total_steps)
        self._next = 0

    def due(self, committed: int, on_their_way: bool = False) -> list:
        """(request_id, delta, at_step) of the entries that fire now that `committed` steps have, in order.

        `at_step`: a leave's step, the first its generation trains (`membership.ScaleBy.at_step`); None for a join.
        `on_their_way`: devices are starting or warm and not admitted yet. A leave cancels those first, and
        one may still join before the leave's step: a leave then waits for the last moment it can still
        be exact, one step before its own (its members wait there: `hold`), or until none is on its way.
        A join puts devices on their way: the entries stop after one, and the caller, having carried it
        out, asks again with what is on its way now, until none is due.
        """
        fired = []
        while self._next < self._firing and self._fires(self.outcomes[self._next], committed, on_their_way):
            outcome = self.outcomes[self._next]
            self._next += 1
            if outcome.status == "pending":  # not one that applied before this driver (`applied_before`)
                outcome.status = "waiting"
                fired.append((f"schedule-{self._next - 1}", outcome.delta, outcome.step if outcome.delta < 0 else None))
                if outcome.delta > 0:
                    break
        return fired

    def taken_as_done(self) -> list:
        """The details of the leaves at a re-adopted job's step that it counts as applied before it (a member
        did not come back, or its metrics file holds their leave event): inferred, so said."""
        return [outcome.detail for outcome in self.outcomes if outcome.unsure and outcome.status != "pending"]

    @staticmethod
    def _fires(outcome: Outcome, committed: int, on_their_way: bool) -> bool:
        if committed < outcome.fire_at:
            return False
        return not (outcome.delta < 0 and on_their_way) or committed >= outcome.step - 1

    def applied_before(self, record: dict) -> None:
        """An event record, this run's or its predecessor's: a leave event at the step of a leave that may
        have applied before this driver (`resumed_at`) says it did; it does not fire again."""
        if record.get("event") != "leave":
            return
        for outcome in self.outcomes:
            if outcome.unsure and outcome.status == "pending" and outcome.step == record["step"]:
                outcome.status, outcome.applied_step = "on time", outcome.step
                outcome.detail = f"{outcome.label} applied at step {outcome.step}, before the driver was restarted"

    def hold(self, leaving: Sequence[str]) -> int:
        """The step of the first exact leave not decided and published yet (`NO_HOLD`: none).

        `leaving`: the members the coordinator will drop at its next generation, not published yet
        (`Membership.leaving`). The members wait at the boundary before that step until it moves on,
        so that the leave takes effect there whatever the step time.
        """
        pending = set(leaving)
        for outcome in self.outcomes[: self._firing]:
            if not outcome.exact:
                continue
            if outcome.status == "pending" or (outcome.status == "waiting" and outcome.devices & pending):
                return outcome.step
        return NO_HOLD

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
        self.applied_before(record)
        added, removed = device_change(previous_devices, record["devices"])
        reports = []
        for outcome in self.outcomes:
            if outcome.status != "waiting" or not outcome.devices:
                continue
            outcome.devices -= set(added if outcome.delta > 0 else removed)
            if outcome.devices:
                continue
            outcome.applied_step = record["step"]
            report = _timeliness(outcome)
            if report:
                reports.append(report)
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


def _timeliness(outcome: Outcome) -> str:
    """Sets an applied entry's status and detail; returns the detail when it is to be reported."""
    off = outcome.applied_step - outcome.step
    slack = ON_TIME_STEPS if outcome.delta > 0 else 0  # a leave is exact; a join waits for its warm-up
    if 0 <= off <= slack or (off < 0 and outcome.delta > 0):
        outcome.status = "on time"
        outcome.detail = f"{outcome.label} applied at step {outcome.applied_step}"
        return ""
    if off < 0:
        outcome.status = "early"
        outcome.detail = (
            f"{outcome.label} applied at step {outcome.applied_step}, {-off} steps early "
            "(a failure re-formed the device set before its step)"
        )
        return outcome.detail
    outcome.status = "late"
    if outcome.delta > 0:
        why = "the new device was warming up"
    elif outcome.unsure:
        why = "the driver was restarted at its step, and its predecessor's decision did not outlive it"
    elif not outcome.exact:
        why = "an earlier entry at its step fired first, so it could not be decided ahead of its step"
    else:
        why = "another change of the device set was still forming at its step boundary"
    outcome.detail = f"{outcome.label} applied at step {outcome.applied_step}, {off} steps late ({why})"
    return outcome.detail
