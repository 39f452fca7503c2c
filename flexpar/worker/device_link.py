"""A device's link to the coordinator: a thread that follows the store, and the calls a worker makes.

The device half of the control plane (the driver half is
flexpar/driver/coordinator.py; the keys are flexpar/comm/protocol.py's).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import queue
import signal
import sys
import threading
import time
from typing import Optional

import torch.distributed as dist

from flexpar.comm.channel import Channel
from flexpar.comm.protocol import NOTICE_KEY, get_json, has, meet
from flexpar.comm.store import connect


class JobStopped(Exception):
    """The coordinator stopped the job (done, error, or no worker left)."""


class Evicted(Exception):
    """The coordinator refused or evicted this device; the message says why."""


class DriverLost(Exception):
    """The job's driver (and the store it hosts) is gone."""


# How often a device's follower thread reads the store, and how often a device
# waiting for a generation looks at what the follower saw.
DEVICE_POLL_S = 0.02
# A follower reads every followed key at least this often (protocol.NOTICE_KEY says when to read sooner).
FOLLOW_ALL_S = 0.5


class DeviceLink:
    """A worker's connection to the coordinator.

    A background thread follows the published generation, the stop flag and
    this device's reply key, and bumps the heartbeat, on its own store client:
    the training loop reads plain attributes and never waits on the store
    between steps.
    """

    def __init__(self, host: str, port: int, device_id: str, timeout_s: float, poll_s: float = DEVICE_POLL_S):
        self.host, self.port, self.timeout_s = host, port, timeout_s
        self.device_id = device_id
        self.store = connect(host, port, timeout_s)
        self.events = Channel(self.store, "events")
        self._outbox: queue.Queue = queue.Queue()
        self.latest_generation = 0
        self.stop_reason: Optional[str] = None
        self.reply: Optional[str] = None
        self.speed: Optional[float] = None  # emulated speed set by the driver, if any
        self.dead_members: frozenset = frozenset()  # peers of the latest generation known dead
        self.finish_reason: Optional[str] = None  # the driver asked to stop after the step in flight
        self.driver_lost = False  # the store (and so the driver) is gone
        self.leave_requested_at: Optional[float] = None  # SIGTERM: leave at the next boundary
        self._leave_proof = ""
        self._leave_grace_s = 30.0
        self._poll_s = poll_s
        self._follower_store: Optional[dist.TCPStore] = None
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._follow, name="flexpar-link", daemon=True)
        self._thread.start()

    def set_timeout(self, timeout_s: float) -> None:
        """Use the job's `timeout_s` for every store call from here on (the process starts with a default).

        It bounds how long a store call can wait for an answer: a driver whose
        host vanished (no connection reset) is noticed within it.
        """
        self.timeout_s = timeout_s
        for store in (self.store, self._follower_store):
            if store is not None:
                store.set_timeout(datetime.timedelta(seconds=timeout_s))

    def _follow(self) -> None:
        store = connect(self.host, self.port, self.timeout_s)
        self._follower_store = store
        store.set_timeout(datetime.timedelta(seconds=self.timeout_s))  # set_timeout may have run meanwhile
        metrics = Channel(store, "metrics")
        beats = 0
        last_beat = 0.0
        notice = None  # NOTICE_KEY at the last reading of the followed keys
        read_all_at = 0.0
        while not self._closing.is_set():
            try:
                seen = store.add(NOTICE_KEY, 0)  # first: a key told after this is read next time
                if seen != notice or time.monotonic() - read_all_at >= FOLLOW_ALL_S:
                    notice, read_all_at = seen, time.monotonic()
                    self._read_followed(store)
                if self.leave_requested_at is not None and self._leave_proof:
                    Channel(store, "events").send(
                        {"type": "leave", "device_id": self.device_id, "proof": self._leave_proof}
                    )
                    self._leave_proof = ""  # sent once
                while not self._outbox.empty():
                    metrics.send(self._outbox.get())
                    self._outbox.task_done()
                now = time.monotonic()
                self._enforce_leave_grace(now)
                if now - last_beat > 0.5:
                    beats += 1
                    store.set(f"heartbeat/{self.device_id}", str(beats))
                    last_beat = now
            except Exception:  # the store, hosted by the driver, is gone
                self.driver_lost = True
                self._wait_out_leave_grace()
                return
            self._closing.wait(self._poll_s)
        try:
            while not self._outbox.empty():
                metrics.send(self._outbox.get())
        except Exception:
            pass

    def _read_followed(self, store) -> None:
        """Read the keys this device follows (written with `tell_devices`)."""
        if has(store, "gen/latest"):
            self.latest_generation = int(store.get("gen/latest"))
        dead_key = f"gen/{self.latest_generation}/dead"
        if has(store, dead_key):
            self.dead_members = frozenset(get_json(store, dead_key))
        if has(store, "stop"):
            self.stop_reason = store.get("stop").decode()
        if self.finish_reason is None and has(store, "finish"):
            self.finish_reason = store.get("finish").decode()
        if has(store, f"speed/{self.device_id}"):
            self.speed = float(store.get(f"speed/{self.device_id}"))
        if has(store, f"reply/{self.device_id}"):
            self.reply = store.get(f"reply/{self.device_id}").decode()

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

    def _enforce_leave_grace(self, now: float) -> None:
        # Once the job is stopping (the driver's SIGTERM came with this one: a whole host's),
        # the device stops with the others at the boundary, and rank 0 may be writing the
        # final checkpoint: the grace no longer applies (a later second SIGTERM still kills).
        if self.finish_reason is not None or self.stop_reason is not None:
            return
        if self.leave_requested_at is not None and now - self.leave_requested_at > self._leave_grace_s:
            print(
                f"flexpar: device {self.device_id}: did not leave within {self._leave_grace_s:g} s of "
                "SIGTERM; exiting now (the others recover as after a failure)",
                file=sys.stderr,
                flush=True,
            )
            os.kill(os.getpid(), signal.SIGKILL)

    def _wait_out_leave_grace(self) -> None:
        """With the store gone the follower stops, but a pending leave's grace still applies."""
        while self.leave_requested_at is not None and not self._closing.is_set():
            self._enforce_leave_grace(time.monotonic())
            self._closing.wait(self._poll_s)

    def publish(self, record: dict) -> None:
        """Queue a metrics record; the follower thread sends it, off the step's critical path."""
        self._outbox.put(record)

    def flush(self) -> None:
        """Wait until every queued record has been sent."""
        if self._thread.is_alive():
            self._outbox.join()

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
        with self._driver_needed():
            self.events.send({"type": message_type, "device_id": self.device_id, **fields})

    def generation(self, generation: int) -> dict:
        with self._driver_needed():
            return get_json(self.store, f"gen/{generation}")

    @contextlib.contextmanager
    def _driver_needed(self):
        """A store call that fails because the driver is gone raises DriverLost, not c10d's error."""
        try:
            yield
        except RuntimeError as error:
            self.driver_lost = True
            raise DriverLost(
                f"the job's driver is gone ({str(error).splitlines()[0] if str(error) else error})"
            ) from None

    def read_finish_reason(self) -> Optional[str]:
        """Why the job is asked to finish, read from the store now (the follower may lag)."""
        with self._driver_needed():
            if has(self.store, "finish"):
                self.finish_reason = self.store.get("finish").decode()
        return self.finish_reason

    def gather(self, generation: int, members: tuple, poll_s: float = 0.0005) -> str:
        """Meet the other members of `generation` in the store before forming its group.

        Returns "" once every member has arrived, or why the generation cannot
        form: a member the coordinator knows is dead, or a newer generation.
        """

        def problem() -> str:
            self.check()
            if self.latest_generation > generation:
                return f"generation {generation} was superseded by {self.latest_generation} before it formed"
            lost = self.dead_members & set(members) if self.latest_generation == generation else set()
            return f"peer {min(lost)} died before generation {generation} formed" if lost else ""

        with self._driver_needed():
            return meet(self.store, f"gen/{generation}/arrived", len(members), problem, poll_s)

    def wait_for_generation(self, after: int, joining: bool) -> tuple:
        """The first published generation > `after` that holds this device, with its record.

        A joiner skips generations formed without it (it was not admitted yet);
        a member that a newer generation leaves out is out: Evicted.
        """
        while True:
            self.check()
            latest = self.latest_generation
            if latest > after:
                record = self.generation(latest)
                if self.device_id in record["members"]:
                    return latest, record
                if not joining:
                    raise Evicted(f"generation {latest} does not include {self.device_id}")
                after = latest
            time.sleep(self._poll_s)

    def close(self) -> None:
        """Stop following; records still queued are sent first."""
        self._closing.set()
        self._thread.join(timeout=5)
