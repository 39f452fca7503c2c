"""The coordinator: the driver's half of the control plane, carrying out `membership.decide`.

It turns what devices send (flexpar/comm/channel.py), process exits and
heartbeats into membership events (whether a device's message lets it in
is decided in flexpar/core/admission.py), and carries out the decided actions
in the store (flexpar/comm/protocol.py's keys). The device half is
flexpar/worker/device_link.py.

A driver restarted with `--resume` starts with the membership's adoption
window open: the devices that outlived its predecessor report (`present`, then
`adopt` messages), each checked like a joiner's `ready` (proof, model, version)
and against this job's fingerprint (flexpar/core/adoption.py), and this host's
re-adopted devices are taken over by pid (`adopt_local`).
"""

from __future__ import annotations

import dataclasses
import hmac
import json
import queue
import socket
import time
from typing import Callable, Iterable, Optional

from flexpar.comm.channel import Channel
from flexpar.comm.protocol import adopt_proof, get_json, has, join_proof, scale_proof, tell_devices
from flexpar.core import admission, adoption
from flexpar.core import membership as ms

# How often the coordinator reads the devices' heartbeats (they beat every 0.5 s).
HEARTBEATS_READ_S = 0.1

READY_TIMES = ("startup_s", "build_s", "warmup_s", "digest_s")
"""The seconds a joiner's "ready" reports (flexpar/worker/warm_up.py `identity`), by the generation record's key."""


class Coordinator:
    """Carries out membership decisions: the executor around `membership.decide`.

    It runs in the driver's loop (`step()` is called every few milliseconds),
    so it needs no threads or locks. `spawn_local(device_ids)` and
    `stop_local(device_id)` start and stop local worker processes;
    `local_exits()` returns the ids of local workers whose process has ended.
    A restarted driver's: `adopt_local(device_id, pid, device)` takes over one
    of this host's devices that its predecessor started; `fingerprint` is this
    job's (`adoption.fingerprint`); `resume_from(action)` carries out a
    `NothingToAdopt` (the checkpoint's settings, published before any device
    starts; it raises when there is no checkpoint).
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
        job_shapes: Optional[list] = None,
        adopt_local: Callable[[str, int, str], None] = lambda device_id, pid, device: None,
        fingerprint: Optional[dict] = None,
        resume_from: Callable[[ms.NothingToAdopt], None] = lambda action: None,
        seen_waiting: Callable[[], Iterable[str]] = lambda: (),
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
        # The driver's model as `factory_checks.model_shapes` gives it: a refusal names what differs.
        self.job_shapes = job_shapes
        self.events = Channel(store, "events")
        self.stop_reason: Optional[str] = None
        self.published: list = []  # Publish actions, for metrics and status
        self.errors: list = []  # error messages from devices: the job stops on the first
        self.refused: list = []  # devices refused, in order (their reasons were said as they came)
        self.start_values_warned = False  # the devices' factories built different trainable values (said once)
        self.heartbeats: dict = {}  # device_id -> (last heartbeat value, time it changed)
        # device_id -> {READY_TIMES key: seconds} its "ready" said (a re-adopted one's report: its warm-up):
        # what its start took before it was let in, in the join event.
        self.ready_times: dict = {}
        self._heartbeats_read_at = float("-inf")
        self._finish_asked: queue.SimpleQueue = queue.SimpleQueue()  # by signal handlers (request_finish)
        self.adopt_local = adopt_local
        self.fingerprint = fingerprint or {}
        self.resume_from = resume_from
        # This host's devices waiting for a driver (their report files): an adoption window waits for them.
        self.seen_waiting = seen_waiting
        self.reports: dict = {}  # device id -> its last present/adopt message (a restarted driver's)
        self.declined: Optional[str] = None  # a device of another job reported: this driver stops
        self.nothing_to_adopt: Optional[ms.NothingToAdopt] = None  # the window closed with no member back

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
        # The exits first, then the messages: whatever an ended process sent (a member's "finished",
        # which makes its exit a normal end) was sent before it exited, so it is read before its exit counts.
        exited = list(self.local_exits())
        for message in self.events.receive() if receive or exited else ():
            event = self._event_of(message, now)
            if event is not None:
                self.apply(event)
        for device_id in exited:
            self.heartbeats.pop(device_id, None)
        # Heartbeats move every 0.5 s and count after seconds: reading them (two store
        # round trips per device) at every one of the driver's 100 polls a second only
        # woke threads on cores that compute (see NOTICE_KEY).
        silent, waiting = [], None
        if now - self._heartbeats_read_at >= HEARTBEATS_READ_S:
            self._heartbeats_read_at = now
            silent = self._silent_devices(now)
            if self.state.adoption is not None:  # as often: files of this host's waiting devices
                waiting = tuple(self.seen_waiting())
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
        if waiting is not None and self.state.adoption is not None:
            self.apply(ms.SeenWaiting(waiting))
        self.apply(ms.Tick(now))

    def _announce_death(self, device_id: str) -> None:
        """Tell the members at once that a peer is gone, so nobody waits out a timeout."""
        state = self.state
        if (device_id in state.members and device_id not in state.leaving) or device_id in state.departing:
            key = f"gen/{state.generation}/dead"
            dead = set(get_json(self.store, key)) if has(self.store, key) else set()
            tell_devices(self.store, key, json.dumps(sorted(dead | {device_id})))

    def _event_of(self, message: dict, now: float):
        kind = message.get("type")
        device = message.get("device_id", "")
        if kind in ("announce", "ready", "scale", "leave") and not self._proof_ok(message):
            reason = admission.WRONG_SECRET
            if kind == "scale":
                self.on_note(f"refused a scale request: {reason}")
                request_id = str((message.get("request") or {}).get("id", ""))
                self._execute(ms.Answer(request_id, False, reason, self.state.device_count))
                return None
            if kind == "leave":
                return None
            self._execute(ms.Refuse(device, reason))
            return None
        if kind in ("present", "adopt"):
            return self._report_of(message, now)
        if kind == "error":
            self.errors.append(message)
            return None
        if kind == "start_values":  # a factory that is not deterministic: said once per job
            if not self.start_values_warned:
                self.start_values_warned = True
                self.on_note(str(message.get("message", "")))
            return None
        if kind == "announce":
            # Every device beats; one that stops (crashed host, SIGSTOP, a hang) is dead
            # after heartbeat_timeout_s, long before a collective's timeout would say so.
            self.heartbeats[device] = (None, now)
            return ms.Announced(device)
        if kind == "ready":
            self._note_times(device, message, READY_TIMES)
            return ms.Ready(device, self._ready_problem(message))
        if kind == "formed":
            return ms.Formed(device, int(message["generation"]))
        if kind == "failure":
            return ms.FailureReported(device, int(message["generation"]), now)
        if kind == "handed_off":
            return ms.HandedOff(device, int(message["generation"]))
        if kind == "finished":
            return ms.Finished(device, rank_0=message.get("rank") == 0)
        if kind == "bye":
            self.heartbeats.pop(device, None)
            return ms.Exited(device, now)
        if kind == "scale":
            request = message.get("request") or {}
            return ms.ScaleBy(admission.scale_delta(request, self.state.device_count), str(request.get("id", "")))
        if kind == "leave":
            return ms.LeaveRequested(device)
        return None

    def _note_times(self, device: str, message: dict, keys: tuple) -> None:
        """The seconds of `keys` a device's message says (a number each), kept for its join event."""
        times = self.ready_times.setdefault(device, {})
        times.update({key: float(message[key]) for key in keys if isinstance(message.get(key), (int, float))})

    def _report_of(self, message: dict, now: float):
        """A device that outlived its driver: its notice ("present") or report ("adopt") as an event."""
        device = message.get("device_id", "")
        proof_ok = hmac.compare_digest(adopt_proof(self.secret, device, self.salt), str(message.get("proof", "")))
        final = message.get("type") == "adopt"
        if not proof_ok and not final:
            return None  # a notice proves nothing yet; its report will
        problem = "" if proof_ok else admission.ADOPTION_PROOF_MISMATCH
        if final and not problem:
            problem = self._ready_problem(message) or adoption.fingerprint_problem(
                self.fingerprint, message.get("fingerprint") or {}
            )
            self._note_times(device, message, ("warmup_s",))
        if final or device not in self.reports:
            self.reports[device] = message
        self.heartbeats.setdefault(device, (None, now))
        return ms.Reported(admission.device_report(message), now, problem)

    def _adopt_locals(self, members) -> None:
        """This host's devices among `members`, started by the old driver: taken over by pid."""
        host = socket.gethostname()
        for device in members:
            message = self.reports.get(device) or {}
            if device.startswith("local-") and message.get("host") == host and not message.get("remote"):
                self.adopt_local(device, int(message["pid"]), str(message.get("device", "cpu")))

    def _continue_remote_ids(self) -> None:
        """Joiners number their ids from `remote/counter`: a new one must not take a reported one's."""
        numbers = [
            int(d.rsplit("-", 1)[1])
            for d in self.reports
            if not d.startswith("local-") and d.rsplit("-", 1)[-1].isdigit()
        ]
        missing = max(numbers, default=0) - self.store.add("remote/counter", 0)
        if missing > 0:
            self.store.add("remote/counter", missing)

    def _proof_ok(self, message: dict) -> bool:
        if message.get("type") == "scale":
            expected = scale_proof(self.secret, message.get("request"))
        else:
            expected = join_proof(self.secret, message.get("device_id", ""), self.salt)
        return hmac.compare_digest(expected, str(message.get("proof", "")))

    def _ready_problem(self, message: dict) -> str:
        """Why a warm device cannot train with this job ("" when it can): core/admission.py's checks."""
        return admission.ready_problem(
            message,
            self.version,
            self.job_digest,
            self.job_shapes,
            self.frozen_reference if self.frozen_reference is not None else lambda: None,
        )

    def _silent_devices(self, now: float) -> list:
        silent = []
        state = self.state
        counted = state.watched
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
                # A sharded job's planned leavers: they hand their state over to the members, then exit.
                "departing": list(action.departing),
                # What each joiner's start took, paid before this generation (its start-up, model build,
                # warm-up with compile=True's compilation, frozen digest): the join event's detail says it.
                **{
                    key: {
                        device: self.ready_times[device][key]
                        for device in action.joined
                        if key in self.ready_times.get(device, {})
                    }
                    for key in READY_TIMES
                },
            }
            if action.from_step is not None:  # a scheduled leave: the members train the steps before it first
                record["from_step"] = action.from_step
            if action.adopted is not None:  # the first generation of a re-adopted job
                record["adopted"] = dataclasses.asdict(action.adopted)
                record["restore"] = action.restore
                self._adopt_locals(action.members)
                self._continue_remote_ids()
            self.store.set(f"gen/{action.generation}", json.dumps(record))
            tell_devices(self.store, "gen/latest", str(action.generation))
            self.published.append(action)
            self.write_status()
        elif isinstance(action, ms.Refuse):
            tell_devices(self.store, f"reply/{action.device_id}", "refused: " + action.reason)
            self.on_note(f"refused device {action.device_id}: {action.reason}")
            self.refused.append(action.device_id)
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
        elif isinstance(action, ms.Decline):
            self.declined = action.reason
        elif isinstance(action, ms.NothingToAdopt):
            self.nothing_to_adopt = action
            self._continue_remote_ids()
            self.resume_from(action)

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
