"""A device's warm-up (one forward and backward of one VW, no update) and the identity it then reports."""

from __future__ import annotations

import time

import torch

from flexpar import recipes
from flexpar.core import factory_checks
from flexpar.errors import UserCodeError
from flexpar.version import __version__
from flexpar.worker.loader import first_batch, to_device
from flexpar.worker.user_code import loss_terms, model_digest


def warm_up(job, model, forward_model, device, sync, frozen, zero_grad, device_id: str) -> float:
    """One forward and backward of VW 0 of step 0, no update: pays start-up costs off the critical path.

    Returns the seconds it took. Leaves the model as it found it: no
    gradient (`zero_grad`), the buffers the forward moved put back (and noted
    in `frozen`: they always travel). Tells `sync` whether the loss is
    token-weighted, which every device learns alike from the same batch.
    """
    started = time.perf_counter()
    batch = to_device(first_batch(job), device)
    buffers = [(name, buffer.clone()) for name, buffer in model.named_buffers()]  # BatchNorm must not count it
    try:  # under the step's autocast: with compile=True, this compiles the graph the steps run
        with recipes.autocast(job, device.type):
            result = job.loss(forward_model, batch)
        terms = loss_terms(result, 0, 0)
        terms.tensor.backward()
        # A token-weighted loss needs its counts summed exactly (flexpar/comm/gradient_sync.py). Every device
        # warms up on the same batch, so every device takes the same collectives.
        sync.exact_stats = terms.count is not None
    except Exception as error:
        if job.compile and recipes.is_compile_error(error):
            raise UserCodeError(
                f"torch.compile failed on device {device_id} during its warm-up "
                f"({type(error).__name__}: {str(error).strip()[:2000]}); run without "
                "compile=True, or try compile_options={'backend': 'aot_eager'}"
            ) from error
        raise
    zero_grad()
    # Buffers the forward moved (BatchNorm statistics, a frozen trunk's included) always travel.
    frozen.note_warm_up(
        name for (name, saved), buffer in zip(buffers, model.buffers()) if not torch.equal(buffer, saved)
    )
    with torch.no_grad():
        for (_, saved), buffer in zip(buffers, model.buffers()):
            buffer.copy_(saved)
    return time.perf_counter() - started


def identity(model, frozen, warmup_s, ready_s=None) -> dict:
    """What says this device runs this job's model: checked by the coordinator for joiners and for
    devices a restarted driver re-adopts alike; a joiner's `ready_s` (its start-up and model build:
    `Training.ready_s`) goes into its join event with its warm-up."""
    return {
        **(ready_s or {}),
        "digest": model_digest(model),
        "shapes": factory_checks.model_shapes(model),  # a refusal names the first that differs
        "version": __version__,
        "warmup_s": warmup_s,
        "frozen_digest": frozen.combined,
        "frozen_digests": frozen.digests,
        # The digest's time is news only where something is frozen (a fine-tuning job); a
        # fully trainable model's join event keeps its plain "(warm-up X s)" detail.
        "digest_s": frozen.digest_s if frozen.layout.frozen else None,
    }
