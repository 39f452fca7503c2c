"""Streamed joins of a sharded job (Job(shard_optimizer=...)): the joiner listens while its chunks stream.

`ShardStreaming` carries it out for the worker, beside
flexpar/worker/streaming.py (the unsharded stream, whose step-loop parts it
shares: listeners, records, the stream event) and
flexpar/worker/shard_levelling.py (the blocking levelling it replaces at a
join). At a join boundary where it applies (`ShardStreaming._refusal`, then
what the members report):

- the members keep the partition they had (`ShardStream.old`: the old
  members keep their ranks, the joiners come last, hold nothing and are
  primary of nothing); every member computes the new partition (with the
  joiners) and the levelling plan from what each member reports, the same
  everywhere, and its rounds (flexpar/core/shard_stream_plan.py);
- the joiners receive the replicated state (scheduler, loss scale, buffers,
  unsharded parameters, ...) and, from each source, the layout of the
  optimizer-state pieces it will send;
- every step while the stream runs, every chunk's primary broadcasts its
  updated parameter values to every member (also where every old member
  holds everything), so a listener holds every parameter value after its
  first step without any of them streaming;
- after each update the sources post the round's pieces (optimizer state of
  parameter ranges, from the state's own memory where a piece lies in one
  held slice); a receiver waits for them before its next update, then holds
  and steps them (`ShardedOptimizer.add`) with every later summed gradient
  while their old holders step them too;
- after the last round, a checksum all-reduce compares every received piece
  with its source's (a mismatch stops the job naming the parameter), and
  every member installs the new partition at once: the next step runs with
  it, and the joiners take VWs.

A new generation while the stream runs (a failure, a leave, a join, a driver
loss) abandons it: every old member drops what it received (it holds exactly
its old chunks again, at its committed step), a listener holds nothing and
is a joiner again (committed = -1), and that boundary levels as usual.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Optional

import torch
import torch.distributed as dist

from flexpar.comm import state_transfer as training_state
from flexpar.comm.collectives import collective
from flexpar.comm.exact_sync import parameter_checksums
from flexpar.comm.shard_transfer import exchange, gather_reports
from flexpar.core import shard_stream_plan, stream_plan
from flexpar.core.shard_partition import Partition
from flexpar.core.shard_plan import Report, plan_levelling
from flexpar.errors import TrainingError
from flexpar.worker import join_way, stream_rules
from flexpar.worker.stream_session import Stream, StreamMismatch


@dataclasses.dataclass
class ShardStream(Stream):
    """A sharded stream in flight: `plan` is a flexpar/core/shard_stream_plan.py `Plan`."""

    old: Optional[Partition] = None  # the partition every member keeps working with until the end
    new: Optional[Partition] = None  # the partition installed after the last round
    layouts: dict = dataclasses.field(default_factory=dict)  # parameter -> [(key, dtype, per element)] received
    announced: dict = dataclasses.field(default_factory=dict)  # parameter -> the layout this source announced
    arriving: list = dataclasses.field(default_factory=list)  # [(segment, state)] posted, not yet held
    sending: list = dataclasses.field(default_factory=list)  # tensors posted to send, kept until waited for
    abandoned: bool = False

    @property
    def bytes_sent(self) -> int:
        """Each move goes to one receiver."""
        return self.plan.size


class ShardStreaming:
    """A sharded job's streamed join, carried out (see the module docstring).

    It holds no state of its own: the stream in flight (a `ShardStream`) is
    the device's `StreamSession`, the shard holdings the `ShardedOptimizer`'s,
    the pending step `ShardLevelling`'s, whose blocking levelling it falls
    back to where the join does not stream.
    """

    def __init__(self, training, owners, device, levelling, streamed_join):
        self.optimizer, self.shards, self.device = training.optimizer, training.shards, device
        self.membership, self.committed, self.faults = owners.membership, owners.committed, owners.faults
        self.streams, self.records = owners.streams, owners.records
        self.levelling = levelling
        self.streamed_join = streamed_join  # its `stream` event and its drop are the unsharded stream's
        self.by_cost = owners.cost_planner is not None

    # ------------------------------------------------------------ the boundary

    def level_join(self, stock, rank: int, group: tuple, training: int, record: dict, peer_lost, settings) -> float:
        """A sharded boundary: joiners listen while their chunks stream where that applies, else the
        blocking levelling (the join event says which, and why). Returns the bytes the group sent."""
        self.streams.say("")
        if not stock.joiners:
            return self.levelling.level(stock, rank, group, training, record, peer_lost, settings)
        refusal = "a planned leave hands its state over at this boundary" if len(group) > training else None
        refusal = refusal or self._refusal(stock, settings)
        if refusal is None and self._choose_way(stock, rank, group, training, settings, peer_lost) == "blocking":
            return self.levelling.level(stock, rank, group, training, record, peer_lost, settings)  # the choice says it
        if refusal is None:
            self.levelling.finish_pending(stock)
            reports = self._stream_reports(group, peer_lost, settings)
            refusal = shard_stream_plan.refusal(reports, self._old_partition(reports))
            if refusal is None:
                return self._level_shard_streamed(reports, rank, group, training, peer_lost)
        self.streams.say(f"blocking transfer: {refusal}")
        return self.levelling.level(stock, rank, group, training, record, peer_lost, settings)

    def _choose_way(self, stock, rank: int, group: tuple, training: int, settings, peer_lost) -> str:
        """The way this join takes (flexpar/worker/join_way.py), the same on every member."""
        sizes = lambda: join_way.sharded_state_bytes(self.shards.model, training)  # noqa: E731
        owners = (self.committed, self.records, self.streams)
        choice = join_way.choose_at_boundary(
            stock, rank, group, settings, owners, sizes, self.device, peer_lost, tuple(stock.joiners)
        )
        return choice.way

    def _refusal(self, stock, settings) -> Optional[str]:
        """None if the job's kind lets this join stream; else why not (the same on every member)."""
        common = stream_rules.common_refusal(settings, self.by_cost, stock.joiners, stock.latest_step)
        if common:
            return common
        shards = self.shards
        if not shards.sharded:
            return "no parameter is sharded"
        if any(shards.parameters[index].requires_grad for index in shards.replicated):
            return "sparse-gradient parameters are replicated, not sharded, in a sharded job"
        return stream_plan.refusal([type(self.optimizer).__name__])

    def _stream_reports(self, group: tuple, peer_lost, settings) -> list:
        """Every member's report, with whether its optimizer state may stream and its bytes per element."""
        shards = self.shards
        holdings = () if self.committed.step < 0 else (shards.everything() if shards.pristine else shards.holdings())
        streamable, per_element = 1, 1
        for piece in shards.slices.values():
            state = shards.optimizer.state.get(piece, {})
            values = list(state.values())
            if not values or not all(value is None or _contiguous(value) for value in values):
                streamable = 0
            size = sum(value.element_size() for value in values if torch.is_tensor(value) and value.dim() > 0)
            per_element = max(per_element, size)
        # The bytes per sender and step: rank 0's (a member: a joiner has no step times of its own yet).
        sender_bytes = stream_rules.sender_bytes(settings, self.committed.balance)
        numbers = [self.committed.step, int(shards.values_complete), 1, int(shards.pristine), streamable, per_element]
        numbers.append(sender_bytes)
        rows = gather_reports(numbers, holdings, len(group), self.device, peer_lost)
        return [
            shard_stream_plan.MemberReport(row[0], bool(row[1]), tuple(intervals), bool(row[3]), bool(row[4]), *row[5:])
            for row, intervals in rows
        ]

    def _old_partition(self, reports: list) -> Optional[Partition]:
        members = sum(1 for report in reports if report.committed >= 0)
        return self.levelling.target_partition(members) if members else None

    def _level_shard_streamed(self, reports: list, rank: int, group: tuple, training: int, peer_lost) -> float:
        """The replicated state to the joiners, the pieces' layouts to their receivers, and the plan."""
        shards = self.shards
        old = self._old_partition(reports)
        new = self.levelling.target_partition(training)
        levelling = plan_levelling(
            [Report(report.committed, report.complete, report.holdings, True) for report in reports],
            new,
            [space.element_bytes for space in shards.spaces],
        )
        transfers = [transfer for transfer in levelling.transfers if transfer.state]
        state_bytes = [max(report.state_bytes for report in reports)] * len(shards.spaces)
        holdings = {member: report.holdings for member, report in enumerate(reports) if report.committed >= 0}
        cuttable = shards.by != "parameters"
        plan = shard_stream_plan.plan(
            transfers, shards.spaces, state_bytes, reports[0].sender_bytes, cuttable, holdings
        )
        joiners = levelling.state_receivers
        messages, sent, announced = self._send_layouts(plan, rank, joiners, levelling.state_source, peer_lost)
        if rank in joiners:
            shards.drop()
            self.levelling.restore_replicated(messages[levelling.state_source]["replicated"])
            shards.values_outdated()  # every value arrives with the first step's broadcast
        shards.work_with(old)
        total = collective(lambda: training_state.all_level(len(group), self.device, sent, peer_lost))
        stream = ShardStream(
            plan,
            tuple(joiners),
            {},
            time.time(),
            self.records.median_step_time(),
            old=old,
            new=new,
            layouts={k: v for message in messages.values() for k, v in message.get("layouts", {}).items()},
            announced=announced,
            rank=rank,
        )
        senders = len({move.source for move in plan.moves})
        members = len({move.destination for move in plan.moves} - set(joiners))
        also = f"; new chunks of {members} member{'s' if members != 1 else ''} too" if members else ""
        self.streams.begin(
            stream,
            stream_rules.planned_note(
                len(joiners),
                plan.size,
                plan.rounds,
                senders,
                " of optimizer state",
                f" (sharded{also}; parameter values from every step's broadcast)",
            ),
        )
        return total

    def _send_layouts(self, plan, rank: int, joiners: tuple, state_source: int, peer_lost) -> tuple:
        """One exchange: the replicated state from `state_source` to the joiners, and from each source to
        each of its receivers the layout of the pieces it will send (keys, dtypes, per element or not).

        Returns (the messages received by source, the bytes this member sent, the layouts it announced).
        """
        outgoing: dict = {}
        if rank == state_source:
            replicated = self.levelling.capture_replicated()
            for joiner in joiners:
                outgoing[joiner] = {"replicated": replicated}
        announced: dict = {}
        for move in plan.moves:
            if move.source == rank:
                state = self.shards.piece(*move.segment, copy=False)
                layout = announced.setdefault(move.parameter, _layout(state, self.shards.by == "parameters"))
                outgoing.setdefault(move.destination, {}).setdefault("layouts", {})[move.parameter] = layout
        incoming = {move.source for move in plan.moves if move.destination == rank}
        if rank in joiners:
            incoming.add(state_source)
        messages, sent = exchange(outgoing, sorted(incoming), self.device, peer_lost=peer_lost)
        return messages, sent, announced

    # ------------------------------------------------------------ the step loop

    def land_pieces(self) -> None:
        """Before a step's update: the pieces this device sent have left and those it receives have
        landed; it holds (and from now on steps) the latter. Called before the step's gradient is
        confirmed (`_confirm_gradient`): a peer lost in this wait fails the step before it is pending,
        never between a member's confirmation and its commit."""
        if not sharded_stream_running(self.streams):
            return
        stream = self.streams.current
        self.streams.wait(self.membership.peer_lost)
        stream.sending = []
        if stream.arriving:
            arriving, stream.arriving = stream.arriving, []
            self.shards.add(arriving)

    def round(self, step: int) -> None:
        """After step `step`'s update and broadcast: this round's pieces, from their sources to their receivers."""
        stream = self.streams.current
        number = stream.rounds_done
        moves = stream.plan.in_round(number)
        tamper = any(move.source == self.membership.rank for move in moves) and self.faults.take_tamper(step)
        operations = []
        for move in moves:
            if move.source == self.membership.rank:
                tensors = self._piece_to_send(move)
                if tamper and tensors:  # a test's STEP:DEVICE:stream:tamper: one value changed (the check must see it)
                    tensors[0] = tensors[0].clone()
                    tensors[0].view(-1)[0] += 1.0
                    tamper = False
                stream.sending += tensors
                operations += [dist.P2POp(dist.isend, tensor.view(-1), move.destination) for tensor in tensors]
            elif move.destination == self.membership.rank:
                state = self._allocated(move)
                stream.arriving.append((move.segment, state))
                received = [state[key] for key in sorted(state) if state[key] is not None]
                operations += [dist.P2POp(dist.irecv, tensor.view(-1), move.source) for tensor in received]
        self.faults.fire("stream", step, self.membership.members)
        works = collective(lambda: dist.batch_isend_irecv(operations)) if operations else []
        self.streams.post(works)  # waited for before the next update (`_land_streamed_pieces`)
        if self.records.last is not None:  # the first step after the boundary is timed from the commit before its stall
            stall = stream.stall_s if stream.rounds_done == 0 else 0.0
            stream.step_times.append(self.records.last_step_time() - stall)
        stream.rounds_done += 1
        if stream.rounds_done == stream.plan.rounds:
            self._finish(step)

    def _piece_to_send(self, move) -> list:
        """The state tensors of a move, in key order: views of the held state where one slice holds it."""
        state = self.shards.piece(*move.segment, copy=False)
        if _layout(state, self.shards.by == "parameters") != self.streams.current.announced[move.parameter]:
            raise TrainingError(
                f"streamed join: the optimizer state of {self.shards.names[move.parameter]!r} changed its layout "
                f"during the stream ({sorted(state)}); the join cannot complete"
            )
        return [state[key].contiguous() for key in sorted(state) if state[key] is not None]

    def _allocated(self, move) -> dict:
        """Memory for a received move's state, as the source announced it (not touched until it lands)."""
        length = move.stop - move.start
        return {
            key: None
            if dtype is None  # a value that is None on the source
            else torch.empty(
                (length,) if shape == "element" else shape, dtype=getattr(torch, dtype), device=self.device
            )
            for key, dtype, shape in self.streams.current.layouts[move.parameter]
        }

    def _finish(self, step: int) -> None:
        """Every member: each received piece against its source's (one all-reduce), then the new partition."""
        stream, shards = self.streams.current, self.shards
        self.land_pieces()
        moves = stream.plan.moves
        rows = torch.zeros(len(self.membership.members), len(moves), dtype=torch.float64)
        for index, move in enumerate(moves):
            if self.membership.rank in (move.source, move.destination):
                state = shards.piece(*move.segment, copy=False)
                tensors = [state[key] for key in sorted(state) if state[key] is not None]
                rows[self.membership.rank, index] = float(sum(parameter_checksums(tensors)) % (1 << 52))
        if len(self.membership.members) > 1:
            collective(lambda: dist.all_reduce(rows))
        for index, move in enumerate(moves):
            if rows[move.destination, index] != rows[move.source, index]:
                raise StreamMismatch(
                    f"streamed join after step {step}: {self.membership.members[move.destination]}'s copy of "
                    f"{shards.names[move.parameter]!r} (elements {move.start}-{move.stop - 1}, its optimizer "
                    f"state) differs from {self.membership.members[move.source]}'s; the join is not trusted, "
                    "so the job stops"
                )
        shards.install(stream.new, self.membership.rank)  # the same step on every member: the next one runs with it
        shards.values_received()  # this step's broadcast brought every value
        if self.membership.rank == 0:
            self.streamed_join.publish_event(step)
        self.streams.end()

    def abandon(self) -> None:
        """A new generation or a lost driver drops the sharded stream in flight: hold exactly the old
        partition's chunks again (a listener: nothing). `StreamedJoin.abandon` then drops the stream."""
        stream = self.streams.current
        stream.abandoned = True
        stream.arriving, stream.sending = [], []
        if stream.rank in stream.listeners:
            self.shards.drop()
            self.shards.values_outdated()
            self.streams.keep_for_pending(None)
        else:
            self.shards.install(stream.old, stream.rank)
            self.streams.keep_for_pending(stream if self.levelling.pending_commit is not None else None)


def _layout(state: dict, whole: bool) -> list:
    """[key, dtype name or None, shape] of a piece's state, in key order: the shape is "element" for a
    tensor of one value per element of a range (cut anywhere), the exact shape for a scalar or a
    whole parameter's tensors (Adafactor's row and column factors included)."""
    return [
        [key, None, []]
        if value is None
        else [key, str(value.dtype).replace("torch.", ""), list(value.shape) if whole or not value.dim() else "element"]
        for key, value in sorted(state.items())
    ]


def _contiguous(value) -> bool:
    return torch.is_tensor(value) and value.is_contiguous()


def sharded_stream_running(streams) -> bool:
    """A sharded stream runs: every primary broadcasts its chunks after every step."""
    return isinstance(streams.current, ShardStream) and not streams.current.abandoned
