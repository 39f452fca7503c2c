"""The vocabulary of membership decisions: the events that go in, the actions that come out.

`decide(state, event) -> (state, actions)` (decide.py) takes one of these
events and returns these actions; the coordinator (flexpar/driver/coordinator.py)
turns store messages, process exits and the time into events, and carries
the actions out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

from flexpar.core.adoption import Adopted, DeviceReport

# ----------------------------------------------------------------- events


@dataclass(frozen=True)
class Start:
    """The job starts: spawn the initial local devices."""

    local_devices: int


@dataclass(frozen=True)
class Announced:
    """A device (local or remote) connected and is warming up."""

    device_id: str


@dataclass(frozen=True)
class Ready:
    """A device finished warm-up; `problem` is why it must be refused, or empty."""

    device_id: str
    problem: str = ""


@dataclass(frozen=True)
class Formed:
    device_id: str
    generation: int


@dataclass(frozen=True)
class FailureReported:
    device_id: str
    generation: int
    now: float


@dataclass(frozen=True)
class HandedOff:
    """A departing device (hand_off) handed its state over in `generation` and exits."""

    device_id: str
    generation: int


@dataclass(frozen=True)
class Exited:
    """A device's process is gone (exit, crash or lost heartbeat)."""

    device_id: str
    now: float


@dataclass(frozen=True)
class ScaleBy:
    """Add (delta > 0, spawned locally) or remove (delta < 0) devices.

    `request_id` names the request in its `Answer` (a `flexpar scale` call,
    or a schedule entry); empty: nobody waits for an answer. `at_step`: a
    scheduled leave decided ahead of its step (flexpar/core/schedule.py): its
    generation takes effect at the boundary before that step (`Publish.from_step`),
    not at the next one; None: at the next boundary (`flexpar scale`).
    """

    delta: int
    request_id: str = ""
    at_step: Optional[int] = None


@dataclass(frozen=True)
class LeaveRequested:
    """A device asked to leave at the next step boundary (it got SIGTERM: preemption)."""

    device_id: str


@dataclass(frozen=True)
class FinishRequested:
    """Stop after the step in flight (SIGTERM to the driver, a callback's STOP); `quiet`: say nothing."""

    reason: str
    quiet: bool = False


@dataclass(frozen=True)
class Finished:
    """A member committed the job's last step (or the agreed stop) and ends: the job is over.

    Sent by every member before its process exits, so the coordinator reads it
    before it sees the exit, which is then no failure. `rank_0`: it is rank 0,
    which hands the job's result over ("done") before it exits.
    """

    device_id: str
    rank_0: bool = False


@dataclass(frozen=True)
class Tick:
    now: float


@dataclass(frozen=True)
class SeenWaiting:
    """A restarted driver's look at its own host: these devices are alive and wait to be re-adopted
    (their report files, flexpar/comm/waiting.py); its adoption window waits for them."""

    device_ids: tuple


@dataclass(frozen=True)
class Reported:
    """A device that outlived its driver reported to the restarted one (or is still finishing its
    step: `report.final` False); `problem`: why it is not of this job (proof, model, settings)."""

    report: DeviceReport
    now: float
    problem: str = ""


Event = Union[
    Start,
    Announced,
    Ready,
    Formed,
    FailureReported,
    HandedOff,
    Exited,
    ScaleBy,
    LeaveRequested,
    FinishRequested,
    Finished,
    Tick,
    Reported,
    SeenWaiting,
]


# ---------------------------------------------------------------- actions


@dataclass(frozen=True)
class SpawnLocal:
    device_ids: tuple


@dataclass(frozen=True)
class Publish:
    """A new generation. `adopted`: the first one of a re-adopted job (flexpar/core/adoption.py);
    `restore`: a checkpoint its rank 0 reads before the state is levelled (newer than what the
    re-adopted devices hold)."""

    generation: int
    members: tuple
    joined: tuple
    left: tuple
    failed: tuple
    adopted: Optional[Adopted] = None
    restore: str = ""
    departing: tuple = ()  # a sharded job's leavers: they hand their state over, then exit
    # The first step the generation trains (a scheduled leave published ahead of its step): the
    # members commit the steps before it in the current generation. None: at the next boundary.
    from_step: Optional[int] = None


@dataclass(frozen=True)
class Refuse:
    device_id: str
    reason: str


@dataclass(frozen=True)
class Evict:
    """Tell a device it is out, and stop it."""

    device_id: str
    reason: str = "it stopped answering after a failure"


@dataclass(frozen=True)
class StopJob:
    reason: str


@dataclass(frozen=True)
class FinishJob:
    """Stop training cleanly after the step in flight (checkpointed when checkpointing is on)."""

    reason: str
    quiet: bool = False


@dataclass(frozen=True)
class Answer:
    """The answer to a scale request: accepted (with the device count it aims at) or refused."""

    request_id: str
    accepted: bool
    message: str
    devices: int
    started: tuple = ()  # devices spawned for it
    leaving: tuple = ()  # members that leave at the next generation
    cancelled: tuple = ()  # devices on their way that it cancelled


@dataclass(frozen=True)
class Note:
    """Something worth telling the user that changes nothing."""

    message: str


@dataclass(frozen=True)
class Decline:
    """The restarted driver stops with `reason` (a device of another job reported); the waiting
    devices are told nothing: they wait on for a driver of their own job."""

    reason: str


@dataclass(frozen=True)
class NothingToAdopt:
    """No member of the job came back within the adoption window: the job resumes from `checkpoint`,
    its newest ("" when there is none: the driver stops with an error), before the initial devices
    (the `SpawnLocal` that follows) read its settings."""

    reason: str
    checkpoint: str = ""


Action = Union[SpawnLocal, Publish, Refuse, Evict, StopJob, FinishJob, Answer, Note, Decline, NothingToAdopt]


__all__ = [
    "Action",
    "Announced",
    "Answer",
    "Decline",
    "Event",
    "Evict",
    "Exited",
    "FailureReported",
    "FinishJob",
    "FinishRequested",
    "Finished",
    "Formed",
    "HandedOff",
    "LeaveRequested",
    "Note",
    "NothingToAdopt",
    "Publish",
    "Ready",
    "Refuse",
    "Reported",
    "ScaleBy",
    "SeenWaiting",
    "SpawnLocal",
    "Start",
    "StopJob",
    "Tick",
]
