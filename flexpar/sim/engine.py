"""The event-driven simulation of the step loop of one job under one policy.

Time advances one step at a time (per-device work is a numpy vector, never a
Python event per VW), and jumps at elastic events: a join, leave or slowdown
takes effect at the first step boundary at or after its time; a failure
interrupts the step in flight. Each step:

1. apply the events that are due, and charge the policy's cost for them;
2. ask the policy's assignment rule for this step's VW counts (for flexpar,
   ``flexpar.core.balance.next_assignment``);
3. busy time per device = count x seconds per VW x noise; step time from the
   closed-form model (``model.py``);
4. if a device fails inside the step, the step is lost and recovery charged;
   else the step is committed and the busy times fed back to the rule
   (``flexpar.core.balance.observe``).

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
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from flexpar.core import balance

from .elastic_events import Changes, ElasticEvents
from .model import device_critical_paths, ring_all_reduce_seconds
from .policies import Policy, make_policy
from .results import SimulationEvent, SimulationResult
from .scenario import Scenario


@dataclass
class _Step:
    """One simulated (not yet committed) step."""

    counts: Tuple[int, ...]
    busy: np.ndarray
    seconds: float


class _Simulation(ElasticEvents):
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
        self.stream = None  # a streamed join in flight (elastic_events.Stream)
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

    def record(
        self,
        kind: str,
        device_ids: Sequence[str] = (),
        stall_s: float = 0.0,
        detail: str = "",
        time_s: Optional[float] = None,
        **join,
    ) -> None:
        """Log an event at ``time_s`` (default: now), when it took effect, before its stall.

        ``join``: a join's or a stream's way and costs (``SimulationEvent``'s last fields).
        """
        when = self.clock if time_s is None else time_s
        self.events.append(
            SimulationEvent(when, self.committed, kind, tuple(device_ids), stall_s, len(self.active), detail, **join)
        )

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
        # A streamed join in flight: the members' steps are longer by its predicted extra (sim/joins.py).
        extra = self.stream.extra_s if self.stream is not None else 0.0
        return _Step(self.counts, busy, float(paths.max()) + extra)

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
        if self.stream is not None:
            self._advance_stream(1)
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
        if self.stream is not None:
            limit = min(limit, self.stream.steps_left)
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
        if self.stream is not None:
            self._advance_stream(steps)
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
            changes = Changes()
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
            scenario=self.scenario.name,
            policy=self.policy.name,
            label=self.policy.label,
            target_steps=self.scenario.steps,
            completed_steps=self.committed,
            total_time_s=self.clock,
            global_batch=self.scenario.global_batch,
            stall_s=self.stall_s,
            lost_work_s=self.lost_work_s,
            checkpoint_s=self.checkpoint_s,
            events=tuple(self.events),
            segment_end_s=np.array(columns[0], dtype=float),
            segment_committed=np.array(columns[1], dtype=int),
            segment_steps=np.array(columns[2], dtype=int),
            segment_step_s=np.array(columns[3], dtype=float),
            segment_imbalance=np.array(columns[4], dtype=float),
            segment_devices=np.array(columns[5], dtype=int),
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
