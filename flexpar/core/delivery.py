"""Exactly-once delivery of the devices' records: which arrivals are new, and what the driver acknowledges.

Every record the devices publish (a committed step's, an evaluation's, an
event's) must reach the metrics file, the sample ledger, the trackers and the
callbacks once, whatever dies when. So records are sent at least once and
written at most once:

- the devices keep what they published since the last step the driver
  acknowledged (`unacknowledged`) and send it again at every generation's
  boundary: after a failure (a new rank 0), after a re-adoption by a restarted
  driver, after a resume from a checkpoint (the kept records travel in it);
- a driver restarted with `--resume` starts from what its metrics file holds
  (`Delivery.of_records`): the file, not the driver's memory, says what was
  delivered.

The same record can therefore arrive several times, from several devices and
drivers; `Delivery` says which arrivals are new. A record is known by its
identity (`identity`): a step record by its step, an evaluation by the step
it evaluated, an event by its kind, generation, step and the time its
device stamped on it (a re-sent event is the same dict, so the same time).

Pure: no store, no files, no clock.
"""

from __future__ import annotations

from typing import Iterable, Optional


def identity(record: dict) -> tuple:
    """What makes two arrivals the same record."""
    kind = record["kind"]
    if kind in ("step", "eval"):
        return (kind, int(record["step"]))
    return (kind, record["event"], int(record["generation"]), int(record["step"]), float(record["time"]))


class Delivery:
    """The records a driver has delivered (written, handed to callbacks), by identity.

    `acknowledged()` is the highest step N such that every step record from
    the first one delivered up to N is: what the devices may forget (every
    record they published before step N's, and so with a step at or below N,
    was delivered or never will be sent again by a live device).
    """

    def __init__(self) -> None:
        self._seen: set = set()
        self._lowest: Optional[int] = None
        self._contiguous = -1

    @classmethod
    def of_records(cls, records: Iterable[dict]) -> "Delivery":
        """What a metrics file's records say was delivered (a resumed driver's start)."""
        delivery = cls()
        for record in records:
            delivery.add(record)
        return delivery

    def is_new(self, record: dict) -> bool:
        return identity(record) not in self._seen

    def add(self, record: dict) -> None:
        """Note `record` as delivered."""
        key = identity(record)
        self._seen.add(key)
        if key[0] != "step":
            return
        step = key[1]
        if self._lowest is None:
            self._lowest, self._contiguous = step, step
        while ("step", self._contiguous + 1) in self._seen:
            self._contiguous += 1

    def acknowledged(self) -> int:
        """The last step of the delivered run of steps that starts at the first one delivered (-1: none)."""
        return self._contiguous

    def steps(self) -> set:
        return {key[1] for key in self._seen if key[0] == "step"}


def unacknowledged(records: Iterable[dict], acknowledged: int) -> list:
    """The kept records a device must still keep: those of a step after the acknowledged one.

    Records are published in the order they happen: an evaluation at step S
    (the model after S steps) and an event at step S (S steps committed) come
    before step S's own record, so once that is acknowledged they were
    delivered too.
    """
    return [record for record in records if int(record["step"]) > acknowledged]
