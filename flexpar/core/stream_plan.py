"""The plan of a streamed join: which part of the training state travels in which slice, from whom, when.

A streamed join (the worker's part is flexpar/worker/streaming.py,
docs/internals.md "Streamed joins") lets the joiner listen to the members'
steps while the members send it the training state a slice per step: the
running devices never stop for the whole transfer. This module decides the
slices; it is pure (no processes, no clocks), so every member computes the
same plan from the same inputs, and a plan can be re-made from the survivors
when a sender fails.

- What may stream (`refusal`): an optimizer whose update of a parameter reads
  only that parameter's gradient and state, plus global scalars (the step
  count, the clipping factor, the learning rate). A slice then holds whole
  parameters with their optimizer state; element ranges of a parameter only
  for element-wise optimizers (each element's update reads only that
  element's gradient and state). Anything else (LBFGS, or an optimizer
  flexpar does not know) joins with today's blocking transfer, and the join
  event says why.
- The small state (scheduler, step counters, loss scale, RNG, buffers that
  change) is not planned here: it travels at the join boundary, before any
  slice.
- Slices (`plan`): each round (one step's gap between an update and the next
  step) gives every sender at most `sender_bytes`; the tensors go in model
  order, cut into element ranges no larger than `sender_bytes` where that is
  allowed, each piece to the sender with the fewest bytes so far in the round
  (striped). A piece that may not be cut and is larger than `sender_bytes`
  travels alone in a round of its own sender (`Plan.oversize` names it).
- A sender lost (`replan`): the pieces not yet delivered are planned again
  among the survivors; delivered pieces stay delivered, because the
  listener's own updates keep them current. `continuation` decides, from
  what every member of the new generation reports, whether the stream goes
  on at all (else the listener is a joiner again).
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Optional, Sequence

ELEMENTWISE = frozenset(
    {"SGD", "Adam", "AdamW", "Adagrad", "Adadelta", "Adamax", "ASGD", "NAdam", "RAdam", "RMSprop", "Rprop"}
    | {"SparseAdam"}
)
"""torch.optim classes whose update of each element reads only that element's gradient and state (and
global scalars): any element range of a parameter may travel on its own."""

PER_PARAMETER = ELEMENTWISE | frozenset({"Adafactor", "Muon"})
"""torch.optim classes whose update of a parameter reads only that parameter (Adafactor's row and column
factors, Muon's orthogonalised matrix): whole parameters may travel on their own, ranges may not."""


def refusal(optimizer_classes: Iterable[str]) -> Optional[str]:
    """None if a job with these optimizer classes (their names) may stream a join; else the reason.

    A class that is not in `PER_PARAMETER` (LBFGS reads every parameter in its
    line search; a user's own class may do anything) makes the join blocking.
    """
    unknown = sorted({name for name in optimizer_classes if name not in PER_PARAMETER})
    if not unknown:
        return None
    return (
        f"the optimizer {', '.join(unknown)} is not known to update each parameter from its own gradient and "
        "state alone"
    )


def elementwise(optimizer_classes: Iterable[str]) -> bool:
    """Whether every class is element-wise, so that a parameter may travel in element ranges."""
    return all(name in ELEMENTWISE for name in optimizer_classes)


@dataclasses.dataclass(frozen=True)
class Tensor:
    """One trainable parameter as the plan sees it: its name, elements, and bytes per element.

    `bytes_per_element`: the parameter's own bytes plus its optimizer state's
    per element (AdamW on float32: 4 + 4 + 4 = 12).
    """

    name: str
    elements: int
    bytes_per_element: int

    def __post_init__(self):
        if self.elements < 0 or self.bytes_per_element < 1:
            raise ValueError(f"{self.name}: elements={self.elements}, bytes_per_element={self.bytes_per_element}")


@dataclasses.dataclass(frozen=True)
class Piece:
    """Elements [start, stop) of tensor `name` (with their optimizer state), `size` bytes."""

    name: str
    start: int
    stop: int
    size: int


@dataclasses.dataclass(frozen=True)
class Slice:
    """What `sender` sends in round `round` (after that many updates since the join): `pieces`, in order."""

    round: int
    sender: str
    pieces: tuple

    @property
    def size(self) -> int:
        return sum(piece.size for piece in self.pieces)


@dataclasses.dataclass(frozen=True)
class Plan:
    """Every slice of a stream, by round then sender; `oversize`: pieces over `sender_bytes` (not cuttable)."""

    slices: tuple
    sender_bytes: int
    oversize: tuple = ()
    cuttable: bool = False  # pieces are element ranges that may be cut again (a re-plan's smaller slices)

    @property
    def rounds(self) -> int:
        return 1 + max((piece.round for piece in self.slices), default=-1)

    @property
    def size(self) -> int:
        return sum(piece.size for piece in self.slices)

    def delivered_share(self, rounds_done: int) -> float:
        """The share of the bytes delivered once `rounds_done` rounds landed (the display's "joining 45%")."""
        if not self.slices:
            return 1.0
        done = sum(piece.size for piece in self.slices if piece.round < rounds_done)
        return done / self.size


def sender_bytes(link_bytes_per_s: float, step_s: float, share: float, cap: Optional[int] = None) -> int:
    """Bytes a sender may send per step so that its step slows by about `share` of a step.

    Sending `b` bytes over a link of `link_bytes_per_s` costs the sender about
    `b / link_bytes_per_s` seconds; `share` of a step of `step_s` seconds
    allows `share * step_s * link_bytes_per_s`. `cap` (the user's bytes per
    step) bounds it; at least 1 byte, so a stream always ends.
    """
    if link_bytes_per_s <= 0 or step_s <= 0 or not 0 < share <= 1:
        raise ValueError(
            f"link {link_bytes_per_s} B/s, step {step_s} s, share {share}: each must be positive, the share <= 1"
        )
    allowed = int(share * step_s * link_bytes_per_s)
    if cap is not None:
        allowed = min(allowed, cap)
    return max(1, allowed)


def pieces_of(tensors: Sequence[Tensor], limit: int, cuttable: bool) -> list:
    """The tensors in order as pieces of at most `limit` bytes (cut into element ranges where `cuttable`)."""
    pieces = []
    for tensor in tensors:
        if tensor.elements == 0:
            continue
        step = max(1, limit // tensor.bytes_per_element) if cuttable else tensor.elements
        for start in range(0, tensor.elements, step):
            stop = min(tensor.elements, start + step)
            pieces.append(Piece(tensor.name, start, stop, (stop - start) * tensor.bytes_per_element))
    return pieces


def plan(tensors: Sequence[Tensor], senders: Sequence[str], sender_bytes: int, cuttable: bool) -> Plan:
    """The slices that bring a listener all of `tensors` from `senders`, `sender_bytes` per sender per round."""
    if not senders:
        raise ValueError("a stream needs at least one sender")
    if sender_bytes < 1:
        raise ValueError(f"sender_bytes={sender_bytes} must be >= 1")
    packed = _pack(pieces_of(tensors, sender_bytes, cuttable), tuple(senders), sender_bytes, first_round=0)
    return dataclasses.replace(packed, cuttable=cuttable)


def replan(
    previous: Plan,
    rounds_done: int,
    survivors: Sequence[str],
    last_round_from: Optional[Iterable[str]] = None,
    sender_bytes: Optional[int] = None,
) -> Plan:
    """The rest of `previous` after `rounds_done` rounds, among `survivors`, from round `rounds_done`.

    Delivered slices stay in the plan as they were; the undelivered pieces
    (of every sender, lost or not) are packed again, in their order. With
    `last_round_from`, the last of those rounds (`rounds_done - 1`, cut off by
    a failure before the listener waited for it) landed only from these
    senders: its other slices are undelivered too. `sender_bytes`: the rest's
    bytes per sender per round (default: the previous plan's).
    """
    if not survivors:
        raise ValueError("no sender is left to stream from: the join falls back to the blocking transfer")
    landed_last = None if last_round_from is None else set(last_round_from)

    def delivered(piece: Slice) -> bool:
        if piece.round >= rounds_done:
            return False
        return landed_last is None or piece.round < rounds_done - 1 or piece.sender in landed_last

    kept = tuple(piece for piece in previous.slices if delivered(piece))
    rest = [item for piece in previous.slices if not delivered(piece) for item in piece.pieces]
    rest.sort(key=_model_order(previous))
    limit = previous.sender_bytes if sender_bytes is None else sender_bytes
    if limit < 1:
        raise ValueError(f"sender_bytes={limit} must be >= 1")
    if previous.cuttable:  # smaller slices than before: cut the pieces again
        rest = [part for item in rest for part in _cut(item, limit)]
    packed = _pack(rest, tuple(survivors), limit, first_round=rounds_done)
    undelivered = set(rest)
    delivered_oversize = tuple(item for item in previous.oversize if item not in undelivered)
    return Plan(kept + packed.slices, limit, delivered_oversize + packed.oversize, previous.cuttable)


def _cut(piece: Piece, limit: int) -> list:
    """`piece` as element ranges of at most `limit` bytes (at least one element each)."""
    elements = piece.stop - piece.start
    per_element = piece.size // max(1, elements)
    if piece.size <= limit or elements <= 1 or per_element < 1:
        return [piece]
    step = max(1, limit // per_element)
    return [
        Piece(piece.name, start, min(piece.stop, start + step), (min(piece.stop, start + step) - start) * per_element)
        for start in range(piece.start, piece.stop, step)
    ]


@dataclasses.dataclass(frozen=True)
class Sizing:
    """The slices' size while a stream runs, and what the last change of it is waiting to show.

    `halved_from`: the slowdown measured before the last halving, and `halved_at` the round whose
    slices were the first smaller ones (their cost shows in the statistics two rounds later);
    `settled`: halving did not help, so the size no longer shrinks (the slowdown is not the
    transfer's: on a shared host, the listener's own work); `last_slowdown`: the previous
    round's reading (every change is called for by two steps in a row, `resized`).
    """

    sender_bytes: int
    floor: int
    halved_from: Optional[float] = None
    halved_at: int = -1
    settled: bool = False
    last_slowdown: Optional[float] = None


RESIZE_LAG = 2
"""A round's slices overlap the next step; that step's time reaches every member in the statistics of
the step after it: a size chosen at round r is measured at round r + 2."""


def resized(sizing: Sizing, slowdown: float, round_number: int, share: float) -> Sizing:
    """The next rounds' size, from the members' step slowdown (their step / the one before the join, - 1).

    The goal is a step about `share` longer than before. Halved while the step
    is more than twice that much longer, as long as halving helps: a halving
    that did not take away half of the excess is undone and the size settles.
    Doubled while the step is less than half of `share` longer. Never below
    `floor`. Pure, so every member resizes alike from the same summed step times.

    Every change is called for by two steps in a row (this reading and the one before it, kept in
    `last_slowdown`): a halving where both ran more than twice `share` longer (its `halved_from` the
    smaller), a doubling where both ran less than half of it longer, and a halving stays only where
    both steps that carry the smaller slices show it helped. One step alone decides nothing: in
    benchmarks/join_stream.py's 2 GB streams the step that carried the first slices ran 1.1-1.35x
    the listening steps after it, the halving it called for was judged against that one step and
    stuck, and the streams ran 16 steps where the rule on steady steps takes 10 (2026-12-07).
    """
    previous = sizing.last_slowdown
    sizing = dataclasses.replace(sizing, last_slowdown=slowdown)
    if sizing.halved_from is not None:
        if round_number < sizing.halved_at + RESIZE_LAG + 1:
            return sizing  # the smaller slices' cost shows from halved_at + RESIZE_LAG: two such steps judge it
        if max(previous, slowdown) > sizing.halved_from - (sizing.halved_from - share) / 2:  # not helped enough
            return Sizing(sizing.sender_bytes * 2, sizing.floor, settled=True, last_slowdown=slowdown)
        sizing = dataclasses.replace(sizing, halved_from=None, halved_at=-1)
    if previous is None:
        return sizing
    if min(previous, slowdown) > 2 * share and not sizing.settled and sizing.sender_bytes // 2 >= sizing.floor:
        return dataclasses.replace(
            sizing,
            sender_bytes=sizing.sender_bytes // 2,
            halved_from=min(previous, slowdown),
            halved_at=round_number,
        )
    if max(previous, slowdown) < share / 2:
        return dataclasses.replace(sizing, sender_bytes=sizing.sender_bytes * 2)
    return sizing


def resize_round(
    sizing: Sizing, before_s: float, member_step_s: Sequence[float], rounds_done: int, share: float
) -> tuple:
    """The slices' size for round `rounds_done`, and the members' step before the join: `(sizing, before_s)`.

    `member_step_s`: the senders' previous step times (the statistics of the
    step just taken: a listener's are left out by the caller). Their median
    at round 0 is the step before the join (the baseline); at round 1 it holds
    the join boundary's stall and is not used; from round 2 on, the size
    follows `resized` from that median over the baseline. The engine
    (flexpar/worker/streaming.py) and the simulator (flexpar/sim/stream_course.py)
    both size a stream with this, so the simulated stream takes the engine's rounds.
    """
    times = sorted(value for value in member_step_s if value > 0)
    if not times:
        return sizing, before_s
    median = times[len(times) // 2]
    if rounds_done == 0:
        return sizing, median
    if rounds_done < 2 or before_s <= 0:
        return sizing, before_s
    return resized(sizing, median / before_s - 1.0, rounds_done, share), before_s


MIN_SENDER_BYTES = 1 << 20
"""The smallest slice a sender's round shrinks to without `join_stream_mb` (a stream must end)."""

DEFAULT_SENDER_BYTES = 64 << 20
"""A sender's bytes per step while no step time is measured yet."""


def first_sender_bytes(link_bytes_per_s: float, step_s: float, share: float) -> int:
    """A stream's first slice per sender: `sender_bytes` of the predicted step, `DEFAULT_SENDER_BYTES`
    while none is measured. The engine (flexpar/worker/stream_rules.py, without `join_stream_mb`) and
    the simulator (flexpar/sim/joins.py) both size a stream's first plan with this."""
    if step_s <= 0:
        return DEFAULT_SENDER_BYTES
    return sender_bytes(link_bytes_per_s, step_s, share)


def first_sizing(first_sender_bytes: int) -> Sizing:
    """A stream's sizing before its first round: its first slices, and `sizing_floor` of them. The engine
    (flexpar/worker/streaming.py, without `join_stream_mb`) and the simulator (flexpar/sim/stream_course.py)
    both start a stream's re-sizing from this."""
    return Sizing(first_sender_bytes, sizing_floor(first_sender_bytes))


def sizing_floor(first_sender_bytes: int) -> int:
    """The smallest slices a stream shrinks to: half its first size, at least MIN_SENDER_BYTES (never
    above the first size). One halving at most: on a shared host the steps' slowdown is mostly the
    listener's own work, which smaller slices only spread over more steps (measured: with an eighth,
    the benchmark's streams outlasted its jobs)."""
    return min(first_sender_bytes, max(MIN_SENDER_BYTES, first_sender_bytes // 2))


def continuation(
    identities: Sequence[float], listening_steps: Sequence[int], latest_step: int, receivers: Sequence[int]
) -> Optional[tuple]:
    """The listeners' ranks if a stream broken off by a failure or a leave goes on, else None.

    Every member of the new generation reports the identity of the stream it
    holds (0: none) and, a listener, the step its state is at (-1: not a
    listener); the listeners report no committed step, so they are the
    `receivers` behind `latest_step`. The stream goes on only where nothing
    else needs levelling: every member holds the same stream (nobody new, no
    plan that differs), the listeners are exactly the receivers and at the
    members' latest step, and at least one member is not a listener (a sender).
    """
    listeners = tuple(rank for rank, step in enumerate(listening_steps) if step >= 0)
    if not identities or identities[0] == 0 or any(identity != identities[0] for identity in identities):
        return None
    if not listeners or len(listeners) == len(identities) or tuple(sorted(receivers)) != listeners:
        return None
    if any(listening_steps[rank] != latest_step for rank in listeners):
        return None
    return listeners


def _model_order(previous: Plan):
    """Pieces sort back into the order the plan first had them (tensor order, then element order)."""
    rank = {}
    for piece in previous.slices:
        for item in piece.pieces:
            rank.setdefault(item.name, len(rank))
    return lambda item: (rank[item.name], item.start)


def _pack(pieces: Sequence[Piece], senders: tuple, sender_bytes: int, first_round: int) -> Plan:
    """Rounds of one bin per sender (capacity `sender_bytes`); each piece to the emptiest bin it fits.

    Pieces keep their order: a piece that fits no bin of the round closes the
    round. A piece larger than a bin alone opens a bin of its own (oversize).
    """
    slices, oversize = [], []
    round_number = first_round
    bins = {sender: [] for sender in senders}
    filled = {sender: 0 for sender in senders}

    def close():
        nonlocal bins, filled, round_number
        for sender in senders:
            if bins[sender]:
                slices.append(Slice(round_number, sender, tuple(bins[sender])))
        round_number += 1
        bins = {sender: [] for sender in senders}
        filled = {sender: 0 for sender in senders}

    for piece in pieces:
        if piece.size > sender_bytes:
            oversize.append(piece)
        target = min(senders, key=lambda sender: (filled[sender], senders.index(sender)))
        if filled[target] and filled[target] + piece.size > sender_bytes:
            close()
            target = senders[0]
        bins[target].append(piece)
        filled[target] += piece.size
    if any(bins.values()):
        close()
    return Plan(tuple(slices), sender_bytes, tuple(oversize))
