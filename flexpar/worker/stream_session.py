"""A streamed join as one device holds it: the stream in flight, its transfers, what its boundary said.

flexpar/worker/streaming.py (and shard_streaming.py for a sharded job) plan
and carry out the rounds; this module holds what they share with the rest of
the worker: who listens, which transfers are in flight, and what landed when
a stream broke off.
"""

from __future__ import annotations

import dataclasses
import datetime
from typing import Optional

from flexpar.comm.collectives import wait_for_transfers
from flexpar.core import stream_plan
from flexpar.errors import TrainingError
from flexpar.worker import join_way

MASK_BITS = 52
"""Senders a listener can name in its landed mask (a float64 slot of the stock holds 52 bits exactly)."""

LANDED_WAIT_S = 0.05
"""How long a listener waits, at a failure, for each receive of the round in flight before it counts as lost."""


class StreamMismatch(TrainingError):
    """After a streamed join, the joiner's copy of a tensor differs from its sender's."""


@dataclasses.dataclass
class Stream:
    """A stream in flight in this generation (the same on every member but `works`)."""

    plan: stream_plan.Plan
    listeners: tuple  # ranks
    tensors: dict  # the plan's tensor name -> the parameter
    started_wall: float
    step_before_s: float  # the members' median step time before the join
    rounds_done: int = 0
    step_times: list = dataclasses.field(default_factory=list)
    skippable: bool = True  # every per-parameter state value is a tensor: a listener may skip updates
    stall_s: float = 0.0  # the join boundary's stall (rank 0, which publishes the events)
    plan_generation: int = 0  # the generation whose boundary made the plan (a re-plan makes it anew)
    senders: tuple = ()  # the plan's senders (device ids), in the plan's order
    # A listener's receives in flight, by sender: (sender, its works), waited for before the next update.
    receipts: tuple = ()
    broken_off: bool = False  # a failure or a new generation interrupted it (`StreamSession.suspend`)
    sizing: Optional[stream_plan.Sizing] = None  # the slices follow the members' step times (no join_stream_mb)
    member_step_s: tuple = ()  # every member's previous step time, from the last step's statistics
    rank: int = -1  # this device's rank in the stream's generation (`Worker.rank` only once its boundary ends)
    before_s: float = 0.0  # the members' median step time before the join, from those statistics
    landed_mask: int = 0  # a listener, broken off: the senders (bits by place) whose last slices landed
    choice: dict = dataclasses.field(default_factory=dict)  # join_way.event_fields of the choice that began it

    def identity(self) -> float:
        """The same on every member holding this stream in this state (0 is no stream): its plan's
        generation and the rounds posted."""
        return float(self.plan_generation * (1 << 20) + self.rounds_done + 1)

    @property
    def bytes_sent(self) -> int:
        """Every slice goes to every listener."""
        return self.plan.size * len(self.listeners)


class StreamSession:
    """This device's streamed join: the stream in flight, its transfers, and what its boundary said.

    Invariants:

    - `current` is the stream in flight in this generation (a `Stream`, or a
      sharded job's `ShardStream`), the same on every member but its works;
      None while none runs. Broken off (`suspend`) it stays until the next
      boundary decides whether it goes on.
    - `transfers` are this device's sends (a sender) or receives (a
      listener) posted and not yet waited for: at most one round's, waited
      for before this device's next optimizer update (`wait`), or handed to
      the old group's reaper when the stream breaks off.
    - `note` is what this boundary's join event says of the stream, or why
      the join was blocking ("" if nothing).
    - `choice` is the way this boundary's join took and both predictions
      (flexpar/worker/join_way.py), the same on every member; None where no
      choice was made (no join, or a join that cannot stream).
    - `link_bytes_per_s` is the bandwidth this device measured on its last
      blocking transfer of the state as its source (0: none yet).
    - `of_pending` is a sharded stream abandoned at a boundary while this
      device held a step it had not applied (flexpar/worker/shard_levelling.py's
      `pending_commit`): that step is applied with that stream's listeners.
    """

    def __init__(self) -> None:
        self.current: Optional[Stream] = None
        self.transfers: tuple = ()
        self.note = ""
        self.of_pending: Optional[Stream] = None
        self.choice = None
        self.link_bytes_per_s = 0.0

    # ------------------------------------------------------------ who listens

    def listening(self) -> bool:
        """This device listens to the stream: by its rank in the stream's generation, which a boundary
        broken off after the stream began never made `Worker.rank` (a joiner that restored the small
        state there reported it as a member's committed step, and trained from unstreamed values)."""
        return self.current is not None and self.current.rank in self.current.listeners

    def contributors(self, members: tuple) -> tuple:
        """The members that run VWs this step: all but the listeners."""
        if self.current is None:
            return members
        return tuple(device for rank, device in enumerate(members) if rank not in self.current.listeners)

    def with_listeners(self, assignment: tuple, world: int) -> tuple:
        """A contributors' assignment in member rank order (`world` members), listeners at 0 VWs."""
        if self.current is None:
            return tuple(assignment)
        counts = iter(assignment)
        return tuple(0 if rank in self.current.listeners else next(counts) for rank in range(world))

    def without_listeners(self, values) -> list:
        if self.current is None:
            return list(values)
        return [value for rank, value in enumerate(values) if rank not in self.current.listeners]

    def held_bytes(self, allocated: int) -> int:
        """Of `allocated` optimizer-state bytes, what this device holds: a listener, the stream's share
        landed so far (its tensors are allocated whole at the join, and filled round by round)."""
        if not self.listening():
            return allocated
        return int(allocated * self.current.plan.delivered_share(self.current.rounds_done))

    def held_step(self, committed: int) -> int:
        """The committed step this device reports as holding: none (-1) while it listens."""
        return -1 if self.listening() else committed

    def report(self, committed: int) -> tuple:
        """What this device puts in the boundary's stock of a stream in flight (Stock's stream fields)."""
        stream = self.current
        if stream is None:
            return (0.0, -1, 0)
        listening = committed if self.listening() else -1
        return (stream.identity(), listening, stream.landed_mask)  # the mask: a listener's only

    # ------------------------------------------------------------ its course

    def begin(self, stream: Stream, note: str) -> None:
        """A boundary starts a stream (or goes on with one, re-planned): the join event says `note`,
        after the choice's reason where this boundary chose to stream (the stream keeps the choice's
        predictions for its `stream` event)."""
        if self.choice is not None and self.choice.way == "stream":
            note = f"{self.choice.reason}; {note}"
            stream.choice = join_way.event_fields(self.choice)
        self.current = stream
        self.note = note

    def chose(self, choice) -> None:
        """This boundary's choice of the join's way (None: none made); a blocking one is the event's note."""
        self.choice = choice
        if choice is not None and choice.way == "blocking":
            self.note = choice.reason

    def say(self, note: str) -> None:
        """What this boundary's join event says of the stream, or why the join was blocking."""
        self.note = note

    def post(self, works) -> None:
        """A round's sends or receives, waited for before this device's next optimizer update."""
        self.transfers += tuple(works)

    def wait(self, peer_lost) -> None:
        """Before an optimizer update: the slices posted after the last one have left this device (a
        sender) or arrived (a listener)."""
        if self.transfers:  # kept until they are waited for: a failure here leaves them unlanded
            wait_for_transfers(list(self.transfers), peer_lost)
            self.transfers = ()
        if self.current is not None:
            self.current.receipts = ()

    def suspend(self) -> list:
        """A failure or a new generation breaks the stream off; the next boundary decides whether it
        goes on. A listener notes which senders' slices of the last round landed: it waits for them
        only briefly (a sender that died sends nothing more).

        Returns the transfers in flight, to retire with the old group.
        """
        works, self.transfers = list(self.transfers), ()
        stream = self.current
        if stream is None or stream.broken_off:
            return works
        mask = 0
        known = all(device is not None for device, _ in stream.receipts) and len(stream.senders) <= MASK_BITS
        if self.listening() and known:
            for place, sender in enumerate(stream.senders):
                received = [work for device, work in stream.receipts if device == sender]
                if all(_landed(work) for work in received):
                    mask |= 1 << place
        self.current = dataclasses.replace(stream, broken_off=True, landed_mask=mask, receipts=())
        return works

    def end(self) -> None:
        """The stream completed, or is dropped: none runs."""
        self.current = None

    def keep_for_pending(self, stream: Optional[Stream]) -> None:
        """A sharded stream abandoned while this device held an unapplied step (None: it held none)."""
        self.of_pending = stream

    def resume_for_pending(self) -> None:
        """The unapplied step is applied with the stream it was taken in (`end` after it)."""
        self.current = self.of_pending

    def drop_pending(self) -> None:
        self.of_pending = None


def _landed(work) -> bool:
    """Whether a receive work of a broken-off round completed (waited for briefly: its sender may be dead)."""
    if work is None:
        return False
    try:
        return bool(work.wait(datetime.timedelta(seconds=LANDED_WAIT_S)))
    except RuntimeError:  # the sender died (closed connection) or did not send in time
        return False
