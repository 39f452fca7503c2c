"""A streaming job's data on one device: the stream groups of the VWs it runs, and every group's position.

Where a map-style job's device owns a `VirtualWorkerLoader` (loader.py), a job
whose `dataset=` is an iterable one owns a `DataStreams`: before each step
`StepLoop.train` tells it every member's VWs (`prepare`), the step's VWs read
their batches from it (`batch`), its positions commit with the step
(`commit`), and they are training state (`capture`/`restore`, through
`TrainingState`: a joiner receives them with the state, blocking or
streamed, and checkpoints hold them, so `--resume` on another device count
continues at the next item).

The reading is flexpar/data/streams.py's `VirtualWorkerStreams`, the split
flexpar/core/stream_split.py's, who reads what and when positions are
exchanged flexpar/core/stream_holding.py's.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch.distributed as dist

from flexpar.comm.collectives import collective
from flexpar.core import stream_holding
from flexpar.core.stream_split import Position, start
from flexpar.data import VirtualWorkerStreams, describe


class DataStreams:
    """The VW streams of an iterable dataset as this device reads them, and every group's position.

    Invariants:
    - this device reads only the stream groups of the VWs it runs at the step
      in hand (a sharded dataset with one VW per group is read once in the
      whole job: read amplification 1.0); the round-robin split's one group
      is read by every device that runs a VW;
    - `known` holds, for every group, a position at a committed boundary up
      to the committed step (the newest this device heard of: its own for the
      groups it reads, else the last exchange's or the restored state's). A
      reader opened at an older boundary reads forward to the committed one,
      which is exact, so an older position costs reading, never items;
    - the members exchange positions (`stream_holding.exchange_due`: at the
      first step of a generation, where a member opens a group, and every
      `EXCHANGE_EVERY` steps), so a VW moved by a rebalance, a join or a leave
      opens at its committed position, and a kill -9 makes a survivor read
      forward at most `EXCHANGE_EVERY` chunks of the lost device's groups.

    The chunks read since the committed boundary stay in memory
    (`VirtualWorkerStreams`), so a step redone after a failure reads the same
    items without reading the stream again on a device that read them.
    """

    def __init__(self, job, say: Callable[[str], None] = lambda line: None, source=None, every: Optional[int] = None):
        self.job = job
        self.say = say  # a line on the device's stderr: what reaching restored positions cost
        self.source = source if source is not None else describe(job.dataset)
        self.virtual_workers = job.virtual_workers
        self.every = every or stream_holding.EXCHANGE_EVERY
        self.reader = self._new_reader()
        self.split = self.reader.split
        self.known: dict = {group: start(group) for group in range(self.split.groups)}
        self.layout: Optional[tuple] = None  # (generation, groups by member) of the last step prepared
        self.prepared: Optional[int] = None  # the step whose VWs the reader holds
        self.read_at_commit = 0  # the reader's items_read at the last commit
        self.ahead: list = []  # positions past the committed boundary heard before a generation change
        self.restore_costs: list = []  # Restore records of positions reached since the caller last took them

    def _new_reader(self) -> VirtualWorkerStreams:
        job = self.job
        return VirtualWorkerStreams(
            job.dataset,
            job.virtual_workers,
            job.micro_batch_size,
            seed=job.seed,
            collate_fn=job.collate_fn,
            num_workers=job.num_workers,
            pass_end=job.pass_end,
            source=self.source,
        )

    # -- the step --------------------------------------------------------------------------------

    def prepare(self, step: int, holdings: Sequence[Sequence[int]], rank: int, generation: int) -> None:
        """Before running `step`: member `i` runs the VWs `holdings[i]`; this device is member `rank`.

        Every member calls it for every step, alike (the exchange is a collective)."""
        layout = (generation, stream_holding.groups_by_member(self.split, holdings))
        self.ahead = []  # a step broken off before its commit: what was heard of its end is not committed
        if stream_holding.exchange_due(self.layout, layout, step, self.every) and len(holdings) > 1:
            self._exchange(step, len(holdings))
        self.layout = layout
        self._hold(holdings[rank], step)

    def open_at_boundary(self, step: int, holdings: Sequence[Sequence[int]], rank: int, generation: int) -> dict:
        """`prepare` at a generation's boundary, and what reaching the positions cost on all members
        together ({} if nothing was skipped or read forward): the event's `stream_skipped_items` and
        `stream_skip_s` (the slowest member's seconds)."""
        self.prepare(step, holdings, rank, generation)
        mine = self.take_restore_costs()
        parts = [mine]
        if len(holdings) > 1:
            parts = [None] * len(holdings)
            collective(lambda: dist.all_gather_object(parts, mine))
        parts = [part for part in parts if part]
        if not parts:
            return {}
        return {
            "stream_skipped_items": sum(part["stream_skipped_items"] for part in parts),
            "stream_skip_s": max(part["stream_skip_s"] for part in parts),
        }

    def _exchange(self, step: int, world: int) -> None:
        """Every member's positions at the committed boundary `step`; each keeps the newest per group."""
        mine = [position.to_dict() for position in self._positions(step)]
        gathered: list = [None] * world
        collective(lambda: dist.all_gather_object(gathered, mine))
        heard = [Position.from_dict(data) for part in gathered for data in part]
        self.known = stream_holding.newest(self.known, heard, step)

    def exchange_ahead(self, step: int, world: int) -> None:
        """Step `step - 1` is about to commit and the members then move to another generation (a leave,
        a join): every member's positions at the boundary `step`, kept until that step commits, so the
        groups a planned leaver read open at their committed position."""
        if world < 2:
            return
        mine = [own.to_dict() for g in self.reader.reading() if (own := self.reader.newest_position(g, step))]
        gathered: list = [None] * world
        collective(lambda: dist.all_gather_object(gathered, mine))
        self.ahead = [Position.from_dict(data) for part in gathered for data in part]

    def _positions(self, step: int) -> list:
        """Every group's newest position known here, up to `step` (the groups read here: their own)."""
        for group in self.reader.reading():
            own = self.reader.newest_position(group, step)
            if own is not None:
                self.known = stream_holding.newest(self.known, [own], step)
        return [self.known[group] for group in sorted(self.known)]

    def _hold(self, virtual_workers: Sequence[int], step: int) -> None:
        if self.prepared == step and tuple(sorted(virtual_workers)) == self.reader.held:
            return
        self._positions(step)  # the groups closed now keep their newest position in `known`
        needed = set(self.split.groups_of(virtual_workers))
        for group in self.reader.reading():
            own = self.reader.newest_position(group, step)
            if group in needed and (own is None or own.step != step):
                self.reader.drop_group(group)  # behind: reopened from its newest position below
        opening = sorted(needed - set(self.reader.reading()))
        if opening:
            positions = [self.known[group].to_dict() for group in opening]
            self.reader.load({**self.reader.header(), "step": step, "groups": positions})
        self.reader.restores.clear()
        self.reader.hold(virtual_workers, step)
        self.restore_costs.extend(r for r in self.reader.restores if r.how == "skip" or r.replayed)
        self.prepared = step

    @property
    def reading(self) -> list:
        return self.reader.reading()

    def batch(self, step: int, virtual_worker: int):
        """The batch of `virtual_worker` at `step` (the loader's interface: StepRun reads it so)."""
        return self.reader.batch(step, virtual_worker)

    def item_ids(self, step: int, virtual_workers: Sequence[int]) -> list:
        """The `[group, pass, index]` of every item this device's `virtual_workers` trained at `step`."""
        return [list(item) for v in virtual_workers for item in self.reader.item_ids(step, v)]

    def pass_ends_at(self, step: int) -> list:
        """The pass ends met while this device read the chunks of `step` (as dicts)."""
        return [ended.to_dict() for ended in self.reader.pass_ends() if ended.step == step]

    def read_since(self, step: int) -> tuple:
        """(items this device took from its streams since the last commit, pass ends it met at `step`):
        the same again for a step run again (exact sums' redo); a step broken off adds its reads to
        the one redone, and a boundary's skips to the step after it."""
        return self.reader.items_read - self.read_at_commit, len(self.pass_ends_at(step))

    def trained_items(self, step: int, virtual_workers: Sequence[int], world: int) -> list:
        """The sample ledger's entry of `step`: every member's items, sorted (a gather; tests and the soak)."""
        mine = self.item_ids(step, virtual_workers)
        if world == 1:
            return sorted(mine)
        gathered: list = [None] * world
        collective(lambda: dist.all_gather_object(gathered, mine))
        return sorted(item for part in gathered for item in part)

    def pass_ends_of(self, step: int, world: int) -> list:
        """Every pass end met in the chunks of `step`, one per (group, pass) (a gather where any was met)."""
        mine = self.pass_ends_at(step)
        if world > 1:
            gathered: list = [None] * world
            collective(lambda: dist.all_gather_object(gathered, mine))
            mine = [ended for part in gathered for ended in part]
        unique = {(ended["group"], ended["pass"]): ended for ended in mine}
        return [unique[key] for key in sorted(unique)]

    def commit(self, step: int) -> None:
        """Step `step - 1` committed: what came before the boundary `step` is forgotten."""
        self.known = stream_holding.newest(self.known, self.ahead, step)
        self.ahead = []
        self._positions(step)
        self.reader.commit(step)
        self.read_at_commit = self.reader.items_read

    # -- the training state ------------------------------------------------------------------------

    def capture(self, step: int) -> dict:
        """Every group's newest position up to the committed step `step` (those read elsewhere may be older)."""
        return {**self.reader.header(), "step": step, "groups": [p.to_dict() for p in self._positions(step)]}

    def restore(self, state: dict) -> None:
        """A peer's or a checkpoint's positions (their step is the committed step restored with them)."""
        step = int(state["step"])
        if step < self.reader.committed:  # an older state than this reader's: read it anew
            self.reader.close()
            self.reader = self._new_reader()
            self.known, self.read_at_commit = {}, 0
        else:
            self._positions(step)  # this device's own, where newer than the state's
        self.known = stream_holding.newest(self.known, [Position.from_dict(d) for d in state["groups"]], step)
        missing = [group for group in range(self.split.groups) if group not in self.known]
        if missing:
            raise ValueError(f"the stream state of step {step} has no position of stream groups {missing}")
        for group in self.reader.reading():
            own = self.reader.newest_position(group, step)
            if own is None or own.step != step:
                self.reader.drop_group(group)
        self.reader.commit(step)
        self.layout = None  # the next step exchanges
        self.prepared = None
        self.ahead = []

    def take_restore_costs(self) -> dict:
        """What reaching positions cost since the last call: items skipped or read forward, and seconds."""
        costs, self.restore_costs = self.restore_costs, []
        if not costs:
            return {}
        items = sum(r.skipped + r.replayed for r in costs)
        seconds = sum(r.seconds for r in costs)
        self.say(
            f"stream positions: {len(costs)} stream groups reached by reading {items} items ({seconds:.2f} s; "
            "a dataset with a complete state_dict() loads its position instead of skipping)"
        )
        return {"stream_skipped_items": items, "stream_skip_s": round(seconds, 4)}

    def close(self) -> None:
        """Close every stream read here (and its DataLoader processes)."""
        self.reader.close()
