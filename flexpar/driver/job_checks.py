"""The driver's checks of a job, once, before any worker starts: errors are reported here, once.

`pickle_pieces` names a piece that cannot travel to the workers;
`first_batch_check` runs the loss on VW 0 of step 0 (under the job's
autocast where the driver's CPU supports it) and checks `sample_cost` on a
few indices. `job` is a `flexpar.Job`.
"""

from __future__ import annotations

import contextlib
import math
import pickle

import torch
from torch import nn

from flexpar import recipes
from flexpar.core import batching
from flexpar.errors import UserCodeError
from flexpar.worker.cost_planner import sample_costs
from flexpar.worker.loader import load_batch
from flexpar.worker.user_code import loss_terms, nonfinite_message


def pickle_pieces(job) -> bytes:
    """The job as bytes for the workers; each piece that cannot travel is named."""
    for name in (
        "model",
        "optimizer",
        "loss",
        "lr_scheduler",
        "collate_fn",
        "dataset",
        "evaluate",
        "eval_dataset",
        "sample_cost",
    ):
        piece = getattr(job, name)
        if piece is None:
            continue
        try:
            pickle.dumps(piece)
        except Exception as error:
            raise UserCodeError(
                f"{name}= cannot be sent to worker processes ({error}). Worker processes import "
                f"your pieces by name: define {name} at module level of your script or a module "
                "(not as a lambda or inside a function), and keep the dataset picklable."
            ) from None
    return pickle.dumps(job)


def first_batch_check(job, model: nn.Module) -> None:
    """Run the loss on virtual worker 0 of step 0 in the driver, to report errors once."""
    indices = batching.virtual_worker_indices(job.seed, 0, 0, len(job.dataset), job.global_batch, job.virtual_workers)
    batch = load_batch(job, indices, batching.data_seed(job.seed, 0, 0))
    if not torch.cuda.is_available():  # a CPU job: the workers' device type is known here already
        recipes.check_mixed_precision(job, "cpu")
        recipes.check_compile(job, "cpu")
    dtype = recipes.autocast_dtype(job)
    # Under autocast, as in the workers, where the driver's CPU supports it (else plain).
    precision = recipes.autocast(job, "cpu") if dtype and not recipes.autocast_problem("cpu", dtype) else None
    # Eval mode: the check must not move BatchNorm statistics of the model we return.
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), precision or contextlib.nullcontext():
            value = loss_terms(job.loss(model, batch), 0, 0).value
    finally:
        model.train(was_training)
    if not math.isfinite(value):
        raise UserCodeError(nonfinite_message(0, 0))
    if job.sample_cost is not None:
        check_sample_cost(job, indices)


def check_sample_cost(job, indices) -> None:
    """Call sample_cost on a few indices (those of VW 0 of step 0, and the dataset's last) in the driver.

    A function that raises or returns a non-number, NaN, an infinity or a
    negative number is refused here, once, naming the index, before any
    worker starts; the workers check every value they use too.
    """
    sample_costs(job, list(indices)[:8] + [len(job.dataset) - 1])
