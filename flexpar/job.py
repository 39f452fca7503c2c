"""The user's pieces, checked once in the driver before any worker starts."""

from __future__ import annotations

import hashlib
import math
import multiprocessing
import pickle
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Optional

import torch
from torch import nn

from flexpar import batching


class FitResult(NamedTuple):
    """What fit() returns: the trained model (in the calling process) and a summary."""

    model: nn.Module
    summary: dict


class UserCodeError(Exception):
    """A piece of the user's code raised, or returned something unusable."""


class TrainingError(RuntimeError):
    """The job stopped: a worker's error, or no device left. The message says which."""


@dataclass(frozen=True)
class Job:
    """A training job built from single-device pieces.

    model:          zero-argument factory returning an nn.Module (called under
                    torch.manual_seed(seed), so every device builds the same one)
    optimizer:      maps an iterable of parameters to a torch.optim.Optimizer
    loss:           loss(model, batch) -> scalar mean loss of the batch
    dataset:        any map-style torch Dataset
    global_batch:   samples per optimizer step, independent of the device count
    virtual_workers / micro_batch: how the global batch is cut (give one)
    lr_scheduler:   optional, maps the optimizer to a scheduler stepped once per step
    """

    model: Callable[[], nn.Module]
    optimizer: Callable[[Any], torch.optim.Optimizer]
    loss: Callable[[nn.Module, Any], torch.Tensor]
    dataset: Any
    global_batch: int
    virtual_workers: Optional[int] = None
    micro_batch: Optional[int] = None
    seed: int = 0
    lr_scheduler: Optional[Callable] = None
    collate_fn: Optional[Callable] = None
    num_workers: int = 0

    def __post_init__(self):
        for name in ("model", "optimizer", "loss"):
            if not callable(getattr(self, name)):
                raise TypeError(f"{name}= must be a function (got {type(getattr(self, name)).__name__})")
        if self.lr_scheduler is not None and not callable(self.lr_scheduler):
            raise TypeError("lr_scheduler= must be a function of the optimizer")
        if not isinstance(self.global_batch, int) or self.global_batch < 1:
            raise ValueError(f"global_batch={self.global_batch!r} must be a positive whole number")
        object.__setattr__(self, "virtual_workers", self._virtual_workers())
        if not hasattr(self.dataset, "__getitem__") or not hasattr(self.dataset, "__len__"):
            raise TypeError("dataset= must be a map-style Dataset (with __getitem__ and __len__)")
        if len(self.dataset) < self.global_batch:
            raise ValueError(
                f"the dataset has {len(self.dataset)} samples, fewer than one global batch of "
                f"{self.global_batch}; use a smaller global_batch or more data"
            )
        if self.num_workers < 0:
            raise ValueError(f"num_workers={self.num_workers} must be >= 0")

    def _virtual_workers(self) -> int:
        if self.virtual_workers is not None and self.micro_batch is not None:
            if self.virtual_workers * self.micro_batch != self.global_batch:
                raise ValueError(
                    f"virtual_workers={self.virtual_workers} x micro_batch={self.micro_batch} != "
                    f"global_batch={self.global_batch}; give one of the two"
                )
            return self.virtual_workers
        if self.micro_batch is not None:
            if self.micro_batch < 1 or self.global_batch % self.micro_batch:
                raise ValueError(
                    f"global_batch={self.global_batch} is not divisible by micro_batch="
                    f"{self.micro_batch}; choose a micro_batch that divides it"
                )
            return self.global_batch // self.micro_batch
        virtual_workers = 1 if self.virtual_workers is None else self.virtual_workers
        if not isinstance(virtual_workers, int) or virtual_workers < 1:
            raise ValueError(f"virtual_workers={virtual_workers!r} must be a positive whole number")
        if self.global_batch % virtual_workers:
            divisors = [d for d in range(1, self.global_batch + 1) if self.global_batch % d == 0]
            raise ValueError(
                f"global_batch={self.global_batch} is not divisible by virtual_workers="
                f"{virtual_workers}; choose one of {divisors[:12]}"
            )
        return virtual_workers

    @property
    def micro_batch_size(self) -> int:
        return self.global_batch // self.virtual_workers

    def steps_per_epoch(self) -> int:
        return batching.steps_per_epoch(len(self.dataset), self.global_batch)

    def fit(self, steps=None, epochs=None, devices=None, **options) -> FitResult:
        """Train on worker processes and return the trained model here, in the driver.

        The keyword options are those of `flexpar.options.FitOptions` (schedule,
        max_devices, emulate_speeds, metrics, checkpoint_every, ...). Under
        `flexpar run`, the command line overrides them.
        """
        from flexpar import launch, options as options_module

        refuse_inside_worker_import()
        resolved = options_module.resolve(dict(steps=steps, epochs=epochs, devices=devices, **options))
        try:
            return launch.run(self, resolved)
        except (TrainingError, UserCodeError) as error:
            if resolved.verbose:
                raise
            # The message says what went wrong and where; flexpar's own frames would bury it.
            raise error.with_traceback(None) from None


MAIN_GUARD_MESSAGE = (
    "fit() was called while a worker process imported your script. Put the training call under "
    "`if __name__ == \"__main__\":` so that workers can import the script without starting training again."
)
EXIT_MAIN_GUARD = 78  # a worker's exit code for it: the driver then reports MAIN_GUARD_MESSAGE, once


def refuse_inside_worker_import() -> None:
    """fit() called while a worker imports the user's script means a missing main guard.

    The worker exits at once with EXIT_MAIN_GUARD and no traceback; the driver,
    which sees its exit code, says so once (not once per worker).
    """
    if getattr(multiprocessing.current_process(), "_inheriting", False):
        import os
        import sys

        sys.stderr.flush()
        os._exit(EXIT_MAIN_GUARD)


# ------------------------------------------------------------ driver checks


def build_model(job: Job) -> nn.Module:
    """The model factory's result, built under the job's seed (same on every device)."""
    torch.manual_seed(job.seed)
    model = job.model()
    if not isinstance(model, nn.Module):
        raise UserCodeError(f"model= returned {type(model).__name__}, not an nn.Module")
    return model


def build_optimizer(job: Job, model: nn.Module):
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
            f"loss(model, batch) must return a scalar tensor (the mean loss of the batch); at step "
            f"{step}, virtual worker {virtual_worker} it returned {shape}. Reduce it, e.g. with .mean()"
        )
    return float(value.detach())


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


def pickle_pieces(job: Job) -> bytes:
    """The job as bytes for the workers; each piece that cannot travel is named."""
    for name in ("model", "optimizer", "loss", "lr_scheduler", "collate_fn", "dataset"):
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


def first_batch_check(job: Job, model: nn.Module) -> None:
    """Run the loss on virtual worker 0 of step 0 in the driver, to report errors once."""
    from flexpar.loader import load_batch

    indices = batching.virtual_worker_indices(
        job.seed, 0, 0, len(job.dataset), job.global_batch, job.virtual_workers
    )
    batch = load_batch(job, indices, batching.data_seed(job.seed, 0, 0))
    # Eval mode: the check must not move BatchNorm statistics of the model we return.
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            value = check_loss(job.loss(model, batch), 0, 0)
    finally:
        model.train(was_training)
    if not math.isfinite(value):
        raise UserCodeError(nonfinite_message(0, 0))
