"""The workload of benchmarks/balance.py: its model, data, emulated device speeds and sizes.

Module level, so that flexpar's workers and the DDP ranks import the pieces by
reference. Nothing here starts a process.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import torch
from harness import cpu_count
from torch import nn

import flexpar

INPUTS = 256
HIDDEN = 512
CLASSES = 10
MICRO_BATCH = 16
DATASET_SIZE = 4096
SEED = 0


def make_dataset(size: int = DATASET_SIZE, seed: int = SEED):
    """Synthetic classification data: labels are the argmax of a fixed projection."""
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(size, INPUTS, generator=generator)
    projection = torch.randn(INPUTS, CLASSES, generator=generator)
    return torch.utils.data.TensorDataset(inputs, (inputs @ projection).argmax(dim=1))


def make_model() -> nn.Module:
    return nn.Sequential(
        nn.Linear(INPUTS, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, CLASSES)
    )


def make_optimizer(parameters):
    return torch.optim.SGD(parameters, lr=0.05, momentum=0.9)


class EmulatedKernelLoss:
    """Cross-entropy of a real forward pass, plus `kernel_s` of sleep standing for device time."""

    def __init__(self, kernel_s: float):
        self.kernel_s = kernel_s

    def __call__(self, model, batch):
        inputs, labels = batch
        loss = nn.functional.cross_entropy(model(inputs), labels)
        time.sleep(self.kernel_s)
        return loss


def stretch_to_speed(elapsed_s: float, speed: float) -> float:
    """Emulate a device of relative `speed`: sleep so that `elapsed_s` of work takes elapsed_s / speed.

    The same rule as flexpar's worker (sleep (1/speed - 1) x the VW's measured
    compute, after it); returns the stretched duration.
    """
    if speed >= 1.0:
        return elapsed_s
    pause = elapsed_s * (1.0 / speed - 1.0)
    time.sleep(pause)
    return elapsed_s + pause


# ---------------------------------------------------------------- configuration


@dataclass(frozen=True)
class Config:
    speeds: tuple = (1.0, 1.0, 0.5, 0.25)
    virtual_workers: int = 32
    kernel_ms: float = 20.0
    rounds: int = 3
    flexpar_steps: int = 140  # steps [warmup_steps, change_step) measure the balanced state
    warmup_steps: int = 10
    change_step: int = 100
    changed_device: int = 0
    changed_speed: float = 0.5
    ddp_steps: int = 12
    single_steps: int = 6
    moving_window: int = 3
    tolerance: float = 0.05
    fine_virtual_workers: int = 128  # the second round's V (0: no such round)
    fine_steps: int = 60  # steps [fine_warmup_steps, fine_steps) measure it
    fine_warmup_steps: int = 20
    fine_single_steps: int = 3

    @property
    def global_batch(self) -> int:
        return self.virtual_workers * MICRO_BATCH

    @property
    def devices(self) -> int:
        return len(self.speeds)

    @property
    def changed_speeds(self) -> tuple:
        speeds = list(self.speeds)
        speeds[self.changed_device] = self.changed_speed
        return tuple(speeds)


QUICK = dict(
    rounds=1,
    flexpar_steps=36,
    warmup_steps=5,
    change_step=20,
    ddp_steps=5,
    single_steps=3,
    fine_steps=30,
    fine_warmup_steps=15,
    fine_single_steps=2,
)


def fine_config(config: Config) -> Config:
    """The V = 128 round as a Config of its own: no slowdown, steps [fine_warmup_steps, fine_steps) measured.

    The balancer settles in steps, not seconds, and after its first move at
    the fourth step it may need a dozen or two more to resolve a one-VW
    difference of 2% (flexpar/balance.py), so the window starts at step 20.
    """
    return replace(
        config,
        virtual_workers=config.fine_virtual_workers,
        flexpar_steps=config.fine_steps,
        warmup_steps=config.fine_warmup_steps,
        change_step=config.fine_steps,
        single_steps=config.fine_single_steps,
    )


def threads_per_device(config: Config) -> int:
    """Torch threads of one device process: what flexpar's launcher gives each CPU worker
    (cores // devices, at least 1); the single-device loop and the DDP ranks use the same."""
    return max(1, cpu_count() // config.devices)


def make_job(config: Config) -> flexpar.Job:
    return flexpar.Job(
        model=make_model,
        optimizer=make_optimizer,
        loss=EmulatedKernelLoss(config.kernel_ms / 1000.0),
        dataset=make_dataset(),
        global_batch=config.global_batch,
        virtual_workers=config.virtual_workers,
        seed=SEED,
    )
