"""Shared training pieces for the tests, importable by worker processes.

The reference is the plain single-process loop the equivalence promise is
stated against: per step, the mean loss over the whole global batch (each VW
slice under its own random stream, so dropout draws the same masks), one
backward, one optimizer step.
"""

from __future__ import annotations

import time

import torch
from torch import nn

import flexpar
from flexpar import batching
from flexpar.job import build_model, build_optimizer
from flexpar.loader import load_batch

FEATURES = 12
CLASSES = 3


def make_dataset(size: int = 480, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(size, FEATURES, generator=generator)
    labels = (inputs[:, :CLASSES].argmax(dim=1)).long()
    return torch.utils.data.TensorDataset(inputs, labels)


def make_model():
    return nn.Sequential(
        nn.Linear(FEATURES, 32), nn.Tanh(), nn.Dropout(0.2), nn.Linear(32, 32), nn.Tanh(),
        nn.Linear(32, CLASSES),
    )


def make_wider_model():
    """A different architecture: a joiner with it must be refused."""
    return nn.Sequential(nn.Linear(FEATURES, 64), nn.Tanh(), nn.Linear(64, CLASSES))


def sgd(parameters):
    return torch.optim.SGD(parameters, lr=0.1, momentum=0.9)


def adamw(parameters):
    return torch.optim.AdamW(parameters, lr=0.01, weight_decay=0.01)


def step_decay(optimizer):
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=4, gamma=0.7)


class Loss:
    """Cross-entropy; `delay_s` of sleep per call makes steps long enough for elastic tests."""

    def __init__(self, delay_s: float = 0.0):
        self.delay_s = delay_s

    def __call__(self, model, batch):
        if self.delay_s:
            time.sleep(self.delay_s)
        inputs, labels = batch
        return nn.functional.cross_entropy(model(inputs), labels)


def make_job(optimizer=sgd, virtual_workers=4, global_batch=48, delay_s=0.0, dataset=None, **extra):
    return flexpar.Job(
        model=extra.pop("model", make_model), optimizer=optimizer, loss=Loss(delay_s),
        dataset=dataset if dataset is not None else make_dataset(),
        global_batch=global_batch, virtual_workers=virtual_workers, seed=7, **extra,
    )


def reference(job, steps: int) -> nn.Module:
    """Plain single-process training over the same global batches."""
    model = build_model(job)
    optimizer, scheduler = build_optimizer(job, model)
    loss_of = job.loss.__class__(0.0) if isinstance(job.loss, Loss) else job.loss
    size = len(job.dataset)
    for step in range(steps):
        losses = []
        for virtual_worker in range(job.virtual_workers):
            indices = batching.virtual_worker_indices(
                job.seed, step, virtual_worker, size, job.global_batch, job.virtual_workers
            )
            batch = load_batch(job, indices, batching.data_seed(job.seed, step, virtual_worker))
            torch.manual_seed(batching.virtual_worker_seed(job.seed, step, virtual_worker))
            losses.append(loss_of(model, batch))
        torch.stack(losses).mean().backward()
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        optimizer.zero_grad(set_to_none=True)
    return model


def assert_same_parameters(model, expected, rtol=1e-5, atol=1e-7):
    for (name, got), (_, want) in zip(model.state_dict().items(), expected.state_dict().items()):
        torch.testing.assert_close(got, want, rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")
