"""The boundary between two generations: form the new process group, bring every member level.

`Boundaries` carries it out for the worker: `Worker.run` calls `enter` for every generation that includes the
device (or lists it as departing): the members meet in the store, form the
generation's gloo/NCCL group (flexpar/comm/collectives.py `fresh_group`),
take stock of who holds the latest committed step, and level:

- unsharded (`_level`): the lowest-ranked member at the latest step sends
  the whole training state to the members behind it
  (flexpar/comm/state_transfer.py);
- sharded (`Job(shard_optimizer=True)`): the plan of
  flexpar/worker/shard_levelling.py moves chunks of optimizer state and
  parameter values (a join streams them where it can:
  flexpar/worker/shard_streaming.py); planned leavers (`record["departing"]`)
  take part in a hand-off group first, then leave, and the members form the
  training group.

Before the first step, the members that hold the untrained model also put a
digest of its trainable part in the stock (`_start_digest`); those whose
values differ from the source's (a model factory that is not deterministic)
receive the source's (`_align_start`), so every device starts from the same
values, and one warning names the difference.

Rank 0 then publishes the generation's event (with the bytes the boundary
sent and its stall). The generation's head is what the device would tell a
restarted driver (flexpar/worker/orphan.py).
"""

from __future__ import annotations

import time

import torch.distributed as dist

from flexpar.comm import state_transfer as training_state
from flexpar.comm.collectives import PeerFailure, collective, fresh_group
from flexpar.core import balance, batching, factory_checks
from flexpar.worker import checkpoints, join_way, stream_rules
from flexpar.worker.device_link import DriverLost
from flexpar.worker.shard_streaming import ShardStream


class Boundaries:
    """The boundaries between generations, carried out: `enter` makes a generation the device's `Membership`.

    It holds no state of its own: what a boundary changes is its owners'
    (the membership, the committed step, the records, the stream session,
    the shard holdings); it is handed the job's run settings with each
    boundary.
    """

    def __init__(self, link, training, owners, device, device_id: str, reaper, joins: tuple):
        self.link, self.reaper = link, reaper
        self.device, self.device_id = device, device_id
        self.model, self.optimizer, self.frozen, self.sync = (
            training.model,
            training.optimizer,
            training.frozen,
            training.sync,
        )
        self.membership, self.committed, self.records = owners.membership, owners.committed, owners.records
        self.faults, self.streams, self.state = owners.faults, owners.streams, owners.state
        self.exact_steps = owners.exact_steps  # Job(deterministic=True) only
        self.data_streams = owners.data_streams  # a streaming job's VW streams, else None
        self.by_cost = owners.cost_planner is not None
        # The joins carried out: unsharded, and (sharded jobs only) the levelling and the sharded stream.
        self.streamed_join, self.shard_levelling, self.shard_streaming = joins

    def enter(self, generation: int, record: dict, settings) -> None:
        """Form the generation's process group and bring every member to the same state.

        A sharded job's planned leavers (`record["departing"]`) first hand
        their state over: members and departing devices form a hand-off group
        for the levelling only, then the departing devices return (and exit)
        and the members form the training group.
        """
        self.link.check()
        members = tuple(record["members"])
        departing = tuple(record.get("departing", ())) if self.shard_levelling is not None else ()
        group = members + departing
        rank = group.index(self.device_id)
        self.faults.fire("formation", self.committed.step, self.membership.members)
        # Forming a gloo group waits for every member inside C++, where a member's
        # death is only seen at the timeout. Meet in the store first, where it is
        # seen at once (the coordinator's death notices), then form in milliseconds.
        problem = self.link.gather(generation, group)
        if problem:
            raise PeerFailure(problem)
        if record.get("restore"):  # a re-adopted job whose checkpoint is newer than any device
            if self.shard_levelling is not None:  # sharded: every member reads its own chunks
                if rank < len(members):
                    self.shard_levelling.resume(members, settings, record["restore"])
            elif rank == 0:
                self.state.restore(checkpoints.read_checkpoint(record["restore"], self.device))

        def peer_lost():
            return self.link.lost_among(generation, group)

        # A stream in flight breaks off here; the stock says whether it goes on (flexpar/worker/streaming.py).
        abandoned = self.streams.suspend()
        with fresh_group(
            self.reaper.retire(self.sync.release_works() + abandoned),
            settings.backend,
            dist.PrefixStore(f"gen/{generation}/{'handoff' if departing else 'pg'}", self.link.store),
            rank,
            len(group),
            settings.timeout_s,
        ):
            if not departing:
                self.link.send("formed", generation=generation)
            # Every wait of a boundary watches for a peer the coordinator reports dead (killed or hung).
            start = self._start_digest() if self.committed.step == 0 else 0.0
            held, report = self.streams.held_step(self.committed.step), self.streams.report(self.committed.step)
            stock = collective(
                lambda: training_state.take_stock(
                    held, self.committed.wall, rank, len(group), self.device, peer_lost, start, report
                )
            )
            self.streams.say("")
            self.streams.chose(None)
            # A stream broken off goes on, re-planned, or is dropped (flexpar/worker/streaming.py).
            streaming = self.streamed_join.goes_on(stock, generation, group, settings)
            if not streaming:
                self.abandon_stream()
            if self.shard_levelling is not None:  # joiners listen while their chunks stream where that applies
                sent = self.shard_streaming.level_join(stock, rank, group, len(members), record, peer_lost, settings)
            else:
                sent = 0.0 if streaming else self._level_members(stock, rank, generation, group, settings)
            if stock.differing:
                sent += self._align_start(stock, rank, group, peer_lost)
            boundary_bytes = int(sent)  # the state this boundary sent, all senders (the event's)
        if rank >= len(members):
            return  # departing: handed over
        if departing:  # the training group, without the departing devices
            problem = self.link.gather(generation, members, label="training")
            if problem:
                raise PeerFailure(problem)
            with fresh_group(
                self.reaper.retire([]),
                settings.backend,
                dist.PrefixStore(f"gen/{generation}/pg", self.link.store),
                rank,
                len(members),
                settings.timeout_s,
            ):
                self.link.send("formed", generation=generation)
        self.membership.enter(generation, members, rank)
        self.link.report_head = (generation, members)  # what it tells a restarted driver, should this one go
        self.committed.break_off()  # a step broken off before this boundary is redone from here
        self.sync.start_generation(len(members))
        moved = self._open_streams(generation, members, rank)  # inside the stall: a joiner's streams too
        if rank == 0:
            # The previous rank 0 (or driver) may have died with records unsent or unread, or this
            # device may have been brought level without committing the last ones: send again every
            # record the driver has not acknowledged, in order (it drops those it has: core.delivery).
            self._complete_last_digest()
            self.records.publish_all()
            stall = max(0.0, time.time() - stock.last_commit_wall)
            if self.streams.current is not None:  # the first streamed step is timed from before this stall
                self.streams.current.stall_s = stall
            choice = self.streams.choice
            join_fields = join_way.event_fields(choice)
            if choice is not None and choice.way == "blocking":  # what the join cost the members: its stall
                join_fields["lost_s"] = round(stall, 6)
            self.records.publish_generation_events(
                record,
                stall,
                boundary_bytes,
                self.streams.note,
                step=self.committed.step,
                generation=generation,
                members=members,
                stream_moves=moved,
                join_fields=join_fields,
            )

    def _open_streams(self, generation: int, members: tuple, rank: int) -> dict:
        """A streaming job: every member opens the stream groups of its VWs of the next step (the
        positions exchanged first), so what reaching them costs is paid in the boundary and named in
        its event; the step loop finds them open (flexpar/worker/data_streams.py)."""
        if self.data_streams is None:
            return {}
        contributors = self.streams.contributors(members)
        split = balance.next_assignment(self.committed.balance, contributors, self.data_streams.virtual_workers)
        assignment = self.streams.with_listeners(split, len(members))
        holdings = [batching.virtual_workers_of(assignment, member) for member in range(len(members))]
        return self.data_streams.open_at_boundary(self.committed.step, holdings, rank, generation)

    def abandon_stream(self) -> list:
        """Drop the stream in flight, if any (a lost driver, or a boundary where it cannot go on): a
        sharded stream's receivers first drop what they received (flexpar/worker/shard_streaming.py),
        then `StreamedJoin.abandon`. Returns the transfers in flight (their works keep the old group
        alive until it is retired)."""
        if isinstance(self.streams.current, ShardStream):
            self.shard_streaming.abandon()
        return self.streamed_join.abandon()

    def _complete_last_digest(self) -> None:
        """A new rank 0 (the last one died, maybe before its record of the last step left) puts the
        digest in its own record of that step: only rank 0 computes digests, and the state it holds
        now is that step's (flexpar/worker/determinism.py)."""
        last = self.records.last
        if (
            self.exact_steps is not None
            and last is not None
            and last.get("kind") == "step"
            and "digest" not in last
            and last.get("step") == self.committed.step - 1  # the state held is after that step
            and (self.shard_levelling is None or self.shard_levelling.shards.values_complete)
            and not self.streams.listening()
        ):
            self.exact_steps.record(last["step"])

    def _start_digest(self) -> float:
        """What this device reports of its untrained trainable part (flexpar/core/factory_checks.py),
        hashed on the device that holds it."""
        return factory_checks.start_digest(self.state.model_state())

    def _align_start(self, stock: training_state.Stock, rank: int, group: tuple, peer_lost) -> float:
        """Before the first step: the source's trainable values replace those that differ, as DDP's
        first broadcast does; the first differing device names the difference in one warning.

        Returns the bytes sent, all senders together.
        """
        sent, names = 0, []
        if rank == stock.source:
            state = {"model": self.state.model_state()}
            sent = collective(lambda: training_state.send_state(state, stock.differing, self.device))
        elif rank in stock.differing:
            received = collective(lambda: training_state.receive_state(stock.source, self.device))["model"]
            names = factory_checks.differing_names(self.state.model_state(), received)
            self.frozen.load(self.model, received)  # in place: the optimizer's (and shards') tensors stay
        total = collective(lambda: training_state.all_level(len(group), self.device, sent, peer_lost))
        if rank == stock.differing[0]:
            differing = [group[other] for other in stock.differing]
            try:
                self.link.send(
                    "start_values", message=factory_checks.start_values_warning(group[stock.source], differing, names)
                )
            except DriverLost:  # a warning is not worth a failure: a restarted driver re-adopts a level set
                pass
        return total

    def _level_members(self, stock: training_state.Stock, rank: int, generation: int, group: tuple, settings) -> float:
        """Bring the members level: joiners listen while the state streams where that applies, else
        the whole state is sent now (the join event says which, and why)."""
        if not stock.receivers:
            return 0.0
        refusal = stream_rules.refusal(stock, settings, self.by_cost, self.model, self.optimizer)
        if refusal is None:
            sizes = lambda: join_way.state_bytes(self.model, self.optimizer)  # noqa: E731
            peer_lost = lambda: self.link.lost_among(generation, group)  # noqa: E731
            owners = (self.committed, self.records, self.streams)
            choice = join_way.choose_at_boundary(
                stock, rank, group, settings, owners, sizes, self.device, peer_lost, tuple(stock.receivers)
            )
            if choice.way == "stream":
                return self.streamed_join.level(stock, rank, generation, group, settings)
        elif refusal != "not a join":
            self.streams.say(f"blocking transfer: {refusal}")
        return self._level(stock, rank, len(group))

    def _level(self, stock: training_state.Stock, rank: int, world_size: int) -> float:
        """Send the latest state from the source to the members behind it; returns the bytes sent."""
        sent = 0
        if rank == stock.source:
            began = time.perf_counter()
            state = self.state.capture()
            sent = collective(
                lambda: training_state.send_state(
                    state,
                    stock.receivers,
                    self.device,
                    after_size=lambda: self.faults.fire("transfer", self.committed.step, self.membership.members),
                )
            )
            seconds = time.perf_counter() - began
            if sent >= join_way.MIN_MEASURED_BYTES and seconds > 0:  # the link, as the next join predicts it
                self.streams.link_bytes_per_s = sent / len(stock.receivers) / seconds
        elif rank in stock.receivers:
            # A joiner holds nothing committed: it receives the model in place. A member
            # that is only behind keeps its own state intact until the new one is whole.
            own = self.model.state_dict() if self.committed.step < 0 else None
            self.state.restore(collective(lambda: training_state.receive_state(stock.source, self.device, own)))
        # The stall ends when the slowest receiver has restored; the sum says what the boundary sent.
        return collective(lambda: training_state.all_level(world_size, self.device, sent))
