"""The job benchmarks/driver_loss.py trains, under `flexpar run` (its driver is killed and restarted).

An MLP of about 2.8M parameters with Adam (its state: about 22 MB more), 2 local CPU devices, 4 VWs.
The number of steps and where the final parameters go come from the environment the benchmark
sets, so that the resume command the devices print (the same script and flags) runs the same job.
"""

from __future__ import annotations

import os

import torch
from torch import nn

import flexpar

FEATURES, HIDDEN, CLASSES = 256, 1536, 10


def make_model() -> nn.Module:
    return nn.Sequential(
        nn.Linear(FEATURES, HIDDEN),
        nn.GELU(),
        nn.Linear(HIDDEN, HIDDEN),
        nn.GELU(),
        nn.Linear(HIDDEN, CLASSES),
    )


def make_optimizer(parameters):
    return torch.optim.Adam(parameters, lr=1e-3)


def loss(model, batch):
    inputs, labels = batch
    return nn.functional.cross_entropy(model(inputs), labels)


def make_job() -> flexpar.Job:
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(4096, FEATURES, generator=generator)
    labels = inputs[:, :CLASSES].argmax(dim=1)
    dataset = torch.utils.data.TensorDataset(inputs, labels)
    return flexpar.Job(
        model=make_model,
        optimizer=make_optimizer,
        loss=loss,
        dataset=dataset,
        global_batch=64,
        virtual_workers=4,
        seed=3,
    )


if __name__ == "__main__":
    model, summary = make_job().fit(steps=int(os.environ["DRIVER_LOSS_STEPS"]))
    torch.save(model.state_dict(), os.environ["DRIVER_LOSS_FINAL"])
    print(f"resumed by {summary.get('resumed_by')} from {summary['resumed_from']}", flush=True)
