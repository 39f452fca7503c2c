"""A sharded job's worker at its boundaries and around its update (Job(shard_optimizer=True)).

`ShardLevelling` carries it out for the worker. The pieces, in the order a
step meets them:

- `confirm_gradient`: after the gradient all-reduce and before anything
  changes, one more tiny all-reduce. A member that completes it knows every
  member holds the step's summed gradient and statistics. A member that fails
  in it keeps that gradient (`pending_commit`): if another member committed
  the step (`take_stock` at the next boundary says so), it finishes the step
  itself, bit-identical to the others, instead of needing its chunks sent.
  This is how a failure that split a commit (the all-reduce completed on some
  members and not on others) loses nothing even where every surviving copy of
  a chunk is on a member that did not commit it.
- `broadcast_parameters`: after the update, each chunk's primary sends its
  updated parameter values to every member (flexpar/comm/shard_transfer.py);
  until then the member's `ShardedOptimizer.values_complete` is False.
- `level`: at a boundary, every member reports what it holds, the
  pure plan (flexpar/core/shard_plan.py) says who sends what, one
  many-to-many exchange moves it, and once every member has passed, each keeps
  exactly its chunks of the new partition. Until then a member holds what it
  had and what it received together, so a failure in the middle of a
  boundary leaves every piece on the members that held it or received it.
- `resume`: a resumed job's first generation reads each member's own
  chunks from the checkpoint (flexpar/worker/checkpoints.py).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from flexpar.comm import state_transfer as training_state
from flexpar.comm.collectives import collective, wait_for_collective
from flexpar.comm.shard_transfer import broadcast_chunks, exchange, gather_reports
from flexpar.core.shard_partition import Partition, partition
from flexpar.core.shard_plan import Report, lost_description, plan_levelling
from flexpar.errors import ShardStateLost
from flexpar.worker import checkpoints
from flexpar.worker.shard_streaming import sharded_stream_running


class ShardLevelling:
    """A sharded job's levelling at its boundaries and its agreement around each update.

    It owns `pending_commit`: the step (its number, summed statistics,
    assignment and VW sets) whose summed gradient every member confirmed to
    hold (`confirm_gradient`) and this device has not applied yet; None
    otherwise. It is set only by `confirm_gradient`, cleared when the step is
    applied (`applying_pending`) or finished at the next boundary
    (`finish_pending`, through `commit_step`, the step loop's commit). The
    shard holdings themselves are the `ShardedOptimizer`'s (flexpar/worker/shards.py).
    """

    def __init__(self, job, training, owners, device, device_id: str, commit):
        self.job = job
        self.model, self.scheduler, self.shards = training.model, training.scheduler, training.shards
        self.device, self.device_id = device, device_id
        self.membership, self.committed, self.faults = owners.membership, owners.committed, owners.faults
        self.streams, self.state = owners.streams, owners.state
        self.commit_step = commit  # the step loop's: a pending step is applied as every step is
        self.pending_commit: Optional[tuple] = None

    def target_partition(self, world_size: int) -> Partition:
        return partition(self.shards.spaces, world_size, self.job.shard_redundancy, by=self.shards.by)

    # ------------------------------------------------------------ around the update

    def confirm_gradient(self, pending: tuple) -> None:
        """Agree that every member holds the step's summed gradient before any member applies it."""
        self.pending_commit = pending
        if len(self.membership.members) > 1:
            flag = torch.zeros(1, device=self.device)
            work = collective(lambda: dist.all_reduce(flag, async_op=True))
            wait_for_collective(work, self.membership.peer_lost)

    def applying_pending(self) -> None:
        """The step whose gradient was confirmed is being applied: it is no longer pending (a failure
        from here on does not keep its gradient)."""
        self.pending_commit = None

    def broadcast_parameters(self, step: int) -> None:
        """Every member gets the updated values of the chunks others stepped (their primaries send)."""
        self.faults.fire("update", step, self.membership.members)
        if not self.shards.values_complete or sharded_stream_running(self.streams):  # a listener needs every value
            broadcast_chunks(self.shards.flat, self.shards.partition.chunks, self.membership.peer_lost)
            self.shards.values_received()

    # ------------------------------------------------------------ boundaries

    def finish_pending(self, stock) -> None:
        """A step whose summed gradient this device holds but did not apply: applied if another member
        committed it (with the listeners of the stream it was taken in: flexpar/worker/shard_streaming.py)."""
        if self.pending_commit is None:
            return
        pending, self.pending_commit = self.pending_commit, None
        if stock.latest_step == self.committed.step + 1:  # another member committed it: finish it here
            self.streams.resume_for_pending()
            try:
                self.commit_step(*pending)
            finally:
                self.streams.end()
        self.streams.drop_pending()
        self.shards.zero_grad(keep_gradient=False)

    def level(self, stock, rank: int, group: tuple, training: int, record: dict, peer_lost, settings) -> float:
        """Bring the group's members level onto the partition of its first `training` members.

        Returns the bytes the group sent (summed over its members).
        """
        shards = self.shards
        self.finish_pending(stock)
        holdings = () if self.committed.step < 0 else (shards.everything() if shards.pristine else shards.holdings())
        numbers = [self.committed.step, int(shards.values_complete), int(rank < training)]
        rows = gather_reports(numbers, holdings, len(group), self.device, peer_lost)
        reports = [Report(row[0], bool(row[1]), tuple(intervals), bool(row[2])) for row, intervals in rows]
        target = self.target_partition(training)
        plan = plan_levelling(reports, target, [space.element_bytes for space in shards.spaces])
        if plan.lost:
            raise ShardStateLost(self._lost_message(plan.lost, record, settings))
        outgoing: dict = {}
        raw_out: dict = {}
        for transfer in plan.sent_by(rank):
            interval = (transfer.space, transfer.start, transfer.stop)
            message = outgoing.setdefault(transfer.destination, {"pieces": []})
            if transfer.state:
                message["pieces"] += [[list(segment), state] for segment, state in shards.pieces_of([interval], False)]
            if not transfer.state or transfer.destination in plan.parameter_receivers:
                raw_out.setdefault(transfer.destination, []).append(shards.values(*interval))
        if rank == plan.state_source:
            replicated = self.capture_replicated()
            for receiver in plan.state_receivers:
                outgoing.setdefault(receiver, {"pieces": []})["replicated"] = replicated
        receives_values = rank in plan.parameter_receivers
        incoming = {transfer.source for transfer in plan.received_by(rank)}
        if rank in plan.state_receivers:
            incoming.add(plan.state_source)
        raw_in: dict = {}
        for transfer in plan.received_by(rank):
            if not transfer.state or receives_values:
                raw_in.setdefault(transfer.source, []).append(
                    shards.values(transfer.space, transfer.start, transfer.stop)
                )
        if outgoing:
            self.faults.fire("transfer", self.committed.step, self.membership.members)
        messages, sent = exchange(outgoing, sorted(incoming), self.device, raw_out, raw_in, peer_lost)
        if rank in plan.state_receivers:  # a joiner, or a member whose state is of an older step
            shards.drop()
            self.restore_replicated(messages[plan.state_source]["replicated"])
        shards.add((tuple(segment), state) for message in messages.values() for segment, state in message["pieces"])
        if receives_values:
            shards.values_received()
        total = collective(lambda: training_state.all_level(len(group), self.device, sent, peer_lost))
        # Every member holds what it needs: each keeps its chunks of the new partition only.
        shards.install(target if rank < training else None, rank)
        return total

    def _lost_message(self, lost: tuple, record: dict, settings) -> str:
        """The one line a job stops with when every copy of some state is gone."""
        what = lost_description(lost, self.shards.spaces, self.shards.names)
        gone = list(record.get("failed", ())) + list(record.get("left", ()))
        redundancy = self.job.shard_redundancy
        directory = settings.checkpoint_dir
        latest = checkpoints.latest_checkpoint(directory) if directory else None
        if latest:
            where = f"the latest checkpoint is {latest}; resume with: {settings.resume_command}"
        else:
            where = "no checkpoint was written (pass checkpoint_every= and checkpoint_dir=), so the job cannot continue"
        together = " together" if len(gone) > 1 else ""
        failed = f"{', '.join(gone)} failed{together}" if gone else "its holders are gone"
        return (
            f"optimizer state lost: {what} had no copy left on the devices still running "
            f"({failed}; shard_redundancy={'default (2)' if redundancy is None else redundancy}); {where}"
        )

    def capture_replicated(self) -> dict:
        """What a joiner needs besides the sharded parameters and their state."""
        return {
            "replicated": self.shards.replicated_state(),
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "step": self.committed.step,
            "extra": self.state.capture_extra(),
        }

    def restore_replicated(self, state: dict) -> None:
        """A joiner, or a member of an older step, takes the replicated state."""
        self.shards.load_replicated(state["replicated"])
        if self.scheduler is not None and state["scheduler"] is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        self.state.restore_extra(state)

    def resume(self, members: tuple, settings, path: str = "") -> None:
        """Read the common state and this member's chunks of checkpoint `path` (default: the job's resume path).

        Generation 1 of a resumed job, or the first generation of a re-adopted
        one whose checkpoint is newer than any device (`record["restore"]`).
        """
        reader = checkpoints.CheckpointReader(path or settings.resume_path)
        rank = members.index(self.device_id)
        common = reader.common
        self.model.load_state_dict(common["model"])  # in place: the sharded parameters stay views
        self.shards.load_optimizer_plain(reader.plain_param_groups_and_replicated())
        if self.scheduler is not None and common.get("scheduler") is not None:
            self.scheduler.load_state_dict(common["scheduler"])
        self.state.restore_extra(common)
        target = self.target_partition(len(members))
        shards = self.shards
        pieces = []
        for k, start, stop in shards.segments(target.holdings(rank)):
            number = shards.number_of(k)
            state = reader.segment_state(number, start, stop, shards.parameters[shards.sharded[k]].numel())
            pieces.append(((k, start, stop), {key: _to(value, self.device) for key, value in state.items()}))
        shards.pristine = False
        shards.drop()
        shards.add(pieces)
        shards.install(target, rank)
        shards.values_received()


def _to(value, device):
    return value.to(device) if isinstance(value, torch.Tensor) else value
