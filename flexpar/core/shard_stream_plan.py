"""The rounds of a sharded job's streamed join: which optimizer-state piece travels when (pure).

A sharded job (Job(shard_optimizer=...)) streams a join as an unsharded one
does (flexpar/core/stream_plan.py, flexpar/worker/shard_streaming.py), but
what travels is fixed by the levelling plan (flexpar/core/shard_plan.py):
each transfer is a range of optimizer state, from one holder (its source) to
one member of the new partition that lacks it (its destination: the joiner,
or an older member whose new chunks reach beyond its old ones). Parameter
values never travel: every member receives them from the chunks' primaries'
broadcast after each step.

`plan` cuts each transfer at parameter boundaries (a slice of the sharded
optimizer is one parameter's range), and, for element-wise sharding, into
ranges of at most `sender_bytes` of state; then it gives each source's
pieces rounds of at most `sender_bytes` (a piece larger than that travels
alone). Each piece comes from the least loaded of the members that hold it
(not only the levelling plan's source), so all holders send at once and the
rounds' count is about the state's bytes / (holders x `sender_bytes`).
Every member computes the same plan from the same inputs.

`refusal` says, from what every device reports at the boundary (`MemberReport`),
whether the join may stream at all: the old members must keep the partition
they had (ranks 0.., each at the latest step with its values complete and
exactly its chunks), the joiners follow them, and every piece of state must
be made of tensors whose layout the receivers can be told in advance.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Optional, Sequence

from flexpar.core.shard_partition import Partition, Space, merge, segments_of, subtract


@dataclasses.dataclass(frozen=True)
class MemberReport:
    """What one device of a sharded join boundary reports (its rank is its position in the reports)."""

    committed: int  # -1: a joiner
    complete: bool = True  # its sharded parameter values are all at `committed`
    holdings: tuple = ()  # (space, start, stop) intervals whose optimizer state it holds
    pristine: bool = False  # its optimizer never stepped
    streamable: bool = True  # every slice it holds has a state of contiguous tensors (or None values)
    state_bytes: int = 1  # optimizer-state bytes per element of what it holds (the widest slice's)
    sender_bytes: int = 1  # the bytes per sender and step it would plan


def refusal(reports: Sequence[MemberReport], old: Optional[Partition]) -> Optional[str]:
    """None if a join with these reports may stream; else why not.

    `old`: the partition of the members (the devices that hold a committed
    step), which they must still hold exactly, in rank order.
    """
    members = [report for report in reports if report.committed >= 0]
    if old is None or not members or any(report.committed >= 0 for report in reports[len(members) :]):
        return "the joiners are not the last ranks"
    latest = max(report.committed for report in members)
    if any(report.committed != latest or not report.complete for report in members):
        return "a member is behind the latest step"
    if any(report.pristine for report in members):
        return "the optimizer has not stepped yet (nothing to stream)"
    if not all(report.streamable for report in members):
        return "some optimizer state is empty (a parameter never stepped) or not made of contiguous tensors"
    for rank, report in enumerate(members):
        if merge(report.holdings) != old.holdings(rank):
            return "the members' chunks are not those of their partition (a rank changed)"
    return None


@dataclasses.dataclass(frozen=True)
class Move:
    """Elements [start, stop) of sharded parameter `parameter`'s optimizer state, from `source` to
    `destination` (ranks), in round `round`; `size`: its bytes."""

    round: int
    source: int
    destination: int
    parameter: int
    start: int
    stop: int
    size: int

    @property
    def segment(self) -> tuple:
        return (self.parameter, self.start, self.stop)


@dataclasses.dataclass(frozen=True)
class Plan:
    """Every move of a sharded stream, in the order both sides of each pair post them."""

    moves: tuple
    sender_bytes: int

    @property
    def rounds(self) -> int:
        return 1 + max((move.round for move in self.moves), default=-1)

    @property
    def size(self) -> int:
        return sum(move.size for move in self.moves)

    def in_round(self, number: int) -> tuple:
        return tuple(move for move in self.moves if move.round == number)

    def delivered_share(self, rounds_done: int) -> float:
        """The share of the bytes delivered once `rounds_done` rounds landed (the display's "joining 45%")."""
        if not self.moves:
            return 1.0
        return sum(move.size for move in self.moves if move.round < rounds_done) / self.size


def plan(
    transfers: Sequence,
    spaces: Sequence[Space],
    state_bytes: Sequence[int],
    sender_bytes: int,
    cuttable: bool,
    holdings: Optional[Mapping[int, Sequence[tuple]]] = None,
) -> Plan:
    """The rounds of `transfers` (flexpar/core/shard_plan.py's `Transfer`s with state).

    `state_bytes[space]`: bytes of optimizer state per element of that space
    (AdamW on float32: 8). `cuttable`: a parameter's range may be cut further
    (element-wise sharding); otherwise each parameter's range travels whole.
    `holdings[rank]`: the (space, start, stop) intervals each member holds at
    the latest step; each piece then comes from the holder (not its
    destination) that has sent the fewest bytes so far, so that every holder
    of a range streams at once (striped). Without it, a transfer's pieces come
    from its source.
    """
    if sender_bytes < 1:
        raise ValueError(f"sender_bytes={sender_bytes} must be >= 1")
    filled: dict = {}  # source -> (its current round, bytes in it)
    sent: dict = {}  # source -> bytes in all
    moves = []
    for transfer in transfers:
        weight = max(1, int(state_bytes[transfer.space]))
        interval = (transfer.space, transfer.start, transfer.stop)
        sources = [transfer.source]
        if holdings is not None:
            sources = (
                sorted(
                    rank
                    for rank, held in holdings.items()
                    if rank != transfer.destination and not subtract([interval], held)
                )
                or sources
            )
        for parameter, start, stop in segments_of(spaces, [interval]):
            step = max(1, sender_bytes // weight) if cuttable else stop - start
            for low in range(start, stop, step):
                high = min(stop, low + step)
                size = (high - low) * weight
                source = min(sources, key=lambda rank: (sent.get(rank, 0), rank))
                number, used = filled.get(source, (0, 0))
                if used and used + size > sender_bytes:
                    number, used = number + 1, 0
                filled[source] = (number, used + size)
                sent[source] = sent.get(source, 0) + size
                moves.append(Move(number, source, transfer.destination, parameter, low, high, size))
    return Plan(tuple(moves), sender_bytes)
