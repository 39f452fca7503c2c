"""The simulation's elastic events: joins, leaves, slowdowns and failures applied at step boundaries,
their costs charged to the clock, and the failure that kills a step in flight.

Part of `engine._Simulation` (a mixin: its attributes are the simulation's own).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Tuple

from flexpar.core.join_choice import JoinChoice

from .joins import choose_join, join_inputs, simulate_stream
from .model import failure_noticed_seconds, uniform_assignment
from .scenario import Event


@dataclass
class Changes:
    """The device changes of one step boundary."""

    joined: List[str] = field(default_factory=list)
    left: List[str] = field(default_factory=list)
    failed: List[str] = field(default_factory=list)

    def any(self) -> bool:
        return bool(self.joined or self.left or self.failed)


@dataclass
class Stream:
    """A streamed join in flight: its listeners hold no VWs; every member step is `extra_s` longer."""

    listeners: List[str]
    steps_left: int
    extra_s: float
    lost_s: float  # the members' lost time so far: the boundary's stall, then each step's extra
    started_s: float  # the boundary's start
    steps: int = 0


class ElasticEvents:
    """Elastic events of `engine._Simulation` (a part of it)."""

    stream: Optional[Stream] = None

    # ---------------------------------------------------------------- streamed joins

    def _join_choice(self, changes: Changes, survivors: List[str]) -> Optional[JoinChoice]:
        """flexpar's decision for this boundary's joiners (in-place policies), from the members' figures."""
        if not changes.joined or not survivors or not self.policy.elasticity.keeps_state_in_memory:
            return None
        return choose_join(survivors, *self._members_figures(survivors), len(self.active), self.parameters)

    def _members_figures(self, survivors: List[str]) -> tuple:
        """The members' VW counts (the current assignment, else the equal split) and seconds per VW."""
        if self.counts is not None and tuple(self.device_ids) == tuple(survivors):
            counts = self.counts
        else:
            counts = uniform_assignment(len(survivors), self.scenario.virtual_workers)
        return counts, [self.seconds[device_id] for device_id in survivors]

    def _start_stream(self, joined: List[str], survivors: List[str], stall_s: float, started_s: float) -> None:
        """A streamed join begins: its course as the engine would re-size it (sim/stream_course.py), on the
        members' figures at this boundary; its listeners hold no VWs until it ends."""
        inputs = join_inputs(survivors, *self._members_figures(survivors), len(self.active), self.parameters)
        seed = self.scenario.seed * 1_000_003 + self.committed  # this boundary's own draw of step noise
        noise = self.parameters.join.step_noise
        course = simulate_stream(inputs, self.parameters, self.scenario.noise if noise is None else noise, seed)
        for device_id in joined:
            self.active.remove(device_id)
        self.stream = Stream(
            list(joined), course.rounds, course.lost_s(inputs.step_s) / course.rounds, stall_s, started_s
        )

    def _advance_stream(self, steps: int) -> None:
        """`steps` member steps committed while the stream runs; at its end the listeners take VWs."""
        stream = self.stream
        stream.steps_left -= steps
        stream.steps += steps
        stream.lost_s += steps * stream.extra_s
        if stream.steps_left <= 0:
            self.active.extend(stream.listeners)
            self.layout_stale = True
            self._end_stream(f"the state streamed over {stream.steps} steps; the joiner takes VWs")

    def _end_stream(self, detail: str) -> None:
        stream, self.stream = self.stream, None
        self.record(
            "stream",
            tuple(stream.listeners),
            detail=detail,
            way="stream",
            members_lost_s=stream.lost_s,
            first_vw_s=self.clock - stream.started_s,
            stream_steps=stream.steps,
        )

    def _break_stream(self, changes: Changes) -> None:
        """Another change at a boundary drops the stream: its listeners are joiners again at this boundary."""
        listeners = list(self.stream.listeners)
        self._end_stream("broken off by another change: the listener joins again at this boundary")
        self.active.extend(listeners)
        changes.joined[:0] = listeners

    def _next_time_event(self) -> Optional[Tuple[float, int, Event]]:
        while self.time_position < len(self.time_events) and self.time_events[self.time_position][1] in self.consumed:
            self.time_position += 1
        if self.time_position < len(self.time_events):
            return self.time_events[self.time_position]
        return None

    def _take_due_events(self) -> List[Event]:
        """Events due at this boundary (time reached, or step reached; not step failures)."""
        due: List[Event] = []
        while True:
            head = self._next_time_event()
            if head is None or head[0] > self.clock:
                break
            self.consumed.add(head[1])
            due.append(head[2])
        while self.step_position < len(self.step_events):
            at_step, order, event = self.step_events[self.step_position]
            if at_step > self.committed or event.kind == "failure":
                break  # a step failure kills the step it names: see _failure_in_step
            self.step_position += 1
            due.append(event)
        return due

    def _apply_event(self, event: Event, changes: Changes) -> None:
        if event.kind == "join":
            delay = self.policy.elasticity.admission_delay_s(self.parameters)
            appeared = event.at_s if event.at_s is not None else self.clock
            for device in event.devices:
                self.seconds[device.device_id] = device.seconds_per_vw
                self.pending.append((appeared + delay, device.device_id))
        elif event.kind == "slowdown":
            for device_id in event.device_ids:
                if device_id in self.seconds:
                    self.seconds[device_id] *= event.factor
                    self.layout_stale = True
            self.record("slowdown", event.device_ids, detail=f"seconds per VW x{event.factor:g}")
        else:
            bucket = changes.left if event.kind == "leave" else changes.failed
            for device_id in event.device_ids:
                if device_id in self.active:
                    self.active.remove(device_id)
                    bucket.append(device_id)
                elif self.stream is not None and device_id in self.stream.listeners:
                    self.stream.listeners.remove(device_id)
                    self.record("cancelled", (device_id,), detail=f"{event.kind} while listening to its stream")
                    if not self.stream.listeners:
                        self._end_stream("no listener left")
                elif any(device_id == pending_id for _, pending_id in self.pending):
                    self.pending = [
                        (ready, pending_id) for ready, pending_id in self.pending if pending_id != device_id
                    ]
                    self.record("cancelled", (device_id,), detail=f"{event.kind} during warm-up")
                else:
                    self.record("ignored", (device_id,), detail=f"{event.kind} of a device that is not there")

    def _admit_ready_joiners(self, changes: Changes) -> None:
        ready = sorted((time, device_id) for time, device_id in self.pending if time <= self.clock)
        if not ready:
            return
        self.pending = [(time, device_id) for time, device_id in self.pending if time > self.clock]
        for _, device_id in ready:
            if len(self.active) >= self.scenario.virtual_workers:
                self.record(
                    "refused",
                    (device_id,),
                    detail=f"already {len(self.active)} devices for "
                    f"{self.scenario.virtual_workers} VWs (every device needs one)",
                )
                continue
            self.active.append(device_id)
            changes.joined.append(device_id)

    def _charge_changes(self, changes: Changes, in_flight_lost_s: float = 0.0) -> None:
        """Charge one boundary's changes (and a lost step in flight) to the clock."""
        self.layout_stale = True
        if self.stream is not None:
            self._break_stream(changes)
        survivors = [device_id for device_id in self.active if device_id not in changes.joined]
        if not survivors and self.policy.elasticity.keeps_state_in_memory:
            self.lost = True
            self.record("lost", changes.left + changes.failed, detail="no device left holds the training state")
            return
        choice = self._join_choice(changes, survivors)
        cost = self.policy.elasticity.change_cost(
            len(changes.joined),
            len(changes.left),
            len(changes.failed),
            len(self.active),
            self.parameters,
            join_stall_s=None if choice is None else choice.chosen.boundary_stall_s,
        )
        stall = in_flight_lost_s + (cost.stall_s if self.active else 0.0)
        took_effect = self.clock
        self.clock += cost.stall_s if self.active else 0.0
        self.stall_s += stall
        for kind, ids in (("failure", changes.failed), ("leave", changes.left), ("join", changes.joined)):
            if ids:
                detail = f"{len(self.active)} devices after"
                if kind == "join" and choice is not None:
                    chosen = choice.chosen
                    self.record(
                        kind,
                        ids,
                        stall_s=stall,
                        detail=f"{detail}; {choice.reason}",
                        time_s=took_effect,
                        way=choice.way,
                        members_lost_s=chosen.members_lost_s,
                        first_vw_s=chosen.first_vw_s,
                        stream_steps=chosen.stream_steps,
                    )
                else:
                    self.record(kind, ids, stall_s=stall, detail=detail, time_s=took_effect)
                stall = 0.0  # one boundary, one stall: charge it to the first record only
        if choice is not None and choice.way == "stream":
            self._start_stream(list(changes.joined), survivors, cost.stall_s, took_effect)
        if cost.rolls_back:
            self._roll_back()
        elif cost.checkpoints:
            self.last_checkpoint_step = self.committed
            self.work_since_checkpoint_s = 0.0

    def _roll_back(self) -> None:
        lost_steps = self.committed - self.last_checkpoint_step
        self.stall_s += self.work_since_checkpoint_s
        self.lost_work_s += self.work_since_checkpoint_s
        self.committed = self.last_checkpoint_step
        self.record(
            "rollback",
            (),
            stall_s=self.work_since_checkpoint_s,
            detail=f"{lost_steps} steps since the checkpoint at step {self.last_checkpoint_step} redone",
        )
        self.work_since_checkpoint_s = 0.0

    def boundary(self) -> None:
        """Apply everything due at this step boundary."""
        changes = Changes()
        for event in self._take_due_events():
            self._apply_event(event, changes)
        self._admit_ready_joiners(changes)
        if changes.any():
            self._charge_changes(changes)

    def wait_for_devices(self) -> bool:
        """With no device at all: jump to the next event or joiner. False if there is none."""
        candidates = [time for time, _ in self.pending]
        head = self._next_time_event()
        if head is not None:
            candidates.append(head[0])
        if not candidates:
            return False
        resume = max(self.clock, min(candidates))
        self.stall_s += resume - self.clock
        self.record("idle", (), stall_s=resume - self.clock, detail="no devices; waiting")  # from now
        self.clock = resume
        return True

    def _failure_noticed_at(self, step, failed_at: float, events: List[Event]) -> float:
        """When the survivors stop working on the step a failure killed; it is lost up to then.

        flexpar's survivors run their own VWs to the step's all-reduce and learn
        of the death there, or ``detection_s`` after it if that is later
        (``failure_noticed_seconds``). A policy whose agent watches the
        processes stops them at the death and pays the detection in its change
        cost.
        """
        if not self.policy.elasticity.notices_failures_in_collective:
            return failed_at
        failed = {device_id for event in events for device_id in event.device_ids}
        survivors = [busy for device_id, busy in zip(self.device_ids, step.busy) if device_id not in failed]
        return self.clock + failure_noticed_seconds(
            max(survivors) if survivors else 0.0, failed_at - self.clock, self.parameters.elastic
        )

    def _failure_in_step(self, step_seconds: float) -> Optional[Tuple[float, List[Event]]]:
        """The failure that kills the step now running, if any: (time, its events)."""
        active = set(self.active)
        if self.step_position < len(self.step_events):
            at_step, order, event = self.step_events[self.step_position]
            if at_step <= self.committed and event.kind == "failure":
                self.step_position += 1
                if active.intersection(event.device_ids):
                    return self.clock + step_seconds, [event]
                self._apply_event(event, Changes())  # records it as cancelled or ignored
        end = self.clock + step_seconds
        for position in range(self.time_position, len(self.time_events)):
            at_s, order, event = self.time_events[position]
            if at_s > end:
                break
            if order in self.consumed or event.kind != "failure":
                continue
            if not active.intersection(event.device_ids):
                continue
            # Failures within the detection window of the first one are
            # noticed together: one recovery for all of them.
            window_end = at_s + self.parameters.elastic.detection_s
            events = []
            for later_at, later_order, later in self.time_events[position:]:
                if later_at > window_end:
                    break
                if later.kind == "failure" and later_order not in self.consumed:
                    self.consumed.add(later_order)
                    events.append(later)
            return at_s, events
        return None
