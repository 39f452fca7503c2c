"""One step's work on one device: its VWs one after another, then the sums across devices.

`StepLoop.train` (flexpar/worker/step_loop.py) calls `StepRun.run` with this
device's VWs of the step: each VW's batch (flexpar/worker/loader.py), the
user's loss under the job's autocast, `loss / V` backward (the last VW's
backward sends gradient buckets as they fill: flexpar/comm/gradient_sync.py),
then the step's statistics vector (flexpar/core/step_statistics.py) and the
sums, exact with `Job(deterministic=True)` (flexpar/worker/determinism.py).
What it returns, the summed statistics with the summed gradient in `.grad`,
every member holds alike.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Sequence

import torch
import torch.distributed as dist

from flexpar import recipes
from flexpar.comm.collectives import collective
from flexpar.core import batching
from flexpar.core import ledger as sample_ledger
from flexpar.core.step_statistics import StatsLayout, mixed_loss_message
from flexpar.errors import UserCodeError
from flexpar.worker.buffers import buffer_vector
from flexpar.worker.loader import seed_model_randomness, to_device
from flexpar.worker.shards import optimizer_bytes
from flexpar.worker.user_code import loss_terms


def statistics_layout(world: int, job, exact) -> StatsLayout:
    """The job's statistics layout for `world` devices (with the exact sums' slots where `exact`)."""
    if exact is None:
        return StatsLayout(world)
    return StatsLayout(world, job.virtual_workers, exact.tensors)


@dataclasses.dataclass
class VirtualWorkerTotals:
    """What this device's VWs of a step add up to, before the sums across devices."""

    busy: float = 0.0  # compute seconds (stretched for an emulated slower device)
    loss_sum: float = 0.0
    first_bad: int = 0  # 1 + the first VW whose loss was not finite (0: none)
    pairs: int = 0  # VWs whose loss was a (loss_sum, count) pair
    count: float = 0.0  # their summed counts
    terms: list = dataclasses.field(default_factory=list)  # exact sums: (VW, loss term, count) per VW
    published: int = 0  # a scheduled leave's generation, read before the last VW (await_scheduled_leave)
    stream_read: int = 0  # a streaming job: items this device took from its streams for the step
    pass_ends: int = 0  # a streaming job: pass ends this device met in the step's chunks


class StepRun:
    """Runs this device's VWs of a step and sums the step across devices.

    Its own state: `step_samples`, the samples the last step consumed (the
    sample ledger, tests and the fault soak only; None without it). The rest
    is handed to it: what the device trains with (`training`), the owners it
    reads (membership, records, stream session, faults), the applied
    gradient and the exact steps it feeds.
    """

    def __init__(self, job, args, device, link, training, loader, owners, sample_ledger: bool):
        self.job, self.args, self.device, self.link, self.loader = job, args, device, link, loader
        self.model, self.optimizer, self.shards = training.model, training.optimizer, training.shards
        self.sync, self.exact = training.sync, training.exact
        self.forward_model, self.scaler = training.forward_model, training.scaler
        self.sample_ledger = sample_ledger
        self.membership, self.records, self.faults = owners.membership, owners.records, owners.faults
        self.streams, self.gradient, self.exact_steps = owners.streams, owners.gradient, owners.exact_steps
        self.streaming = owners.data_streams is not None  # the loader is then the DataStreams (stream ledger)
        self.step_samples = None

    def run(self, step: int, virtual_workers: Sequence[int], redo: bool = False) -> torch.Tensor:
        """Run this device's VWs of `step` and sum gradients and statistics across devices.

        Job(deterministic=True): exact sums (flexpar/worker/determinism.py); a
        step whose gradient outgrew its exponents runs again (`redo`), on
        every device alike.
        """
        world = len(self.membership.members)
        exact = self.exact
        self.sync.reset()
        if exact is not None:
            exact.begin(redo)
        streaming = self.streaming
        ledger = sample_ledger.count_vector(len(self.job.dataset)) if self.sample_ledger and not streaming else None
        totals = self._virtual_workers(step, virtual_workers, ledger)
        if streaming:  # what this device took from the streams for this step, and the pass ends it met
            totals.stream_read, totals.pass_ends = self.loader.read_since(step)
        slots = statistics_layout(world, self.job, exact)
        stats = self._statistics(totals, slots, world)
        if exact is not None:
            holds_all = (self.shards is None or self.shards.values_complete) and not self.streams.listening()
            self.exact_steps.statistics(stats, slots, totals.terms, self.membership.rank, holds_all)
            summed = exact.finish(
                stats, world, lambda: self.faults.fire("sync", step, self.membership.members), self.membership.peer_lost
            )
            if self.exact_steps.resolve(summed, slots, step, self.membership.members, self.membership.rank):
                return self.run(step, virtual_workers, redo=True)  # every device alike: run the step again
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
            self.step_samples = sample_ledger.consumed(ledger.cpu())
        if streaming and self.sample_ledger:  # the (group, pass, index) of every item the step trained
            self.step_samples = self.loader.trained_items(step, virtual_workers, world)
        return summed

    def _virtual_workers(self, step: int, virtual_workers: Sequence[int], ledger) -> VirtualWorkerTotals:
        """This device's VWs of `step`, one after another: forward, backward, their totals.

        Recipes: a scalar loss backpropagates loss / V, a pair (loss_sum, count)
        its loss_sum (the division by the global count follows the sum across
        devices); fp16 multiplies either by the loss scale.
        """
        job, exact = self.job, self.exact
        totals = VirtualWorkerTotals()
        scale = self.scaler.scale if self.scaler is not None else 1.0
        first_kind = None
        last = virtual_workers[-1] if len(virtual_workers) else None  # a listening joiner runs none
        for virtual_worker in virtual_workers:
            started = time.perf_counter()
            batch = to_device(self.loader.batch(step, virtual_worker), self.device)
            if ledger is not None:
                # What the loader really loaded (its DataLoader carried the indices with the
                # batch), not the plan's indices: a wrong or stale batch shows in the audit.
                ledger[self.loader.loaded_indices] += 1.0
            seed_model_randomness(self.device, batching.virtual_worker_seed(job.seed, step, virtual_worker))
            if virtual_worker == last:  # send buckets as they fill
                # Before any bucket is sent (nobody waits in a collective meanwhile): a leave scheduled
                # for the next step takes effect at this boundary once the driver has published it.
                totals.published = self.link.await_scheduled_leave(
                    step + 1, self.membership.generation, self.membership.members
                )
                exact.arm(len(self.membership.members)) if exact is not None else self.sync.arm()
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
            if not math.isfinite(value) and not totals.first_bad:
                totals.first_bad = virtual_worker + 1
            if vw_count is not None:
                totals.pairs += 1
                totals.count += vw_count
                (loss * scale if scale != 1.0 else loss).backward()
            elif scale != 1.0:
                ((loss / job.virtual_workers) * scale).backward()
            else:
                (loss / job.virtual_workers).backward()
            term = value if vw_count is not None else value / job.virtual_workers
            if exact is not None:  # this VW's gradient into the int64 sum; .grad cleared for the next
                exact.add_virtual_worker()
                totals.terms.append((virtual_worker, term, vw_count or 0))
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            totals.busy += self._stretched(time.perf_counter() - started)
            totals.loss_sum += term
        return totals

    def _stretched(self, elapsed: float) -> float:
        """An emulated slower device (the driver's speed, else its own): this VW's compute stretched to
        1/speed of it."""
        speed = self.link.speed if self.link.speed is not None else self.args.speed
        if speed < 1.0:
            pause = elapsed * (1.0 / speed - 1.0)
            time.sleep(pause)
            elapsed += pause
        return elapsed

    def _statistics(self, totals: VirtualWorkerTotals, slots: StatsLayout, world: int) -> torch.Tensor:
        """This device's part of the step's statistics vector (flexpar/core/step_statistics.py)."""
        rank = self.membership.rank
        listening = self.streams.listening()
        buffers = buffer_vector(self.model, listening) if world > 1 else torch.zeros(0, dtype=torch.float64)
        stats = torch.zeros(slots.size + buffers.numel(), dtype=torch.float64)
        stats[slots.buffers] = buffers
        stats[slots.busy.start + rank] = totals.busy
        stats[slots.seen.start + rank] = max(self.link.latest_generation, totals.published)
        stats[slots.loss] = totals.loss_sum
        stats[slots.bad.start + rank] = totals.first_bad
        # The driver asked to stop, or is gone: looked at now, not only as the follower thread last saw it.
        stats[slots.stop] = 1.0 if (self.link.finish_reason is not None or self.link.driver_gone_now()) else 0.0
        stats[slots.count] = totals.count
        stats[slots.pairs] = totals.pairs
        # The optimizer-state bytes this device holds (KiB: exact in a float32 carrier up to 16 GiB), for the record.
        stats[slots.optimizer.start + rank] = (
            self.streams.held_bytes(optimizer_bytes(self.optimizer, self.shards)) // 1024
        )
        stats[slots.stream_read] = totals.stream_read
        stats[slots.pass_ends] = totals.pass_ends
        last = self.records.last
        if last is not None and last.get("kind") == "step":
            stats[slots.previous_step_s.start + rank] = float(last["step_time_s"])
        if self.scaler is not None:  # fp16: this device's own gradient overflowed (all skip the step)
            exact = self.exact
            overflowed = (
                exact.nonfinite if exact is not None else recipes.has_nonfinite(self.sync.dense, self.sync.sparse)
            )
            stats[slots.overflow] = float(overflowed)
        return stats
