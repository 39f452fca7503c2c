"""The step loop of one device.

Lifecycle (`Phase`), with its transitions:

    WARMING    -> WAITING     built the model, ran one forward/backward, told the coordinator
    WAITING    -> FORMING     a published generation includes this device
    FORMING    -> ACTIVE      the generation's process group formed; state is level
    ACTIVE     -> FORMING     at a step boundary, all members agreed on a newer generation
    ACTIVE     -> LEAVING     ... that leaves this device out (planned scale-in: it skips
                              that step's update, which every survivor commits, and exits
                              at the lowest CPU priority)
    ACTIVE     -> RECOVERING  a collective failed (a peer died or hung)
    FORMING    -> RECOVERING  forming or levelling the state failed
    RECOVERING -> FORMING     the coordinator published the survivors' generation
    RECOVERING -> LEAVING     ... without this device
    ACTIVE     -> STOPPING    all members agreed to stop after this step: the driver asked
                              (SIGTERM to it) or is gone; rank 0 writes a checkpoint
    STOPPING   -> DONE
    any        -> DONE        the last step committed, or the job was stopped
    any        -> LEAVING     SIGTERM to this device: it asks to leave at the next boundary
                              (preemption); a second SIGTERM or the grace period kills it

One step, from the top: `Worker.train` picks this device's VWs from the
shared assignment, `Worker.run_step` runs them one after another (forward,
`loss / V` backward; the last VW's backward sends gradient buckets as they
fill), `GradientSync.finish` waits for the sums and the step's statistics,
then the optimizer and scheduler step, and the statistics decide the next
assignment and whether a new generation starts after this step.
"""

from __future__ import annotations

import collections
import enum
import json
import math
import os
import pickle
import signal
import sys
import time
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from flexpar.core import balance, batching, ledger as sample_ledger
from flexpar.comm import state_transfer as training_state
from flexpar.comm.protocol import get_blob, get_json, join_proof, put_blob, tell_driver
from flexpar.worker.device_link import DeviceLink, DriverLost
from flexpar import recipes
from flexpar.callbacks import CALLBACK_STOP
from flexpar.worker.cost_planner import CostPlanner
from flexpar.errors import UserCodeError
from flexpar.worker.user_code import build_model, build_optimizer, loss_terms, model_digest, nonfinite_message
from flexpar.worker.loader import VirtualWorkerLoader, load_batch, to_device as _to_device
from flexpar.core.step_statistics import StatsLayout, mixed_loss_message, nonfinite_gradient_message
from flexpar.comm.gradient_sync import GradientSync, GroupReaper, PeerFailure, _collective, fresh_group
from flexpar.version import __version__
from flexpar.worker.state_keeping import WorkerCheckpoints
from flexpar.worker.evaluation_round import WorkerEvaluation
from flexpar.worker.records import RECORDS_KEPT, WorkerRecords
from flexpar.worker.settings import RunSettings, WorkerArgs


class Phase(enum.Enum):
    WARMING = "warming"
    WAITING = "waiting"
    FORMING = "forming"
    ACTIVE = "active"
    RECOVERING = "recovering"
    LEAVING = "leaving"
    STOPPING = "stopping"
    DONE = "done"


class _StopEarly:
    """What `Worker.train` returns when the members agreed to stop after a step."""


def _yield_cores() -> None:
    """A leaving device's teardown (gloo, threads, freeing its memory) runs at the lowest priority.

    On a host it shares with survivors, the survivors' next group forms while
    this process exits; the exit is not on anyone's critical path.
    """
    try:
        os.nice(19)
    except (AttributeError, OSError):  # no os.nice on this platform, or refused: exit at normal priority
        pass


class Worker(WorkerCheckpoints, WorkerEvaluation, WorkerRecords):
    """One device's training: its lifecycle (`Phase`), the step loop, the boundaries between generations.

    State capture and checkpoints, evaluation, and step records live in the
    mixins named for them (flexpar/worker_checkpoints.py, worker_evaluation.py,
    worker_records.py); the step itself, from `train` to the optimizer, is here.
    """

    def __init__(self, args: WorkerArgs, link: DeviceLink):
        self.args = args
        self.link = link
        self.phase = Phase.WARMING
        self.device = torch.device(args.device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.job = pickle.loads(get_blob(link.store, "job/payload", args.secret))
        self.settings = RunSettings(**get_json(link.store, "job/settings"))
        link.set_timeout(self.settings.timeout_s)  # a vanished driver is noticed within the job's timeout
        self.model = build_model(self.job).to(self.device)
        self.optimizer, self.scheduler = build_optimizer(self.job, self.model)
        self.sync = GradientSync(self.model, self.device, self.settings.bucket_mb, peer_lost=self._peer_lost)
        # Recipes (flexpar/recipes.py): checked for this device's type before anything runs;
        # the VWs' forward calls `forward_model` (compiled, or the model itself).
        recipes.check_mixed_precision(self.job, self.device.type)
        recipes.check_compile(self.job, self.device.type)
        self.forward_model = recipes.compiled(self.job, self.model)
        self.scaler = recipes.make_scaler(self.job)  # fp16 only; part of the training state
        self._grad_norm = 0.0  # of the step in flight's applied gradient (`_prepare_gradient`)
        self.reaper = GroupReaper()
        self.loader = VirtualWorkerLoader(self.job, self._plan, self.settings.total_steps,
                                          record_indices=self.settings.sample_ledger)
        self.balance_state = balance.BalanceState(seconds_per_vw={})
        # Job(sample_cost=...): each step's VW sets by predicted cost (flexpar/cost_planner.py).
        self.cost_planner = (CostPlanner(self.job, self.settings.total_steps) if self.job.sample_cost is not None
                             else None)
        self.generation = 0
        self.members: tuple = ()
        self.rank = 0
        self.assignment: tuple = ()
        self.committed = -1
        self.committed_wall = time.time()
        self.salt = link.store.get("job/salt").decode()
        self.proof = join_proof(args.secret, args.device_id, self.salt)
        # The step records of the last steps this device committed (every device keeps
        # them; rank 0 publishes). A rank 0 that dies may take queued records with it.
        self.recent_records: collections.deque = collections.deque(maxlen=RECORDS_KEPT)
        self.recovering = False  # the next generation follows a failed collective
        self.faults = {(int(step), phase): _SIGNALS[fault[3] if len(fault) > 3 else "kill"]
                       for fault in self.settings.faults for step, device, phase in [fault[:3]]
                       if device == args.device_id}

    def _peer_lost(self) -> Optional[str]:
        """A member of this generation that the coordinator knows is dead, if any."""
        if self.link.latest_generation != self.generation:
            return None
        lost = self.link.dead_members & set(self.members)
        return min(lost) if lost else None

    def _transfer_fault(self) -> None:
        self._fault_point("transfer", self.committed)

    # Boundary phases happen at some steps only: their faults fire at the first
    # such phase at or after their step.
    _BOUNDARY_PHASES = ("transfer", "formation", "checkpoint")

    def _fault_point(self, phase: str, step: int) -> None:
        """Fault injection by schedule: kill -9 (or SIGTERM) this device here, if the schedule says so.

        Each fault fires once: a step redone after a failure does not fire it again.
        """
        due = [key for key in self.faults if key[1] == phase and
               (key[0] == step or (phase in self._BOUNDARY_PHASES and key[0] <= step))]
        for key in due:
            number = self.faults.pop(key)
            # Said first, with the time: the fault soak measures detection from it.
            print(f"flexpar: fault: {self.args.device_id} gets {signal.Signals(number).name} at step {step} "
                  f"({phase}) at {time.time():.6f}", file=sys.stderr, flush=True)
            os.kill(os.getpid(), number)

    # ------------------------------------------------------------ lifecycle

    def run(self) -> None:
        try:
            self._run()
        except DriverLost:
            if self.phase is Phase.STOPPING:
                raise  # the members stopped together and said where the state is
            # Lost outside a healthy step (waiting, forming, or a collective failed with it):
            # no peer can be asked who is alive, so every member writes what it committed.
            if self.committed >= 0 and self.members:
                self._rescue(self.committed, agreed=False)
            else:
                self._say("the job's driver is gone; this device held no committed state")
            raise

    def _run(self) -> None:
        proof = self.proof
        self.link.send("announce", proof=proof, remote=self.args.remote)
        warmup_s = self.warm_up()
        self.link.send("ready", proof=proof, digest=model_digest(self.model),
                       version=__version__, warmup_s=warmup_s)
        self.phase = Phase.WAITING
        generation, record = self.link.wait_for_generation(0, joining=True)
        # Devices of generation 1 built the same model from the same seed: step 0 is
        # committed everywhere. Later joiners hold nothing yet and receive the state.
        self.committed = 0 if generation == 1 else -1
        if generation == 1 and self.settings.resume_path and record["members"][0] == self.args.device_id:
            self._restore(training_state.read_checkpoint(self.settings.resume_path, self.device))
        while True:
            try:
                self.phase = Phase.FORMING
                self.enter(generation, record)
                self.phase = Phase.ACTIVE
                upcoming = self.train()
                if upcoming is None:
                    self.finish()
                    return
                if isinstance(upcoming, _StopEarly):
                    self.stop_early()
                    return
                generation, record = upcoming
                if self.args.device_id not in record["members"]:
                    self.phase = Phase.LEAVING
                    _yield_cores()
                    return
                continue
            except PeerFailure as failure:
                self.phase = Phase.RECOVERING
                self.recovering = True
                self.optimizer.zero_grad(set_to_none=True)
                self.link.send("failure", generation=generation, step=self.committed,
                               error=str(failure)[:500])
            # Outside the except block, whose traceback holds the broken group's works.
            self.reaper.retire(self.sync.release_works())()
            generation, record = self.link.wait_for_generation(generation, joining=False)

    def warm_up(self) -> float:
        """One forward and backward of one VW, no update: pays start-up costs off the critical path."""
        started = time.perf_counter()
        indices = batching.virtual_worker_indices(
            self.job.seed, 0, 0, len(self.job.dataset), self.job.global_batch, self.job.virtual_workers
        )
        batch = _to_device(load_batch(self.job, indices, batching.data_seed(self.job.seed, 0, 0)), self.device)
        buffers = [buffer.clone() for buffer in self.model.buffers()]  # BatchNorm must not count it
        try:  # under the step's autocast: with compile=True, this compiles the graph the steps run
            with recipes.autocast(self.job, self.device.type):
                result = self.job.loss(self.forward_model, batch)
            terms = loss_terms(result, 0, 0)
            terms.tensor.backward()
            # A token-weighted loss needs its counts summed exactly (flexpar/sync.py). Every device
            # warms up on the same batch, so every device takes the same collectives.
            self.sync.exact_stats = terms.count is not None
        except Exception as error:
            if self.job.compile and recipes.is_compile_error(error):
                raise UserCodeError(f"torch.compile failed on device {self.args.device_id} during its warm-up "
                                    f"({type(error).__name__}: {str(error).strip()[:2000]}); run without "
                                    "compile=True, or try compile_options={'backend': 'aot_eager'}") from error
            raise
        self.optimizer.zero_grad(set_to_none=True)
        with torch.no_grad():
            for buffer, saved in zip(self.model.buffers(), buffers):
                buffer.copy_(saved)
        return time.perf_counter() - started

    def enter(self, generation: int, record: dict) -> None:
        """Form the generation's process group and bring every member to the same state."""
        self.link.check()
        members = tuple(record["members"])
        rank = members.index(self.args.device_id)
        self._fault_point("formation", self.committed)
        # Forming a gloo group waits for every member inside C++, where a member's
        # death is only seen at the timeout. Meet in the store first, where it is
        # seen at once (the coordinator's death notices), then form in milliseconds.
        problem = self.link.gather(generation, members)
        if problem:
            raise PeerFailure(problem)
        with fresh_group(self.reaper.retire(self.sync.release_works()), self.settings.backend,
                         dist.PrefixStore(f"gen/{generation}/pg", self.link.store), rank, len(members),
                         self.settings.timeout_s):
            self.link.send("formed", generation=generation)
            stock = _collective(lambda: training_state.take_stock(
                self.committed, self.committed_wall, rank, len(members), self.device))
            if stock.receivers:
                self._level(stock, rank, len(members))
        previous_members = self.members
        self.generation, self.members, self.rank = generation, members, rank
        self.sync.start_generation(len(members))
        if rank == 0:
            # The previous rank 0 may have died with records unsent, or this device may
            # have been brought level without committing the last ones: send them again
            # (the driver drops steps it already has).
            for kept in self.recent_records:
                self.link.publish(kept)
            self._publish_generation_event(record, previous_members, max(0.0, time.time() - stock.last_commit_wall))

    def _level(self, stock: training_state.Stock, rank: int, world_size: int) -> None:
        """Send the latest state from the source to the members behind it."""
        if rank == stock.source:
            state = self._capture()
            _collective(lambda: training_state.send_state(state, stock.receivers, self.device,
                                                          after_size=self._transfer_fault))
        elif rank in stock.receivers:
            # A joiner holds nothing committed: it receives the model in place. A member
            # that is only behind keeps its own state intact until the new one is whole.
            own = self.model.state_dict() if self.committed < 0 else None
            self._restore(_collective(lambda: training_state.receive_state(stock.source, self.device, own)))
        # The stall ends when the slowest receiver has restored.
        _collective(lambda: training_state.all_level(world_size, self.device))

    def finish(self, stopped: str = "", checkpoint: str = "") -> None:
        self.phase = Phase.DONE
        self._checkpoint_writer_now().wait()  # the checkpoint "done" names exists before the job ends
        if self.rank == 0:
            data = training_state.to_bytes({"model": self.model.state_dict(), "step": self.committed})
            put_blob(self.link.store, "result", data, self.args.secret)
            self.link.flush()
            tell_driver(self.link.store, "done", json.dumps({"step": self.committed, "stopped": stopped,
                                                                     "checkpoint": checkpoint}))

    def stop_early(self) -> None:
        """Every member committed the same step and stops: the driver asked, or is gone."""
        self.phase = Phase.STOPPING
        if self.link.driver_lost:
            self._rescue(self.committed, agreed=True)
            raise DriverLost("the job's driver is gone")
        # Another member may have seen the request first: ask the store for its words,
        # so that every member agrees on the reason (a callback's stop evaluates once more).
        reason = (self._verdict_stop or self.link.finish_reason or self.link.read_finish_reason()
                  or "the driver asked to stop")
        if reason.startswith(CALLBACK_STOP) and self._evaluation_due(final=True):
            self.evaluate(ask_driver=False)  # a callback's stop ends as the last step does
        checkpoint = ""
        if self.rank == 0:
            if self.settings.checkpoint_dir:
                checkpoint = self._write_checkpoint(self.settings.checkpoint_dir)
            self._publish_event("stop", f"{reason}; stopped after step {self.committed}"
                                + (f", checkpoint {checkpoint}" if checkpoint else ""), 0.0)
        self.finish(stopped=reason, checkpoint=checkpoint)

    def _say(self, message: str) -> None:
        print(f"flexpar: device {self.args.device_id}: {message}", file=sys.stderr, flush=True)

    # ------------------------------------------------------------ training

    def _plan(self, step: int) -> range:
        """This device's VWs at `step` as currently known (the loader prefetches along it)."""
        if self.cost_planner is not None:  # known ahead: planned rates move only past the noise
            return self.cost_planner.assignment(step, self.members)[self.rank] if self.members else ()
        return batching.virtual_workers_of(self.assignment, self.rank) if self.assignment else range(0)

    def train(self) -> Optional[tuple]:
        """Run steps until the last one (returns None) or an agreed new generation.

        Returns the new generation's number and record. A planned leaver learns
        that it leaves from the step's statistics and returns before that
        step's optimizer update (see `_skips_last_update`).
        """
        while self.committed < self.settings.total_steps:
            if self._evaluation_due():  # the model of the step boundary, in this generation
                if self.evaluate(ask_driver=self.settings.eval_verdict):
                    return _StopEarly()
            self.link.check(driver_loss_handled=True)
            if self.cost_planner is not None:  # by cost: this step's own VW sets, any VWs per device
                sets = self.cost_planner.assignment(self.committed, self.members)
                assignment, mine = tuple(len(members) for members in sets), sets[self.rank]
            else:
                assignment = balance.next_assignment(
                    self.balance_state, self.members, self.job.virtual_workers
                )
                if self.rank == 0 and self.assignment and assignment != self.assignment and \
                        tuple(self.balance_state.device_ids) == self.members:
                    self._publish_event("rebalance", f"{list(self.assignment)} -> {list(assignment)}", 0.0)
                mine = batching.virtual_workers_of(assignment, self.rank)
            self.assignment = assignment
            step = self.committed
            summed = self.run_step(step, mine)
            world = len(self.members)
            slots = StatsLayout(world)
            busy = summed[slots.busy].tolist()
            seen = summed[slots.seen].tolist()
            loss = float(summed[slots.loss])
            bad = [int(value) for value in summed[slots.bad].tolist() if value > 0]
            if bad:
                raise UserCodeError(nonfinite_message(step, min(bad) - 1))
            pairs, count = round(float(summed[slots.pairs])), float(summed[slots.count])
            if 0 < pairs < self.job.virtual_workers:  # each device ran one kind; they differ
                raise UserCodeError(mixed_loss_message(step))
            if pairs:
                loss /= count  # the token mean of the whole global batch
            # Stopping early (asked by the driver, or it is gone) wins over a new
            # generation: every member commits this step, then stops.
            stopping = float(summed[slots.stop]) > 0
            target = int(max(seen))
            upcoming = (target, self.link.generation(target)) if target > self.generation and not stopping else None
            if upcoming is not None and self._skips_last_update(upcoming[1]):
                return upcoming
            if world > 1:
                self._set_buffers(summed[slots.buffers] / world)
            grad_norm, skip = self._verdict_on_gradient(summed, slots, step)
            if not skip:
                self.optimizer.step()
                if self.scheduler is not None:
                    self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.committed += 1
            now = time.time()
            step_time, self.committed_wall = now - self.committed_wall, now
            self.balance_state = balance.observe(self.balance_state, self.members, assignment, busy)
            self.recent_records.append(self._step_record(step, loss, step_time, busy, assignment, grad_norm))
            if self.settings.sample_ledger:
                self.recent_records[-1]["ledger"] = self._step_samples
            moved = self._observe_costs(step, sets, busy) if self.cost_planner is not None else ""
            if self.rank == 0:
                self.link.publish(self.recent_records[-1])
                if moved:  # a planned rate moved past the noise: the plans of later steps change
                    self._publish_event("rebalance", moved, 0.0)
                self._maybe_checkpoint()
            if stopping:
                return _StopEarly()
            if upcoming is not None:
                return upcoming
        if self._evaluation_due():  # after the last step
            self.evaluate(ask_driver=False)
        return None

    def _observe_costs(self, step: int, sets: tuple, busy: list) -> str:
        """By cost: the step's costs and VW sets go into its record, its busy times into the rates.

        Returns the rebalance event's detail when a planned rate moved, else "".
        """
        record = self.recent_records[-1]
        record["cost"] = self.cost_planner.device_costs(step, sets)
        record["virtual_worker_sets"] = [list(members) for members in sets]
        return self.cost_planner.observe(step, self.members, sets, busy)

    def _prepare_gradient(self, summed: torch.Tensor, dense_sums: Optional[list]):
        """Make the summed gradient the one to apply: divided by the global count (pairs) and the
        loss scale (fp16), measured, clipped (flexpar/recipes.py).

        Called by `GradientSync.finish` with the summed statistics and the dense
        sums before they are written back (it returns the clip's multiplier,
        which the write-back applies), or, on one device, with `dense_sums`
        None after the step's backward. Everything here is a function of the
        summed gradient and statistics, which every device holds alike.
        """
        slots = StatsLayout(len(self.members))
        pairs, count = round(float(summed[slots.pairs])), float(summed[slots.count])
        scale = self.scaler.scale if self.scaler is not None else 1.0
        factor = 1.0 / ((count if pairs else 1.0) * scale) if (pairs or scale != 1.0) else 1.0
        if dense_sums is None:
            self._grad_norm = recipes.finish_gradients(self.sync.dense, self.sync.sparse, factor,
                                                       self.job.max_grad_norm)
            return None
        self._grad_norm, multiplier = recipes.prepare_gradients(dense_sums, self.sync.sparse, factor,
                                                                self.job.max_grad_norm)
        return multiplier

    def _verdict_on_gradient(self, summed: torch.Tensor, slots: "StatsLayout", step: int) -> tuple:
        """(the applied gradient's norm before clipping, whether every device skips this step).

        fp16: a step is skipped (no optimizer or scheduler step) when a device's
        own gradient overflowed (the statistics say so) or the sum is not
        finite, and the loss scale backs off; otherwise it may grow. Without a
        loss scaler a non-finite summed gradient stops the job here, naming the
        step: applied, it would make the next step's loss fail and blame that
        step. Every device reads the same statistics and norm: every device agrees.
        """
        norm = self._grad_norm
        if self.scaler is None:
            if not math.isfinite(norm):
                raise UserCodeError(nonfinite_gradient_message(step, norm))
            return norm, False
        skip = float(summed[slots.overflow]) > 0 or not math.isfinite(norm)
        self.scaler.update(found_inf=skip)
        return norm, skip

    def _skips_last_update(self, upcoming_record: dict) -> bool:
        """Whether this device leaves at this boundary and need not apply this step.

        Every survivor commits the step, so a planned leaver's own copy of it
        is never needed; skipping the update (100 ms for a 25M-parameter Adam
        step on a contended CPU) leaves the host's cores to the survivors,
        whose next generation forms meanwhile. Rank 0 still commits: it
        publishes the step's record and writes checkpoints.
        """
        return self.rank != 0 and self.args.device_id not in upcoming_record["members"]

    def run_step(self, step: int, virtual_workers: Sequence[int]) -> torch.Tensor:
        """Run this device's VWs of `step` and sum gradients and statistics across devices."""
        job = self.job
        world = len(self.members)
        self.sync.reset()
        ledger = sample_ledger.count_vector(len(job.dataset)) if self.settings.sample_ledger else None
        busy = 0.0
        loss_sum = 0.0
        first_bad = 0
        # Recipes: a scalar loss backpropagates loss / V, a pair (loss_sum, count) its
        # loss_sum (the division by the global count follows the sum across devices);
        # fp16 multiplies either by the loss scale.
        scale = self.scaler.scale if self.scaler is not None else 1.0
        pairs, count, first_kind = 0, 0.0, None
        last = virtual_workers[-1]
        for virtual_worker in virtual_workers:
            started = time.perf_counter()
            batch = _to_device(self.loader.batch(step, virtual_worker), self.device)
            if ledger is not None:
                # What the loader really loaded (its DataLoader carried the indices with the
                # batch), not the plan's indices: a wrong or stale batch shows in the audit.
                ledger[self.loader.loaded_indices] += 1.0
            self._seed_model_randomness(batching.virtual_worker_seed(job.seed, step, virtual_worker))
            if virtual_worker == last:
                self.sync.arm()
            self._fault_point("forward", step)
            with recipes.autocast(job, self.device.type):
                result = job.loss(self.forward_model, batch)
            loss, value, vw_count = loss_terms(result, step, virtual_worker)
            if first_kind is None:
                first_kind = (virtual_worker, vw_count is not None)
            elif first_kind[1] != (vw_count is not None):
                raise UserCodeError(mixed_loss_message(step, first_kind, virtual_worker))
            if (step, "backward") in self.faults and loss.requires_grad:
                loss.register_hook(lambda grad: self._fault_point("backward", step))
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
        buffers = self._buffer_vector() if world > 1 else torch.zeros(0, dtype=torch.float64)
        slots = StatsLayout(world)
        stats = torch.zeros(slots.size + buffers.numel(), dtype=torch.float64)
        stats[slots.buffers] = buffers
        stats[slots.busy.start + self.rank] = busy
        stats[slots.seen.start + self.rank] = self.link.latest_generation
        stats[slots.loss] = loss_sum
        stats[slots.bad.start + self.rank] = first_bad
        stats[slots.stop] = 1.0 if (self.link.finish_reason is not None or self.link.driver_lost) else 0.0
        stats[slots.count] = count
        stats[slots.pairs] = pairs
        if self.scaler is not None:  # fp16: this device's own gradient overflowed (all skip the step)
            stats[slots.overflow] = float(recipes.has_nonfinite(self.sync.dense, self.sync.sparse))
        summed = self.sync.finish(stats.to(self.device), before_wait=lambda: self._fault_point("sync", step),
                                  scale=self._prepare_gradient)
        if world == 1:  # nothing was summed: this device's gradient is the step's
            self._prepare_gradient(summed, None)
        if ledger is not None:
            # Tests and the fault soak only: its own all-reduce, so the ledger never
            # changes the step's statistics vector.
            if world > 1:
                ledger = ledger.to(self.device)
                _collective(lambda: dist.all_reduce(ledger))
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

    # ------------------------------------------------------------ buffers

    # The BatchNorm rule: normalisation uses each VW's own batch statistics, so
    # gradients and parameters do not depend on the device set. Running
    # statistics (buffers) are updated by each device over its own VWs and then
    # averaged across devices every step, riding in the statistics vector. With
    # one device they equal the single-process run exactly; with several, they
    # are the mean of per-device running averages (close, not identical).

    def _buffer_vector(self) -> torch.Tensor:
        buffers = [buffer.detach().reshape(-1).to("cpu", torch.float64) for buffer in self.model.buffers()]
        return torch.cat(buffers) if buffers else torch.zeros(0, dtype=torch.float64)

    def _set_buffers(self, averaged: torch.Tensor) -> None:
        offset = 0
        for buffer in self.model.buffers():
            part = averaged[offset : offset + buffer.numel()].view(buffer.shape)
            if not buffer.dtype.is_floating_point:
                part = part.round()
            buffer.copy_(part.to(buffer.device, buffer.dtype))
            offset += buffer.numel()

_SIGNALS = {"kill": signal.SIGKILL, "term": signal.SIGTERM, "stop": signal.SIGSTOP}


