"""The control plane on torch.distributed's TCPStore.

One store per job, hosted by the driver. Everything the processes of a job tell
each other outside the training collectives goes through it:

    job/...            the job's pieces (signed), script path, model digest, version
    events/<k>         device -> coordinator messages (announce, ready, formed, failure, bye)
                       and CLI -> coordinator requests (scale), in order
    gen/latest, gen/<G> the published generations: members in rank order, who joined/left/failed
    gen/<G>/pg/...     the PrefixStore under which generation G's process group forms
    reply/<device>     the coordinator's word to one device (refused, evicted)
    answer/<request>   the coordinator's answer to a scale request (accepted or refused, why)
    finish             stop training cleanly after the step in flight (SIGTERM to the driver)
    heartbeat/<device> a counter each device bumps; a remote device that stops bumping is dead
    metrics/<k>        per-step and event records from rank 0, read by the driver
    result/...         the final training state (signed), written by rank 0
    error, stop, status

Values larger than the store's message limit travel as chunked blobs. Blobs
that are unpickled (the job) or loaded (state) carry an HMAC made with the
job's secret, and joiners prove they hold the secret, because TCPStore itself
authenticates nobody.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import hmac
import json
import os
import queue
import signal
import socket
import sys
import threading
import time
from typing import Callable, Iterable, Optional

import torch.distributed as dist

from flexpar.core import membership as ms

CHUNK_BYTES = 4 << 20  # the libuv TCPStore refuses messages above 8 MiB


class JobStopped(Exception):
    """The coordinator stopped the job (done, error, or no worker left)."""


class Evicted(Exception):
    """The coordinator refused or evicted this device; the message says why."""


class DriverLost(Exception):
    """The job's driver (and the store it hosts) is gone."""


class Unreachable(Exception):
    """No job answers at an address; the message says where and why, in one line.

    `exit_at_once`: a connection attempt was abandoned on a thread that is
    still inside C++ code: a command line must end with os._exit.
    """

    exit_at_once = False


def connect(host: str, port: int, timeout_s: float, server: bool = False) -> dist.TCPStore:
    """A TCPStore client (or the server, for the driver).

    The server listens on `host` only (loopback by default): TCPStore itself
    binds every interface, so the driver binds the listening socket to the
    asked address and hands it to TCPStore (its `master_listen_fd`), which
    serves its own protocol on it.
    """
    listen_fd = None
    if server:
        try:
            listener = socket.create_server((host, port), backlog=1024)
        except OSError as error:
            raise ValueError(f"cannot listen on {host}:{port} ({error.strerror}); choose another --port "
                             "(0 picks a free one) or --host") from None
        port = listener.getsockname()[1]
        listen_fd = listener.detach()  # TCPStore owns the descriptor from here on
    return dist.TCPStore(
        host,
        port,
        is_master=server,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=timeout_s),
        master_listen_fd=listen_fd,
    )


@contextlib.contextmanager
def _quiet_native_stderr():
    """Silence c10d's own C++ log lines (retries, frame dumps) for a moment.

    They are written by the C++ side straight to file descriptor 2, so the
    descriptor itself is pointed at /dev/null and restored afterwards. Used
    only around a command-line client's connection attempt, whose failure we
    report in one line of our own.
    """
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def connect_client(host: str, port: int, timeout_s: float, wait_for_job: bool = False) -> dist.TCPStore:
    """A store client for a command-line tool: Unreachable (one line) instead of c10d's dumps or a hang.

    Answers within about `timeout_s` whatever listens at the address:
    - nothing (a closed port, a dead job): at once, unless `wait_for_job`
      (`flexpar join` started beside its job, as under SLURM), which keeps
      trying until `timeout_s` (a plain connection attempt every 0.5 s);
    - a program that is not a flexpar job (an HTTP server, a silent
      listener): TCPStore's handshake waits for an answer that never comes,
      without a timeout of its own, so the connection is made on a daemon
      thread that is abandoned at the deadline.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            _probe(host, port, timeout_s)
            break
        except Unreachable:
            if not wait_for_job or time.monotonic() + 0.5 > deadline:
                raise
            time.sleep(0.5)
    # Something listens: a job answers its handshake in milliseconds.
    handshake_s = max(1.0, deadline - time.monotonic())
    outcome: queue.Queue = queue.Queue()
    abandoned = False

    def attempt():
        try:
            outcome.put(connect(host, port, handshake_s))
        except BaseException as error:  # handed to the caller's thread
            outcome.put(error)

    with _quiet_native_stderr():
        threading.Thread(target=attempt, name="flexpar-connect", daemon=True).start()
        try:
            result = outcome.get(timeout=handshake_s + 1.0)
        except queue.Empty:
            result = TimeoutError("something listens there but does not answer as a flexpar job does")
            abandoned = True
    if isinstance(result, dist.TCPStore):
        return result
    if isinstance(result, (RuntimeError, OSError)):  # DistNetworkError is a RuntimeError
        error = _unreachable(host, port, timeout_s, result)
        # A thread still inside TCPStore's C++ handshake must not meet the interpreter's
        # teardown (it aborts the process): the command line exits at once instead.
        error.exit_at_once = abandoned
        raise error from None
    raise result


def _probe(host: str, port: int, timeout_s: float) -> None:
    """Unreachable at once when nothing listens at host:port (TCPStore would retry until its timeout)."""
    try:
        socket.create_connection((host, port), timeout=min(timeout_s, 5.0)).close()
    except OSError as error:
        raise _unreachable(host, port, timeout_s, error) from None


def _unreachable(host: str, port: int, timeout_s: float, error: BaseException) -> "Unreachable":
    text = str(getattr(error, "strerror", None) or error).strip()
    reason = text.splitlines()[0] if text else type(error).__name__
    return Unreachable(f"no flexpar job answers at {host}:{port} within {timeout_s:g} s ({reason}); "
                       "check the address the job printed, and that the job is still running")


def sign(secret: str, *parts: bytes) -> str:
    mac = hmac.new(secret.encode(), digestmod=hashlib.sha256)
    for part in parts:
        mac.update(part)
    return mac.hexdigest()


def scale_proof(secret: str, request) -> str:
    """What a scale request presents: the secret's HMAC over the request (with its id)."""
    return sign(secret, b"scale:", json.dumps(request, sort_keys=True).encode())


def join_proof(secret: str, device_id: str, salt: str) -> str:
    """What a joiner presents: proof that it knows the secret, bound to its id."""
    return sign(secret, b"join:", device_id.encode(), b":", salt.encode())


def put_blob(store, key: str, data: bytes, secret: str) -> None:
    """Store `data` under `key` in chunks, with an HMAC over the whole."""
    chunks = [data[i : i + CHUNK_BYTES] for i in range(0, len(data), CHUNK_BYTES)] or [b""]
    for index, chunk in enumerate(chunks):
        store.set(f"{key}/{index}", chunk)
    meta = {"chunks": len(chunks), "size": len(data), "mac": sign(secret, data)}
    store.set(f"{key}/meta", json.dumps(meta))


def get_blob(store, key: str, secret: str) -> bytes:
    """The blob under `key`; raises ValueError if its HMAC does not match the secret."""
    meta = json.loads(store.get(f"{key}/meta"))
    data = b"".join(store.get(f"{key}/{index}") for index in range(meta["chunks"]))
    if len(data) != meta["size"] or not hmac.compare_digest(sign(secret, data), meta["mac"]):
        raise ValueError(
            f"the data under '{key}' is not signed with this job's secret: "
            "check the secret you passed (FLEXPAR_SECRET or --secret-file)"
        )
    return data


def get_json(store, key: str):
    return json.loads(store.get(key))


def has(store, key: str) -> bool:
    return store.check([key])


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


# The driver's counterpart of NOTICE_KEY (below): every channel message, and the key
# "done", bump it after they are written, so the driver's loop reads one counter per
# pass and its channels only when it moved (driver_loop.DriverLoop.run). They then set
# DRIVER_WAKE_KEY, which a thread of the driver waits for in the store (DriverWaker):
# the driver's loop sleeps until something was sent, instead of polling the store 100
# times a second on cores that compute.
DRIVER_NOTICE_KEY = "driver/notice"
DRIVER_WAKE_KEY = "driver/wake"


def wake_driver(store) -> None:
    """Have the driver's loop look at what was just written (the counter first, then the wake-up)."""
    store.add(DRIVER_NOTICE_KEY, 1)
    store.set(DRIVER_WAKE_KEY, "1")


def tell_driver(store, key: str, value: str) -> None:
    """Set `key` for the driver (as "done") and wake its loop."""
    store.set(key, value)
    wake_driver(store)


class DriverWaker:
    """A thread of the driver that waits in the store for DRIVER_WAKE_KEY and sets `woken`.

    TCPStore's `wait` answers when the key is set (the store's own server
    holds the waiter: no polling). The thread deletes the key before it sets
    the event, and writers bump DRIVER_NOTICE_KEY before they set the key, so
    no message is missed: one sent while the loop runs either moved the
    counter the loop reads next, or sets the key again. `close()` sets the key
    itself to let the thread end.
    """

    # A wait that long never times out in practice; if it does, the thread waits again on
    # a fresh connection (a client whose wait timed out may still get the late answer).
    _WAIT = datetime.timedelta(days=7)

    def __init__(self, host: str, port: int, timeout_s: float, store):
        self.store = store
        self.woken = threading.Event()
        self._closing = threading.Event()
        self._client = connect(host, port, timeout_s)
        self._thread = threading.Thread(target=self._run, args=(host, port, timeout_s), name="flexpar-waker",
                                        daemon=True)
        self._thread.start()

    def _run(self, host: str, port: int, timeout_s: float) -> None:
        client = self._client
        while not self._closing.is_set():
            try:
                client.wait([DRIVER_WAKE_KEY], self._WAIT)
                client.delete_key(DRIVER_WAKE_KEY)
            except RuntimeError:
                if self._closing.is_set():
                    return
                try:
                    client = connect(host, port, timeout_s)
                except RuntimeError:
                    return  # the store is gone: the driver is ending
            self.woken.set()

    def close(self) -> None:
        self._closing.set()
        try:
            self.store.set(DRIVER_WAKE_KEY, "1")
        except RuntimeError:
            pass
        self._thread.join(timeout=5.0)


# ---------------------------------------------------------------- coordinator

# How often the coordinator reads the devices' heartbeats (they beat every 0.5 s).
HEARTBEATS_READ_S = 0.1


class Coordinator:
    """Carries out membership decisions: the executor around `membership.decide`.

    It runs in the driver's loop (`step()` is called every few milliseconds),
    so it needs no threads or locks. `spawn_local(device_ids)` and
    `stop_local(device_id)` start and stop local worker processes;
    `local_exits()` returns the ids of local workers whose process has ended.
    """

    def __init__(
        self,
        store,
        secret: str,
        salt: str,
        job_digest: str,
        version: str,
        state: ms.Membership,
        spawn_local: Callable[[tuple], None],
        stop_local: Callable[[str], None],
        local_exits: Callable[[], Iterable[str]],
        heartbeat_timeout_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
        on_note: Callable[[str], None] = print,
    ):
        self.store = store
        self.secret = secret
        self.salt = salt
        self.job_digest = job_digest
        self.version = version
        self.state = state
        self.spawn_local = spawn_local
        self.stop_local = stop_local
        self.local_exits = local_exits
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.clock = clock
        self.on_note = on_note
        self.events = Channel(store, "events")
        self.stop_reason: Optional[str] = None
        self.published: list = []     # Publish actions, for metrics and status
        self.errors: list = []        # error messages from devices: the job stops on the first
        self.heartbeats: dict = {}    # device_id -> (last heartbeat value, time it changed)
        self.warmups: dict = {}       # device_id -> its warm-up's seconds (from "ready"): in the join event
        self._heartbeats_read_at = float("-inf")
        self._finish_asked: queue.SimpleQueue = queue.SimpleQueue()  # by signal handlers (request_finish)

    def request_finish(self, reason: str, note: bool = True) -> None:
        """`finish` from a signal handler: only recorded here, decided at the next `step()`.

        A handler runs between two bytecodes of the driver's loop, possibly in
        the middle of `apply`; deciding there could lose a state update.
        (SimpleQueue.put is reentrant: safe in a signal handler.)
        """
        self._finish_asked.put(ms.FinishRequested(reason, quiet=not note))

    def apply(self, event) -> tuple:
        """Decide on `event` and carry the actions out; returns them (the schedule reads its answers)."""
        self.state, actions = ms.decide(self.state, event)
        for action in actions:
            self._execute(action)
        return actions

    def step(self, receive: bool = True) -> None:
        """Turn what happened since the last call into events and apply them.

        `receive=False`: the caller knows no message was sent since the last call
        (DRIVER_NOTICE_KEY did not move), so the events channel is not read.
        """
        now = self.clock()
        while not self._finish_asked.empty():
            self.apply(self._finish_asked.get())
        for message in (self.events.receive() if receive else ()):
            event = self._event_of(message, now)
            if event is not None:
                self.apply(event)
        exited = list(self.local_exits())
        for device_id in exited:
            self.heartbeats.pop(device_id, None)
        # Heartbeats move every 0.5 s and count after seconds: reading them (two store
        # round trips per device) at every one of the driver's 100 polls a second only
        # woke threads on cores that compute (see NOTICE_KEY).
        silent = []
        if now - self._heartbeats_read_at >= HEARTBEATS_READ_S:
            self._heartbeats_read_at = now
            silent = self._silent_devices(now)
        for device_id in silent:
            self.on_note(f"device {device_id} stopped answering (no heartbeat for {self.heartbeat_timeout_s:g} s): "
                         "counted as failed")
            self.stop_local(device_id)  # a hung local process is killed; a remote one is evicted
            tell_devices(self.store, f"reply/{device_id}", "evicted: it stopped answering (no heartbeat)")
            exited.append(device_id)
        for device_id in exited:
            self._announce_death(device_id)
            self.apply(ms.Exited(device_id, now))
        self.apply(ms.Tick(now))

    def _announce_death(self, device_id: str) -> None:
        """Tell the members at once that a peer is gone, so nobody waits out a timeout."""
        state = self.state
        if device_id in state.members and device_id not in state.leaving:
            key = f"gen/{state.generation}/dead"
            dead = set(get_json(self.store, key)) if has(self.store, key) else set()
            tell_devices(self.store, key, json.dumps(sorted(dead | {device_id})))

    def _event_of(self, message: dict, now: float):
        kind = message.get("type")
        device = message.get("device_id", "")
        if kind in ("announce", "ready", "scale", "leave") and not self._proof_ok(message):
            reason = "wrong job secret: pass the job's secret (--secret-file, FLEXPAR_SECRET or FLEXPAR_SECRET_FILE)"
            if kind == "scale":
                self.on_note(f"refused a scale request: {reason}")
                request_id = str((message.get("request") or {}).get("id", ""))
                self._execute(ms.Answer(request_id, False, reason, self.state.device_count))
                return None
            if kind == "leave":
                return None
            self._execute(ms.Refuse(device, reason))
            return None
        if kind == "error":
            self.errors.append(message)
            return None
        if kind == "announce":
            # Every device beats; one that stops (crashed host, SIGSTOP, a hang) is dead
            # after heartbeat_timeout_s, long before a collective's timeout would say so.
            self.heartbeats[device] = (None, now)
            return ms.Announced(device)
        if kind == "ready":
            if isinstance(message.get("warmup_s"), (int, float)):
                self.warmups[device] = float(message["warmup_s"])
            return ms.Ready(device, self._ready_problem(message))
        if kind == "formed":
            return ms.Formed(device, int(message["generation"]))
        if kind == "failure":
            return ms.FailureReported(device, int(message["generation"]), now)
        if kind == "bye":
            self.heartbeats.pop(device, None)
            return ms.Exited(device, now)
        if kind == "scale":
            request = message.get("request") or {}
            return ms.ScaleBy(self._scale_delta(message), str(request.get("id", "")))
        if kind == "leave":
            return ms.LeaveRequested(device)
        return None

    def _proof_ok(self, message: dict) -> bool:
        if message.get("type") == "scale":
            expected = scale_proof(self.secret, message.get("request"))
        else:
            expected = join_proof(self.secret, message.get("device_id", ""), self.salt)
        return hmac.compare_digest(expected, str(message.get("proof", "")))

    def _ready_problem(self, message: dict) -> str:
        if message.get("version") != self.version:
            return (
                f"flexpar version {message.get('version')} differs from the job's {self.version}; "
                f"install flexpar=={self.version} on the joining host"
            )
        if message.get("digest") != self.job_digest:
            return (
                "the model differs from the job's (parameter names, shapes or dtypes do not match): "
                "join with the same script and model code"
            )
        return ""

    def _scale_delta(self, message: dict) -> int:
        request = message["request"]
        if "delta" in request:
            return int(request["delta"])
        return int(request["devices"]) - self.state.device_count

    def _silent_devices(self, now: float) -> list:
        silent = []
        state = self.state
        counted = set(state.members + state.waiting + state.starting) - state.dead
        for device, (last_value, changed_at) in list(self.heartbeats.items()):
            if device not in counted:  # gone already (left, exited, refused): nothing to watch
                del self.heartbeats[device]
                continue
            key = f"heartbeat/{device}"
            value = self.store.get(key) if has(self.store, key) else None
            if value != last_value:
                self.heartbeats[device] = (value, now)
            elif now - changed_at > self.heartbeat_timeout_s:
                silent.append(device)
                del self.heartbeats[device]
        return silent

    def _execute(self, action) -> None:
        if isinstance(action, ms.SpawnLocal):
            self.spawn_local(action.device_ids)
        elif isinstance(action, ms.Publish):
            record = {
                "members": list(action.members),
                "joined": list(action.joined),
                "left": list(action.left),
                "failed": list(action.failed),
                # What each joiner's warm-up took (its start-up costs and, with compile=True, the
                # compilation): paid before this generation, the join event's detail says it.
                "warmup_s": {device: self.warmups[device] for device in action.joined if device in self.warmups},
            }
            self.store.set(f"gen/{action.generation}", json.dumps(record))
            tell_devices(self.store, "gen/latest", str(action.generation))
            self.published.append(action)
            self.write_status()
        elif isinstance(action, ms.Refuse):
            tell_devices(self.store, f"reply/{action.device_id}", "refused: " + action.reason)
            self.on_note(f"refused device {action.device_id}: {action.reason}")
        elif isinstance(action, ms.Evict):
            tell_devices(self.store, f"reply/{action.device_id}", "evicted: " + action.reason)
            self.stop_local(action.device_id)
        elif isinstance(action, ms.StopJob):
            self.stop_reason = action.reason
            tell_devices(self.store, "stop", action.reason)
        elif isinstance(action, ms.FinishJob):
            if not action.quiet:
                self.on_note(f"stopping at the next step boundary: {action.reason}")
            tell_devices(self.store, "finish", action.reason)
        elif isinstance(action, ms.Answer):
            if action.request_id:
                answer = {"accepted": action.accepted, "message": action.message, "devices": action.devices}
                self.store.set(f"answer/{action.request_id}", json.dumps(answer))
        elif isinstance(action, ms.Note):
            self.on_note(action.message)

    def finish(self, reason: str, note: bool = True) -> None:
        """Ask the devices to stop after the step in flight (they agree on it in the step's statistics).

        A decision like any other (membership.FinishRequested): from then on
        the device set no longer changes, so a whole host's SIGTERM, which
        also reaches every device, stops the job instead of emptying it.
        """
        self.apply(ms.FinishRequested(reason, quiet=not note))

    def write_status(self, extra: Optional[dict] = None) -> None:
        state = self.state
        status = {
            "generation": state.generation,
            "devices": list(state.members),
            "waiting": list(state.waiting),
            "starting": list(state.starting),
            "max_devices": state.max_devices,
        }
        status.update(extra or {})
        self.store.set("status", json.dumps(status))


# ---------------------------------------------------------------- device side


# How often a device's follower thread reads the store, and how often a device
# waiting for a generation looks at what the follower saw.
DEVICE_POLL_S = 0.02

# Devices follow a few keys: gen/latest, gen/<G>/dead, stop, finish, speed/<device> and
# reply/<device>. Whoever writes one of them does so with `tell_devices`, which then
# bumps NOTICE_KEY: a follower reads that one counter per poll, and the keys only when
# it moved. Reading them all at every poll took seven store round trips, 50 times a
# second; each wakes a thread in the worker and the store's thread in the driver, and
# where every core computes (one CPU device takes them all) each wake-up preempts a
# compute thread, whose OpenMP team then waits for it. (A one-device job's overhead
# against a plain accumulation loop turned out to be page faults, not these wake-ups:
# worker_process.keep_freed_memory.) A follower still reads every key each FOLLOW_ALL_S,
# so a writer that does not tell is seen late, not never.
NOTICE_KEY = "devices/notice"
FOLLOW_ALL_S = 0.5


def tell_devices(store, key: str, value: str) -> None:
    """Set `key`, one of the keys devices follow, and have their followers read it (NOTICE_KEY)."""
    store.set(key, value)
    store.add(NOTICE_KEY, 1)


def meet(store, key: str, count: int, problem: Callable[[], str] = lambda: "", poll_s: float = 0.0005) -> str:
    """Arrive at `key` in the store and wait until `count` members have: "" then, or `problem()`'s
    first non-empty answer (why the meeting cannot complete), asked between polls.

    Every member of a new generation meets so before it forms the generation's
    process group (`DeviceLink.gather`): forming a gloo group waits inside C++,
    where a member's death shows only at the timeout, while here it shows at
    once. benchmarks/sim_validation.py's probe meets the same way.
    """
    store.add(key, 1)
    while store.add(key, 0) < count:
        why = problem()
        if why:
            return why
        time.sleep(poll_s)
    return ""


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
        self.driver_lost = False                  # the store (and so the driver) is gone
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
                    Channel(store, "events").send({"type": "leave", "device_id": self.device_id,
                                                   "proof": self._leave_proof})
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
            print(f"flexpar: device {self.device_id}: did not leave within {self._leave_grace_s:g} s of "
                  "SIGTERM; exiting now (the others recover as after a failure)", file=sys.stderr, flush=True)
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
            raise DriverLost(f"the job's driver is gone ({str(error).splitlines()[0] if str(error) else error})") from None

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
