"""A channel: an append-only list of JSON messages in the job's store, many writers and one reader.

Devices send the coordinator their events (announce, ready, formed,
failure, bye) and rank 0 its step records on channels; the driver reads them.
"""

from __future__ import annotations

import json
import time
from typing import Callable, Optional

from flexpar.comm.protocol import wake_driver

# A writer takes an index and writes its message right after (two store calls); one killed
# in between (kill -9 of a device while its follower thread sends a record) never writes it.
# The reader waits this long for a taken index, then skips it: otherwise every later message
# would wait behind the hole for ever (step records, then joins and failure reports).
HOLE_GRACE_S = 5.0
_LATE_KEPT = 64  # skipped indices a reader keeps looking at


class Channel:
    """An append-only list of JSON messages in the store: many writers, one reader.

    A writer takes the next index with the store's atomic add, then writes the
    message; the reader follows the indices in order and waits for a message
    whose index is taken but whose value is not yet written, for up to
    HOLE_GRACE_S (then its writer is taken for dead and the index skipped). The
    reader is the driver: a writer then bumps DRIVER_NOTICE_KEY.
    """

    def __init__(self, store, name: str, clock: Callable[[], float] = time.monotonic):
        self.store = store
        self.name = name
        self.cursor = 0
        self.clock = clock
        self.skipped = 0  # indices whose writer never wrote them (in time)
        self._skipped_indices: list = []  # the last _LATE_KEPT of them, looked at again on every receive
        self._hole_since: Optional[float] = None  # when the reader first found the index at cursor empty

    def send(self, message: dict) -> None:
        index = self.store.add(f"{self.name}/count", 1)
        self.store.set(f"{self.name}/{index}", json.dumps(message))
        wake_driver(self.store)

    def receive(self, writers_done: bool = False) -> list:
        """The messages written since the last call, in order.

        `writers_done`: every writer still alive has finished writing (the job
        is over), so an index still empty now never will be written: skip it at
        once instead of after HOLE_GRACE_S.
        """
        count = self.store.add(f"{self.name}/count", 0)
        messages = []
        # An index skipped as a dead writer's may have been a stalled one's (SIGSTOP, a
        # starved thread): deliver it late rather than never.
        for index in list(self._skipped_indices):
            key = f"{self.name}/{index}"
            if self.store.check([key]):
                messages.append(json.loads(self.store.get(key)))
                self.store.delete_key(key)
                self._skipped_indices.remove(index)
        while self.cursor < count:
            key = f"{self.name}/{self.cursor + 1}"
            if not self.store.check([key]):
                now = self.clock()
                if self._hole_since is None:
                    self._hole_since = now
                if now - self._hole_since < HOLE_GRACE_S and not writers_done:
                    break  # being written
                self.skipped += 1  # its writer died between taking the index and writing
                self._skipped_indices = (self._skipped_indices + [self.cursor + 1])[-_LATE_KEPT:]
            else:
                messages.append(json.loads(self.store.get(key)))
                self.store.delete_key(key)
            self._hole_since = None
            self.cursor += 1
        return messages
