"""What of a soak run's drawn faults really happened, read from the run's output (pure).

Signals: each worker says `flexpar: fault: DEVICE gets SIGNAL at step N (PHASE)
at TIME` just before it signals itself (flexpar/worker.py), so a drawn signal
fired when its device's line names its phase. Joins and leaves: the run
summary's schedule outcomes (applied on time or late; a join whose device was
cancelled while warming up by a later leave also happened: a device came and
went). Everything drawn that did not happen is counted apart, never as
injected.

Two kinds of combined faults are counted where they really happened:
- simultaneous: a step at which two or more signals fired (by the step their
  fault lines name), and, apart, a step at which a signal fired and a join or
  leave was scheduled;
- during recovery: a signal that fired after a kill -9 or SIGSTOP of another
  device and before the job had recovered from it: before the first "failure"
  event after it (the survivors' next generation formed) and before the first
  step committed after it (no step commits between a member's death and the
  new generation; a rank 0 that dies soon after forming one may take its
  failure event with it, never a step record), by the times of the lines and
  the records (one host's clock). An evaluation or group formation between
  the new generation and its first step is part of the recovery.
A kill with a formation fault in its recovery is both when the two name the
same step.
"""

from __future__ import annotations

import collections
import re
from dataclasses import dataclass, field

from soak_plan import FAULT_KINDS, SIGNAL_NAMES, SIGNAL_PHASES

FAULT_LINE = re.compile(r"flexpar: fault: (\S+) gets (SIG\w+) at step (\d+) \((\w+)\) at ([\d.]+)")
_KIND_OF_SIGNAL = {name: kind for kind, name in SIGNAL_NAMES.items()}


@dataclass(frozen=True)
class Fired:
    kind: str  # kill, stop, term, join, leave, driver
    phase: str  # a signal's phase; "schedule" for joins and leaves
    step: int
    device: str = ""
    time: float = 0.0


@dataclass
class Tally:
    fired: list = field(default_factory=list)  # Fired
    not_fired: list = field(default_factory=list)  # (kind, phase, step, device) drawn, never happened
    simultaneous: int = 0
    signal_with_change: int = 0
    during_recovery: int = 0

    @property
    def signals(self) -> list:
        return [fault for fault in self.fired if fault.phase != "schedule"]


def fired_signals(stderr_text: str) -> list:
    """Fired of every fault line in a run's output, in order."""
    return [
        Fired("driver" if device == "driver" else _KIND_OF_SIGNAL[name], phase, int(step), device, float(at))
        for device, name, step, phase, at in FAULT_LINE.findall(stderr_text)
    ]


def tally(plan, stderr_text: str, schedule_outcomes: list, records: list) -> Tally:
    """`plan`: the run's RunPlan; `schedule_outcomes`: its summary's "schedule" (None: the run gave
    no summary, so no join or leave is known to have applied); `records`: its metrics records."""
    result = Tally(fired=fired_signals(stderr_text))
    for step, device, phase, kind in plan.faults:
        if not any(f.device == device and f.phase == phase for f in result.fired):
            result.not_fired.append((kind, phase, step, device))
    if plan.driver_fault is not None and not any(f.kind == "driver" for f in result.fired):
        step, phase = plan.driver_fault
        result.not_fired.append(("driver", phase, step, "driver"))
    for outcome in schedule_outcomes or ():
        kind = "join" if outcome["delta"] > 0 else "leave"
        if outcome["status"] in ("on time", "late") or "warming up when" in outcome["detail"]:
            result.fired.append(Fired(kind, "schedule", outcome["step"]))
        else:
            result.not_fired.append((kind, "schedule", outcome["step"], ""))
    if schedule_outcomes is None:
        result.not_fired.extend(
            ("join" if delta > 0 else "leave", "schedule", step, "") for step, delta in plan.schedule
        )
    signal_steps = collections.Counter(f.step for f in result.signals)
    change_steps = {f.step for f in result.fired if f.phase == "schedule"}
    result.simultaneous = sum(1 for count in signal_steps.values() if count >= 2)
    result.signal_with_change = len(set(signal_steps) & change_steps)
    marks = sorted(
        r["time"] for r in records if r["kind"] == "step" or (r["kind"] == "event" and r["event"] == "failure")
    )
    result.during_recovery = sum(1 for f in result.signals if _in_recovery(f, result.signals, marks))
    return result


def _in_recovery(fault: Fired, signals: list, recovered_marks: list) -> bool:
    """Whether `fault` fired after another device's kill or SIGSTOP and before the first
    failure event or committed step after that (`recovered_marks`: their times, sorted)."""
    for earlier in signals:
        if earlier is fault or earlier.kind not in ("kill", "stop") or earlier.time >= fault.time:
            continue
        recovered = next((at for at in recovered_marks if at > earlier.time), float("inf"))
        if fault.time < recovered:
            return True
    return False


def counts(tallies: list, phases: tuple = SIGNAL_PHASES) -> dict:
    """The soak's JSON figures over runs' tallies: fired by kind and by each of `phases`, not fired, combined."""
    fired = [f for t in tallies for f in t.fired]
    missed = [entry for t in tallies for entry in t.not_fired]
    return {
        "fired_by_kind": {kind: sum(1 for f in fired if f.kind == kind) for kind in FAULT_KINDS},
        "fired_by_phase": {phase: sum(1 for f in fired if f.phase == phase) for phase in phases},
        "not_fired": len(missed),
        "not_fired_by_kind": {kind: sum(1 for m in missed if m[0] == kind) for kind in FAULT_KINDS},
        "not_fired_by_phase": {phase: sum(1 for m in missed if m[1] == phase) for phase in phases},
        "simultaneous": sum(t.simultaneous for t in tallies),
        "signal_with_change": sum(t.signal_with_change for t in tallies),
        "during_recovery": sum(t.during_recovery for t in tallies),
    }
