"""The background thread of a device's link (flexpar/worker/device_link.py): it follows the store.

What the thread carries out, apart from what the worker's main thread calls
on the link: it reads the keys the coordinator tells the devices (the newest
generation, dead peers, stop and finish, the schedule hold, the driver's
acknowledgements, this device's reply and speed) into the link's fields,
sends the records queued on the link and a leave request, bumps the
heartbeat, and enforces a SIGTERMed device's leave grace. When the driver
(and the store it hosts) goes, it looks for a restarted one at the same
address for `driver_grace_s` (`_find_driver`); once one answers, the main
thread takes it over (`DeviceLink.await_driver`, then `rejoin`).
"""

from __future__ import annotations

import datetime
import os
import signal
import sys
import time
from typing import Optional

import torch.distributed as dist

from flexpar.comm.channel import Channel
from flexpar.comm.protocol import (
    ACKNOWLEDGED_KEY,
    DRIVER_KEY,
    NOTICE_KEY,
    SCHEDULE_HOLD_KEY,
    adopt_proof,
    get_json,
    has,
)
from flexpar.comm.store import connect, reconnect

# A follower reads every followed key at least this often (protocol.NOTICE_KEY says when to read sooner).
FOLLOW_ALL_S = 0.5
# How a device that lost its driver looks for a restarted one at the same address: a connection
# attempt (`store.reconnect`), then a pause growing from FIRST_RETRY_S to LAST_RETRY_S. A restarted
# driver is found within LAST_RETRY_S of its listen (0.13-0.20 s measured), for a few milliseconds
# of CPU a second while nothing listens.
FIRST_RETRY_S, LAST_RETRY_S = 0.05, 0.25


class StoreFollower:
    """The link's thread. It holds no state of its own between polls but its store client: what it
    reads, and the counters it shares with the main thread (`_losses`, `_answered`), are the link's
    fields, which the main thread reads as plain attributes and never waits on the store for."""

    def __init__(self, link):
        self.link = link

    def run(self) -> None:
        """The thread's loop, until the link closes or no driver came back within the grace."""
        link = self.link
        store = metrics = None
        beats = 0
        last_beat = 0.0
        notice = None  # NOTICE_KEY at the last reading of the followed keys
        read_all_at = 0.0
        while not link._closing.is_set():
            if time.monotonic() < link.starved_until and not link.driver_lost:  # a test's "starve" fault
                link._closing.wait(link._poll_s)
                continue
            try:
                if store is None:  # the first connection: its failure is a loss like any later one
                    store = connect(link.host, link.port, link.timeout_s)
                    store.set_timeout(datetime.timedelta(seconds=link.timeout_s))  # configure may have run
                    link._follower_store, metrics = store, Channel(store, "metrics")
                if link.driver_lost and link._rejoined < link._losses:
                    self._between_drivers(store)  # the main thread has not rejoined a driver yet
                else:
                    seen = store.add(NOTICE_KEY, 0)  # first: a key told after this is read next time
                    if seen != notice or time.monotonic() - read_all_at >= FOLLOW_ALL_S:
                        notice, read_all_at = seen, time.monotonic()
                        self._read_followed(store)
                    if link.leave_requested_at is not None and link._leave_proof and link.announced:
                        Channel(store, "events").send(
                            {"type": "leave", "device_id": link.device_id, "proof": link._leave_proof}
                        )
                        link._leave_proof = ""  # sent once
                    while not link._outbox.empty():
                        self._send_queued(metrics)
                now = time.monotonic()
                self._enforce_leave_grace(now)
                if now - last_beat > 0.5:
                    beats += 1
                    store.set(f"heartbeat/{link.device_id}", str(beats))
                    last_beat = now
            except Exception:  # the store, hosted by the driver, is gone
                store = self._find_driver()
                if store is None:
                    return
                link._follower_store, metrics, notice = store, Channel(store, "metrics"), None
                continue
            link._closing.wait(link._poll_s)
        try:
            while not link._outbox.empty():
                metrics.send(link._outbox.get())
        except Exception:
            pass

    def _send_queued(self, metrics: Channel) -> None:
        """Send the oldest queued record; it counts as handled (`task_done`) even when the send fails.

        A send fails when the driver goes (kill -9) while this thread sends: the
        record is lost with that driver, like those still queued, which `rejoin`
        drops (rank 0 sends every record it keeps again to a driver that re-adopts
        it: flexpar.core.delivery). Counted as never done, it held `flush` for
        ever: rank 0 of a re-adopted job hung in its final `flush`, the driver
        waiting for its "done" (the fault soak's seed 907, run 23). The loss is
        noted before the record counts as handled, so a `flush` under way raises
        DriverLost rather than take it for sent.
        """
        link = self.link
        record = link._outbox.get()
        try:
            metrics.send(record)
        except Exception:
            link.note_lost()
            raise
        finally:
            link._outbox.task_done()

    def _find_driver(self) -> Optional[dist.TCPStore]:
        """The driver is gone: look for a restarted one at the same address for `driver_grace_s`.

        Returns a client of the store that answered, or None when the grace ran
        out (or the link closes). Records queued for the old driver stay
        queued: they go to the new one once the main thread has rejoined it.
        """
        link = self.link
        link._losses += 1
        link.note_lost()
        deadline = time.monotonic() + link.driver_grace_s
        delay = FIRST_RETRY_S
        while not link._closing.is_set() and time.monotonic() < deadline:
            self._enforce_leave_grace(time.monotonic())
            try:
                return reconnect(link.host, link.port, link.timeout_s)
            except RuntimeError:
                pass
            link._closing.wait(min(delay, max(0.0, deadline - time.monotonic())))
            delay = min(LAST_RETRY_S, 2 * delay)
        link._search_over.set()
        self._wait_out_leave_grace()
        return None

    def _between_drivers(self, store) -> None:
        """Connected to a store at the address, not rejoined yet: read what its driver says about itself,
        give a re-adopting one this device's notice (it is there, still finishing its step maybe), and
        read this device's reply (a refusal)."""
        link = self.link
        if link._answered < link._losses and has(store, DRIVER_KEY):
            link.driver = get_json(store, DRIVER_KEY)
            if link.driver.get("adopting") and link.secret:
                generation, members = link.report_head
                proof = adopt_proof(link.secret, link.device_id, store.get("job/salt").decode())
                notice = {"type": "present", "device_id": link.device_id, "generation": generation}
                notice.update(members=list(members), seen=link.latest_generation, proof=proof)
                Channel(store, "events").send(notice)
            link._answered = link._losses
        if has(store, f"reply/{link.device_id}"):
            link.reply = store.get(f"reply/{link.device_id}").decode()

    def _read_followed(self, store) -> None:
        """Read the keys this device follows (written with `tell_devices`)."""
        link = self.link
        # The hold before the generation: the driver publishes a leave's generation before it moves the
        # hold past its step, so a hold read as moved comes with that generation (`await_scheduled_leave`).
        hold = int(store.get(SCHEDULE_HOLD_KEY)) if has(store, SCHEDULE_HOLD_KEY) else -1
        if has(store, "gen/latest"):
            link.latest_generation = int(store.get("gen/latest"))
        link.schedule_hold = hold
        dead_key = f"gen/{link.latest_generation}/dead"
        if has(store, dead_key):
            link.dead_members = frozenset(get_json(store, dead_key))
        if has(store, "stop"):
            link.stop_reason = store.get("stop").decode()
        if link.finish_reason is None and has(store, "finish"):
            link.finish_reason = store.get("finish").decode()
        if has(store, f"speed/{link.device_id}"):
            link.speed = float(store.get(f"speed/{link.device_id}"))
        if has(store, ACKNOWLEDGED_KEY):  # a restarted driver's may be unwritten yet, never lower
            link.acknowledged = max(link.acknowledged, int(store.get(ACKNOWLEDGED_KEY)))
        if has(store, f"reply/{link.device_id}"):
            link.reply = store.get(f"reply/{link.device_id}").decode()

    def _enforce_leave_grace(self, now: float) -> None:
        link = self.link
        # Once the job is stopping (the driver's SIGTERM came with this one: a whole host's),
        # the device stops with the others at the boundary, and rank 0 may be writing the
        # final checkpoint: the grace no longer applies (a later second SIGTERM still kills).
        if link.finish_reason is not None or link.stop_reason is not None:
            return
        if link.leave_requested_at is not None and now - link.leave_requested_at > link._leave_grace_s:
            print(
                f"flexpar: device {link.device_id}: did not leave within {link._leave_grace_s:g} s of "
                "SIGTERM; exiting now (the others recover as after a failure)",
                file=sys.stderr,
                flush=True,
            )
            os.kill(os.getpid(), signal.SIGKILL)

    def _wait_out_leave_grace(self) -> None:
        """With the store gone the follower stops, but a pending leave's grace still applies."""
        link = self.link
        while link.leave_requested_at is not None and not link._closing.is_set():
            self._enforce_leave_grace(time.monotonic())
            link._closing.wait(link._poll_s)
