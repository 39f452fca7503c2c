"""One step of one device, from the top: its VWs, the sum across devices, the optimizer update.

One step, from the top: `StepLoop.train` picks this device's VWs from the
shared assignment, `StepLoop.run_step` runs them one after another (forward,
`loss / V` backward; the last VW's backward sends gradient buckets as they
fill), `GradientSync.finish` waits for the sums and the step's statistics,
then the optimizer and scheduler step, and the statistics decide the next
assignment and whether a new generation starts after this step.

`StepLoop` is part of `flexpar.worker.lifecycle.Worker` (its attributes are
the worker's own; see there): the lifecycle calls `train` once the device is
active in a generation, and `train` returns at the next change of generation,
an agreed stop, or the last step.
"""

from __future__ import annotations

import math
import time
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from flexpar import recipes
from flexpar.comm.collectives import collective
from flexpar.core import balance, batching
from flexpar.core import ledger as sample_ledger
from flexpar.core.step_statistics import StatsLayout, mixed_loss_message
from flexpar.errors import UserCodeError
from flexpar.worker import records
from flexpar.worker.buffers import buffer_vector, set_buffers
from flexpar.worker.loader import to_device as _to_device
from flexpar.worker.user_code import loss_terms, nonfinite_message


class StopEarly:
    """What `StepLoop.train` returns when the members agreed to stop after a step."""


class StepLoop:
    """The step loop of `flexpar.worker.lifecycle.Worker` (a part of it; its attributes are the worker's own).

    Its own state: `assignment`, the VWs per member of the last step it ran
    (the loader prefetches along it), and `_generation_records`, the newest
    published generation's record the members move to at a later boundary.
    Both are replaced, never changed in place.
    """

    assignment: tuple = ()
    _generation_records: dict = {}

    # ------------------------------------------------------------ training

    def _plan(self, step: int) -> range:
        """This device's VWs at `step` as currently known (the loader prefetches along it)."""
        if self.cost_planner is not None:  # known ahead: planned rates move only past the noise
            return (
                self.cost_planner.assignment(step, self.membership.members)[self.membership.rank]
                if self.membership.members
                else ()
            )
        return batching.virtual_workers_of(self.assignment, self.membership.rank) if self.assignment else range(0)

    def train(self) -> Optional[tuple]:
        """Run steps until the last one (returns None) or an agreed new generation.

        Returns the new generation's number and record. A planned leaver learns
        that it leaves from the step's statistics and returns before that
        step's optimizer update (see `_skips_last_update`).
        """
        while self.committed.step < self.settings.total_steps:
            if self.evaluation.due(
                self.committed.step, self.membership.generation, self.settings
            ):  # the step boundary's model
                if self._evaluate(ask_driver=self.settings.eval_verdict):
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
                    detail = f"{list(self.assignment)} -> {list(assignment)}"
                    self.records.publish_event(
                        "rebalance",
                        detail,
                        0.0,
                        step=self.committed.step,
                        generation=self.membership.generation,
                        members=self.membership.members,
                    )
                mine = batching.virtual_workers_of(assignment, self.membership.rank)
            self.assignment = assignment
            step = self.committed.begin()  # in flight until it commits or a collective breaks off
            summed = self.run_step(step, mine)
            self.frozen.check_flags(step)  # user code changed requires_grad: stop before applying anything
            slots = self._layout()
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
            if upcoming is not None and self._skips_last_update(upcoming[1]):
                return upcoming
            pending = (step, summed, assignment, sets if self.cost_planner is not None else None)
            if self.shards is not None:  # sharded: every member holds this gradient before any applies it
                self._land_streamed_pieces()  # a sharded stream's pieces in flight: before the step is pending
                self._confirm_gradient(pending)
            moved = self._commit_step(*pending)
            if self.shards is not None:
                self._broadcast_parameters(step)
            if self.exact is not None and self.membership.rank == 0:  # the digest after the update (sharded: broadcast)
                self.exact_steps.record(step)
            self._zero_grad()
            if self.membership.rank == 0:
                self.link.publish(self.records.last)
                if moved:  # a planned rate moved past the noise: the plans of later steps change
                    self.records.publish_event(
                        "rebalance",
                        moved,
                        0.0,
                        step=self.committed.step,
                        generation=self.membership.generation,
                        members=self.membership.members,
                    )
            if self.membership.rank == 0 or (
                self.shards is not None and not self.streams.listening()
            ):  # sharded: each its part
                self.checkpoints.maybe(self.settings, self.membership.rank, self.membership.members)
            if stopping:
                return StopEarly()
            if upcoming is not None:
                return upcoming
            if self.streams.current is not None and self.committed.step < self.settings.total_steps:
                if self.shards is not None:  # flexpar/worker/shard_streaming.py
                    self._shard_stream_round(step)
                else:
                    self._stream_round(step)  # a streamed join's next slice (flexpar/worker/streaming.py)
        if self.evaluation.due(self.committed.step, self.membership.generation, self.settings):  # after the last step
            self._evaluate(ask_driver=False)
        return None

    def _evaluate(self, ask_driver: bool) -> str:
        """The evaluation round of the model after `committed` steps, by this generation's contributors
        in proportion to the next step's assignment (flexpar/worker/evaluator.py)."""
        return self.evaluation.run(
            self.committed.step,
            self.membership.generation,
            self.membership.members,
            self.membership.rank,
            self._step_assignment(),
            self.streams.contributors(self.membership.members),
            self.settings.eval_keys,
            self.membership.peer_lost,
            ask_driver,
        )

    def _layout(self) -> StatsLayout:
        """This job's statistics layout for the current device set."""
        if self.exact is None:
            return StatsLayout(len(self.membership.members))
        return StatsLayout(len(self.membership.members), self.job.virtual_workers, self.exact.tensors)

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

    def _commit_step(self, step: int, summed: torch.Tensor, assignment: tuple, sets) -> str:
        """Apply step `step` from its summed gradient (in `.grad`) and statistics, and commit it.

        Everything here is a function of what every member holds alike after
        the gradient all-reduce, so a member that failed before it (sharded:
        flexpar/worker/shard_levelling.py) can apply it later with the same
        result. Returns the cost balancer's rebalance detail ("" if none).
        """
        self._applying_pending()
        world = len(self.membership.members)
        slots = self._layout()
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
                self._skip_unreceived()  # a listener does not update what it does not hold yet
                self.optimizer.step()
            if self.scheduler is not None:
                self.scheduler.step()
        step_time = self.committed.commit(
            self.streams.contributors(self.membership.members),
            self.streams.without_listeners(assignment),
            self.streams.without_listeners(busy),
        )
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
        if self.streams.current is not None:  # a streamed join: how much of the state each listener holds
            record["joining"] = self._listener_shares()
        record["optimizer_bytes"] = [int(round(value)) * 1024 for value in summed[slots.optimizer].tolist()]
        if self.streams.current is not None:  # every member's previous step time: its slices follow them
            self.streams.current.member_step_s = tuple(summed[slots.previous_step_s].tolist())
        self.records.keep(record)
        if self.settings.sample_ledger:
            record["ledger"] = self._step_samples
        return self._observe_costs(step, sets, busy) if self.cost_planner is not None else ""

    def _observe_costs(self, step: int, sets: tuple, busy: list) -> str:
        """By cost: the step's costs and VW sets go into its record, its busy times into the rates.

        Returns the rebalance event's detail when a planned rate moved, else "".
        """
        record = self.records.last
        record["cost"] = self.cost_planner.device_costs(step, sets)
        record["virtual_worker_sets"] = [list(members) for members in sets]
        return self.cost_planner.observe(step, self.membership.members, sets, busy)

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

    def run_step(self, step: int, virtual_workers: Sequence[int], redo: bool = False) -> torch.Tensor:
        """Run this device's VWs of `step` and sum gradients and statistics across devices.

        Job(deterministic=True): exact sums (flexpar/worker/determinism.py); a
        step whose gradient outgrew its exponents runs again (`redo`), on
        every device alike.
        """
        job = self.job
        world = len(self.membership.members)
        exact = self.exact
        self.sync.reset()
        if exact is not None:
            exact.begin(redo)
            terms = []
        ledger = sample_ledger.count_vector(len(job.dataset)) if self.settings.sample_ledger else None
        busy = 0.0
        loss_sum = 0.0
        first_bad = 0
        # Recipes: a scalar loss backpropagates loss / V, a pair (loss_sum, count) its
        # loss_sum (the division by the global count follows the sum across devices);
        # fp16 multiplies either by the loss scale.
        scale = self.scaler.scale if self.scaler is not None else 1.0
        pairs, count, first_kind = 0, 0.0, None
        last = virtual_workers[-1] if len(virtual_workers) else None  # a listening joiner runs none
        published = 0  # a scheduled leave's generation, read before the last VW (await_scheduled_leave)
        for virtual_worker in virtual_workers:
            started = time.perf_counter()
            batch = _to_device(self.loader.batch(step, virtual_worker), self.device)
            if ledger is not None:
                # What the loader really loaded (its DataLoader carried the indices with the
                # batch), not the plan's indices: a wrong or stale batch shows in the audit.
                ledger[self.loader.loaded_indices] += 1.0
            self._seed_model_randomness(batching.virtual_worker_seed(job.seed, step, virtual_worker))
            if virtual_worker == last:  # send buckets as they fill
                # Before any bucket is sent (nobody waits in a collective meanwhile): a leave scheduled
                # for the next step takes effect at this boundary once the driver has published it.
                published = self.link.await_scheduled_leave(
                    step + 1, self.membership.generation, self.membership.members
                )
                exact.arm(world) if exact is not None else self.sync.arm()
            self.faults.fire("forward", step, self.membership.members)
            with recipes.autocast(job, self.device.type):
                result = job.loss(self.forward_model, batch)
            loss, value, vw_count = loss_terms(result, step, virtual_worker)
            if first_kind is None:
                first_kind = (virtual_worker, vw_count is not None)
            elif first_kind[1] != (vw_count is not None):
                raise UserCodeError(mixed_loss_message(step, first_kind, virtual_worker))
            if self.faults.armed("backward", step) and loss.requires_grad:
                loss.register_hook(lambda grad: self.faults.fire("backward", step, self.membership.members))
            if not math.isfinite(value) and not first_bad:
                first_bad = virtual_worker + 1
            if vw_count is not None:
                pairs += 1
                count += vw_count
                (loss * scale if scale != 1.0 else loss).backward()
            elif scale != 1.0:
                ((loss / job.virtual_workers) * scale).backward()
            else:
                (loss / job.virtual_workers).backward()
            if exact is not None:  # this VW's gradient into the int64 sum; .grad cleared for the next
                exact.add_virtual_worker()
                terms.append(
                    (virtual_worker, value if vw_count is not None else value / job.virtual_workers, vw_count or 0)
                )
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            elapsed = time.perf_counter() - started
            speed = self.link.speed if self.link.speed is not None else self.args.speed
            if speed < 1.0:
                # Emulated slower device: stretch this VW's compute to 1/speed of it.
                pause = elapsed * (1.0 / speed - 1.0)
                time.sleep(pause)
                elapsed += pause
            busy += elapsed
            loss_sum += value if vw_count is not None else value / job.virtual_workers
        buffers = (
            buffer_vector(self.model, self.streams.listening()) if world > 1 else torch.zeros(0, dtype=torch.float64)
        )
        slots = self._layout()
        stats = torch.zeros(slots.size + buffers.numel(), dtype=torch.float64)
        stats[slots.buffers] = buffers
        stats[slots.busy.start + self.membership.rank] = busy
        stats[slots.seen.start + self.membership.rank] = max(self.link.latest_generation, published)
        stats[slots.loss] = loss_sum
        stats[slots.bad.start + self.membership.rank] = first_bad
        stats[slots.stop] = 1.0 if (self.link.finish_reason is not None or self.link.driver_lost) else 0.0
        stats[slots.count] = count
        stats[slots.pairs] = pairs
        # This device's optimizer-state bytes (KiB: exact in a float32 carrier up to 16 GiB), for the record.
        stats[slots.optimizer.start + self.membership.rank] = self.optimizer_bytes() // 1024
        last = self.records.last
        if last is not None and last.get("kind") == "step":
            stats[slots.previous_step_s.start + self.membership.rank] = float(last["step_time_s"])
        if self.scaler is not None:  # fp16: this device's own gradient overflowed (all skip the step)
            overflowed = (
                exact.nonfinite if exact is not None else recipes.has_nonfinite(self.sync.dense, self.sync.sparse)
            )
            stats[slots.overflow] = float(overflowed)
        if exact is not None:
            holds_all = (self.shards is None or self.shards.values_complete) and not self.streams.listening()
            self.exact_steps.statistics(stats, slots, terms, self.membership.rank, holds_all)
            summed = exact.finish(
                stats, world, lambda: self.faults.fire("sync", step, self.membership.members), self.membership.peer_lost
            )
            if self.exact_steps.resolve(
                summed, slots, step, self.membership.members, self.membership.rank
            ):  # every device alike: run the step again
                return self.run_step(step, virtual_workers, redo=True)
        else:
            summed = self.sync.finish(
                stats.to(self.device),
                before_last_launch=lambda: self.faults.fire("sync", step, self.membership.members),
                scale=lambda summed_stats, dense_sums: self.gradient.prepare(summed_stats, dense_sums, slots),
            )
        if world == 1 or exact is not None:  # the step's gradient is in .grad (exact: converted once)
            self.gradient.prepare(summed, None, slots)
        if ledger is not None:
            # Tests and the fault soak only: its own all-reduce, so the ledger never
            # changes the step's statistics vector.
            if world > 1:
                ledger = ledger.to(self.device)
                collective(lambda: dist.all_reduce(ledger))
            self._step_samples = sample_ledger.consumed(ledger.cpu())
        return summed

    def _seed_model_randomness(self, seed: int) -> None:
        """Seed the streams the VW's forward and backward draw from (dropout).

        The same streams as torch.manual_seed(seed) for the CPU and this device,
        without its lazy seeding of every other backend, which captures a
        traceback per call (milliseconds per VW on a small model).
        """
        torch.default_generator.manual_seed(seed)
        if self.device.type == "cuda":
            torch.cuda.manual_seed(seed)  # the current device: set in __init__
