"""The last step this device committed: its number, when it was committed, and the balancer's state after it."""

from __future__ import annotations

import time
from typing import Optional

from flexpar.core import balance


class CommittedStep:
    """This device's last committed step, and the step it computes on top of it.

    Invariants: `step` is the number of optimizer updates in the state this
    device holds (0: the untrained model every device of the first generation
    builds alike; -1: nothing committed, a joiner, or a listener whose stream
    was dropped). `wall` is the wall time at which that step was committed
    (the next step's time is measured from it, and it travels with the state,
    so a boundary's stall is measured from the last commit of any member).
    `balance` is the balancer's state as of that step: every member holds the
    same one, since it is a function of the summed statistics.
    `in_flight` is the step being computed on top of `step` (always `step`
    itself) until it commits or is broken off; None between steps.

    Only `commit` moves the step forward; `restore` takes a peer's or a
    checkpoint's.
    """

    def __init__(self) -> None:
        self.step = -1
        self.wall = time.time()
        self.balance = balance.BalanceState(seconds_per_vw={})
        self.in_flight: Optional[int] = None

    def admitted(self, first_generation: bool) -> None:
        """Let in: the devices of generation 1 hold step 0 (the same model from the same seed); a later
        joiner holds nothing yet and receives the state."""
        self.step = 0 if first_generation else -1

    def begin(self) -> int:
        """The next step starts on top of this one; returns its number (the committed step)."""
        self.in_flight = self.step
        return self.step

    def commit(self, contributors: tuple, assignment: list, busy: list) -> float:
        """The step in flight is applied: one more committed, the balancer observes its busy times.

        Returns the step's time: from the last commit to this one.
        """
        self.step += 1
        self.in_flight = None
        now = time.time()
        step_time, self.wall = now - self.wall, now
        self.balance = balance.observe(self.balance, contributors, assignment, busy)
        return step_time

    def break_off(self) -> bool:
        """The step in flight will not be committed here (a boundary redoes it, or the driver is gone);
        returns whether there was one."""
        abandoned = self.in_flight is not None
        self.in_flight = None
        return abandoned

    def restore(self, step: int, extra: dict) -> None:
        """A peer's or a checkpoint's committed step, with the commit time and balancer state it sent."""
        self.step = step
        if "balance" in extra:
            self.balance = balance.state_from_dict(extra["balance"])
        self.wall = float(extra.get("committed_wall", self.wall))

    def forget(self) -> None:
        """A listener whose stream is dropped holds no committed state of its own."""
        self.step = -1

    def extra(self) -> dict:
        """What travels with the state (`restore`'s `extra`)."""
        return {"balance": balance.state_to_dict(self.balance), "committed_wall": self.wall}
