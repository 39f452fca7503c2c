"""The course of a simulated streamed join: its rounds as the engine sizes them, and the members' steps.

The engine (flexpar/worker/streaming.py) does not keep a stream's first plan:
before each round it re-sizes the slices from the members' previous step
times (``flexpar.core.stream_plan.resize_round``: halved while two steps in a
row run more than twice the target share longer, undone where the two steps
that carry the smaller slices do not show it helped, doubled while two steps
run less than half of it longer) and re-plans
what has not been sent (``stream_plan.replan``). This module runs that loop
with the same pure functions, on the simulated members' step times instead
of measured ones, so a simulated stream takes the rounds the engine's rule
gives for those times.

The members' steps while the joiner listens (the model of sim/joins.py and
core/join_choice.py): the step before the join times the listener's slowdown
(its work on shared cores), plus each sender's slice of the round in flight
over the join link (a round is sent after an update and overlaps the next
step). Listening step ``j`` (the ``j``-th step after the boundary, from 0)
carries round ``j - 1``'s slices; the statistics the engine sizes round ``r``
from are those of step ``r - 1`` (round 0: the step before the join).
Optional per-step noise (mean one, lognormal; a synchronous step takes one
time on every member) stands for a real host's step-to-step spread, to which
the rule reacts: the engine's baseline is one step, and each decision reads
two.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from flexpar.core import stream_plan

STATE_BYTES_PER_ELEMENT = 12
"""How the simulated state is cut: elements of a float32 parameter with AdamW's two moments (4 + 4 + 4
bytes), the engine's cuttable case (flexpar/core/stream_plan.py cuts element ranges, and a re-plan's cuts
follow element boundaries). The simulator knows the state's bytes, not its tensors: it plans them as one
tensor of such elements."""

MAX_ROUNDS = 100_000
"""A bound on a simulated stream's rounds (the rule never shrinks slices below its floor, so a stream of
any size the simulator is given ends well before it)."""


@dataclass(frozen=True)
class StreamCourse:
    """What a simulated stream did.

    ``rounds``: the steps the joiner listened (the engine's ``rounds_done`` at
    the end: the joiner takes VWs from the next step). ``planned_rounds``: the
    first plan's. ``member_step_s``: the members' step time of each listening
    step as the rule read it, noise included (the first without the
    boundary's stall; one time for every member: a synchronous step).
    ``expected_step_s``: the same steps without the noise (the listener's
    slowdown and the slices the rule chose). ``sender_bytes``: each round's
    slice size per sender as the rule set it. ``before_step_s``: the members'
    step the engine took as the baseline (round 0's statistics).
    """

    rounds: int
    planned_rounds: int
    member_step_s: tuple
    sender_bytes: tuple
    before_step_s: float
    expected_step_s: tuple = ()

    def lost_s(self, step_before_s: float) -> float:
        """The members' time lost while streaming: each listening step beyond the step before the join,
        without the steps' noise (a noisy step's excursions are the model's step noise, charged apart;
        the noise changes the lost time through the slices the rule chose, and so the steps' count)."""
        return sum(max(0.0, seconds - step_before_s) for seconds in self.expected_step_s or self.member_step_s)


@dataclass(frozen=True)
class CourseInputs:
    """What a simulated stream's course follows (seconds, bytes, bytes per second).

    ``step_s``: the members' step before the join; ``slowdown``: their step
    while a listener runs, over ``step_s`` (before the slices' cost);
    ``link_bytes_per_s``: the link a slice crosses; ``first_sender_bytes``: the
    first plan's slice per sender (the engine's ``sender_bytes``);
    ``baseline_ratio``: the step the engine takes as its baseline (the
    members' last step before the boundary) over ``step_s`` (above 1 where
    the joiner's start-up shared their cores then);
    ``resizes``: the engine resizes (False under ``join_stream_mb``);
    ``noise_sigma``, ``seed``: the steps' lognormal spread and its seed;
    ``tensors``: the state's tensors as the engine plans them
    (``stream_plan.Tensor``, in model order; empty: one tensor of
    ``state_bytes``, `state_tensors`).
    """

    state_bytes: int
    senders: int
    first_sender_bytes: int
    step_s: float
    slowdown: float
    link_bytes_per_s: float
    share: float
    baseline_ratio: float = 1.0
    resizes: bool = True
    noise_sigma: float = 0.0
    seed: int = 0
    tensors: tuple = ()

    def __post_init__(self) -> None:
        for name, least in (("state_bytes", 0), ("senders", 1), ("first_sender_bytes", 1)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise ValueError(f"stream course: {name}={value!r} must be an integer >= {least}")
        for name in ("step_s", "slowdown", "link_bytes_per_s", "share", "baseline_ratio"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"stream course: {name}={value!r} must be a positive number")
        if not (math.isfinite(self.noise_sigma) and self.noise_sigma >= 0):
            raise ValueError(f"stream course: noise_sigma={self.noise_sigma!r} must be >= 0")


def course(inputs: CourseInputs) -> StreamCourse:
    """Run the engine's sizing loop (`stream_plan.resize_round`, `replan`) on the modelled member steps."""
    senders = tuple(f"sender-{index}" for index in range(inputs.senders))
    tensors = list(inputs.tensors) or state_tensors(inputs.state_bytes)
    plan = stream_plan.plan(tensors, senders, inputs.first_sender_bytes, cuttable=True)
    planned = plan.rounds
    sizing = stream_plan.first_sizing(plan.sender_bytes)
    largest, total_rounds = _largest_by_round(plan), plan.rounds  # (`rounds` reads every slice: kept)
    rng = np.random.default_rng(inputs.seed)
    before = inputs.step_s * inputs.baseline_ratio * _noise(inputs.noise_sigma, rng)
    before_s, step_times, expected, sizes, in_flight = 0.0, [], [], [], 0
    rounds_done = 0
    while rounds_done < MAX_ROUNDS:
        # The listening step just taken (a synchronous step: one time for every member): the listener's
        # slowdown, and the largest slice of the round before it over the link.
        sending = in_flight / inputs.link_bytes_per_s
        expected.append(inputs.step_s * inputs.slowdown + sending)
        step_times.append(inputs.step_s * inputs.slowdown * _noise(inputs.noise_sigma, rng) + sending)
        previous = before if rounds_done == 0 else step_times[rounds_done - 1]
        if inputs.resizes:
            sizing, before_s = stream_plan.resize_round(
                sizing, before_s, [previous] * inputs.senders, rounds_done, inputs.share
            )
            if sizing.sender_bytes != plan.sender_bytes:
                plan = stream_plan.replan(plan, rounds_done, senders, sender_bytes=sizing.sender_bytes)
                largest, total_rounds = _largest_by_round(plan), plan.rounds
        in_flight = largest.get(rounds_done, 0)
        sizes.append(plan.sender_bytes)
        rounds_done += 1
        if rounds_done >= total_rounds:
            break
    return StreamCourse(rounds_done, planned, tuple(step_times), tuple(sizes), before, tuple(expected))


def _largest_by_round(plan: stream_plan.Plan) -> dict:
    """Each round's largest slice (a sender's bytes), by round."""
    largest: dict = {}
    for piece in plan.slices:
        largest[piece.round] = max(largest.get(piece.round, 0), piece.size)
    return largest


def state_tensors(state_bytes: int) -> list:
    """The simulated state as the plan sees it: one cuttable tensor of `STATE_BYTES_PER_ELEMENT`-byte elements."""
    elements = -(-state_bytes // STATE_BYTES_PER_ELEMENT)
    return [stream_plan.Tensor("state", elements, STATE_BYTES_PER_ELEMENT)]


def _noise(sigma: float, rng: np.random.Generator) -> float:
    """A mean-one lognormal factor of one step (1 where `sigma` is 0)."""
    if sigma <= 0:
        return 1.0
    return float(np.exp(sigma * rng.standard_normal() - sigma * sigma / 2))
