"""Which way a joiner comes in: streamed (it listens while the state streams) or the blocking transfer.

A pure decision (no clocks, no processes): from what flexpar measures before
a join, predict what each way costs the members and when the joiner starts to
contribute, and choose. The engine's wiring comes later; the simulator
(flexpar/sim) is its first user.

The model (docs/simulator.md, "Joins"), per way:

- **blocking**: the boundary (a new group: ``boundary_s``) plus the whole
  state over the link. The members lose that stall; the joiner takes VWs from
  the next step on.
- **streamed**: the boundary plus the small state only; then ``stream_steps``
  steps during which the joiner listens (no VWs) and each step of the members
  is longer by

  - the senders' share of the slices, ``state_bytes / (senders x steps)``
    over the link (a sender's slices leave during its next step);
  - where the joiner shares cores with members (same host, more busy threads
    than cores): the listener's own work, taken from the members' cores. The
    listener does what a member does in a step besides its VWs (the summed
    gradient's all-reduce, the optimizer's update of what it holds): about
    ``LISTENER_WORK x (step_s - compute_s)`` of busy time per step, which
    stretches the members' steps by processor sharing
    (``members + listener busy share`` threads on ``cores``).

  The members lose the boundary plus every step's extra; the joiner's first
  step with VWs starts after the boundary and the stream's steps.

``choose``: a forced mode is honoured; ``auto`` takes the way with the smaller
predicted members' lost time, except that it takes the blocking transfer when
the joiner shares a member's cores on a host with more busy threads than
cores (the listener's work then comes out of the members' steps), and when the
stream would make the joiner contribute later than ``max_first_vw_s`` (while
the blocking transfer does not).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

MODES = ("auto", "stream", "blocking")
"""How a join may come in: chosen from the predictions, or forced."""

MAX_FIRST_VW_S = 60.0
"""The engine's bound on a streamed joiner's first VW under ``auto`` (flexpar/worker/join_way.py; the
simulator's default too): a stream whose joiner would take VWs later than this, and later than the
blocking transfer's, is not taken, however little it is predicted to cost the members."""

LISTENER_WORK = 1.3
"""The listener's busy time per step as a share of a member's step besides its VWs (the summed gradient's
all-reduce, in which it takes part like a member, and the update of what it holds, which skips what has
not landed yet). Calibrated on benchmarks/join_stream.py in two quiet runs on the 2-core machine (3
processes on 2 cores; docs/benchmarks.md, 2026-12-06 and 2026-12-07): the work that gives each size's
measured members' slowdown, less its slices' share (`listener_work_for`), was 1.33, 1.30, 1.21, 1.30
and 1.30, 1.31, 1.02, 1.88 at 0.1, 0.5, 1 and 2 GB; 1.3 is their median. (The 0.95 before it, from
0.1 and 0.5 GB on an earlier day, put the join events' predicted cost of a stream at 0.5-0.7x of what
it cost in both runs.) It moves the prediction only where a listener shares oversubscribed cores,
where `auto` takes the blocking transfer anyway; a joiner on idle cores or its own GPU slows no member."""


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def _finite(value, minimum: float = 0.0) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= minimum


@dataclass(frozen=True)
class SharedCores:
    """The joiner runs on the host of `member` and shares its `cores` with `members` busy members there."""

    member: str
    cores: float
    members: int

    def __post_init__(self) -> None:
        _check(bool(self.member), "shared cores: name the member whose cores the joiner shares")
        _check(_finite(self.cores) and self.cores > 0, f"shared cores: cores={self.cores!r} must be positive")
        _check(
            isinstance(self.members, int) and self.members >= 1,
            f"shared cores: members={self.members!r} must be an integer >= 1",
        )

    @property
    def oversubscribed(self) -> bool:
        """More busy threads than cores once the joiner runs too."""
        return self.members + 1 > self.cores


@dataclass(frozen=True)
class JoinInputs:
    """What flexpar measures before a join (seconds, bytes, bytes per second).

    ``step_s``: the members' median step time; ``compute_s``: of which the
    slowest member's VW compute (its busy time), the rest being the
    all-reduce and the optimizer step. ``state_bytes``: the trainable state
    (parameters and their optimizer state), what streams; ``small_state_bytes``:
    what travels at the boundary either way (buffers, scheduler, counters).
    ``link_bytes_per_s``: the measured bandwidth of a state transfer to the
    joiner. ``boundary_s``: a boundary without a transfer (a new group).
    ``stream_steps``: the stream's planned steps; ``senders``: the members
    that send slices. ``shared``: where the joiner shares a member's cores.
    """

    step_s: float
    compute_s: float
    state_bytes: float
    link_bytes_per_s: float
    boundary_s: float
    stream_steps: int
    senders: int = 1
    small_state_bytes: float = 0.0
    shared: Optional[SharedCores] = None

    def __post_init__(self) -> None:
        for name in ("step_s", "compute_s", "state_bytes", "boundary_s", "small_state_bytes"):
            _check(_finite(getattr(self, name)), f"join inputs: {name}={getattr(self, name)!r} must be finite >= 0")
        _check(self.compute_s <= self.step_s, f"join inputs: compute_s={self.compute_s} exceeds step_s={self.step_s}")
        _check(
            _finite(self.link_bytes_per_s) and self.link_bytes_per_s > 0,
            f"join inputs: link_bytes_per_s={self.link_bytes_per_s!r} must be positive",
        )
        for name in ("stream_steps", "senders"):
            value = getattr(self, name)
            _check(
                isinstance(value, int) and not isinstance(value, bool) and value >= 1,
                f"join inputs: {name}={value!r} must be an integer >= 1",
            )


@dataclass(frozen=True)
class Prediction:
    """One way's predicted costs, in seconds from the boundary's start.

    ``boundary_stall_s``: the members' stop at the boundary. ``members_lost_s``:
    the members' training time lost to the join (the stall plus, while
    streaming, each step's time beyond the step before the join).
    ``first_vw_s``: until the joiner's first step with VWs starts.
    ``stream_steps``: steps it listens (0: blocking). ``member_slowdown``:
    the members' step while streaming over the one before (1: blocking).
    """

    way: str
    boundary_stall_s: float
    members_lost_s: float
    first_vw_s: float
    stream_steps: int = 0
    member_slowdown: float = 1.0


@dataclass(frozen=True)
class JoinChoice:
    """The way taken (`stream` or `blocking`), the mode asked, both predictions and a one-line reason."""

    way: str
    mode: str
    stream: Prediction
    blocking: Prediction
    reason: str

    @property
    def chosen(self) -> Prediction:
        return self.stream if self.way == "stream" else self.blocking


def predict_blocking(inputs: JoinInputs) -> Prediction:
    """The blocking transfer: the boundary and the whole state over the link; nothing after it."""
    stall = inputs.boundary_s + (inputs.state_bytes + inputs.small_state_bytes) / inputs.link_bytes_per_s
    return Prediction("blocking", stall, stall, stall)


def listener_slowdown(inputs: JoinInputs, listener_work: float = LISTENER_WORK) -> float:
    """How many times longer the members' steps run while a listener shares their cores (1: it does not).

    Processor sharing: ``members`` busy threads on ``cores`` get
    ``min(1, cores / threads)`` of a core each; the listener is busy a share
    ``u`` of each step (``listener_work`` of the step's non-VW part: the
    engine's ``LISTENER_WORK``, or a host's calibrated figure in the simulator).
    """
    _check(_finite(listener_work) and listener_work > 0, f"listener_work={listener_work!r} must be positive")
    shared = inputs.shared
    if shared is None or inputs.step_s <= 0:
        return 1.0
    busy = listener_work * (inputs.step_s - inputs.compute_s) / inputs.step_s
    before = max(1.0, shared.members / shared.cores)
    during = max(1.0, (shared.members + busy) / shared.cores)
    return during / before


def listener_work_for(inputs: JoinInputs, slowdown: float) -> Optional[float]:
    """The listener work that makes `listener_slowdown(inputs, work)` equal `slowdown` (the inverse).

    None where no work can say it: the joiner does not share cores, the step
    has no non-VW part, or the slowdown stays within the idle cores (a
    listener there slows nobody, whatever its work). A calibration's tool
    (benchmarks/validation/join_rows.py): from a measured slowdown of the
    members' steps, less their slices' share, on a host like the one predicted.
    """
    shared = inputs.shared
    if shared is None or inputs.step_s <= 0 or inputs.step_s <= inputs.compute_s:
        return None
    before = max(1.0, shared.members / shared.cores)
    during = slowdown * before
    if during <= 1.0:
        return None
    busy = during * shared.cores - shared.members
    if busy <= 0:
        return None
    return busy * inputs.step_s / (inputs.step_s - inputs.compute_s)


def predict_stream(inputs: JoinInputs) -> Prediction:
    """The streamed join: a small boundary, then `stream_steps` slower steps of the members."""
    stall = inputs.boundary_s + inputs.small_state_bytes / inputs.link_bytes_per_s
    steps = inputs.stream_steps
    send_s = inputs.state_bytes / (inputs.senders * steps) / inputs.link_bytes_per_s
    extra = inputs.step_s * (listener_slowdown(inputs) - 1.0) + send_s
    slowdown = 1.0 + extra / inputs.step_s if inputs.step_s > 0 else 1.0
    return Prediction(
        "stream",
        stall,
        stall + steps * extra,
        stall + steps * (inputs.step_s + extra),
        stream_steps=steps,
        member_slowdown=slowdown,
    )


def seconds_text(seconds: float) -> str:
    """Two significant figures, as a reason prints them (0.19, 2.1, 12, 340)."""
    if seconds >= 100:
        return f"{seconds:.0f}"
    return f"{seconds:.2g}"


def choose(inputs: JoinInputs, mode: str = "auto", max_first_vw_s: Optional[float] = None) -> JoinChoice:
    """The way a join takes under `mode` (`MODES`), with both predictions and the reason.

    `max_first_vw_s`: with `auto`, a stream whose joiner would contribute
    later than this is not taken (unless the blocking transfer would be later
    still). Ties go to the blocking transfer (the joiner contributes at once).
    """
    _check(mode in MODES, f"join mode {mode!r}: expected one of {list(MODES)}")
    _check(
        max_first_vw_s is None or (_finite(max_first_vw_s) and max_first_vw_s > 0),
        f"max_first_vw_s={max_first_vw_s!r} must be positive (or None: no bound)",
    )
    stream, blocking = predict_stream(inputs), predict_blocking(inputs)
    why = ""
    if mode != "auto":
        way, why = mode, f"join mode {mode}"
    elif inputs.shared is not None and inputs.shared.oversubscribed:
        way, why = "blocking", f"the joiner shares {inputs.shared.member}'s cores"
    elif (
        max_first_vw_s is not None
        and stream.first_vw_s > max_first_vw_s
        and blocking.first_vw_s < stream.first_vw_s
        and stream.members_lost_s < blocking.members_lost_s
    ):
        way = "blocking"
        why = (
            f"streaming's joiner would contribute after {seconds_text(stream.first_vw_s)} s, over the "
            f"{seconds_text(max_first_vw_s)} s bound"
        )
    else:
        way = "stream" if stream.members_lost_s < blocking.members_lost_s else "blocking"
    if way == "stream":
        reason = (
            f"streamed: predicted {seconds_text(stream.members_lost_s)} s lost against "
            f"{seconds_text(blocking.members_lost_s)} s blocking"
        )
    else:
        reason = (
            f"blocking transfer: predicted {seconds_text(blocking.members_lost_s)} s against "
            f"{seconds_text(stream.members_lost_s)} s streaming"
        )
    if why:
        reason += f" ({why})"
    return JoinChoice(way, mode, stream, blocking, reason)


def planned_stream_steps(state_bytes: float, senders: int, sender_bytes: int) -> int:
    """The steps a stream of `state_bytes` takes from `senders` at `sender_bytes` each per step (at least 1).

    What core/stream_plan.py's `plan` comes to when the state can be cut into
    element ranges (element-wise optimizers): full rounds of every sender's
    slice, the rest in a last one.
    """
    _check(isinstance(senders, int) and senders >= 1, f"senders={senders!r} must be an integer >= 1")
    _check(isinstance(sender_bytes, int) and sender_bytes >= 1, f"sender_bytes={sender_bytes!r} must be >= 1")
    return max(1, math.ceil(state_bytes / (senders * sender_bytes)))
