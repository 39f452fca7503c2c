"""Which generation this device trains in: its number, its members, this device's rank."""

from __future__ import annotations

from typing import Optional


class Membership:
    """The generation this device trains in.

    Invariant: `generation` (its number), `members` (its device ids in rank
    order) and `rank` (this device's place among them) are set together,
    only by `enter`, at a boundary whose group formed and whose members are
    level (flexpar/worker/boundaries.py); (0, (), 0) before the first. Every
    part of the worker reads them here.
    """

    def __init__(self, link):
        self.link = link
        self.generation = 0
        self.members: tuple = ()
        self.rank = 0

    def enter(self, generation: int, members: tuple, rank: int) -> None:
        self.generation, self.members, self.rank = generation, members, rank

    def peer_lost(self) -> Optional[str]:
        """A member of this generation that the coordinator knows is dead, if any."""
        return self.link.lost_among(self.generation, self.members)
