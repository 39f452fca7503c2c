"""The workload of benchmarks/overhead.py: its MLP, data, optimizer, loss, the sizes of a run, and how a
run's samples/s is read (`throughput`, the same for every side).

Module level, so that flexpar's worker processes and the baselines' spawned
processes find the pieces by name.
"""

from __future__ import annotations

import dataclasses
from typing import List

import harness
import torch
from harness import median
from torch import nn
from torch.utils.data import TensorDataset

# ---------------------------------------------------------------- configuration


@dataclasses.dataclass(frozen=True)
class Config:
    """Sizes of one benchmark run; the full run and --quick differ only here."""

    features: int
    hidden: int
    hidden_layers: int
    classes: int
    per_device_batch: int  # DDP comparison: samples per device per step
    micro_batch: int  # accumulation comparison: samples per VW / micro-batch
    steps: int  # steps per run
    skip: int  # leading steps excluded from timing (start-up)
    repeats: int  # alternating rounds
    dataset_size: int

    def parameter_count(self) -> int:
        return sum(parameter.numel() for parameter in MLPFactory(self)().parameters())


# 20 timed steps a run and 5 rounds: with 10 and 3, one run's median moved by 10% between runs
# on this shared 2-core VM, more than the overhead being measured.
FULL = Config(
    features=1024,
    hidden=2048,
    hidden_layers=3,
    classes=10,
    per_device_batch=64,
    micro_batch=4,
    steps=24,
    skip=4,
    repeats=5,
    dataset_size=4096,
)
QUICK = dataclasses.replace(
    FULL, features=256, hidden=512, hidden_layers=2, per_device_batch=32, steps=8, skip=3, repeats=1, dataset_size=1024
)


class MLPFactory:
    """Builds the benchmark MLP: ``hidden_layers`` Linear+ReLU layers, then a classifier."""

    def __init__(self, config: Config):
        self.config = config

    def __call__(self) -> nn.Module:
        config = self.config
        layers: List[nn.Module] = []
        width = config.features
        for _ in range(config.hidden_layers):
            layers += [nn.Linear(width, config.hidden), nn.ReLU()]
            width = config.hidden
        layers.append(nn.Linear(width, config.classes))
        return nn.Sequential(*layers)


def make_optimizer(parameters):
    return torch.optim.SGD(parameters, lr=0.01, momentum=0.9)


def classification_loss(model, batch):
    inputs, labels = batch
    return nn.functional.cross_entropy(model(inputs), labels)


def make_dataset(config: Config) -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(config.dataset_size, config.features, generator=generator)
    labels = torch.randint(0, config.classes, (config.dataset_size,), generator=generator)
    return TensorDataset(inputs, labels)


def throughput(commit_times: List[float], skip: int, samples_per_step: int) -> dict:
    """Steady-state samples/s of one run, two ways.

    ``samples_per_s`` (the figure the ratios use): samples per step over the
    median step duration of steps ``skip ..``; a median, because this machine
    is shared and a step now and then is stretched by someone else's work.
    ``mean_samples_per_s``: over the whole span of those steps, for reference.
    """
    durations = harness.step_durations(commit_times, skip)
    return {
        "samples_per_s": samples_per_step / median(durations),
        "mean_samples_per_s": samples_per_step * len(durations) / sum(durations),
    }
