"""Evaluating the model: `evaluate(model, batch)` over chunks of the evaluation set, and a worker's round of it.

Which chunks a device evaluates is `flexpar.core.evaluation` (pure); this module
loads them (`loader.load_batch`, under each chunk's own data seed), runs the
user's function in eval mode under `torch.no_grad()` and the job's autocast,
and adds the results (`Evaluation`, below, is a worker's round of it at a step
boundary). `evaluate_all` is the single-process evaluation of the
whole set that any device set must reproduce.

Precision and compile, decided: with `mixed_precision`, evaluation runs under
the same `torch.autocast` as training's forward, as Accelerate (its prepared
model's forward is wrapped in autocast) and Lightning (its precision plugin
covers validation steps) do, so the metrics are those of the model as it
trains. It does not run compiled with `compile=True`: eval mode and
`no_grad` make torch.compile trace another graph, and that compilation
would be paid at the first evaluation of every device, joiners included,
with the others waiting in the evaluation's all-reduce (a joiner's warm-up
compiles the training graph only). The eager model has the same parameters.
"""

from __future__ import annotations

import contextlib
import time

import torch
import torch.distributed as dist

from flexpar import recipes
from flexpar.comm.collectives import PeerFailure, collective, wait_for_collective
from flexpar.core import evaluation
from flexpar.errors import UserCodeError
from flexpar.worker.device_link import DriverLost
from flexpar.worker.loader import load_batch, to_device


@contextlib.contextmanager
def eval_mode(model):
    """Eval mode and no autograd for the duration; the model's own mode comes back after."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        model.train(was_training)


def evaluate_chunk(job, model, samples: range, keys=(), device=None) -> dict:
    """`job.evaluate` on one chunk (a range of sample indices), checked: {key: float}."""
    batch = load_batch(_EvalView(job), list(samples), evaluation.chunk_seed(job.seed, samples.start))
    if device is not None:
        batch = to_device(batch, device)
    try:
        return evaluation.as_numbers(job.evaluate(model, batch), keys)
    except evaluation.MetricsError as error:
        raise UserCodeError(f"{error} (evaluation samples {samples.start}-{samples.stop - 1})") from None


def precision(job, device_type: str):
    """The job's autocast for `device_type` (the module docstring), or nothing.

    Nothing also where autocast does not support the job's dtype on that
    device type: only the driver's CPU evaluation of a CUDA job's first chunk
    (`metric_keys`) can meet that; workers refused such a job already.
    """
    dtype = recipes.autocast_dtype(job)
    if dtype is None or recipes.autocast_problem(device_type, dtype) is not None:
        return contextlib.nullcontext()
    return recipes.autocast(job, device_type)


def evaluate_samples(job, model, samples: range, keys, device=None) -> dict:
    """The sums over one device's chunk-aligned sample range (all `keys`, 0 where it has no chunk)."""
    sums = {key: 0.0 for key in keys}
    with eval_mode(model), precision(job, device.type if device is not None else "cpu"):
        for chunk in evaluation.batches_of(samples, job.eval_batch_size):
            for key, value in evaluate_chunk(job, model, chunk, keys, device).items():
                sums[key] += value
    return sums


def metric_keys(job, model) -> tuple:
    """The sorted metric names of `job.evaluate` on the first chunk (run in the driver, so errors show once)."""
    size = len(job.eval_dataset)
    first = range(0, min(size, job.eval_batch_size))
    with eval_mode(model), precision(job, "cpu"):
        return tuple(sorted(evaluate_chunk(job, model, first)))


def evaluate_all(job, model) -> dict:
    """A single-process evaluation of the whole set, chunk by chunk: what every device set must give."""
    keys = metric_keys(job, model)
    sums = evaluate_samples(job, model, range(len(job.eval_dataset)), keys)
    return evaluation.metrics_of(evaluation.metric_vector(sums, keys), keys)


class _EvalView:
    """`load_batch` reads `dataset` and `collate_fn` of a job: the evaluation set's view of it."""

    def __init__(self, job):
        self.dataset = job.eval_dataset
        self.collate_fn = job.collate_fn


# ------------------------------------------------------------ a worker's evaluation round


class Evaluation:
    """A worker's evaluation rounds at step boundaries, and the driver's verdict on them.

    Invariant: `evaluated` is the (generation, committed step) of the last
    round this device completed. Every member of a generation runs the same
    sequence, so it is agreed; a new generation evaluates its first step
    boundary again if it is an evaluation's (the old one may have broken off
    during it), and the driver keeps one record per step. `verdict_stop` is
    the stop reason of the driver's callbacks at the last round that asked
    for one ("" while none stopped the job).
    """

    def __init__(self, job, model, device, link, records, faults):
        self.job = job
        self.model = model
        self.device = device
        self.link = link
        self.records = records
        self.faults = faults
        self.evaluated: tuple = (0, -1)
        self.verdict_stop = ""

    def due(self, committed: int, generation: int, settings, final: bool = False) -> bool:
        """Whether the model after `committed` steps is to be evaluated now.

        Every `eval_every` steps, after the last step, and (`final`) at a stop
        a callback asked for; a function of the committed step and the
        generation only, so every member reaches the same answer.
        """
        if self.job.evaluate is None or committed <= 0 or self.evaluated == (generation, committed):
            return False
        every = settings.eval_every
        return final or committed == settings.total_steps or bool(every and committed % every == 0)

    def run(self, step: int, membership, shares: tuple, contributors: tuple, keys, ask_driver: bool) -> str:
        """Evaluate the model after `step` committed steps on this generation's devices.

        The devices split the evaluation set's chunks in proportion to the next
        step's VW assignment (in `membership`'s generation; `shares`, the contributors' speeds;
        flexpar.core.evaluation), each sums its chunks' metrics, and one
        all-reduce adds the sums. Only then does the record exist: a failure
        before it completes leaves nothing published, and the next generation
        evaluates again. Every member keeps the record (a new rank 0 re-sends
        it); rank 0 publishes it. With `ask_driver`, the devices then wait for
        the driver's callbacks' verdict on it; returns the stop reason, or "".
        """
        started = time.perf_counter()
        generation, members, rank, peer_lost = (
            membership.generation,
            membership.members,
            membership.rank,
            membership.peer_lost,
        )
        keys = tuple(keys)
        # The split of the step's VWs, among the contributors: a joiner still listening evaluates nothing.
        ranges = evaluation.sample_ranges(
            len(self.job.eval_dataset), [share for share in shares if share > 0], self.job.eval_batch_size
        )
        mine = members[rank]
        samples = ranges[contributors.index(mine)] if mine in contributors else range(0)
        sums = evaluate_samples(self.job, self.model, samples, keys, self.device)
        vector = torch.tensor(evaluation.metric_vector(sums, keys), dtype=torch.float64, device=self.device)
        self.faults.fire("eval", step, members)  # tests: a death here breaks the all-reduce below
        if len(members) > 1:
            work = collective(lambda: dist.all_reduce(vector, async_op=True))
            wait_for_collective(work, peer_lost)
        self.evaluated = (generation, step)
        record = {
            "kind": "eval",
            "step": step,
            "time": time.time(),
            "elapsed_s": 0.0,  # filled in by the driver, which knows the job's start
            "generation": generation,
            "devices": list(members),
            "eval_s": time.perf_counter() - started,
            "samples": len(self.job.eval_dataset),
            "metrics": evaluation.metrics_of(vector.cpu().tolist(), keys),
        }
        self.records.keep(record)
        if rank == 0:
            self.link.publish(record)
        if not ask_driver:
            return ""
        self.verdict_stop = self._verdict(step, peer_lost)
        return self.verdict_stop

    def _verdict(self, step: int, peer_lost) -> str:
        """The driver's callbacks' word on the evaluation at `step`: a stop reason, or "" to go on.

        The driver writes it once, so every member reads the same. A peer that
        dies meanwhile makes this a failure (the next generation evaluates
        again and finds the verdict already there).
        """
        key = f"verdict/{step}"
        try:
            while not self.link.store.check([key]):
                self.link.check()
                lost = peer_lost()
                if lost:
                    raise PeerFailure(f"peer {lost} is gone (reported by the coordinator)")
                time.sleep(0.002)
            return self.link.store.get(key).decode()
        except RuntimeError as error:  # the store, hosted by the driver, is gone
            self.link.note_lost()
            raise DriverLost(
                f"the job's driver is gone ({str(error).splitlines()[0] if str(error) else error})"
            ) from None
