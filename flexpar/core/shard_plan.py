"""How the members of a sharded job's new generation become level: the plan, as data (pure).

At every boundary (a start, a join, a planned leave, a failure, a resume)
each member of the new process group reports what it holds (`Report`): its
committed step, whether all its sharded parameter values are at that step,
and the optimizer-state intervals it holds at that step. Holding a range's
state at a step implies holding that range's parameter values at that step
(whoever steps a range or receives its state gets its values too), which is
what lets any holder re-send the parameters a member misses. Departing
members (planned leavers handing their state over) report too; they are
sources only. `plan_levelling(reports, target)` then says, the same on every
member, since every member computes it from the same reports:

1. `latest`: the newest committed step any member holds. Only state held at
   `latest` counts. (A member one step behind that still holds that step's
   summed gradient has already brought itself to `latest` before it
   reports: flexpar/worker/shard_levelling.py.)
2. `transfers` with `state=True`: for every training member, the parts of
   its target chunks it does not hold, each from one member that does: the
   least loaded so far (by bytes), so that several sources send at once.
   Nothing a member holds is sent to it, nothing is sent twice.
3. `lost`: the parts of some target chunk that no member holds at `latest`.
   The job cannot go on from memory (flexpar stops, naming the latest
   checkpoint); the plan says so identically on every member.
4. `state_receivers`: training members behind `latest` (joiners) get the
   replicated state (scheduler, loss scale, buffers, the parameters that are
   not sharded, ...) from `state_source`, the lowest rank at `latest`.
5. `parameter_receivers`: training members whose parameter values are not
   all at `latest` (joiners, members whose last parameter broadcast broke
   off). They get the values of what they will hold with its state, and the
   rest in `transfers` with `state=False`, from members that hold them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from flexpar.core.shard_partition import Partition, Space, merge, segments_of, subtract


@dataclass(frozen=True)
class Report:
    """What one member of a new process group holds (its rank is its position in the reports)."""

    committed: int  # -1: nothing (a joiner)
    complete: bool = True  # all its sharded parameter values are at `committed`
    holdings: tuple = ()  # (space, start, stop): optimizer state (and parameter values) at `committed`
    training: bool = True  # False: departing (a source only; it leaves after the hand-off)


@dataclass(frozen=True)
class Transfer:
    """Elements [start, stop) of `space`, from `source` to `destination`.

    `state`: the range's optimizer state, with its parameter values when the
    destination is a parameter receiver; otherwise parameter values only.
    """

    source: int
    destination: int
    space: int
    start: int
    stop: int
    state: bool = True

    @property
    def size(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class LevellingPlan:
    latest: int
    state_source: int
    state_receivers: tuple
    transfers: tuple
    parameter_receivers: tuple
    lost: tuple

    def sent_by(self, rank: int) -> tuple:
        return tuple(transfer for transfer in self.transfers if transfer.source == rank)

    def received_by(self, rank: int) -> tuple:
        return tuple(transfer for transfer in self.transfers if transfer.destination == rank)


def plan_levelling(reports: Sequence[Report], target: Partition, element_bytes: Sequence[int] = ()) -> LevellingPlan:
    """The levelling of `reports` (ranks 0.. of the new group, training members first) onto `target`.

    `target` partitions the training members (ranks 0..target.world_size - 1).
    `element_bytes[space]` weighs the sources' loads (1 per element if not given).
    """
    training = [rank for rank, report in enumerate(reports) if report.training]
    if training != list(range(target.world_size)):
        raise ValueError(f"the training members must be ranks 0..{target.world_size - 1} (got {training})")
    latest = max(report.committed for report in reports)
    current = [rank for rank, report in enumerate(reports) if report.committed == latest]
    valid = {rank: merge(reports[rank].holdings) for rank in current}
    weights = list(element_bytes)
    load = {rank: 0 for rank in range(len(reports))}
    transfers: list = []
    lost: list = []

    def send(part: tuple, holders: tuple, destination: int, state: bool) -> None:
        if not holders:
            lost.append(part)
            return
        source = min(holders, key=lambda rank: (load[rank], rank))
        space, start, stop = part
        load[source] += (stop - start) * (weights[space] if weights else 1)
        transfers.append(Transfer(source, destination, space, start, stop, state))

    for destination in training:
        for piece in subtract(target.holdings(destination), valid.get(destination, ())):
            for part, holders in _parts_by_holders(piece, valid, exclude=destination):
                send(part, holders, destination, state=True)
    behind = tuple(rank for rank in training if reports[rank].committed < latest)
    parameter_receivers = tuple(rank for rank in training if rank in behind or not reports[rank].complete)
    everything = target.everything()
    # Parameter values: a complete member at `latest` has every range; the others, what they hold.
    values = {rank: everything if reports[rank].complete else valid[rank] for rank in current}
    for destination in parameter_receivers:
        arriving = [(t.space, t.start, t.stop) for t in transfers if t.destination == destination and t.state]
        has = merge(list(valid.get(destination, ())) + arriving)
        for piece in subtract(everything, has):
            for part, holders in _parts_by_holders(piece, values, exclude=destination):
                send(part, holders, destination, state=False)
    return LevellingPlan(
        latest=latest,
        state_source=min(current),
        state_receivers=behind,
        transfers=tuple(transfers),
        parameter_receivers=parameter_receivers,
        lost=merge(lost),
    )


def _parts_by_holders(piece: tuple, holdings: dict, exclude: int) -> list:
    """`piece` cut where the set of members holding it changes: [(part, holders)] in order."""
    space, start, stop = piece
    cuts = {start, stop}
    for rank, intervals in holdings.items():
        if rank == exclude:
            continue
        for held_space, held_start, held_stop in intervals:
            if held_space == space:
                cuts.update(point for point in (held_start, held_stop) if start < point < stop)
    points = sorted(cuts)
    parts = []
    for low, high in zip(points, points[1:]):
        holders = tuple(
            rank
            for rank, intervals in holdings.items()
            if rank != exclude and any(s == space and a <= low and high <= b for s, a, b in intervals)
        )
        parts.append(((space, low, high), holders))
    return parts


def lost_description(lost: Sequence[tuple], spaces: Sequence[Space], names: Sequence[str]) -> str:
    """'elements A-B of NAME (and K more ranges)' for lost (space, start, stop) intervals.

    `names[k]` is sharded parameter k's name; element numbers are within the
    parameter, flattened, last one included.
    """
    segments = segments_of(spaces, lost)
    if not segments:
        return "no elements"
    parameter, start, stop = segments[0]
    more = len(segments) - 1
    first = f"elements {start}-{stop - 1} of {names[parameter]}"
    return first + (f" (and {more} more range{'s' if more > 1 else ''})" if more else "")


def received_elements(plan: LevellingPlan, state: bool = True) -> int:
    """Elements the plan moves to its destinations (with their state, or parameter values only)."""
    return sum(transfer.size for transfer in plan.transfers if transfer.state == state)
