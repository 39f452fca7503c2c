"""The user's pieces at run time: the model and optimizer built from their factories, the loss checked.

Every device (and the driver, for its checks) builds the model under the
job's seed, so all build the same one; what `loss` returns is checked at
every VW, and a mistake is a `UserCodeError` naming the step and the VW.
Used by the worker's step loop and by the driver's checks before any
worker starts (flexpar/driver/job_checks.py); `job` is a `flexpar.Job`.
"""

from __future__ import annotations

import hashlib
import math
from typing import NamedTuple, Optional

import torch
from torch import nn

from flexpar.errors import UserCodeError


def build_model(job) -> nn.Module:
    """The model factory's result, built under the job's seed (same on every device)."""
    torch.manual_seed(job.seed)
    model = job.model()
    if not isinstance(model, nn.Module):
        raise UserCodeError(f"model= returned {type(model).__name__}, not an nn.Module")
    return model


def build_optimizer(job, model: nn.Module):
    optimizer = job.optimizer(model.parameters())
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise UserCodeError(f"optimizer= returned {type(optimizer).__name__}, not a torch.optim.Optimizer")
    scheduler = job.lr_scheduler(optimizer) if job.lr_scheduler is not None else None
    return optimizer, scheduler


def check_loss(value, step: int, virtual_worker: int) -> float:
    """The loss as a float; a non-scalar loss is a user error named with where it happened."""
    if not isinstance(value, torch.Tensor) or value.dim() != 0:
        shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise UserCodeError(
            f"loss(model, batch) must return a scalar tensor (the mean loss of the batch) or a pair "
            f"(loss_sum, count); at step {step}, virtual worker {virtual_worker} it returned {shape}. "
            f"Reduce it, e.g. with .mean()"
        )
    return float(value.detach())


class LossTerms(NamedTuple):
    """What one VW's loss returned: the tensor to differentiate, its value, and the pair's count (or None)."""

    tensor: torch.Tensor
    value: float
    count: Optional[float]


def loss_terms(result, step: int, virtual_worker: int) -> LossTerms:
    """A scalar loss, or a pair (loss_sum, count) with a positive finite count; anything else is a user error."""
    if not isinstance(result, (tuple, list)):
        return LossTerms(result, check_loss(result, step, virtual_worker), None)
    where = f"at step {step}, virtual worker {virtual_worker}"
    if len(result) != 2:
        raise UserCodeError(
            f"loss(model, batch) returned a {type(result).__name__} of {len(result)} items {where}; "
            "return a scalar tensor (the mean loss) or a pair (loss_sum, count)"
        )
    loss_sum, count = result
    value = check_loss(loss_sum, step, virtual_worker)
    number = None
    if isinstance(count, torch.Tensor) and count.numel() == 1 and not count.is_complex():
        number = float(count.detach())
    elif is_real(count):
        number = float(count)
    if number is None or not math.isfinite(number) or number <= 0:
        shown = f"tensor {count.detach().cpu().tolist()!r}" if isinstance(count, torch.Tensor) else repr(count)
        raise UserCodeError(
            f"loss(model, batch) returned the pair (loss_sum, count) with count {shown} {where}; the count "
            "(for example the number of non-padding tokens) must be a positive number, and every virtual "
            "worker's batch must count at least one"
        )
    return LossTerms(loss_sum, value, number)


def is_real(value) -> bool:
    """A real number: int or float, not bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def nonfinite_message(step: int, virtual_worker: int) -> str:
    return (
        f"the loss is not finite (NaN or infinity) at step {step}, virtual worker "
        f"{virtual_worker}; training stopped before applying that step. Lower the learning "
        "rate or check the data of that step."
    )


def model_digest(model: nn.Module) -> str:
    """Digest of parameter and buffer names, shapes and dtypes: what a joiner must match."""
    digest = hashlib.sha256()
    for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
        digest.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype};".encode())
    return digest.hexdigest()
