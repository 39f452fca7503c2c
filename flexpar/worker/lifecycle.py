"""One device's training from start to exit: its lifecycle.

Its phases and the transitions between them are flexpar/worker/phase.py's
`Phase`; `Worker.run` moves the device through them.

The step itself, from the VWs to the optimizer update, is flexpar/worker/step_loop.py
(`StepLoop.train`, which `Worker.run` calls once the device is active) and
step_run.py; the boundary between generations (`Boundaries.enter`: FORMING ->
ACTIVE) is flexpar/worker/boundaries.py, a sharded job's part of it
shard_levelling.py; waiting for a restarted driver (ORPHANED) is
flexpar/worker/orphan.py; the scheduled faults, fault_injection.py.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import socket
import time
from typing import Optional

import torch
import torch.distributed as dist

from flexpar.callbacks import CALLBACK_STOP
from flexpar.comm import state_transfer as training_state
from flexpar.comm.collectives import GroupReaper, PeerFailure, collective, wait_for_collective
from flexpar.comm.protocol import adopt_proof, get_blob, get_json, join_proof, put_blob, tell_driver
from flexpar.core import adoption
from flexpar.data import is_stream
from flexpar.version import __version__
from flexpar.worker import checkpoints, orphan
from flexpar.worker.boundaries import Boundaries
from flexpar.worker.committed import CommittedStep
from flexpar.worker.cost_planner import CostPlanner
from flexpar.worker.data_streams import DataStreams
from flexpar.worker.determinism import ExactSteps
from flexpar.worker.device_link import DeviceLink, DriverLost, Evicted
from flexpar.worker.evaluator import Evaluation
from flexpar.worker.fault_injection import FaultSchedule
from flexpar.worker.gradient import AppliedGradient
from flexpar.worker.host import say, yield_cores
from flexpar.worker.loader import VirtualWorkerLoader
from flexpar.worker.membership import Membership
from flexpar.worker.owners import Owners
from flexpar.worker.phase import Phase
from flexpar.worker.records import RecordQueue
from flexpar.worker.settings import RunSettings, WorkerArgs
from flexpar.worker.shard_levelling import ShardLevelling
from flexpar.worker.shard_streaming import ShardStreaming
from flexpar.worker.shards import zero_grad
from flexpar.worker.state_keeping import Checkpoints, TrainingState
from flexpar.worker.step_loop import StepLoop, StopEarly
from flexpar.worker.step_run import StepRun
from flexpar.worker.stream_session import StreamSession
from flexpar.worker.streaming import StreamedJoin
from flexpar.worker.training import build_training
from flexpar.worker.warm_up import identity, warm_up


class Worker:
    """One device's training: it builds the components and moves the device through its phases (`Phase`).

    Each piece of the device's state has one owner (owners.py: the
    membership, the committed step, the records, the faults, the stream
    session, the checkpoints, the evaluation, the applied gradient, the
    exact steps, the cost planner, a streaming job's data streams; the shard holdings are the
    `ShardedOptimizer`'s), built here and handed to the parts that carry
    out the work: the joins (`streamed_join`, `shard_levelling`,
    `shard_streaming`), the boundaries (`boundaries`) and the steps
    (`step_loop`). docs/internals.md draws who calls whom. The worker's own
    fields are its phase, its driver's salt and proof, and the run
    settings (replaced when a restarted driver re-adopts the device, so
    handed to each call that reads them).
    """

    def __init__(self, args: WorkerArgs, link: DeviceLink):
        self.args = args
        self.link = link
        self.membership = Membership(link)  # the generation it trains in (membership.py)
        self.phase = Phase.WARMING
        self.device = torch.device(args.device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.job = pickle.loads(get_blob(link.store, "job/payload", args.secret))
        self.settings = RunSettings(**get_json(link.store, "job/settings"))
        # A vanished driver is noticed within the job's timeout; a lost one is waited for driver_grace_s.
        link.configure(self.settings.timeout_s, self.settings.driver_grace_s)
        training = build_training(self.job, self.device, self.settings.bucket_mb, self.membership.peer_lost)
        self.model, self.frozen, self._ready_s = training.model, training.frozen, training.ready_s
        self.optimizer, self.scheduler = training.optimizer, training.scheduler
        self.shards, self.sync, self.exact = training.shards, training.sync, training.exact
        self.forward_model, self.scaler = training.forward_model, training.scaler
        self.reaper = GroupReaper()
        # A streaming dataset: one owner of every VW stream and its committed position (data_streams.py).
        self.data_streams = DataStreams(self.job, self._say) if is_stream(self.job.dataset) else None
        self.loader = self.data_streams or VirtualWorkerLoader(
            self.job,
            lambda step: self.step_loop.plan(step),
            self.settings.total_steps,
            record_indices=self.settings.sample_ledger,
        )
        # Job(sample_cost=...): each step's VW sets by predicted cost (flexpar/worker/cost_planner.py).
        self.cost_planner = (
            CostPlanner(self.job, self.settings.total_steps) if self.job.sample_cost is not None else None
        )
        self.salt = link.store.get("job/salt").decode()
        self.proof = join_proof(args.secret, args.device_id, self.salt)
        # The owners of the device's state (owners.py), then the parts that carry out its work with them.
        self.committed = CommittedStep()  # the last committed step, its time and balance (committed.py)
        self.faults = FaultSchedule(args.device_id, self.settings, args.remote, link.starve_follower)
        self.streams = StreamSession()  # a streamed join in flight (stream_session.py)
        self.records = RecordQueue(link)  # kept until the driver acknowledges them (records.py)
        self.state = TrainingState(
            self.job, training, self.committed, self.records, self.cost_planner, self.data_streams
        )
        self.checkpoints = Checkpoints(self.state, self.shards, self.faults, self._say)
        self.evaluation = Evaluation(self.job, self.model, self.device, link, self.records, self.faults)
        # Job(deterministic=True): the step's exact-sum checks and digests (determinism.py).
        exact_steps = ExactSteps(self.exact, self.model, self.device, self.records) if self.exact is not None else None
        owners = Owners(
            self.membership,
            self.committed,
            self.records,
            self.faults,
            self.streams,
            self.state,
            self.checkpoints,
            self.evaluation,
            AppliedGradient(self.job, self.sync, self.scaler),  # the gradient a step applies (gradient.py)
            exact_steps,
            self.cost_planner,
            self.data_streams,
        )
        joins = (StreamedJoin(training, owners, self.device, args.device_id), None, None)  # streaming.py
        if self.shards is not None:  # Job(shard_optimizer=...): the chunks levelled, and streamed to joiners
            levelling = ShardLevelling(
                self.job, training, owners, self.device, args.device_id, lambda *step: self.step_loop.commit_step(*step)
            )
            joins = (joins[0], levelling, ShardStreaming(training, owners, self.device, levelling, joins[0]))
        self.streamed_join, self.shard_levelling, self.shard_streaming = joins
        self.boundaries = Boundaries(link, training, owners, self.device, args.device_id, self.reaper, joins)
        step_run = StepRun(
            self.job, args, self.device, link, training, self.loader, owners, self.settings.sample_ledger
        )
        self.step_loop = StepLoop(
            self.job,
            args,
            link,
            training,
            owners,
            step_run,
            joins,
            self.settings.total_steps,
            self.settings.sample_ledger,
        )
        self._warmup_s: Optional[float] = None  # set once warm

    # ------------------------------------------------------------ lifecycle

    def run(self) -> None:
        """The device's whole life (`Phase`); returns when it is done or leaves, raises to end the process."""
        generation, record = self._admitted()
        while True:
            try:
                try:
                    departing = self.args.device_id not in record["members"]
                    self.phase = Phase.LEAVING if departing else Phase.FORMING
                    self.boundaries.enter(generation, record, self.settings)
                    if departing:  # a planned leaver of a sharded job: its state is handed over
                        self.link.send("handed_off", generation=generation)
                        yield_cores()
                        return
                    self.phase = Phase.ACTIVE
                    upcoming = self.step_loop.train(self.settings)
                    if upcoming is None:
                        self.finish()
                        return
                    if isinstance(upcoming, StopEarly):
                        if self.link.driver_lost:  # the members stopped together: the step in flight committed
                            raise DriverLost("the job's driver is gone", agreed=True)
                        self.stop_early()
                        return
                    generation, record = upcoming
                    if self.args.device_id not in record["members"] + record.get("departing", []):
                        self.phase = Phase.LEAVING
                        yield_cores()
                        return
                    continue
                except PeerFailure as failure:
                    self.phase = Phase.RECOVERING
                    self.records.note_failure()
                    # Sharded: a step whose gradient every member holds may still be finished (shard_levelling.py).
                    zero_grad(self.optimizer, self.shards, keep_gradient=self._holds_pending_step())
                    # A stream in flight breaks off; the next boundary decides whether it goes on (streaming.py).
                    streamed = self.streams.suspend()
                    self.link.send(
                        "failure",
                        generation=generation,
                        step=self.streams.held_step(self.committed.step),
                        error=str(failure)[:500],
                    )
                # Outside the except block, whose traceback holds the broken group's works.
                self.reaper.retire(self.sync.release_works() + streamed)()
                generation, record = self.link.wait_for_generation(generation, joining=False)
            except DriverLost as lost:
                generation, record = self._orphaned(agreed=lost.agreed)

    def _orphaned(self, agreed: bool) -> tuple:
        """ORPHANED: the state in order, then the wait for a restarted driver (flexpar/worker/orphan.py);
        returns the generation (number, record) it re-adopted this device into."""
        self.phase = Phase.ORPHANED
        # A joiner still listening holds no committed state of its own: it reports none, writes no rescue.
        streamed = self.boundaries.abandon_stream()
        abandoned = self.committed.break_off()
        # Sharded: a step whose summed gradient every member holds may still be finished (shard_levelling.py).
        zero_grad(self.optimizer, self.shards, keep_gradient=self._holds_pending_step())
        seen = self.link.latest_generation
        lost_at = self.link.lost_at or time.time()
        holds = self.committed.step >= 0 and bool(self.membership.members)
        # Faults aimed at the lost driver are spent: a re-adopted rank 0 must not fire them at the next,
        # nor the rescue checkpoint below at the lost one's pid.
        self.faults.spend_driver_faults(self.committed.step)
        # Written while the old group still stands (agreed: every member is there).
        path = (
            self.checkpoints.rescue(self.settings, agreed, self.membership.rank, self.membership.members)
            if holds
            else ""
        )
        self.reaper.retire(self.sync.release_works() + streamed)()
        generation, record, salt, settings = orphan.wait_for_a_driver(
            self.link,
            self.args,
            orphan.as_it_is(self.settings, self.membership.members),
            path,
            self.committed.step,
            self.membership.generation,
            seen,
            lost_at,
            lambda salt: self._adoption_report(seen, lost_at, abandoned, salt),
            self._say,
        )
        # The restarted driver's salt (proofs) and settings (checkpoints, timeouts, the eval verdict, the
        # resume command); this device's own remaining faults stay.
        self.salt = salt
        self.proof = join_proof(self.args.secret, self.args.device_id, salt)
        self.settings = dataclasses.replace(RunSettings(**settings), faults=self.settings.faults)
        self.faults.new_driver(self.settings.driver_pid)
        self.link.configure(self.settings.timeout_s, self.settings.driver_grace_s)
        where = orphan.address(self.settings, self.args)
        self._say(f"re-adopted by the restarted driver at {where} (generation {generation})")
        return generation, record

    def _adoption_report(self, seen: int, lost_at: float, abandoned: bool, salt: str) -> dict:
        """What this device tells a restarted driver (core.adoption.DeviceReport's fields, and who it is)."""
        return {
            "generation": self.membership.generation,
            "members": list(self.membership.members),
            "seen": max(seen, self.membership.generation),
            "committed": self.committed.step,
            "warm": self._warmup_s is not None,
            "lost_at": lost_at,
            "abandoned": abandoned,
            "proof": adopt_proof(self.args.secret, self.args.device_id, salt),
            "fingerprint": adoption.fingerprint(self.job, self.settings, __version__),
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "remote": self.args.remote,
            "device": self.args.device,
            **identity(self.model, self.frozen, self._warmup_s),
        }

    def _admitted(self) -> tuple:
        """Announce, warm up, say ready, and wait to be let in: the first generation that holds this device.

        A driver lost meanwhile is waited for (ORPHANED) like a member's: the
        warm-up needs no driver, and a restarted one lets this joiner in.
        SIGTERM on the way (`withdrawing`): before the announcement the device
        goes without a word to the coordinator; after it, it skips what is
        left of its warm-up and its "ready", and waits for the coordinator's
        answer to its leave request (flexpar.worker.device_link: sent only once
        announced): cancelled, or, if it was being let in at that moment, a
        member that leaves at its first step boundary.
        """
        self.faults.fire("announce", 0, self.membership.members)
        if self.withdrawing:
            raise Evicted("asked to stop before it announced itself")
        try:
            self.link.send("announce", proof=self.proof, remote=self.args.remote)
        except DriverLost:
            pass  # it reports to a restarted driver instead, once warm
        finally:
            self.link.announced = True
        self.faults.fire("warmup", 0, self.membership.members)
        if not self.withdrawing:
            self._warmup_s = warm_up(
                self.job,
                self.model,
                self.forward_model,
                self.device,
                self.sync,
                self.frozen,
                lambda: zero_grad(self.optimizer, self.shards),
                self.args.device_id,
            )
        try:
            if not self.withdrawing:
                self.link.send(
                    "ready", proof=self.proof, **identity(self.model, self.frozen, self._warmup_s, self._ready_s)
                )
                self.phase = Phase.WAITING
                self.faults.fire("ready", 0, self.membership.members)
            generation, record = self.link.wait_for_generation(0, joining=True)
        except DriverLost:
            return self._orphaned(agreed=False)
        self.faults.fire("admitted", 0, self.membership.members)
        # Devices of generation 1 built the same model from the same seed: step 0 is
        # committed everywhere. Later joiners hold nothing yet and receive the state.
        self.committed.admitted(first_generation=generation == 1)
        if generation == 1 and self.settings.resume_path:
            if self.shards is not None:  # every member reads its own chunks
                self.shard_levelling.resume(tuple(record["members"]), self.settings)
            elif record["members"][0] == self.args.device_id:
                self.state.restore(checkpoints.read_checkpoint(self.settings.resume_path, self.device))
        return generation, record

    def _holds_pending_step(self) -> bool:
        """Sharded: a step whose summed gradient every member holds, not applied here (shard_levelling.py)."""
        return self.shard_levelling is not None and self.shard_levelling.pending_commit is not None

    @property
    def withdrawing(self) -> bool:
        """SIGTERM came before this device was let in: it stops on its way instead of joining."""
        return self.link.leave_requested_at is not None and self.phase in (Phase.WARMING, Phase.WAITING)

    def finish(self, stopped: str = "", checkpoint: str = "") -> None:
        self.phase = Phase.DONE
        self.checkpoints.writer_now(self.settings).wait()  # the checkpoint "done" names exists before the job ends
        done = json.dumps({"step": self.committed.step, "stopped": stopped, "checkpoint": checkpoint})
        if self.membership.rank == 0:  # the result before the last all-reduce: a rank 0 lost after it leaves it
            data = training_state.to_bytes({"model": self.state.model_state(), "step": self.committed.step})
            with self.link.driver_needed():  # a driver lost now: a restarted one gets the result
                put_blob(self.link.store, "result", data, self.args.secret)
                self.link.flush()
                tell_driver(self.link.store, "finishing", done)  # flexpar/driver/driver_loop.py `_end_key`
        if self.shards is not None and len(self.membership.members) > 1:
            # Sharded: every member writes its own part; the job ends once all are written.
            flag = torch.zeros(1, device=self.device)
            wait_for_collective(collective(lambda: dist.all_reduce(flag, async_op=True)), self.membership.peer_lost)
            self.faults.fire("finish", self.committed.step, self.membership.members)  # tests: after the last sum
        # The job is over (membership.Finished): said before this process exits, so that the coordinator
        # takes the exit for the normal end it is and publishes no generation after the last step. Only
        # rank 0 needs a driver for its end (DriverLost: ORPHANED, then a restarted driver gets the result).
        if self.membership.rank == 0 or not self.link.driver_lost:
            try:
                self.link.send("finished", rank=self.membership.rank)
            except DriverLost:
                if self.membership.rank == 0:
                    raise
        if self.membership.rank == 0:
            with self.link.driver_needed():
                tell_driver(self.link.store, "done", done)

    def stop_early(self) -> None:
        """Every member committed the same step and stops: the driver asked (SIGTERM to it, a callback)."""
        self.phase = Phase.STOPPING
        # Another member may have seen the request first: ask the store for its words,
        # so that every member agrees on the reason (a callback's stop evaluates once more).
        reason = (
            self.evaluation.verdict_stop
            or self.link.finish_reason
            or self.link.read_finish_reason()
            or "the driver asked to stop"
        )
        if reason.startswith(CALLBACK_STOP) and self.evaluation.due(
            self.committed.step, self.membership.generation, self.settings, final=True
        ):
            self.step_loop.evaluate(self.settings, ask_driver=False)  # a callback's stop ends as the last step does
        checkpoint = ""
        # Sharded: every member writes its part (a listening joiner holds none)
        if self.shards is not None and self.settings.checkpoint_dir and not self.streams.listening():
            checkpoint = self.checkpoints.write(
                self.settings, self.settings.checkpoint_dir, self.membership.rank, self.membership.members
            )
        if self.membership.rank == 0:
            if self.settings.checkpoint_dir and self.shards is None:
                checkpoint = self.checkpoints.write(
                    self.settings, self.settings.checkpoint_dir, self.membership.rank, self.membership.members
                )
            self.records.publish_event(
                "stop",
                f"{reason}; stopped after step {self.committed.step}"
                + (f", checkpoint {checkpoint}" if checkpoint else ""),
                0.0,
                step=self.committed.step,
                generation=self.membership.generation,
                members=self.membership.members,
            )
        self.finish(stopped=reason, checkpoint=checkpoint)

    def _say(self, message: str) -> None:
        say(f"flexpar: device {self.args.device_id}: {message}")
