"""What the coordinator knows about the job's devices (`Membership`), and the small moves every rule makes.

decide.py's rules and readoption.py's (a restarted driver re-adopting the
devices that outlived the old one) both take a state and return the next one
with its actions; the moves they share (spawn local devices, publish a
generation, stop the job) are here, so that neither imports the other.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

from flexpar.core.adoption import Adoption
from flexpar.core.membership.events import Publish, SpawnLocal, StopJob


@dataclass(frozen=True)
class Membership:
    """What the coordinator knows about the job's devices."""

    initial_devices: int
    max_devices: int
    grace_s: float
    generation: int = 0
    members: tuple = ()
    formed: frozenset = frozenset()
    starting: tuple = ()  # spawned or announced, not yet warm
    waiting: tuple = ()  # warm and accepted, waiting for the next generation
    leaving: tuple = ()  # members to drop at the next generation
    # A scheduled leave among `leaving` (ScaleBy.at_step): the next generation trains from this step
    # on; the members commit the steps before it first. None: from the next boundary.
    leaving_from: Optional[int] = None
    departing: tuple = ()  # hand_off: leavers of the current generation handing their state over
    survivors: tuple = ()  # members that reported the current generation failed
    dead: frozenset = frozenset()
    failure_since: Optional[float] = None
    next_local: int = 0  # counter for local device ids
    stopped: bool = False
    finishing: bool = False  # every member stops after the step in flight (FinishRequested)
    ended: bool = False  # a member committed the job's last step (or the agreed stop) and ends (Finished)
    result_from: str = ""  # the member that finished as rank 0: it hands the result over, then exits
    local_capacity: Optional[int] = None  # devices this host may run (cores or GPUs); None: no limit
    adoption: Optional[Adoption] = None  # a restarted driver's open adoption window (readoption.py)
    adopted_from: int = 0  # the generation the job was re-adopted from (0: not re-adopted)
    hand_off: bool = False  # planned leavers hand their state over first (a sharded optimizer)

    @property
    def local_count(self) -> int:
        """Devices of this host (ids 'local-N') counted against `local_capacity`."""
        on_their_way = self.members + self.waiting + self.starting
        return sum(1 for d in on_their_way if d.startswith("local-") and d not in self.leaving)

    @property
    def is_formed(self) -> bool:
        return self.generation > 0 and set(self.members) <= self.formed

    @property
    def rank_0_gone(self) -> bool:
        """The job ended and its rank 0's process is gone, or it reported a failure (its last all-reduce
        broke after another member finished: it waits for a generation that never comes): rank 0 hands
        the result over before it exits, so the result is there now, or never comes. Rank 0 is the
        member that said so when it finished; before that, the first member (members keep their rank
        order)."""
        if not self.ended:
            return False
        rank_0 = self.result_from or (self.members[0] if self.members else "")
        return rank_0 in self.dead or rank_0 in self.survivors

    @property
    def device_count(self) -> int:
        """Devices counted against --max-devices: members and those on their way."""
        return len(self.members) + len(self.waiting) + len(self.starting) - len(self.leaving)

    @property
    def watched(self) -> set:
        """Devices whose heartbeats count: members, those on their way, departing devices handing their
        state over, and an open window's reporters."""
        reporters = {r.device_id for r in self.adoption.reports} if self.adoption is not None else set()
        on_their_way = set(self.waiting) | set(self.starting)
        return (set(self.members) | on_their_way | set(self.departing) | reporters) - self.dead


def known(state: Membership, device_id: str) -> bool:
    """A device the job has admitted or retired (a member, waiting, dead or refused), or one that
    reported in an open adoption window."""
    reported = state.adoption is not None and device_id in state.adoption.by_device()
    return device_id in state.members or device_id in state.waiting or device_id in state.dead or reported


def spawn(state: Membership, count: int) -> tuple:
    """Start `count` local devices, numbered on from `next_local` (ids are never reused)."""
    ids = tuple(f"local-{state.next_local + i}" for i in range(count))
    state = dataclasses.replace(state, next_local=state.next_local + count, starting=state.starting + ids)
    return state, [SpawnLocal(ids)]


def publish(state: Membership, members, joined, left, failed, departing=(), from_step=None) -> tuple:
    """The next generation: `members` in rank order; who joined, left and failed since the last one.

    `departing` (hand_off only): leavers that hand their state over to `members` first, then exit.
    `from_step`: the first step it trains (a scheduled leave published ahead of its step); None:
    the members move to it at the first step boundary after they see it.
    """
    state = dataclasses.replace(
        state,
        generation=state.generation + 1,
        members=tuple(members),
        formed=frozenset(),
        waiting=(),
        leaving=(),
        leaving_from=None,
        departing=tuple(departing),
        survivors=(),
        failure_since=None,
    )
    action = Publish(state.generation, state.members, tuple(joined), tuple(left), tuple(failed))
    return state, (dataclasses.replace(action, departing=state.departing, from_step=from_step),)


def stop(state: Membership, reason: str) -> tuple:
    return dataclasses.replace(state, stopped=True), (StopJob(reason),)


def id_order(device_id: str):
    """'local-10' after 'local-9': the name, then its number."""
    name, _, number = device_id.rpartition("-")
    return (name, int(number)) if number.isdigit() else (device_id, -1)
