"""Fault injection by schedule: "kill -9 device local-1 at step 7 during backward".

The driver passes the job's faults (`RunSettings.faults`: step, device,
phase and optionally the signal) to every device; each keeps its own and
fires them at the named points of the step loop and the boundaries, where
the code calls `FaultSchedule.fire(phase, step, members)`. A device's start has points of
its own (START_PHASES, at step 0): `flexpar join` fires "launch" and
"launched" around starting the device's process (`fire_start_fault`), the
device the rest on its way to admission. Faults aimed at the driver
(STEP:driver:PHASE) are fired by the device that is rank 0 at that point (at a
transfer: the sender); the driver fires its own
STEP:driver:record (`die_before_writing`) as that step's record arrives. Tests, the soak and
the benchmarks use this to prove that a failure at any phase loses nothing.
"""

from __future__ import annotations

import os
import signal
import sys
import time

SIGNALS = {"kill": signal.SIGKILL, "term": signal.SIGTERM, "stop": signal.SIGSTOP, "term-group": signal.SIGTERM}
# Sent to the whole process group rather than the device alone: a whole host's SIGTERM (SLURM's
# scancel, systemd, `kill -- -PGID`), which reaches the device's launcher and fork server too.
GROUP_SIGNALS = ("term-group",)

# The points of a device's start, in order, each at step 0: its launcher (`flexpar join`) is about
# to start its process / has just started it; the device is built and about to announce itself /
# announced and about to warm up / said it is ready and waits to be let in / was let in (its first
# generation) and is about to form it.
START_PHASES = ("launch", "launched", "announce", "warmup", "ready", "admitted")

# A test's STEP:DEVICE:PHASE:starve: the device's follower thread stops running from that point (as a
# loaded host's scheduler may leave it) until the main thread notes a lost driver, or this long.
STARVE_S = 10.0

# Boundary phases happen at some steps only: their faults fire at the first
# such phase at or after their step (stream: a streamed join's rounds, flexpar/worker/streaming.py).
BOUNDARY_PHASES = ("transfer", "formation", "checkpoint", "stream")


def faults_of(device_id: str, faults) -> dict:
    """{(step, phase): signal name} of the faults scheduled for `device_id` (default signal: kill)."""
    return {
        (int(step), phase): fault[3] if len(fault) > 3 else "kill"
        for fault in faults
        for step, device, phase in [fault[:3]]
        if device == device_id
    }


def fire_start_fault(device_id: str, faults, phase: str) -> None:
    """`flexpar join`'s start points (START_PHASES "launch", "launched"): the signal scheduled for
    `device_id` there, sent by the launcher (to itself, or its whole process group)."""
    name = faults_of(device_id, faults).get((0, phase))
    if name is not None:
        _send(name, device_id, 0, phase)


def _send(name: str, device_id: str, step: int, phase: str) -> None:
    number = SIGNALS[name]
    whom = ", to its whole process group" if name in GROUP_SIGNALS else ""
    # Said first, with the time: the fault soak measures detection from it.
    print(
        f"flexpar: fault: {device_id} gets {signal.Signals(number).name} at step {step} ({phase}) at "
        f"{time.time():.6f}{whom}",
        file=sys.stderr,
        flush=True,
    )
    if name in GROUP_SIGNALS:
        os.killpg(os.getpgrp(), number)
    else:
        os.kill(os.getpid(), number)


class FaultSchedule:
    """This device's scheduled faults, and the driver's that it may fire: each fires at most once.

    `own` is {(step, phase): signal name} of the faults aimed at this device
    not fired yet (a "tamper" is a streamed join's test fault, taken by the
    stream's sender, and a "starve" stops the device's follower thread: neither
    is sent as a signal); `driver` is the {(step, phase)}
    of the faults aimed at the driver not fired yet. A step redone after a
    failure fires nothing again, and a re-adopted device fires none of a lost
    driver's faults at the next one (`spend_driver_faults`).
    """

    def __init__(self, device_id: str, settings, remote: bool, starve=None):
        """`settings`: the job's run settings (its `faults`, the `driver_pid`); `starve(seconds)`: stops
        this device's follower thread (a test's "starve" fault; DeviceLink.starve_follower)."""
        self.device_id = device_id
        self.own = faults_of(device_id, settings.faults)
        # Faults aimed at the driver (STEP:driver:PHASE): fired by the device that is rank 0 there.
        self.driver = {(int(fault[0]), fault[2]) for fault in settings.faults if fault[1] == "driver"}
        self.driver_pid = settings.driver_pid
        self.remote = remote
        self.starve = starve

    def fire(self, phase: str, step: int, members: tuple) -> None:
        """Kill -9 (or SIGTERM, SIGSTOP) this device here, if the schedule says so; the driver too, if
        this device is the rank 0 of `members` (its generation) or the sender of a transfer."""
        for key in _due(self.own, phase, step):
            if self.own[key] == "starve" and self.starve is not None:  # a test's: no signal either
                self.own.pop(key)
                said = f"flexpar: fault: {self.device_id} starves its follower thread at step {step} ({phase})"
                print(said, file=sys.stderr, flush=True)
                self.starve(STARVE_S)
            elif self.own[key] not in ("tamper", "starve"):  # a streamed join's test fault (streaming.py)
                _send(self.own.pop(key), self.device_id, step, phase)
        if self.driver and (members[:1] == (self.device_id,) or phase == "transfer"):
            self._kill_driver_if_due(phase, step)

    def armed(self, phase: str, step: int) -> bool:
        """Whether a fault of this device's or the driver's names `phase` of `step` exactly."""
        return (step, phase) in self.own or (step, phase) in self.driver

    def take_tamper(self, step: int) -> bool:
        """A streamed join's STEP:DEVICE:stream:tamper due at or before `step`: taken (it fires once)."""
        due = [key for key, name in self.own.items() if key[1] == "stream" and key[0] <= step and name == "tamper"]
        return bool(due) and self.own.pop(due[0]) == "tamper"

    def spend_driver_faults(self, committed: int) -> None:
        """The driver is lost: its faults up to step `committed` are spent (a re-adopted rank 0 must
        not fire them at the next driver, nor the rescue checkpoint at the lost one's pid)."""
        self.driver = {key for key in self.driver if key[0] > committed}

    def new_driver(self, driver_pid: int) -> None:
        """A restarted driver re-adopted this device: its driver faults aim at that one's pid."""
        self.driver_pid = driver_pid

    def _kill_driver_if_due(self, phase: str, step: int) -> None:
        """Tests' and the soak's driver faults (STEP:driver:PHASE): kill -9 the driver here, once."""
        due = _due(self.driver, phase, step)
        if not due or not self.driver_pid or self.remote:
            return
        self.driver -= set(due)
        print(
            f"flexpar: fault: driver gets SIGKILL at step {step} ({phase}) at {time.time():.6f} (pid "
            f"{self.driver_pid}, from {self.device_id})",
            file=sys.stderr,
            flush=True,
        )
        try:
            os.kill(self.driver_pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def record_faults(faults, resumed_from: int) -> set:
    """The steps of the driver's own STEP:driver:record faults (it dies as that step's record arrives,
    before writing it) that a driver continuing from `resumed_from` committed steps fires: a restarted
    driver fires none at a step the devices had committed when it started (they are spent)."""
    return {
        fault.step
        for fault in faults
        if fault.device == "driver" and fault.phase == "record" and fault.step >= resumed_from
    }


def die_before_writing(step: int) -> None:
    """A STEP:driver:record fault: kill -9 this driver with the step's record read and not written (the
    devices committed the step and sent its record; nobody wrote it)."""
    print(
        f"flexpar: fault: driver gets SIGKILL at step {step} (record) at {time.time():.6f} (pid {os.getpid()}, "
        "from the driver)",
        file=sys.stderr,
        flush=True,
    )
    os.kill(os.getpid(), signal.SIGKILL)


def _due(keys, phase: str, step: int) -> list:
    """The (step, phase) keys due at `phase` of `step`: at their own step, or for a boundary phase at
    the first such phase at or after it."""
    boundary = phase in BOUNDARY_PHASES
    return [key for key in keys if key[1] == phase and (key[0] == step or (boundary and key[0] <= step))]
