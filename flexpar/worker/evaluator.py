"""Running `evaluate(model, batch)` over chunks of the evaluation set (in a worker, or in one process).

Which chunks a device evaluates is `flexpar.evaluation` (pure); this module
loads them (`loader.load_batch`, under each chunk's own data seed), runs the
user's function in eval mode under `torch.no_grad()` and the job's autocast,
and adds the results. `evaluate_all` is the single-process evaluation of the
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

import torch

from flexpar.core import evaluation
from flexpar import recipes
from flexpar.errors import UserCodeError
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
