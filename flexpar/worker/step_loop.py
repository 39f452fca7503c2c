"""One step of one device, from the top: its VWs, the sum across devices, the optimizer update.

One step, from the top: `StepLoop.train` picks this device's VWs from the
shared assignment, `StepRun.run` (flexpar/worker/step_run.py) runs them one after another (forward,
`loss / V` backward; the last VW's backward sends gradient buckets as they
fill), `GradientSync.finish` waits for the sums and the step's statistics,
then the optimizer and scheduler step, and the statistics decide the next
assignment and whether a new generation starts after this step.

The worker (flexpar/worker/lifecycle.py) builds a `StepLoop` with the parts
it needs and calls `train` once the device is active in a generation;
`train` returns at the next change of generation, an agreed stop, or the
last step.
"""

from __future__ import annotations

from typing import Optional

import torch

from flexpar.core import balance, batching
from flexpar.core.step_statistics import mixed_loss_message
from flexpar.errors import UserCodeError
from flexpar.worker import records
from flexpar.worker.buffers import set_buffers
from flexpar.worker.shards import zero_grad
from flexpar.worker.step_run import statistics_layout
from flexpar.worker.user_code import nonfinite_message


class StopEarly:
    """What `StepLoop.train` returns when the members agreed to stop after a step."""


class StepLoop:
    """The steps of one device, from its VWs to the optimizer update; the worker hands it the parts.

    Its own state: `assignment`, the VWs per member of the last step it ran
    (the loader prefetches along it), and `_generation_records`, the newest
    published generation's record the members move to at a later boundary.
    `StepRun` (step_run.py) runs each step's VWs and sums them. The committed
    step, the records, the stream and the shard holdings are their owners';
    `total_steps` and `sample_ledger` are fixed for the job (a restarted
    driver with others does not re-adopt the device), the other run
    settings are handed to `train`.
    """

    def __init__(
        self, job, args, link, training, owners, step_run, joins: tuple, total_steps: int, sample_ledger: bool
    ):
        self.job, self.args, self.link, self.step_run = job, args, link, step_run
        self.model, self.frozen = training.model, training.frozen
        self.optimizer, self.scheduler = training.optimizer, training.scheduler
        self.shards, self.exact = training.shards, training.exact
        self.total_steps, self.sample_ledger = total_steps, sample_ledger
        self.membership, self.committed, self.records = owners.membership, owners.committed, owners.records
        self.streams, self.checkpoints, self.evaluation = owners.streams, owners.checkpoints, owners.evaluation
        self.gradient, self.exact_steps, self.cost_planner = owners.gradient, owners.exact_steps, owners.cost_planner
        self.data_streams = owners.data_streams  # a streaming job's positions commit with the step
        # The joins carried out: unsharded, and (sharded jobs only) the levelling and the sharded stream.
        self.streamed_join, self.shard_levelling, self.shard_streaming = joins
        self.assignment: tuple = ()
        self._generation_records: dict = {}

    # ------------------------------------------------------------ training

    def plan(self, step: int) -> range:
        """This device's VWs at `step` as currently known (the loader prefetches along it)."""
        if self.cost_planner is not None:  # known ahead: planned rates move only past the noise
            return (
                self.cost_planner.assignment(step, self.membership.members)[self.membership.rank]
                if self.membership.members
                else ()
            )
        return batching.virtual_workers_of(self.assignment, self.membership.rank) if self.assignment else range(0)

    def train(self, settings) -> Optional[tuple]:
        """Run steps until the last one (returns None) or an agreed new generation.

        Returns the new generation's number and record. A planned leaver learns
        that it leaves from the step's statistics and returns before that
        step's optimizer update (see `_skips_last_update`).
        """
        while self.committed.step < self.total_steps:
            if self.evaluation.due(self.committed.step, self.membership.generation, settings):  # the boundary's
                if self.evaluate(settings, ask_driver=settings.eval_verdict):
                    return StopEarly()
            self.link.check(driver_loss_handled=True)
            if self.cost_planner is not None:  # by cost: this step's own VW sets, any VWs per device
                sets = self.cost_planner.assignment(self.committed.step, self.membership.members)
                assignment, mine = tuple(len(members) for members in sets), sets[self.membership.rank]
            else:
                assignment = self._step_assignment()
                if (
                    self.membership.rank == 0
                    and len(self.assignment) == len(assignment)
                    and assignment != self.assignment
                    and tuple(self.committed.balance.device_ids) == self.streams.contributors(self.membership.members)
                ):
                    self._publish_rebalance(f"{list(self.assignment)} -> {list(assignment)}")
                mine = batching.virtual_workers_of(assignment, self.membership.rank)
            self.assignment = assignment
            if self.data_streams is not None:  # the stream groups of every member's VWs (exchanges positions)
                holdings = [batching.virtual_workers_of(assignment, r) for r in range(len(assignment))]
                self.data_streams.prepare(
                    self.committed.step, holdings, self.membership.rank, self.membership.generation
                )
            step = self.committed.begin()  # in flight until it commits or a collective breaks off
            summed = self.step_run.run(step, mine)
            pass_ends = self._pass_ends(step, summed)
            self.frozen.check_flags(step)  # user code changed requires_grad: stop before applying anything
            slots = statistics_layout(len(self.membership.members), self.job, self.exact)
            bad = [int(value) for value in summed[slots.bad].tolist() if value > 0]
            if bad:
                raise UserCodeError(nonfinite_message(step, min(bad) - 1))
            pairs = round(float(summed[slots.pairs]))
            if 0 < pairs < self.job.virtual_workers:  # each device ran one kind; they differ
                raise UserCodeError(mixed_loss_message(step))
            # Stopping early (asked by the driver, or it is gone) wins over a new
            # generation: every member commits this step, then stops.
            stopping = float(summed[slots.stop]) > 0
            target = int(max(summed[slots.seen].tolist()))
            upcoming = self._upcoming(target, step) if target > self.membership.generation and not stopping else None
            if upcoming is not None and self.data_streams is not None:  # a leaver's streams' positions stay
                self.data_streams.exchange_ahead(step + 1, len(self.membership.members))
            if upcoming is not None and self._skips_last_update(upcoming[1]):
                return upcoming
            pending = (step, summed, assignment, sets if self.cost_planner is not None else None, pass_ends)
            if self.shards is not None:  # sharded: every member holds this gradient before any applies it
                self.shard_streaming.land_pieces()  # a sharded stream's pieces in flight: before the step is pending
                self.shard_levelling.confirm_gradient(pending)
            moved = self.commit_step(*pending)
            if self.shards is not None:
                self.shard_levelling.broadcast_parameters(step)
            if self.exact is not None and self.membership.rank == 0:  # the digest after the update (sharded: broadcast)
                self.exact_steps.record(step)
            zero_grad(self.optimizer, self.shards)
            if self.membership.rank == 0:
                self.link.publish(self.records.last)
                if moved:  # a planned rate moved past the noise: the plans of later steps change
                    self._publish_rebalance(moved)
            if self.membership.rank == 0 or (
                self.shards is not None and not self.streams.listening()
            ):  # sharded: each its part
                self.checkpoints.maybe(settings, self.membership.rank, self.membership.members)
            if stopping:
                return StopEarly()
            if upcoming is not None:
                return upcoming
            if self.streams.current is not None and self.committed.step < self.total_steps:
                if self.shards is not None:  # flexpar/worker/shard_streaming.py
                    self.shard_streaming.round(step)
                else:
                    self.streamed_join.round(step)  # a streamed join's next slice (flexpar/worker/streaming.py)
        if self.evaluation.due(self.committed.step, self.membership.generation, settings):  # after the last step
            self.evaluate(settings, ask_driver=False)
        return None

    def evaluate(self, settings, ask_driver: bool) -> str:
        """The evaluation round of the model after `committed` steps, by this generation's contributors
        in proportion to the next step's assignment (flexpar/worker/evaluator.py)."""
        contributors = self.streams.contributors(self.membership.members)
        shares = self._step_assignment()
        return self.evaluation.run(
            self.committed.step, self.membership, shares, contributors, settings.eval_keys, ask_driver
        )

    def _publish_rebalance(self, detail: str) -> None:
        """Rank 0: the assignment changed (a `rebalance` event after the committed step)."""
        membership = self.membership
        where = {"step": self.committed.step, "generation": membership.generation, "members": membership.members}
        self.records.publish_event("rebalance", detail, 0.0, **where)

    def _step_assignment(self) -> tuple:
        """This step's VWs per member: the balancer's split among the contributors, listeners at 0."""
        contributors = self.streams.contributors(self.membership.members)
        split = balance.next_assignment(self.committed.balance, contributors, self.job.virtual_workers)
        return self.streams.with_listeners(split, len(self.membership.members))

    def _upcoming(self, target: int, step: int) -> Optional[tuple]:
        """(target, its record) if the members move to generation `target` after `step`, else None.

        A scheduled leave's generation is published ahead of its first step (its record's
        `from_step`): the members train on in this one until the boundary before that step. Every
        member decides alike: the same `target` (the step's statistics), record and step.
        """
        record = self._generation_records.get(target)
        if record is None:
            record = self.link.generation(target)
            self._generation_records = {target: record}  # only the newest is asked for again
        from_step = record.get("from_step")
        return (target, record) if from_step is None or step + 1 >= from_step else None

    def _pass_ends(self, step: int, summed: torch.Tensor) -> list:
        """A streaming job's pass ends met in this step's chunks (gathered only where the sum says any)."""
        if self.data_streams is None:
            return []
        slots = statistics_layout(len(self.membership.members), self.job, self.exact)
        if round(float(summed[slots.pass_ends])) == 0:
            return []
        return self.data_streams.pass_ends_of(step, len(self.membership.members))

    def commit_step(self, step: int, summed: torch.Tensor, assignment: tuple, sets, pass_ends=()) -> str:
        """Apply step `step` from its summed gradient (in `.grad`) and statistics, and commit it.

        Everything here is a function of what every member holds alike after
        the gradient all-reduce, so a member that failed before it (sharded:
        flexpar/worker/shard_levelling.py) can apply it later with the same
        result. Returns the cost balancer's rebalance detail ("" if none).
        """
        if self.shard_levelling is not None:  # sharded: the confirmed step is no longer pending
            self.shard_levelling.applying_pending()
        world = len(self.membership.members)
        slots = statistics_layout(len(self.membership.members), self.job, self.exact)
        if self.exact is not None:
            self.exact.commit()
        busy = summed[slots.busy].tolist()
        loss = float(summed[slots.loss])
        if round(float(summed[slots.pairs])):
            loss /= float(summed[slots.count])  # the token mean of the whole global batch
        if world > 1:  # the contributors' mean (a listening joiner adds zeros)
            set_buffers(self.model, summed[slots.buffers] / len(self.streams.contributors(self.membership.members)))
        grad_norm, skip = self.gradient.verdict(summed, slots, step)
        # The last slices sent from these values have left (or landed); waited for even where an fp16 step
        # skips its update, so that the transfers in flight are only ever one round's (streaming.py).
        self.streams.wait(self.membership.peer_lost)
        if not skip:
            if self.shards is not None:  # the chunks this device holds; the others arrive by broadcast
                self.shards.step()
            else:
                self.streamed_join.skip_unreceived()  # a listener does not update what it does not hold yet
                self.optimizer.step()
            if self.scheduler is not None:
                self.scheduler.step()
        step_time = self.committed.commit(
            self.streams.contributors(self.membership.members),
            self.streams.without_listeners(assignment),
            self.streams.without_listeners(busy),
        )
        if self.data_streams is not None:  # every VW stream past this step's items, on every device
            self.data_streams.commit(self.committed.step)
        record = records.step_record(
            step,
            loss,
            step_time,
            busy,
            assignment,
            grad_norm,
            wall=self.committed.wall,
            global_batch=self.job.global_batch,
            generation=self.membership.generation,
            members=self.membership.members,
            contributors_busy=self.streams.without_listeners(busy),
            lr=float(self.optimizer.param_groups[0]["lr"]),
        )
        if self.data_streams is not None:  # what the streams cost and where their passes ended
            record["stream_items_read"] = int(round(float(summed[slots.stream_read])))
            if pass_ends:
                record["pass_ends"] = list(pass_ends)
        if self.streams.current is not None:  # a streamed join: how much of the state each listener holds
            record["joining"] = self.streamed_join.listener_shares()
        record["optimizer_bytes"] = [int(round(value)) * 1024 for value in summed[slots.optimizer].tolist()]
        if self.streams.current is not None:  # every member's previous step time: its slices follow them
            self.streams.current.member_step_s = tuple(summed[slots.previous_step_s].tolist())
        self.records.keep(record)
        if self.sample_ledger:
            record["ledger"] = self.step_run.step_samples
        if self.cost_planner is None:
            return ""
        return self.cost_planner.observe_step(record, step, self.membership.members, sets, busy)

    def _skips_last_update(self, upcoming_record: dict) -> bool:
        """Whether this device leaves at this boundary and need not apply this step.

        Every survivor commits the step, so a planned leaver's own copy of it
        is never needed (unless the job shards its optimizer state: then it
        holds chunks it hands over at the boundary); skipping the update (100 ms for a 25M-parameter Adam
        step on a contended CPU) leaves the host's cores to the survivors,
        whose next generation forms meanwhile. Rank 0 still commits: it
        publishes the step's record and writes checkpoints.
        """
        return (
            self.membership.rank != 0 and self.shards is None and self.args.device_id not in upcoming_record["members"]
        )
