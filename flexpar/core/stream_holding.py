"""Which device reads which stream group, and when the devices exchange the groups' positions (pure).

A streaming job's device reads only the stream groups of the VWs it runs
(flexpar/core/stream_split.py has the split), so a group's newest position is
held by the devices that read it. The others keep, for every group, the
newest position they heard of (`newest`): a position at an older boundary is
as good as the committed one, only dearer, because a reader opened there
reads forward, chunk by chunk, to the committed boundary, which is exact
(the stream is the same on every device and pass).

The devices exchange their positions (one gather of a few small records) at
the steps `exchange_due` names, which every member decides alike from what
every member holds alike (the generation, the VWs of each member at the
step, the step):

- at the first step of a generation (after a join, a leave, a failure or a
  driver's re-adoption: the survivors learn the newest positions of the
  groups a lost device read, or their last exchanged ones);
- at a step where some member reads a group it did not read at the step
  before (a rebalance moved a VW to another device): the new reader opens
  the group at its committed position, and reads nothing twice;
- every `every` steps, so that a failure makes a survivor read forward at
  most that many chunks of the groups the lost device read.
"""

from __future__ import annotations

from typing import Iterable, Optional, Sequence

from flexpar.core.stream_split import Position, StreamSplit

EXCHANGE_EVERY = 32  # steps between two exchanges where nothing moved (a failure re-reads at most that many)


def groups_by_member(split: StreamSplit, holdings: Sequence[Iterable[int]]) -> tuple:
    """The groups each member reads when member `i` runs the VWs `holdings[i]` (a listener none)."""
    return tuple(tuple(split.groups_of(held)) for held in holdings)


def exchange_due(previous: Optional[tuple], current: tuple, step: int, every: int = EXCHANGE_EVERY) -> bool:
    """Whether the members exchange positions before running `step`.

    previous: (generation, groups_by_member) of the step before in this
              process (None: none yet, or another generation since)
    current:  the same for `step`
    """
    if every < 1:
        raise ValueError(f"every={every} must be >= 1")
    if previous is None or previous[0] != current[0] or len(previous[1]) != len(current[1]):
        return True
    if any(not set(now) <= set(before) for before, now in zip(previous[1], current[1])):
        return True  # some member opens a group: it needs the group's committed position
    return step % every == 0


def newest(known: dict, positions: Iterable[Position], step: int) -> dict:
    """`known` (group -> Position) updated with `positions`, each group keeping its newest up to `step`.

    A position past `step` is not of this committed state and is left out;
    of two at the same step the one with the dataset's own state is kept
    (the same place; the state is cheaper to reach).
    """
    merged = dict(known)
    for position in positions:
        if position.step > step:
            continue
        held = merged.get(position.group)
        if (
            held is None
            or held.step > step
            or position.step > held.step
            or (position.step == held.step and held.source is None and position.source is not None)
        ):
            merged[position.group] = position
    return {group: where for group, where in merged.items() if where.step <= step}
