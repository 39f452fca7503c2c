"""The coordinator: the driver's half of the control plane, carrying out `membership.decide`.

It turns what devices send (flexpar/comm/channel.py), process exits and
heartbeats into membership events, and carries out the decided actions in
the store (flexpar/comm/protocol.py's keys). The device half is
flexpar/worker/device_link.py.
"""

from __future__ import annotations

import hmac
import json
import queue
import time
from typing import Callable, Iterable, Optional

from flexpar.comm.channel import Channel
from flexpar.comm.protocol import get_json, has, join_proof, scale_proof, tell_devices
from flexpar.core import frozen
from flexpar.core import membership as ms

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
        frozen_reference: Optional[Callable[[], dict]] = None,
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
        # The job's frozen digests (flexpar/core/frozen.py), computed by the driver in the background;
        # None: no content check (a coordinator without a model of its own).
        self.frozen_reference = frozen_reference
        self.events = Channel(store, "events")
        self.stop_reason: Optional[str] = None
        self.published: list = []  # Publish actions, for metrics and status
        self.errors: list = []  # error messages from devices: the job stops on the first
        self.heartbeats: dict = {}  # device_id -> (last heartbeat value, time it changed)
        self.warmups: dict = {}  # device_id -> its warm-up's seconds (from "ready"): in the join event
        self.digest_times: dict = {}  # device_id -> its frozen digest's seconds (from "ready"): likewise
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
        for message in self.events.receive() if receive else ():
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
            self.on_note(
                f"device {device_id} stopped answering (no heartbeat for {self.heartbeat_timeout_s:g} s): "
                "counted as failed"
            )
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
            if isinstance(message.get("digest_s"), (int, float)):
                self.digest_times[device] = float(message["digest_s"])
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
        reference = self.frozen_reference() if self.frozen_reference is not None else None
        if reference is not None and message.get("frozen_digest") != frozen.combined_digest(reference):
            reported = message.get("frozen_digests")
            if not isinstance(reported, dict):
                return "the device did not report its frozen weights' digests: install the job's flexpar version"
            return frozen.frozen_problem(reference, reported, where=f"device {message.get('device_id', '?')}")
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
                "digest_s": {
                    device: self.digest_times[device] for device in action.joined if device in self.digest_times
                },
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
