"""The fault soak's draw: a run's devices, scheduled joins and leaves, and signal faults (pure).

`draw_run(rng, index)` draws one run from a `random.Random`; `plans(seed)` the
soak's endless sequence of them. A run starts with 2 or 3 devices and gets 2-4
faults (5 when one had to be given a join to fire at): joins and planned
leaves (the schedule), and kill -9, SIGSTOP and SIGTERM to devices at a step
and phase. One fault in four lands on the step of the one before (two at
once); one kill in five at a phase inside a step brings a group-formation kill
of another device at its step, which fires in the recovery from that kill.

Every drawn fault is placed where it can fire (what fired is counted from the
run's output, soak_tally.py, and a fault that still did not fire is counted
apart, never as injected):
- checkpoint and transfer faults go to the device that is rank 0 when they are
  due (rank 0 writes checkpoints and sends the state to joiners); devices get
  their faults in step order, so rank 0 is the first of the starting devices no
  earlier fault took;
- a transfer fault has a join at or after its step (one is added if there is
  room, else the fault moves before the last join);
- a formation fault has a change at or after its step (a join, leave or
  another fault that is not a formation fault), which forms a new generation;
- an eval fault is at an evaluation step (a multiple of EVAL_EVERY).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Callable, Optional

VIRTUAL_WORKERS = 6
SIGNAL_PHASES = ("forward", "backward", "sync", "transfer", "formation", "checkpoint", "eval")
# A sharded soak (soak.py --shard) deals one more: a device's death after its own update of its
# part of the optimizer state, before its broadcast of the new values (only it has them then).
SHARDED_PHASES = SIGNAL_PHASES + ("update",)
SIGNAL_NAMES = {"kill": "SIGKILL", "stop": "SIGSTOP", "term": "SIGTERM"}
FAULT_KINDS = ("kill", "stop", "term", "join", "leave", "driver")
# Every DRIVER_EVERY-th run also gets a kill -9 of its driver at one of these phases (fired by rank 0, or
# by the sender of a join's state); the soak restarts the driver with the devices' resume command.
DRIVER_EVERY = 4
# Every STREAMING_EVERY-th run (from the second) trains a streaming dataset (6 shards, one per VW)
# instead of the map-style one: its stream positions go through the same faults (not with --shard).
STREAMING_EVERY = 3
DRIVER_PHASES = ("forward", "backward", "sync", "transfer")
# Relative frequency of each kind of fault in a drawn run.
KIND_WEIGHTS = {"kill": 4, "stop": 2, "term": 3, "join": 3, "leave": 2}
FIRST_STEP, LAST_STEP = 2, 28
STEPS = 36
CHECKPOINT_EVERY = 5
EVAL_EVERY = 6
EVALUATION_STEPS = tuple(range(EVAL_EVERY, STEPS + 1, EVAL_EVERY)) + (() if STEPS % EVAL_EVERY == 0 else (STEPS,))
# Phases a fault fires in at its own step (the others, at the first such boundary at or after it).
IN_STEP_PHASES = ("forward", "backward", "sync", "update", "eval")
RANK_ZERO_PHASES = ("checkpoint", "transfer")


@dataclass
class RunPlan:
    """One run: its starting devices, scheduled changes and signal faults."""

    index: int
    devices: int
    schedule: list = field(default_factory=list)  # (step, +1 | -1)
    faults: list = field(default_factory=list)  # (step, device, phase, signal name)
    driver_fault: Optional[tuple] = None  # (step, phase): kill -9 of the driver
    streaming: bool = False  # the job trains an iterable dataset (soak_job.make_stream)

    @property
    def size(self) -> int:
        return len(self.schedule) + len(self.faults) + (self.driver_fault is not None)

    @property
    def joins(self) -> int:
        return sum(1 for _, delta in self.schedule if delta > 0)

    def fault_text(self) -> str:
        faults = [f"{step}:{device}:{phase}:{kind}" for step, device, phase, kind in self.faults]
        if self.driver_fault is not None:
            faults.append("{}:driver:{}".format(*self.driver_fault))
        return ",".join(faults)

    def schedule_text(self) -> str:
        return ",".join(f"{step}:{delta:+d}" for step, delta in sorted(self.schedule))


@dataclass
class _Signal:
    step: int
    phase: str
    kind: str
    in_recovery: bool = False  # the formation kill drawn into a kill's recovery


def draw_run(rng: random.Random, index: int, next_phase: Optional[Callable[[tuple], str]] = None) -> RunPlan:
    """A run's plan: never more device losses than can leave one device standing.

    Signals go to the devices the run starts with, each at most once, at most
    devices - 1 of them (a joiner may still be warming up when they fire).
    Planned leaves never outnumber the joins before them, so they take
    joiners, not the devices the signals need. Joins never take the job past
    one device per virtual worker. A run has at most one checkpoint or
    transfer fault: two would both wait for rank 0, and the second device is
    rank 0 only once the first fault has fired, which may be too late.
    `next_phase(excluded)` deals the signals' phases, none of `excluded`
    (default: drawn uniformly; `plans` deals them from a shuffled deck).
    """
    next_phase = next_phase or (lambda excluded: rng.choice([p for p in SIGNAL_PHASES if p not in excluded]))
    devices = rng.choice((2, 3))
    plan = RunPlan(index, devices)
    signals: list = []
    losses_left, joins = devices - 1, 0
    count = rng.randint(2, 4)
    while len(plan.schedule) + len(signals) < count:
        last_join = max((s for s, d in plan.schedule if d > 0), default=LAST_STEP)
        possible = {
            "join": devices + plan.joins < VIRTUAL_WORKERS,
            # A leave comes strictly after a join, and takes that joiner.
            "leave": joins > 0 and last_join < LAST_STEP,
            "kill": losses_left > 0,
            "stop": losses_left > 0,
            "term": losses_left > 0,
        }
        kinds = [kind for kind in KIND_WEIGHTS if possible[kind]]
        if not kinds:
            break
        kind = rng.choices(kinds, weights=[KIND_WEIGHTS[kind] for kind in kinds])[0]
        previous = signals[-1].step if signals else None
        # One fault in four lands on the step of the previous one: two at once.
        step = previous if previous is not None and rng.random() < 0.25 else rng.randint(FIRST_STEP, LAST_STEP)
        if kind == "join":
            plan.schedule.append((step, +1))
            joins += 1
        elif kind == "leave":
            joins -= 1
            plan.schedule.append((max(step, last_join + 1), -1))
        else:
            losses_left -= 1
            phase = next_phase(RANK_ZERO_PHASES if any(s.phase in RANK_ZERO_PHASES for s in signals) else ())
            if phase == "eval":
                step = min(
                    (s for s in EVALUATION_STEPS if s >= step and s <= LAST_STEP),
                    default=max(s for s in EVALUATION_STEPS if s <= LAST_STEP),
                )
            signals.append(_Signal(step, phase, kind))
            # One kill in five inside a step brings a second fault into its recovery: a group-formation
            # fault on another device fires at the next formation, which is the recovery's.
            if (
                kind == "kill"
                and phase in IN_STEP_PHASES
                and losses_left
                and rng.random() < 0.2
                and len(plan.schedule) + len(signals) < count
            ):
                losses_left -= 1
                signals.append(_Signal(step, "formation", "kill", in_recovery=True))
    _make_fireable(rng, plan, signals)
    plan.faults = _assign_devices(rng, devices, signals)
    return plan


def _make_fireable(rng: random.Random, plan: RunPlan, signals: list) -> None:
    """Give transfer faults a join after them, and formation faults a change after them."""
    for signal in signals:
        if signal.phase != "transfer":
            continue
        join_steps = [step for step, delta in plan.schedule if delta > 0]
        if any(step >= signal.step for step in join_steps):
            continue
        if plan.devices + plan.joins < VIRTUAL_WORKERS:
            plan.schedule.append((rng.randint(signal.step, LAST_STEP), +1))
        else:
            signal.step = rng.randint(FIRST_STEP, max(join_steps))
    for signal in signals:
        if signal.phase != "formation" or signal.in_recovery:
            continue
        triggers = [step for step, _ in plan.schedule] + [
            other.step for other in signals if other is not signal and other.phase != "formation"
        ]
        if any(step >= signal.step for step in triggers):
            continue
        if triggers:
            signal.step = rng.randint(FIRST_STEP, max(triggers))
        else:  # nothing scheduled, so there is room for a join
            plan.schedule.append((rng.randint(signal.step, LAST_STEP), +1))


def _assign_devices(rng: random.Random, devices: int, signals: list) -> list:
    """(step, device, phase, kind) per signal: in step order, each to a device no earlier one took;
    checkpoint and transfer faults to the first such device (rank 0 by then)."""
    available = [f"local-{i}" for i in range(devices)]  # in rank order: members keep their order
    faults = []
    for signal in sorted(signals, key=lambda s: s.step):
        device = available[0] if signal.phase in RANK_ZERO_PHASES else rng.choice(available)
        available.remove(device)
        faults.append((signal.step, device, signal.phase, signal.kind))
    return faults


class PhaseDeck:
    """Deals signal phases from a shuffled deck of all of them, a new deck when one is used up,
    so every phase comes up about as often as the others, and early in a soak.

    A phase a run cannot take (`excluded`) stays in the deck for a later run;
    with every phase left excluded, the card comes from a new shuffle.
    `phases`: the deck's cards (SHARDED_PHASES for a sharded soak).
    """

    def __init__(self, rng: random.Random, phases: tuple = SIGNAL_PHASES):
        self.rng = rng
        self.phases = phases
        self.cards: list = []

    def __call__(self, excluded: tuple = ()) -> str:
        if not any(card not in excluded for card in self.cards):
            fresh = list(self.phases)
            self.rng.shuffle(fresh)
            self.cards = fresh + self.cards  # cards are dealt from the end: the old ones first
        for position in range(len(self.cards) - 1, -1, -1):
            if self.cards[position] not in excluded:
                return self.cards.pop(position)
        raise AssertionError("unreachable: a fresh deck holds every phase")


def draw_driver_fault(rng: random.Random, plan: RunPlan) -> tuple:
    """(step, phase) of a kill -9 of the run's driver; a transfer one has a join at or after its step."""
    joins = [step for step, delta in plan.schedule if delta > 0]
    phase = rng.choice([p for p in DRIVER_PHASES if p != "transfer" or joins])
    last = max(joins) if phase == "transfer" else LAST_STEP
    return rng.randint(FIRST_STEP, last), phase


def plans(seed: int, phases: tuple = SIGNAL_PHASES, streaming: bool = True):
    """The soak's runs for `seed`, endless; their signals' phases dealt from `phases`. The driver
    faults are drawn from an rng of their own, so every other draw of a seed stays what it was
    before the soak had them; every STREAMING_EVERY-th run (from the second) trains a stream where
    `streaming`, which changes no other draw."""
    rng = random.Random(seed)
    driver_rng = random.Random(f"driver-{seed}")
    deck = PhaseDeck(rng, phases)
    index = 0
    while True:
        plan = draw_run(rng, index, deck)
        if index % DRIVER_EVERY == DRIVER_EVERY - 1:
            plan.driver_fault = draw_driver_fault(driver_rng, plan)
        plan.streaming = streaming and index % STREAMING_EVERY == 1
        yield plan
        index += 1
