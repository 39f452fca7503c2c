"""Streamed joins: a joiner listens to the members' steps while the training state streams to it.

`StreamedJoin` carries it out for the worker. At a join boundary where streaming applies (`stream_rules.refusal` says
when it does not: flexpar/worker/stream_rules.py), the source sends the joiners only the small state (the
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
  against its sender's (`StreamedJoin._finish`: a mismatch stops the job naming the
  tensor), rank 0 publishes a `stream` event, and from the next step on the
  joiner takes VWs like any member.

A new generation while a stream runs (a failure, a leave, another join)
drops it: the joiner holds no committed state of its own (`committed = -1`
at the next boundary), so that boundary brings it level as any joiner.
"""

from __future__ import annotations

import dataclasses
import time

import torch
import torch.distributed as dist

from flexpar.comm import state_transfer as training_state
from flexpar.comm.collectives import collective
from flexpar.comm.exact_sync import parameter_checksums
from flexpar.core import stream_plan
from flexpar.worker import stream_rules
from flexpar.worker.stream_session import Stream, StreamMismatch


class StreamedJoin:
    """A streamed join of an unsharded job, carried out (see the module docstring).

    It holds no state of its own: the stream in flight is the device's
    `StreamSession`, the committed step its `CommittedStep`, the generation its
    `Membership`; it is handed the job's run settings where it needs them.
    """

    def __init__(self, training, owners, device, device_id: str):
        self.model, self.optimizer, self.scheduler = training.model, training.optimizer, training.scheduler
        self.device, self.device_id = device, device_id
        self.membership, self.committed, self.records = owners.membership, owners.committed, owners.records
        self.faults, self.streams, self.state = owners.faults, owners.streams, owners.state
        self.by_cost = owners.cost_planner is not None  # Job(sample_cost=...): plans every device's VWs ahead
        self.sharded = training.shards is not None  # a sharded job's streams do not go on (they start again)

    # ------------------------------------------------------------ the boundary

    def level(self, stock, rank: int, generation: int, group: tuple, settings) -> float:
        """The small state from the source to the joiners, and the plan; returns the bytes sent."""
        sent = 0
        if rank == stock.source:
            small = self._small_state()
            sent = collective(
                lambda: training_state.send_state(
                    small,
                    stock.receivers,
                    self.device,
                    after_size=lambda: self.faults.fire("transfer", self.committed.step, self.membership.members),
                )
            )
        elif rank in stock.receivers:
            self._restore_small(collective(lambda: training_state.receive_state(stock.source, self.device)))
        self._begin(stock, generation, group, settings)
        return collective(lambda: training_state.all_level(len(group), self.device, sent))

    def _small_state(self) -> dict:
        """The training state without what streams: trainable parameters and their optimizer tensors."""
        state = self.state.capture()
        streamed = set(stream_rules.streamed_parameters(self.model))
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
        self.state.restore_extra(state)

    def _begin(self, stock, generation: int, group: tuple, settings) -> None:
        """Every member: the plan of the stream (the same everywhere, from the same inputs)."""
        parameters = stream_rules.streamed_parameters(self.model)
        travelling = {
            name: stream_rules.travelling(self.optimizer, parameter) for name, parameter in parameters.items()
        }
        classes = [type(self.optimizer).__name__]
        cuttable = stream_plan.elementwise(classes) and all(
            all(tensor.numel() == parameters[name].numel() for tensor in tensors if tensor.dim() > 0)
            for name, tensors in travelling.items()
        )
        tensors = [
            stream_plan.Tensor(
                name,
                parameter.numel(),
                -(-sum(t.numel() * t.element_size() for t in travelling[name]) // max(1, parameter.numel())),
            )
            for name, parameter in parameters.items()
        ]
        senders = tuple(device for other, device in enumerate(group) if other not in stock.receivers)
        sender_bytes = stream_rules.sender_bytes(settings, self.committed.balance)
        plan = stream_plan.plan(tensors, senders, sender_bytes, cuttable)
        skippable = all(
            torch.is_tensor(value)
            for parameter in parameters.values()
            for value in self.optimizer.state.get(parameter, {}).values()
        )
        stream = Stream(
            plan,
            tuple(stock.receivers),
            parameters,
            time.time(),
            self.records.median_step_time(),
            skippable=skippable,
            plan_generation=generation,
            senders=senders,
            rank=group.index(self.device_id),
            sizing=None if settings.join_stream_mb else stream_plan.first_sizing(plan.sender_bytes),
        )
        self.streams.begin(
            stream,
            stream_rules.planned_note(len(stock.receivers), plan.size, plan.rounds, len(senders)),
        )

    def abandon(self) -> list:
        """Drop the stream (a lost driver, or a boundary where it cannot go on): a listener holds no
        committed state.

        Returns the transfers in flight (their works keep the old group alive until it is retired).
        """
        works = self.streams.suspend()
        if self.streams.listening():
            self.committed.forget()
        self.streams.end()
        return works

    def goes_on(self, stock, generation: int, group: tuple, settings) -> bool:
        """At a boundary, after the stock: does a stream broken off go on? If so, re-plan what did not
        land among the surviving senders (every member alike); if not, the caller drops it (a listener
        is a joiner again: it reported no committed step). Sharded streams do not go on (they start
        again)."""
        if self.streams.current is None:
            return False
        listeners = None
        if not self.sharded and not self.by_cost and stock.stream_identities:
            listeners = stream_plan.continuation(
                stock.stream_identities, stock.listening_steps, stock.latest_step, stock.receivers
            )
        if listeners is None or stock.latest_step >= settings.total_steps:
            return False
        stream = self.streams.current
        mask = -1
        for rank in listeners:
            mask &= stock.landed_masks[rank]
        survivors = tuple(device for rank, device in enumerate(group) if rank not in listeners)
        landed_from = [sender for place, sender in enumerate(stream.senders) if mask >> place & 1]
        plan = stream_plan.replan(stream.plan, stream.rounds_done, survivors, last_round_from=landed_from)
        continued = dataclasses.replace(
            stream,
            plan=plan,
            listeners=tuple(listeners),
            senders=survivors,
            plan_generation=generation,
            broken_off=False,
            landed_mask=0,
            rank=group.index(self.device_id),
        )
        left = plan.size - round(plan.delivered_share(stream.rounds_done) * plan.size)
        names = ", ".join(group[rank] for rank in listeners)
        self.streams.begin(continued, f"the stream to {names} goes on from {', '.join(survivors)}: {left} bytes left")
        return True

    # ------------------------------------------------------------ the step loop

    def listener_shares(self) -> dict:
        """How much of the state each listener holds, by device (a step record's `joining`)."""
        share = round(self.streams.current.plan.delivered_share(self.streams.current.rounds_done), 4)
        return {self.membership.members[rank]: share for rank in self.streams.current.listeners}

    def round(self, step: int) -> None:
        """After step `step`'s update: this round's slices, from each sender to each listener."""
        self._resize()
        stream = self.streams.current
        number = stream.rounds_done
        operations = []
        # Tests' STEP:DEVICE:stream:tamper: this sender sends one value changed (the check must see it).
        tamper = self.faults.take_tamper(step)
        receipts = []  # a listener's: the sender of each receive, in order
        for piece in (piece for piece in stream.plan.slices if piece.round == number):
            sender = self.membership.members.index(piece.sender)
            for listener in stream.listeners:
                if self.membership.rank == sender:
                    views = self._views(piece)
                    if tamper:
                        views[0] = views[0].clone()
                        views[0].view(-1)[0] += 1.0
                        tamper = False
                    operations += [dist.P2POp(dist.isend, view, listener) for view in views]
                elif self.membership.rank == listener:
                    views = self._views(piece)
                    operations += [dist.P2POp(dist.irecv, view, sender) for view in views]
                    receipts += [piece.sender] * len(views)
        self.faults.fire("stream", step, self.membership.members)
        works = collective(lambda: dist.batch_isend_irecv(operations)) if operations else []
        # gloo: a work per operation, so a failure can tell which senders' slices landed (`StreamSession.suspend`);
        # otherwise (NCCL coalesces them) none of the round counts as landed.
        if receipts:
            known = len(works) == len(receipts)
            stream.receipts += tuple(zip(receipts, works)) if known else tuple((None, work) for work in works)
        # Waited for before this device's next optimizer update (`StreamSession.wait`): a sender's next
        # write to what it sends, a listener's first read of what it receives. So a round overlaps the
        # next step's forward, backward and all-reduce on both sides; an fp16 step that skipped its
        # update has not waited for the last round's yet.
        self.streams.post(works)
        if self.records.last is not None:  # the first step after the boundary is timed from the commit before its stall
            stall = stream.stall_s if stream.rounds_done == 0 else 0.0
            stream.step_times.append(self.records.last_step_time() - stall)
        stream.rounds_done += 1
        if stream.rounds_done >= stream.plan.rounds:  # (>: a re-plan found everything landed already)
            self._finish(step)

    def _resize(self) -> None:
        """Without `join_stream_mb`, the next rounds' slices follow the members' step times
        (`stream_plan.resized`): the same on every member, from the same summed statistics.

        The first streamed step's statistics carry the step before the join (the baseline); the
        second's carry the first streamed step, which holds the join's stall (left out).
        """
        stream = self.streams.current
        if stream.sizing is None or not stream.member_step_s:
            return
        sizing, stream.before_s = stream_plan.resize_round(
            stream.sizing,
            stream.before_s,
            self.streams.without_listeners(stream.member_step_s),
            stream.rounds_done,
            stream_rules.STREAM_SHARE,
        )
        if sizing.sender_bytes != stream.plan.sender_bytes:
            stream.plan = stream_plan.replan(
                stream.plan, stream.rounds_done, stream.senders, sender_bytes=sizing.sender_bytes
            )
        stream.sizing = sizing

    def _finish(self, step: int) -> None:
        """Every member: the joiners' copies against their senders' (one all-reduce), then they contribute."""
        stream = self.streams.current
        if self.streams.listening():  # the last round has landed (a sender's sends only read: no wait)
            self.streams.wait(self.membership.peer_lost)
        names = list(stream.tensors)
        sent_by = {name: set() for name in names}
        for piece in stream.plan.slices:  # a sender lost since its slices landed: a surviving one checks
            sender = piece.sender if piece.sender in self.membership.members else stream.senders[0]
            for item in piece.pieces:
                sent_by[item.name].add(self.membership.members.index(sender))
        world = len(self.membership.members)
        rows = torch.zeros(world, len(names), dtype=torch.float64)
        for index, name in enumerate(names):  # a listener checks all, a sender what it sent
            if self.streams.listening() or self.membership.rank in sent_by[name]:
                sums = parameter_checksums(stream_rules.travelling(self.optimizer, stream.tensors[name]))
                rows[self.membership.rank, index] = float(sum(sums) % (1 << 52))
        if world > 1:
            collective(lambda: dist.all_reduce(rows))
        for index, name in enumerate(names):
            for listener in stream.listeners:
                for sender in sent_by[name]:
                    if rows[listener, index] != rows[sender, index]:
                        raise StreamMismatch(
                            f"streamed join after step {step}: {self.membership.members[listener]}'s copy of {name!r} "
                            f"(with its optimizer state) differs from {self.membership.members[sender]}'s; the join is "
                            "not trusted, so the job stops"
                        )
        if self.membership.rank == 0:
            self.publish_event(step)
        self.streams.end()

    def publish_event(self, step: int) -> None:
        """Rank 0, after the last round: the `stream` event (what streamed, over how many steps)."""
        stream = self.streams.current
        seconds = time.time() - stream.started_wall
        steps = stream.rounds_done
        during = sorted(stream.step_times)
        slower = ""
        if during and stream.step_before_s > 0:
            median = during[len(during) // 2]
            slower = f"; the members' median step {median / stream.step_before_s:.2f} x the one before"
        listeners = ", ".join(self.membership.members[rank] for rank in stream.listeners)
        lost = stream_lost_s(stream)
        fields = dict(stream.choice)
        if lost is not None:
            fields["lost_s"] = round(lost, 6)
        against = ""
        if lost is not None and "predicted_stream_lost_s" in fields:
            against = f"; the members lost {lost:.2g} s (predicted {fields['predicted_stream_lost_s']:.2g} s)"
        self.records.publish_event(
            "stream",
            f"{listeners} holds the training state: {stream.plan.size} bytes streamed over {steps} "
            f"step{'s' if steps != 1 else ''} ({seconds:.2f} s){slower}{against}",
            0.0,
            step=self.committed.step,
            generation=self.membership.generation,
            members=self.membership.members,
            state_bytes_sent=stream.bytes_sent,
            fields=fields,
        )

    # ------------------------------------------------------------ helpers

    def skip_unreceived(self) -> None:
        """A listener's update leaves out the parameters none of whose pieces has landed yet (their
        slices bring values, moments and step counts as of the moment they are sent): torch's
        optimizers skip a parameter whose `.grad` is None. Saves the joiner's cores (on a shared host,
        the members' too) the update of what it does not hold yet. Only where every per-parameter
        state value is a tensor, so that nothing the listener skips stays behind."""
        stream = self.streams.current
        if stream is None or not self.streams.listening() or not stream.skippable:
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
            parameter = self.streams.current.tensors[item.name]
            for tensor in stream_rules.travelling(self.optimizer, parameter):
                flat = tensor.view(-1)
                whole = item.start == 0 and item.stop == parameter.numel()
                views.append(flat if whole or tensor.dim() == 0 else flat[item.start : item.stop])
        return views


def stream_lost_s(stream):
    """What the stream cost the members (rank 0's clock): the join boundary's stall, then every streamed
    step's time beyond the members' median step before the join (None where that is unknown: a stream
    that went on past another boundary, or no step before the join)."""
    if stream.step_before_s <= 0 or len(stream.step_times) < stream.rounds_done:
        return None
    return stream.stall_s + sum(max(0.0, seconds - stream.step_before_s) for seconds in stream.step_times)
