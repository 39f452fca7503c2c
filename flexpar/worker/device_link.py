"""A device's link to the coordinator: a thread that follows the store, and the calls a worker makes.

The device half of the control plane (the driver half is
flexpar/driver/coordinator.py; the keys are flexpar/comm/protocol.py's).

The follower thread is flexpar/worker/link_follower.py. When the driver (and
the store it hosts) goes, it looks for a restarted one at the same address for
`driver_grace_s`; once one answers, the worker's main thread takes it over
(`await_driver`, then `rejoin`): flexpar/worker/orphan.py. The step loop does
not wait for the follower to notice a lost driver: each step looks itself
(`driver_gone_now`, flexpar/comm/driver_watch.py), so the members train at
most one step past the one in flight when the driver's process ended.
"""

from __future__ import annotations

import contextlib
import datetime
import queue
import threading
import time
from typing import Optional

import torch.distributed as dist

from flexpar.comm.channel import Channel
from flexpar.comm.driver_watch import DriverWatch
from flexpar.comm.protocol import (
    NOTICE_KEY,
    SCHEDULE_HOLD_KEY,
    get_json,
    has,
    meet,
)
from flexpar.comm.store import reconnect
from flexpar.worker.link_follower import StoreFollower


class JobStopped(Exception):
    """The coordinator stopped the job (done, error, or no worker left)."""


class Evicted(Exception):
    """The coordinator refused or evicted this device; the message says why."""


class DriverLost(Exception):
    """The job's driver (and the store it hosts) is gone.

    `agreed`: the members stopped together in a step (every one of them holds
    it); `let_go`: the device was asked to stop (SIGTERM) while it waited for a
    driver, and exits as one let go.
    """

    def __init__(self, message: str = "", agreed: bool = False, let_go: bool = False):
        super().__init__(message)
        self.agreed, self.let_go = agreed, let_go


# How often a device's follower thread reads the store, and how often a device
# waiting for a generation looks at what the follower saw.
DEVICE_POLL_S = 0.02


class DeviceLink:
    """A worker's connection to the coordinator.

    A background thread follows the published generation, the stop flag and
    this device's reply key, and bumps the heartbeat, on its own store client:
    the training loop reads plain attributes and never waits on the store
    between steps.
    """

    def __init__(
        self, host: str, port: int, device_id: str, timeout_s: float, poll_s: float = DEVICE_POLL_S, secret: str = ""
    ):
        self.host, self.port, self.timeout_s = host, port, timeout_s
        self.device_id = device_id
        self.secret = secret  # for the notice this device gives a restarted driver (adopt_proof)
        # At once, not after the timeout, when nothing listens: a job whose driver is gone already.
        self.store = reconnect(host, port, timeout_s, handshake_s=timeout_s)
        self.events = Channel(self.store, "events")
        self._watch = DriverWatch(host, port, timeout_s)  # the step loop's look at the driver (`driver_gone_now`)
        self._outbox: queue.Queue = queue.Queue()
        self.latest_generation = 0
        self.stop_reason: Optional[str] = None
        self.reply: Optional[str] = None
        self.speed: Optional[float] = None  # emulated speed set by the driver, if any
        self.acknowledged = -1  # the step up to which the driver delivered every record (core.delivery)
        self.dead_members: frozenset = frozenset()  # peers of the latest generation known dead
        # The step of the first scheduled leave the driver has not published yet (-1: none): the members
        # wait for it at the boundary before that step (`await_scheduled_leave`).
        self.schedule_hold = -1
        self.finish_reason: Optional[str] = None  # the driver asked to stop after the step in flight
        self.driver_lost = False  # the store (and so the driver) is gone, until `rejoin`
        self.lost_at: Optional[float] = None  # wall clock: when this device noticed it
        self.driver_grace_s = 0.0  # how long to look for a restarted driver (`configure`)
        self.driver: Optional[dict] = None  # the restarted driver's DRIVER_KEY, once one answered
        self.report_head: tuple = (0, ())  # (generation, members) the worker last trained in
        self.leave_requested_at: Optional[float] = None  # SIGTERM: leave at the next boundary
        # Set once the device has announced itself (or is past the point where it would have): a leave
        # request is sent only then, so that the coordinator never reads it before the announcement,
        # which it would then take for a fresh joiner's.
        self.announced = False
        self._leave_proof = ""
        self._leave_grace_s = 30.0
        self._poll_s = poll_s
        self._follower_store: Optional[dist.TCPStore] = None
        # Each loss, and each driver found after it, counts up: `await_driver` hands the main thread a
        # driver found after its last `rejoin` only (never the one it has just lost again).
        self._losses = 0
        self._answered = 0
        self._rejoined = 0
        self._search_over = threading.Event()  # no driver came back within the grace (the follower ended)
        self.starved_until = 0.0  # a test's "starve" fault: the follower does not run until then (monotonic)
        self._closing = threading.Event()
        self._thread = threading.Thread(target=StoreFollower(self).run, name="flexpar-link", daemon=True)
        self._thread.start()

    def configure(self, timeout_s: float, driver_grace_s: float = 0.0) -> None:
        """Use the job's `timeout_s` for every store call from here on (the process starts with a default),
        and look for a restarted driver for `driver_grace_s` after losing one.

        The timeout bounds how long a store call can wait for an answer: a
        driver whose host vanished (no connection reset) is noticed within it.
        """
        self.timeout_s, self.driver_grace_s = timeout_s, driver_grace_s
        for store in (self.store, self._follower_store):
            if store is not None:
                store.set_timeout(datetime.timedelta(seconds=timeout_s))

    def await_driver(self) -> Optional[dict]:
        """(Main thread, after a loss) Block until a driver answers at the address: what it says about
        itself (DRIVER_KEY). None when none came within the grace, this device was asked to leave
        (SIGTERM), or the link is closing."""
        self.note_lost()
        give_up_at = self.lost_at + self.driver_grace_s  # also when only this thread's call failed
        while True:
            if self._answered > self._rejoined and self._answered == self._losses:
                return self.driver
            if (
                self._search_over.is_set()
                or self._closing.is_set()
                or not self._thread.is_alive()
                or self.leave_requested_at is not None
                or time.time() > give_up_at
            ):
                return None
            time.sleep(self._poll_s)

    def driver_gone_now(self) -> bool:
        """(Main thread, at every step's statistics) Whether the driver is gone, looked at now.

        This bounds, in steps, how long the members train past a dead driver, however late the follower
        thread runs (on a loaded host it was seen 3-6 steps late): its watch connection (flexpar/comm/
        driver_watch.py) closes once the driver's process has ended, and a device whose statistics of
        step S are made after that stops the members after step S. So they commit at most the step in
        flight when the driver's connections closed, and the next one. What it costs a step: one poll of
        a socket, no store call, unless the watch closed: a store call then confirms it (a connection
        closed by anything else leaves a live driver's job training, with a fresh watch).
        """
        if self.driver_lost or not self._watch.closed():
            return self.driver_lost
        try:
            self.store.add(NOTICE_KEY, 0)
        except RuntimeError:
            self.note_lost()
            return True
        self._renew_watch()
        return False

    def _renew_watch(self) -> None:
        """A fresh watch connection (its old one closed: a live driver's, or a restarted driver's store)."""
        self._watch.close()
        self._watch = DriverWatch(self.host, self.port, self.timeout_s)

    def starve_follower(self, seconds: float) -> None:
        """A test's "starve" fault (flexpar/worker/fault_injection.py): the follower thread stops running,
        as a loaded host may leave it, until the main thread notes a lost driver or `seconds` passed."""
        self.starved_until = time.monotonic() + seconds

    def note_lost(self) -> None:
        """Note that the driver is gone (either thread may notice first)."""
        self.driver_lost = True
        if self.lost_at is None:
            self.lost_at = time.time()

    def rejoin(self) -> None:
        """(Main thread) Use the restarted driver's store from here on, as this device's driver.

        What the old driver had said (finish, dead peers) no longer holds; the
        follower reads the new driver's keys from now on.
        """
        answered = self._answered
        try:
            store = reconnect(self.host, self.port, self.timeout_s)
        except RuntimeError as error:
            raise DriverLost(f"the restarted driver went again ({error})") from None
        self.store, self.events = store, Channel(store, "events")
        self._renew_watch()
        self.finish_reason, self.dead_members, self.schedule_hold = None, frozenset(), -1
        # Before the follower sends again: records queued for the lost driver would reach the new one
        # ahead of those sent to the lost one and never read, which rank 0 sends again at the re-adopted
        # generation's boundary with every record it keeps, in order (flexpar.core.delivery).
        self._drop_queued()
        self.driver_lost, self.lost_at = False, None
        self._rejoined = answered

    def _drop_queued(self) -> None:
        while True:
            try:
                self._outbox.get_nowait()
            except queue.Empty:
                return
            self._outbox.task_done()

    def request_leave(self, proof: str, grace_s: float) -> None:
        """Ask the coordinator to let this device leave at the next step boundary (preemption).

        Safe to call from a signal handler: it only sets attributes; the
        follower thread sends the request. If the device has not left
        `grace_s` seconds later, it kills itself (the failure path).
        """
        if self.leave_requested_at is None:
            self._leave_grace_s = grace_s
            self._leave_proof = proof
            self.leave_requested_at = time.monotonic()

    def publish(self, record: dict) -> None:
        """Queue a metrics record; the follower thread sends it, off the step's critical path."""
        self._outbox.put(record)

    def flush(self) -> None:
        """Wait until every queued record has been sent (DriverLost when the driver goes meanwhile, or
        went with a record in flight: a restarted one gets them)."""
        while self._outbox.unfinished_tasks and self._thread.is_alive() and not self.driver_lost:
            time.sleep(0.005)
        if self.driver_lost:
            raise DriverLost("the job's driver is gone (records still to send)")

    def check(self, driver_loss_handled: bool = False) -> None:
        """Raise if the coordinator stopped the job or refused this device, or the driver is gone.

        The step loop passes `driver_loss_handled=True`: it agrees with its
        peers on stopping (in the step's statistics) instead.
        """
        if self.reply is not None:
            raise Evicted(self.reply)
        if self.stop_reason is not None:
            raise JobStopped(self.stop_reason)
        if self.driver_lost and not driver_loss_handled:
            raise DriverLost("the connection to the job's driver was lost")

    def send(self, message_type: str, **fields) -> None:
        with self.driver_needed():
            self.events.send({"type": message_type, "device_id": self.device_id, **fields})

    def generation(self, generation: int) -> dict:
        with self.driver_needed():
            return get_json(self.store, f"gen/{generation}")

    @contextlib.contextmanager
    def driver_needed(self):
        """A store call that fails because the driver is gone raises DriverLost, not c10d's error."""
        try:
            yield
        except RuntimeError as error:
            self.note_lost()
            raise DriverLost(
                f"the job's driver is gone ({str(error).splitlines()[0] if str(error) else error})"
            ) from None

    def read_finish_reason(self) -> Optional[str]:
        """Why the job is asked to finish, read from the store now (the follower may lag)."""
        with self.driver_needed():
            if has(self.store, "finish"):
                self.finish_reason = self.store.get("finish").decode()
        return self.finish_reason

    def await_scheduled_leave(self, next_step: int, generation: int, members, poll_s: float = 0.001) -> int:
        """(Main thread, before its step's statistics) Wait until the driver has published the generation of
        a scheduled leave that takes effect at `next_step`, if one is due there and not published yet.

        Returns the newest generation this read (0: none read): the step's statistics carry at least it,
        so that every member moves to it at this boundary. Waits only while the driver owes that
        generation (SCHEDULE_HOLD_KEY is `next_step`) and nothing else decides this boundary first: a
        newer generation (another change forming here; the leave then lands late), a dead peer, a stop
        or finish, a reply, a SIGTERM to this device, or a lost driver.
        """
        latest = 0
        if self.schedule_hold < 0 or self.schedule_hold > next_step:  # the follower's view: nothing owed
            return latest
        while not (
            self.reply is not None
            or self.stop_reason is not None
            or self.finish_reason is not None
            or self.driver_lost
            or self.leave_requested_at is not None
            or self._closing.is_set()
            or self.lost_among(generation, members)
        ):
            try:  # read here, not by the follower, whose polls are 20 ms apart: the members wait meanwhile
                hold = int(self.store.get(SCHEDULE_HOLD_KEY)) if has(self.store, SCHEDULE_HOLD_KEY) else -1
                latest = int(self.store.get("gen/latest")) if has(self.store, "gen/latest") else 0
            except RuntimeError:
                self.note_lost()  # the step's statistics say so; the members stop together
                break
            if hold != next_step or latest > generation:
                break
            time.sleep(poll_s)
        return latest

    def lost_among(self, generation: int, devices) -> Optional[str]:
        """One of `devices` that the coordinator says died in `generation` (the newest it published), if any."""
        if self.latest_generation != generation:
            return None
        lost = self.dead_members & set(devices)
        return min(lost) if lost else None

    def gather(self, generation: int, members: tuple, poll_s: float = 0.0005, label: str = "arrived") -> str:
        """Meet the other members of `generation` in the store before forming its group.

        Returns "" once every member has arrived, or why the generation cannot
        form: a member the coordinator knows is dead, or a newer generation.
        `label` names the meeting (a sharded job's hand-off meets first, then
        its training group).
        """

        def problem() -> str:
            self.check()
            if self.latest_generation > generation:
                return f"generation {generation} was superseded by {self.latest_generation} before it formed"
            lost = self.lost_among(generation, members)
            return f"peer {lost} died before generation {generation} formed" if lost else ""

        with self.driver_needed():
            return meet(self.store, f"gen/{generation}/{label}", len(members), problem, poll_s)

    def wait_for_generation(self, after: int, joining: bool) -> tuple:
        """The first published generation > `after` that holds this device, with its record.

        A joiner skips generations formed without it (it was not admitted yet);
        a member that a newer generation leaves out is out: Evicted. A sharded
        job's planned leaver is in a generation that lists it as departing.
        """
        while True:
            self.check()
            latest = self.latest_generation
            if latest > after:
                record = self.generation(latest)
                if self.device_id in record["members"] or (
                    not joining and self.device_id in record.get("departing", ())
                ):
                    return latest, record
                if not joining:
                    raise Evicted(f"generation {latest} does not include {self.device_id}")
                after = latest
            time.sleep(self._poll_s)

    def close(self) -> None:
        """Stop following; records still queued are sent first."""
        self._closing.set()
        self._thread.join(timeout=5)
        self._watch.close()
