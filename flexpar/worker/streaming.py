"""Streamed joins: a joiner listens to the members' steps while the training state streams to it.

Part of `flexpar.worker.lifecycle.Worker` (its attributes are the worker's
own). At a join boundary where streaming applies (`_stream_refusal` says
when it does not), the source sends the joiners only the small state (the
scheduler, step counters, loss scale, balancer, records, buffers, the
optimizer's per-parameter scalars, and the shapes of what streams), and every
member computes the same plan (flexpar/core/stream_plan.py): whole trainable
parameters with their optimizer state, or element ranges of them for
element-wise optimizers, a slice per sender per step. Then, step by step:

- the joiner *listens*: it has no VWs (the balancer splits the batch among the
  others; its gradient buckets are zeros) and applies each step's summed
  gradient with the same optimizer, scheduler, clipping and loss scale as the
  members, to the state it holds;
- after each update the senders post their slice of the state as it is at
  that moment (`dist.batch_isend_irecv`, the parameters' own memory: no
  copy) and go on with the next step; they wait for those sends only before
  their next optimizer update, which is the next change of those values. The
  joiner posts its receives into its own tensors and waits for them before
  its next update too (the first read of them), so a round overlaps the next
  step's forward, backward and all-reduce; its own updates keep every
  received value current: no gradient history, no replay.
- after the last slice every device checks the joiner's copy of each tensor
  against its sender's (`_check_stream`: a mismatch stops the job naming the
  tensor), rank 0 publishes a `stream` event, and from the next step on the
  joiner takes VWs like any member.

A new generation while a stream runs (a failure, a leave, another join)
drops it: the joiner holds no committed state of its own (`committed = -1`
at the next boundary), so that boundary brings it level as any joiner.
"""

from __future__ import annotations

import dataclasses
import datetime
import time
from typing import Optional

import torch
import torch.distributed as dist

from flexpar.comm import state_transfer as training_state
from flexpar.comm.collectives import collective, wait_for_transfers
from flexpar.comm.exact_sync import parameter_checksums
from flexpar.core import balance, stream_plan
from flexpar.errors import TrainingError

STREAM_SHARE = 0.1
"""A sender's step may take about this share of a step longer while it streams."""

LINK_BYTES_PER_S = {"gloo": 1.0e9, "nccl": 1.0e10}
"""What a sender's link is taken to carry (bytes/s): gloo over TCP, NCCL within a node."""

MASK_BITS = 52
"""Senders a listener can name in its landed mask (a float64 slot of the stock holds 52 bits exactly)."""

LANDED_WAIT_S = 0.05
"""How long a listener waits, at a failure, for each receive of the round in flight before it counts as lost."""

DEFAULT_SENDER_BYTES = 64 << 20
"""A sender's bytes per step while no step time is measured yet."""

MIN_SENDER_BYTES = 1 << 20
"""The smallest slice a sender's round shrinks to without `join_stream_mb` (a stream must end)."""


class StreamMismatch(TrainingError):
    """After a streamed join, the joiner's copy of a tensor differs from its sender's."""


@dataclasses.dataclass
class Stream:
    """A stream in flight in this generation (the same on every member but `works`)."""

    plan: stream_plan.Plan
    listeners: tuple  # ranks
    tensors: dict  # the plan's tensor name -> the parameter
    started_wall: float
    step_before_s: float  # the members' median step time before the join
    rounds_done: int = 0
    step_times: list = dataclasses.field(default_factory=list)
    skippable: bool = True  # every per-parameter state value is a tensor: a listener may skip updates
    stall_s: float = 0.0  # the join boundary's stall (rank 0, which publishes the events)
    plan_generation: int = 0  # the generation whose boundary made the plan (a re-plan makes it anew)
    senders: tuple = ()  # the plan's senders (device ids), in the plan's order
    # A listener's receives in flight, by sender: (sender, its works), waited for before the next update.
    receipts: tuple = ()
    broken_off: bool = False  # a failure or a new generation interrupted it (`_suspend_stream`)
    sizing: Optional[stream_plan.Sizing] = None  # the slices follow the members' step times (no join_stream_mb)
    member_step_s: tuple = ()  # every member's previous step time, from the last step's statistics
    rank: int = -1  # this device's rank in the stream's generation (`self.rank` only once its boundary ends)
    before_s: float = 0.0  # the members' median step time before the join, from those statistics
    landed_mask: int = 0  # a listener, broken off: the senders (bits by place) whose last slices landed

    def identity(self) -> float:
        """The same on every member holding this stream in this state (0 is no stream): its plan's
        generation and the rounds posted."""
        return float(self.plan_generation * (1 << 20) + self.rounds_done + 1)

    @property
    def bytes_sent(self) -> int:
        """Every slice goes to every listener."""
        return self.plan.size * len(self.listeners)


class Streaming:
    """The streamed join's part of the worker (see the module docstring)."""

    stream: Optional[Stream] = None
    # This device's sends (a sender) or receives (a listener) in flight, waited for before its next optimizer
    # update. A tuple: each worker replaces it, never shares it through the class.
    stream_transfers: tuple = ()
    stream_note: str = ""  # what the join event says of the stream (or why the join was blocking)

    # ------------------------------------------------------------ the boundary

    def _stream_refusal(self, stock) -> Optional[str]:
        """None if this boundary's receivers may listen while the state streams; else why not.

        A function of what every member holds alike (the stock, the job, the
        model), so every member decides the same.
        """
        if not stock.receivers or set(stock.receivers) != set(stock.joiners):
            return "not a join"
        common = self._common_stream_refusal(stock.receivers, stock.latest_step)
        if common:
            return common
        refusal = stream_plan.refusal([type(self.optimizer).__name__])
        if refusal:
            return refusal
        for name, parameter in self._streamed_parameters().items():
            if not all(tensor.is_contiguous() for tensor in self._travelling(parameter)):
                return f"parameter {name!r} or its optimizer state is not contiguous in memory"
        return None

    def _common_stream_refusal(self, joiners, latest_step: int) -> Optional[str]:
        """Why no join of this job may stream at this boundary, sharded or not (None: it may)."""
        if self.settings.join_stream_mb == 0:
            return "join_stream_mb=0"
        if self.cost_planner is not None:
            return "sample_cost= plans every device's VWs ahead"
        if 0 in joiners:
            return "the joiner would be rank 0"
        if latest_step >= self.settings.total_steps:
            return "the job is at its last step"
        return None

    def _level_streamed(self, stock, rank: int, generation: int, group: tuple) -> float:
        """The small state from the source to the joiners, and the plan; returns the bytes sent."""
        sent = 0
        if rank == stock.source:
            small = self._small_state()
            sent = collective(
                lambda: training_state.send_state(
                    small,
                    stock.receivers,
                    self.device,
                    after_size=lambda: self.faults.fire("transfer", self.committed.step, self.members),
                )
            )
        elif rank in stock.receivers:
            self._restore_small(collective(lambda: training_state.receive_state(stock.source, self.device)))
        self._begin_stream(stock, generation, group)
        return collective(lambda: training_state.all_level(len(group), self.device, sent))

    def _small_state(self) -> dict:
        """The training state without what streams: trainable parameters and their optimizer tensors."""
        state = self._capture()
        streamed = set(self._streamed_parameters())
        state["model"] = {name: value for name, value in state["model"].items() if name not in streamed}
        optimizer = state["optimizer"]
        shapes, kept = {}, {}
        for index, entry in optimizer["state"].items():
            kept[index] = {}
            for key, value in entry.items():
                if torch.is_tensor(value) and value.dim() > 0:
                    shapes[f"{index}/{key}"] = list(value.shape)
                    value = torch.empty(0, dtype=value.dtype)  # streams; its shape and dtype travel
                kept[index][key] = value
        state["optimizer"] = {"state": kept, "param_groups": optimizer["param_groups"]}
        state["stream_shapes"] = shapes
        return state

    def _restore_small(self, state: dict) -> None:
        """A joiner takes the small state; what streams gets memory of its shape (filled by the stream)."""
        self.model.load_state_dict(state["model"], strict=False)  # buffers and untrained extras only
        shapes = state["stream_shapes"]
        for index, entry in state["optimizer"]["state"].items():
            for key, value in entry.items():
                shape = shapes.get(f"{index}/{key}")
                if shape is not None:  # not touched until its slice lands: no page is written twice
                    entry[key] = torch.empty(shape, dtype=value.dtype, device=self.device)
        self.optimizer.load_state_dict(state["optimizer"])
        if self.scheduler is not None and state["scheduler"] is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        self._restore_extra(state)

    def _begin_stream(self, stock, generation: int, group: tuple) -> None:
        """Every member: the plan of the stream (the same everywhere, from the same inputs)."""
        parameters = self._streamed_parameters()
        classes = [type(self.optimizer).__name__]
        cuttable = stream_plan.elementwise(classes) and all(
            all(tensor.numel() == parameter.numel() for tensor in self._travelling(parameter) if tensor.dim() > 0)
            for parameter in parameters.values()
        )
        tensors = [
            stream_plan.Tensor(
                name,
                parameter.numel(),
                -(-sum(t.numel() * t.element_size() for t in self._travelling(parameter)) // max(1, parameter.numel())),
            )
            for name, parameter in parameters.items()
        ]
        senders = tuple(device for other, device in enumerate(group) if other not in stock.receivers)
        plan = stream_plan.plan(tensors, senders, self._sender_bytes(), cuttable)
        skippable = all(
            torch.is_tensor(value)
            for parameter in parameters.values()
            for value in self.optimizer.state.get(parameter, {}).values()
        )
        self.stream = Stream(
            plan,
            tuple(stock.receivers),
            parameters,
            time.time(),
            self.records.median_step_time(),
            skippable=skippable,
            plan_generation=generation,
            senders=senders,
            rank=group.index(self.args.device_id),
            sizing=None if self.settings.join_stream_mb else stream_plan.Sizing(plan.sender_bytes, self._floor(plan)),
        )
        self.stream_note = (
            f"streamed to {len(stock.receivers)} listener{'s' if len(stock.receivers) > 1 else ''}: "
            f"{plan.size} bytes in {plan.rounds} step{'s' if plan.rounds != 1 else ''} from "
            f"{len(senders)} sender{'s' if len(senders) > 1 else ''}"
        )

    def _abandon_stream(self) -> list:
        """Drop the stream (a lost driver, or a boundary where it cannot go on): a listener holds no
        committed state.

        Returns the transfers in flight (their works keep the old group alive until it is retired).
        """
        works = self._suspend_stream()
        if self._listening():
            self.committed.forget()
        self.stream = None
        return works

    def _suspend_stream(self) -> list:
        """A failure or a new generation breaks the stream off; the next boundary decides whether it
        goes on (`_settle_stream`). A listener notes which senders' slices of the last round landed:
        it waits for them only briefly (a sender that died sends nothing more).

        Returns the transfers in flight, to retire with the old group.
        """
        works, self.stream_transfers = list(self.stream_transfers), ()
        stream = self.stream
        if stream is None or stream.broken_off:
            return works
        mask = 0
        known = all(device is not None for device, _ in stream.receipts) and len(stream.senders) <= MASK_BITS
        if self._listening() and known:
            for place, sender in enumerate(stream.senders):
                received = [work for device, work in stream.receipts if device == sender]
                if all(_landed(work) for work in received):
                    mask |= 1 << place
        self.stream = dataclasses.replace(stream, broken_off=True, landed_mask=mask, receipts=())
        return works

    def _stream_report(self) -> tuple:
        """What this device puts in the boundary's stock of a stream in flight (Stock's stream fields)."""
        stream = self.stream
        if stream is None:
            return (0.0, -1, 0)
        listening = self.committed.step if self._listening() else -1
        return (stream.identity(), listening, stream.landed_mask)  # the mask: a listener's only

    def _held_step(self) -> int:
        """The committed step this device reports as holding: none (-1) while it listens."""
        return -1 if self._listening() else self.committed.step

    def _settle_stream(self, stock, generation: int, group: tuple) -> bool:
        """At a boundary, after the stock: does a stream broken off go on? If so, re-plan what did not
        land among the surviving senders (every member alike); if not, drop it (a listener is a joiner
        again: it reported no committed step). Sharded streams do not go on (they start again)."""
        if self.stream is None:
            return False
        listeners = None
        if self.shards is None and self.cost_planner is None and stock.stream_identities:
            listeners = stream_plan.continuation(
                stock.stream_identities, stock.listening_steps, stock.latest_step, stock.receivers
            )
        if listeners is None or stock.latest_step >= self.settings.total_steps:
            self._abandon_stream()
            return False
        stream = self.stream
        mask = -1
        for rank in listeners:
            mask &= stock.landed_masks[rank]
        survivors = tuple(device for rank, device in enumerate(group) if rank not in listeners)
        landed_from = [sender for place, sender in enumerate(stream.senders) if mask >> place & 1]
        plan = stream_plan.replan(stream.plan, stream.rounds_done, survivors, last_round_from=landed_from)
        self.stream = dataclasses.replace(
            stream,
            plan=plan,
            listeners=tuple(listeners),
            senders=survivors,
            plan_generation=generation,
            broken_off=False,
            landed_mask=0,
            rank=group.index(self.args.device_id),
        )
        left = plan.size - round(plan.delivered_share(stream.rounds_done) * plan.size)
        names = ", ".join(group[rank] for rank in listeners)
        self.stream_note = f"the stream to {names} goes on from {', '.join(survivors)}: {left} bytes left"
        return True

    # ------------------------------------------------------------ the step loop

    def _listening(self) -> bool:
        """This device listens to the stream: by its rank in the stream's generation, which a boundary
        broken off after the stream began never made `self.rank` (a joiner that restored the small
        state there reported it as a member's committed step, and trained from garbage: soak seed 1316)."""
        return self.stream is not None and self.stream.rank in self.stream.listeners

    def _contributors(self) -> tuple:
        """The members that run VWs this step: all but the listeners."""
        if self.stream is None:
            return self.members
        return tuple(device for rank, device in enumerate(self.members) if rank not in self.stream.listeners)

    def _with_listeners(self, assignment: tuple) -> tuple:
        """A contributors' assignment in member rank order, listeners at 0 VWs."""
        if self.stream is None:
            return tuple(assignment)
        counts = iter(assignment)
        return tuple(0 if rank in self.stream.listeners else next(counts) for rank in range(len(self.members)))

    def _without_listeners(self, values) -> list:
        if self.stream is None:
            return list(values)
        return [value for rank, value in enumerate(values) if rank not in self.stream.listeners]

    def _listener_shares(self) -> dict:
        """How much of the state each listener holds, by device (a step record's `joining`)."""
        share = round(self.stream.plan.delivered_share(self.stream.rounds_done), 4)
        return {self.members[rank]: share for rank in self.stream.listeners}

    def _wait_stream_transfers(self) -> None:
        """Before an optimizer update: the slices posted after the last one have left this device (a
        sender) or arrived (a listener)."""
        if self.stream_transfers:  # kept until they are waited for: a failure here leaves them unlanded
            wait_for_transfers(list(self.stream_transfers), self._peer_lost)
            self.stream_transfers = ()
        if self.stream is not None:
            self.stream.receipts = ()

    def _stream_round(self, step: int) -> None:
        """After step `step`'s update: this round's slices, from each sender to each listener."""
        self._resize_stream()
        stream = self.stream
        number = stream.rounds_done
        operations = []
        # Tests' STEP:DEVICE:stream:tamper: this sender sends one value changed (the check must see it).
        tamper = self.faults.take_tamper(step)
        receipts = []  # a listener's: the sender of each receive, in order
        for piece in (piece for piece in stream.plan.slices if piece.round == number):
            sender = self.members.index(piece.sender)
            for listener in stream.listeners:
                if self.rank == sender:
                    views = self._views(piece)
                    if tamper:
                        views[0] = views[0].clone()
                        views[0].view(-1)[0] += 1.0
                        tamper = False
                    operations += [dist.P2POp(dist.isend, view, listener) for view in views]
                elif self.rank == listener:
                    views = self._views(piece)
                    operations += [dist.P2POp(dist.irecv, view, sender) for view in views]
                    receipts += [piece.sender] * len(views)
        self.faults.fire("stream", step, self.members)
        works = collective(lambda: dist.batch_isend_irecv(operations)) if operations else []
        # gloo: a work per operation, so a failure can tell which senders' slices landed (`_suspend_stream`);
        # otherwise (NCCL coalesces them) none of the round counts as landed.
        if receipts:
            known = len(works) == len(receipts)
            stream.receipts += tuple(zip(receipts, works)) if known else tuple((None, work) for work in works)
        # Waited for before this device's next optimizer update (`_wait_stream_transfers`): a sender's next
        # write to what it sends, a listener's first read of what it receives. So a round overlaps the
        # next step's forward, backward and all-reduce on both sides; an fp16 step that skipped its
        # update has not waited for the last round's yet.
        self.stream_transfers += tuple(works)
        if self.records.last is not None:  # the first step after the boundary is timed from the commit before its stall
            stall = stream.stall_s if stream.rounds_done == 0 else 0.0
            stream.step_times.append(self.records.last_step_time() - stall)
        stream.rounds_done += 1
        if stream.rounds_done >= stream.plan.rounds:  # (>: a re-plan found everything landed already)
            self._finish_stream(step)

    def _resize_stream(self) -> None:
        """Without `join_stream_mb`, the next rounds' slices follow the members' step times
        (`stream_plan.resized`): the same on every member, from the same summed statistics.

        The first streamed step's statistics carry the step before the join (the baseline); the
        second's carry the first streamed step, which holds the join's stall (left out).
        """
        stream = self.stream
        if stream.sizing is None or not stream.member_step_s:
            return
        times = sorted(value for value in self._without_listeners(stream.member_step_s) if value > 0)
        if not times:
            return
        median = times[len(times) // 2]
        if stream.rounds_done == 0:
            stream.before_s = median
            return
        if stream.rounds_done < 2 or stream.before_s <= 0:
            return
        sizing = stream_plan.resized(stream.sizing, median / stream.before_s - 1.0, stream.rounds_done, STREAM_SHARE)
        if sizing.sender_bytes != stream.plan.sender_bytes:
            stream.plan = stream_plan.replan(
                stream.plan, stream.rounds_done, stream.senders, sender_bytes=sizing.sender_bytes
            )
        stream.sizing = sizing

    def _finish_stream(self, step: int) -> None:
        """Every member: the joiners' copies against their senders' (one all-reduce), then they contribute."""
        stream = self.stream
        if self._listening():  # the last round has landed (a sender's sends only read: no wait)
            self._wait_stream_transfers()
        names = list(stream.tensors)
        sent_by = {name: set() for name in names}
        for piece in stream.plan.slices:  # a sender lost since its slices landed: a surviving one checks
            sender = piece.sender if piece.sender in self.members else stream.senders[0]
            for item in piece.pieces:
                sent_by[item.name].add(self.members.index(sender))
        world = len(self.members)
        rows = torch.zeros(world, len(names), dtype=torch.float64)
        for index, name in enumerate(names):  # a listener checks all, a sender what it sent
            if self._listening() or self.rank in sent_by[name]:
                sums = parameter_checksums(self._travelling(stream.tensors[name]))
                rows[self.rank, index] = float(sum(sums) % (1 << 52))
        if world > 1:
            collective(lambda: dist.all_reduce(rows))
        for index, name in enumerate(names):
            for listener in stream.listeners:
                for sender in sent_by[name]:
                    if rows[listener, index] != rows[sender, index]:
                        raise StreamMismatch(
                            f"streamed join after step {step}: {self.members[listener]}'s copy of {name!r} "
                            f"(with its optimizer state) differs from {self.members[sender]}'s; the join is "
                            "not trusted, so the job stops"
                        )
        if self.rank == 0:
            self._publish_stream_event(step)
        self.stream = None

    def _publish_stream_event(self, step: int) -> None:
        stream = self.stream
        seconds = time.time() - stream.started_wall
        steps = stream.rounds_done
        during = sorted(stream.step_times)
        slower = ""
        if during and stream.step_before_s > 0:
            median = during[len(during) // 2]
            slower = f"; the members' median step {median / stream.step_before_s:.2f} x the one before"
        listeners = ", ".join(self.members[rank] for rank in stream.listeners)
        self.records.publish_event(
            "stream",
            f"{listeners} holds the training state: {stream.plan.size} bytes streamed over {steps} "
            f"step{'s' if steps != 1 else ''} ({seconds:.2f} s){slower}",
            0.0,
            step=self.committed.step,
            generation=self.generation,
            members=self.members,
            state_bytes_sent=stream.bytes_sent,
        )

    # ------------------------------------------------------------ helpers

    def _streamed_parameters(self) -> dict:
        """The trainable parameters by state_dict name, in model order (what streams)."""
        return {name: parameter for name, parameter in self.model.named_parameters() if parameter.requires_grad}

    def _travelling(self, parameter) -> list:
        """The parameter's values, then its optimizer state's tensors by key (0-dim ones, such as Adam's
        step, travel whole with every piece: a listener skips the updates of what it has not received)."""
        state = self.optimizer.state.get(parameter, {})
        return [parameter.data] + [state[key] for key in sorted(state) if torch.is_tensor(state[key])]

    def _skip_unreceived(self) -> None:
        """A listener's update leaves out the parameters none of whose pieces has landed yet (their
        slices bring values, moments and step counts as of the moment they are sent): torch's
        optimizers skip a parameter whose `.grad` is None. Saves the joiner's cores (on a shared host,
        the members' too) the update of what it does not hold yet. Only where every per-parameter
        state value is a tensor, so that nothing the listener skips stays behind."""
        stream = self.stream
        if stream is None or not self._listening() or not stream.skippable:
            return
        landed = {
            item.name for piece in stream.plan.slices if piece.round < stream.rounds_done for item in piece.pieces
        }
        for name, parameter in stream.tensors.items():
            if name not in landed:
                parameter.grad = None

    def _views(self, piece) -> list:
        """The memory of a slice's pieces: flat element ranges, or whole tensors (not cuttable)."""
        views = []
        for item in piece.pieces:
            parameter = self.stream.tensors[item.name]
            for tensor in self._travelling(parameter):
                flat = tensor.view(-1)
                whole = item.start == 0 and item.stop == parameter.numel()
                views.append(flat if whole or tensor.dim() == 0 else flat[item.start : item.stop])
        return views

    def _sender_bytes(self) -> int:
        """`join_stream_mb` if set, else a share of the step time at the link's rate (the same on every member)."""
        if self.settings.join_stream_mb:
            return max(1, int(self.settings.join_stream_mb * (1 << 20)))
        step_s = self._predicted_step_s()
        if step_s <= 0:
            return DEFAULT_SENDER_BYTES
        link = LINK_BYTES_PER_S.get(self.settings.backend, LINK_BYTES_PER_S["gloo"])
        return stream_plan.sender_bytes(link, step_s, STREAM_SHARE)

    @staticmethod
    def _floor(plan) -> int:
        """The smallest slices a stream shrinks to: half its first size, at least MIN_SENDER_BYTES (never
        above the first size). One halving at most: on a shared host the steps' slowdown is mostly the
        listener's own work, which smaller slices only spread over more steps (measured: with an eighth,
        the benchmark's streams outlasted its jobs)."""
        return min(plan.sender_bytes, max(MIN_SENDER_BYTES, plan.sender_bytes // 2))

    def _predicted_step_s(self) -> float:
        """The balancer's predicted step time (identical on every member: shared state), 0 if unknown."""
        state = self.committed.balance
        seconds = [state.seconds_per_vw.get(device, 0.0) for device in state.device_ids]
        if not state.assignment or not seconds or min(seconds) <= 0:
            return 0.0
        return balance.predicted_step_seconds(state.assignment, seconds)


def _landed(work) -> bool:
    """Whether a receive work of a broken-off round completed (waited for briefly: its sender may be dead)."""
    if work is None:
        return False
    try:
        return bool(work.wait(datetime.timedelta(seconds=LANDED_WAIT_S)))
    except RuntimeError:  # the sender died (closed connection) or did not send in time
        return False
