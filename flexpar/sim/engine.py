"""The event-driven simulation of the step loop of one job under one policy.

Time advances one step at a time (per-device work is a numpy vector, never a
Python event per VW), and jumps at elastic events: a join, leave or slowdown
takes effect at the first step boundary at or after its time; a failure
interrupts the step in flight. Each step:

1. apply the events that are due, and charge the policy's cost for them;
2. ask the policy's assignment rule for this step's VW counts (for flexpar,
   ``flexpar.balance.next_assignment``);
3. busy time per device = count x seconds per VW x noise; step time from the
   closed-form model (``model.py``);
4. if a device fails inside the step, the step is lost and recovery charged;
   else the step is committed and the busy times fed back to the rule
   (``flexpar.balance.observe``).

Skipping identical steps: with no noise, once the device set is unchanged and
the balancer's smoothed times equal the true ones (``is_settled``), every step
until the next event is identical, so the simulator commits them in one go.
That is what makes 1024 devices times many thousand steps cost milliseconds;
with noise every step is simulated, and every flexpar step calls the balancer.

Accounting promise (tested): ``total_time_s`` = the time of the steps that
count towards the result + ``stall_s``, where the stall holds every second
without progress: change and failure costs, the lost part of steps in flight,
redone work after a rollback, blocking checkpoint saves and waiting with no
device at all.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from flexpar.core import balance

from .model import device_critical_paths, failure_noticed_seconds, ring_all_reduce_seconds
from .policies import Policy, make_policy
from .scenario import Event, Scenario


@dataclass(frozen=True)
class SimulationEvent:
    """What happened at one point of a simulated run (for tables, plots, JSON).

    ``kind``: start, join, leave, failure, slowdown, refused (a join past V
    devices), cancelled (a joiner left during its warm-up), ignored (an event
    naming a device that is not there), checkpoint, rollback, idle, lost (the
    job cannot go on). ``stall_s``: the stall this event caused.
    """

    time_s: float
    step: int
    kind: str
    device_ids: Tuple[str, ...] = ()
    stall_s: float = 0.0
    devices_after: int = 0
    detail: str = ""

    def to_dict(self) -> dict:
        return {
            "time_s": self.time_s, "step": self.step, "kind": self.kind, "device_ids": list(self.device_ids),
            "stall_s": self.stall_s, "devices_after": self.devices_after, "detail": self.detail,
        }


@dataclass(frozen=True)
class SimulationResult:
    """One policy's run of one scenario.

    Per committed segment (one step, or a run of identical skipped steps):
    ``segment_end_s`` (clock after it), ``segment_committed`` (committed steps
    after it; drops at a rollback), ``segment_steps``, ``segment_step_s``
    (seconds per step), ``segment_imbalance`` and ``segment_devices``.
    """

    scenario: str
    policy: str
    label: str
    target_steps: int
    completed_steps: int
    total_time_s: float
    global_batch: int
    stall_s: float
    lost_work_s: float
    checkpoint_s: float
    events: Tuple[SimulationEvent, ...]
    segment_end_s: np.ndarray
    segment_committed: np.ndarray
    segment_steps: np.ndarray
    segment_step_s: np.ndarray
    segment_imbalance: np.ndarray
    segment_devices: np.ndarray

    @property
    def completed(self) -> bool:
        return self.completed_steps >= self.target_steps

    @property
    def samples_per_s(self) -> float:
        """Committed samples over the whole run's wall time (stalls included)."""
        if self.total_time_s <= 0:
            return 0.0
        return self.completed_steps * self.global_batch / self.total_time_s

    @property
    def imbalance_median(self) -> float:
        return weighted_median(self.segment_imbalance, self.segment_steps)

    @property
    def step_time_median_s(self) -> float:
        return weighted_median(self.segment_step_s, self.segment_steps)

    @property
    def kept_step_seconds(self) -> float:
        """Time of the executed steps that were not later lost to a rollback."""
        return float(np.dot(self.segment_steps, self.segment_step_s)) - self.lost_work_s

    def count(self, kind: str) -> int:
        """How many devices the events of ``kind`` named (events themselves for start, rollback...)."""
        return sum(len(event.device_ids) or 1 for event in self.events if event.kind == kind)

    def summary(self) -> dict:
        """Plain-type summary (JSON-ready)."""
        return {
            "scenario": self.scenario, "policy": self.policy, "label": self.label,
            "target_steps": self.target_steps, "completed_steps": self.completed_steps,
            "completed": self.completed, "total_time_s": self.total_time_s,
            "samples_per_s": self.samples_per_s, "global_batch": self.global_batch,
            "stall_s": self.stall_s, "lost_work_s": self.lost_work_s, "checkpoint_s": self.checkpoint_s,
            "imbalance_median": self.imbalance_median, "step_time_median_s": self.step_time_median_s,
            "joins": self.count("join"), "leaves": self.count("leave"), "failures": self.count("failure"),
            "refused_joins": self.count("refused"),
        }


def weighted_median(values: np.ndarray, weights: np.ndarray) -> float:
    """The median of ``values`` where value i occurs ``weights[i]`` times; nan when empty."""
    values = np.asarray(values, dtype=float)
    weights = np.asarray(weights, dtype=float)
    if values.size == 0 or weights.sum() <= 0:
        return math.nan
    order = np.argsort(values, kind="stable")
    ordered = values[order]
    cumulative = np.cumsum(weights[order])
    total = int(round(cumulative[-1]))
    # 1-based ranks of the middle value(s); two of them for an even total,
    # averaged like statistics.median does.
    low_rank = (total + 1) // 2
    high_rank = total // 2 + 1
    low = ordered[np.searchsorted(cumulative, low_rank, side="left")]
    high = ordered[np.searchsorted(cumulative, high_rank, side="left")]
    return float((low + high) / 2.0)


@dataclass
class _Step:
    """One simulated (not yet committed) step."""

    counts: Tuple[int, ...]
    busy: np.ndarray
    seconds: float


@dataclass
class _Changes:
    joined: List[str] = field(default_factory=list)
    left: List[str] = field(default_factory=list)
    failed: List[str] = field(default_factory=list)

    def any(self) -> bool:
        return bool(self.joined or self.left or self.failed)


class _Simulation:
    """Mutable state of one ``simulate`` call; private, created per call."""

    def __init__(self, scenario: Scenario, policy: Policy, skip_identical_steps: bool = True) -> None:
        self.scenario = scenario
        self.skip_identical_steps = skip_identical_steps
        self.policy = policy
        self.parameters = scenario.parameters
        self.rng = np.random.default_rng(scenario.seed)
        self.clock = 0.0
        self.committed = 0
        self.active: List[str] = [device.device_id for device in scenario.devices]
        self.seconds: Dict[str, float] = {device.device_id: device.seconds_per_vw for device in scenario.devices}
        self.pending: List[Tuple[float, str]] = []
        self.lost = False
        # Events: time-ordered and step-ordered queues; ``consumed`` holds the
        # positions already handled, because an in-flight failure can be taken
        # out of the time queue ahead of earlier boundary events.
        indexed = list(enumerate(scenario.events))
        self.time_events = sorted(
            ((event.at_s, order, event) for order, event in indexed if event.at_s is not None),
            key=lambda item: (item[0], item[1]),
        )
        self.step_events = sorted(
            ((event.at_step, order, event) for order, event in indexed if event.at_step is not None),
            key=lambda item: (item[0], item[1]),
        )
        self.time_position = 0
        self.step_position = 0
        self.consumed: set = set()
        self.rule = policy.assignment
        self.state = self.rule.initial_state()
        self.checkpoint_every = policy.elasticity.checkpoint_every_steps(self.parameters)
        self.last_checkpoint_step = 0
        self.work_since_checkpoint_s = 0.0
        self.stall_s = 0.0
        self.lost_work_s = 0.0
        self.checkpoint_s = 0.0
        self.events: List[SimulationEvent] = []
        self.segments: List[Tuple[float, int, int, float, float, int]] = []
        # Per device set: ids, true seconds per VW, the all-reduce time.
        self.device_ids: Tuple[str, ...] = ()
        self.seconds_array = np.zeros(0)
        self.all_reduce_s = 0.0
        self.layout_stale = True
        # Balancing interval: busy times summed until the rule observes them.
        self.counts: Optional[Tuple[int, ...]] = None
        self.interval_busy = np.zeros(0)
        self.interval_steps = 0
        self.previous: Optional[Tuple[Tuple[int, ...], float, float]] = None

    # ---------------------------------------------------------------- events

    def record(self, kind: str, device_ids: Sequence[str] = (), stall_s: float = 0.0, detail: str = "",
               time_s: Optional[float] = None) -> None:
        """Log an event at ``time_s`` (default: now), when it took effect, before its stall."""
        when = self.clock if time_s is None else time_s
        self.events.append(
            SimulationEvent(when, self.committed, kind, tuple(device_ids), stall_s, len(self.active), detail)
        )

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

    def _apply_event(self, event: Event, changes: _Changes) -> None:
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
                elif any(device_id == pending_id for _, pending_id in self.pending):
                    self.pending = [(ready, pending_id) for ready, pending_id in self.pending if pending_id != device_id]
                    self.record("cancelled", (device_id,), detail=f"{event.kind} during warm-up")
                else:
                    self.record("ignored", (device_id,), detail=f"{event.kind} of a device that is not there")

    def _admit_ready_joiners(self, changes: _Changes) -> None:
        ready = sorted((time, device_id) for time, device_id in self.pending if time <= self.clock)
        if not ready:
            return
        self.pending = [(time, device_id) for time, device_id in self.pending if time > self.clock]
        for _, device_id in ready:
            if len(self.active) >= self.scenario.virtual_workers:
                self.record("refused", (device_id,), detail=f"already {len(self.active)} devices for "
                            f"{self.scenario.virtual_workers} VWs (every device needs one)")
                continue
            self.active.append(device_id)
            changes.joined.append(device_id)

    def _charge_changes(self, changes: _Changes, in_flight_lost_s: float = 0.0) -> None:
        """Charge one boundary's changes (and a lost step in flight) to the clock."""
        self.layout_stale = True
        survivors = [device_id for device_id in self.active if device_id not in changes.joined]
        if not survivors and self.policy.elasticity.keeps_state_in_memory:
            self.lost = True
            self.record("lost", changes.left + changes.failed, detail="no device left holds the training state")
            return
        cost = self.policy.elasticity.change_cost(
            len(changes.joined), len(changes.left), len(changes.failed), len(self.active), self.parameters
        )
        stall = in_flight_lost_s + (cost.stall_s if self.active else 0.0)
        took_effect = self.clock
        self.clock += cost.stall_s if self.active else 0.0
        self.stall_s += stall
        for kind, ids in (("failure", changes.failed), ("leave", changes.left), ("join", changes.joined)):
            if ids:
                self.record(kind, ids, stall_s=stall, detail=f"{len(self.active)} devices after", time_s=took_effect)
                stall = 0.0  # one boundary, one stall: charge it to the first record only
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
        self.record("rollback", (), stall_s=self.work_since_checkpoint_s,
                    detail=f"{lost_steps} steps since the checkpoint at step {self.last_checkpoint_step} redone")
        self.work_since_checkpoint_s = 0.0

    def boundary(self) -> None:
        """Apply everything due at this step boundary."""
        changes = _Changes()
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

    def _failure_noticed_at(self, step: _Step, failed_at: float, events: List[Event]) -> float:
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
                self._apply_event(event, _Changes())  # records it as cancelled or ignored
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

    # ---------------------------------------------------------------- steps

    def _refresh_layout(self) -> None:
        """Re-derive the per-device vectors after a change of devices or speeds."""
        if self.counts is not None and self.interval_steps:
            self._observe_interval()
        self.device_ids = tuple(self.active)
        self.seconds_array = np.array([self.seconds[device_id] for device_id in self.device_ids])
        self.all_reduce_s = ring_all_reduce_seconds(
            len(self.device_ids), self.parameters.workload.gradient_bytes, self.parameters.network
        )
        self.counts = None
        self.interval_busy = np.zeros(len(self.device_ids))
        self.interval_steps = 0
        self.previous = None
        self.layout_stale = False

    def _observe_interval(self) -> None:
        mean_busy = self.interval_busy / self.interval_steps
        self.state = self.rule.observe(self.state, self.device_ids, self.counts, mean_busy.tolist())
        self.interval_busy = np.zeros(len(self.device_ids))
        self.interval_steps = 0

    def _simulate_step(self) -> _Step:
        if self.counts is None or self.interval_steps == 0:
            self.counts = self.rule.assign(self.state, self.device_ids, self.scenario.virtual_workers)
        counts = np.asarray(self.counts, dtype=float)
        busy = counts * self.seconds_array
        sigma = self.scenario.noise
        if sigma > 0:
            # Mean-one lognormal factors: noise does not change the expected speed.
            busy = busy * np.exp(sigma * self.rng.standard_normal(len(busy)) - 0.5 * sigma * sigma)
        paths = device_critical_paths(self.counts, busy, self.all_reduce_s, self.parameters)
        return _Step(self.counts, busy, float(paths.max()))

    def _commit(self, step: _Step) -> None:
        self.clock += step.seconds
        self.committed += 1
        self.work_since_checkpoint_s += step.seconds
        step_imbalance = balance.imbalance(step.busy.tolist())
        self.segments.append((self.clock, self.committed, 1, step.seconds, step_imbalance, len(self.device_ids)))
        self.interval_busy = self.interval_busy + step.busy
        self.interval_steps += 1
        if self.interval_steps >= self.scenario.balance.interval_steps:
            self._observe_interval()
        self.previous = (step.counts, step.seconds, step_imbalance) if self.scenario.noise == 0 else None
        self._maybe_checkpoint()

    def _maybe_checkpoint(self) -> None:
        every = self.checkpoint_every
        if every is None or self.committed % every or self.committed >= self.scenario.steps:
            return
        save = self.parameters.restart.checkpoint_save_s
        if save > 0:
            self.record("checkpoint", (), stall_s=save)
        self.clock += save
        self.stall_s += save
        self.checkpoint_s += save
        self.last_checkpoint_step = self.committed
        self.work_since_checkpoint_s = 0.0

    def _skippable_steps(self, step_seconds: float) -> int:
        """How many identical steps can be committed at once from here (0: none)."""
        limit = self.scenario.steps - self.committed
        head = self._next_time_event()
        horizons = [head[0]] if head is not None else []
        horizons += [time for time, _ in self.pending]
        for horizon in horizons:
            # One step short of the event: the step-by-step path handles it exactly.
            limit = min(limit, int(math.floor((horizon - self.clock) / step_seconds)) - 1)
        if self.step_position < len(self.step_events):
            limit = min(limit, self.step_events[self.step_position][0] - self.committed)
        if self.checkpoint_every is not None:
            limit = min(limit, self.checkpoint_every - self.committed % self.checkpoint_every - 1)
        return max(0, limit)

    def _try_skip(self) -> bool:
        """Commit a run of identical steps when nothing can change before the next event."""
        if not self.skip_identical_steps or self.previous is None or self.interval_steps != 0:
            return False
        counts, seconds, step_imbalance = self.previous
        # Cheapest checks first: a balancer call costs milliseconds at 1024 devices.
        steps = self._skippable_steps(seconds)
        if steps < 1:
            return False
        if not self.rule.is_settled(self.state, self.device_ids, self.seconds_array.tolist()):
            return False
        if self.rule.assign(self.state, self.device_ids, self.scenario.virtual_workers) != counts:
            return False
        self.clock += steps * seconds
        self.committed += steps
        self.work_since_checkpoint_s += steps * seconds
        self.segments.append((self.clock, self.committed, steps, seconds, step_imbalance, len(self.device_ids)))
        return True

    def run(self) -> SimulationResult:
        self.record("start", self.active, detail=f"{len(self.active)} devices, {self.scenario.virtual_workers} VWs")
        while self.committed < self.scenario.steps and not self.lost:
            self.boundary()
            if self.lost:
                break
            if not self.active:
                if not self.wait_for_devices():
                    self.record("lost", (), detail="no devices and no joins to come")
                    break
                continue
            if self.layout_stale:
                self._refresh_layout()
            if self._try_skip():
                continue
            step = self._simulate_step()
            failure = self._failure_in_step(step.seconds)
            if failure is None:
                self._commit(step)
                continue
            failed_at, failure_events = failure
            noticed_at = self._failure_noticed_at(step, failed_at, failure_events)
            in_flight_lost = noticed_at - self.clock
            self.clock = noticed_at
            changes = _Changes()
            for event in failure_events:
                self._apply_event(event, changes)
            # The abandoned step is never observed: the real workers discard its timings.
            self.interval_busy = np.zeros(len(self.device_ids))
            self.interval_steps = 0
            self._charge_changes(changes, in_flight_lost_s=in_flight_lost)
        return self._result()

    def _result(self) -> SimulationResult:
        columns = list(zip(*self.segments)) if self.segments else [()] * 6
        return SimulationResult(
            scenario=self.scenario.name, policy=self.policy.name, label=self.policy.label,
            target_steps=self.scenario.steps, completed_steps=self.committed, total_time_s=self.clock,
            global_batch=self.scenario.global_batch, stall_s=self.stall_s, lost_work_s=self.lost_work_s,
            checkpoint_s=self.checkpoint_s, events=tuple(self.events),
            segment_end_s=np.array(columns[0], dtype=float), segment_committed=np.array(columns[1], dtype=int),
            segment_steps=np.array(columns[2], dtype=int), segment_step_s=np.array(columns[3], dtype=float),
            segment_imbalance=np.array(columns[4], dtype=float), segment_devices=np.array(columns[5], dtype=int),
        )


def simulate(scenario: Scenario, policy, *, skip_identical_steps: bool = True) -> SimulationResult:
    """Run ``scenario`` under ``policy`` (a ``Policy`` or its name) and return the record.

    Deterministic: the same scenario (seed included) gives the same result.
    ``skip_identical_steps=False`` simulates every step one by one even when
    nothing can change (for checking that skipping changes no figure).
    """
    if isinstance(policy, str):
        policy = make_policy(policy, scenario.balance)
    return _Simulation(scenario, policy, skip_identical_steps).run()


def simulate_all(scenario: Scenario) -> Tuple[SimulationResult, ...]:
    """The scenario under each of its policies, each from the same seed."""
    return tuple(simulate(scenario, name) for name in scenario.policies)
