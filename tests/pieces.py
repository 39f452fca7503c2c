"""Shared training pieces for the tests, importable by worker processes.

The reference is the plain single-process loop the equivalence promise is
stated against: per step, the mean loss over the whole global batch (each VW
slice under its own random stream, so dropout draws the same masks), one
backward, one optimizer step. It follows the job's recipe by hand too: each
VW's forward under torch.autocast, a (loss_sum, count) loss as the token mean
of the whole batch, torch.amp.GradScaler for fp16, clip_grad_norm_ on the
full-batch gradient.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import time

import torch
from torch import nn

import flexpar
from flexpar.core import batching
from flexpar.worker.loader import load_batch
from flexpar.worker.user_code import build_model, build_optimizer

FEATURES = 12
CLASSES = 3


def make_dataset(size: int = 480, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(size, FEATURES, generator=generator)
    labels = (inputs[:, :CLASSES].argmax(dim=1)).long()
    return torch.utils.data.TensorDataset(inputs, labels)


def make_model():
    return nn.Sequential(
        nn.Linear(FEATURES, 32),
        nn.Tanh(),
        nn.Dropout(0.2),
        nn.Linear(32, 32),
        nn.Tanh(),
        nn.Linear(32, CLASSES),
    )


def make_model_slowly():
    """make_model after 1.5 s: a device that takes seconds to build its model (a big one, a slow disk)."""
    time.sleep(1.5)
    return make_model()


def make_wider_model():
    """A different architecture: a joiner with it must be refused."""
    return nn.Sequential(nn.Linear(FEATURES, 64), nn.Tanh(), nn.Linear(64, CLASSES))


class UnseededModel:
    """make_model with values drawn from a generator the OS seeds: every process builds other ones.

    The mistake of a factory that is not deterministic (`torch.Generator().seed()`). Each
    build writes its values to `directory`/<pid>.pt, so a test can start the
    plain loop from the values a device built.
    """

    def __init__(self, directory: str):
        self.directory = directory

    def __call__(self) -> nn.Module:
        model = make_model()
        generator = torch.Generator()
        generator.seed()
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.3)
        torch.save(model.state_dict(), os.path.join(self.directory, f"{os.getpid()}.pt"))
        return model


class HeldBackModel:
    """make_model, except that a process building it once `hold` exists waits until `release` exists.

    A test creates `hold` once the initial devices are built (a callback, in
    the driver), so that a later joiner's start waits until the test lets it
    go (for at most `limit_s`): a joiner on its way at a moment of the test's
    choosing, whatever the host's speed.
    """

    def __init__(self, hold: str, release: str, limit_s: float = 60.0):
        self.hold, self.release, self.limit_s = hold, release, limit_s

    def __call__(self) -> nn.Module:
        if os.path.exists(self.hold):
            deadline = time.monotonic() + self.limit_s
            while not os.path.exists(self.release) and time.monotonic() < deadline:
                time.sleep(0.02)
        return make_model()


class ShapeByProcess:
    """A first layer 16 wide in the process `driver_pid`, 24 wide in any other: other shapes in other processes."""

    def __init__(self, driver_pid: int):
        self.driver_pid = driver_pid

    def __call__(self) -> nn.Module:
        width = 16 if os.getpid() == self.driver_pid else 24
        return nn.Sequential(nn.Linear(FEATURES, width), nn.Tanh(), nn.Linear(width, CLASSES))


def make_broad_model():
    """About 19k parameters (make_model has 1.6k): enough that a transfer's bytes are mostly tensors."""
    return nn.Sequential(nn.Linear(FEATURES, 128), nn.Tanh(), nn.Linear(128, 128), nn.Tanh(), nn.Linear(128, CLASSES))


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


class SlowUntilJoined:
    """`loss(model, batch)` after `waiting_s` of sleep per call until this device has trained in a group
    of at least `devices`, after `delay_s` from then on (per process: a device that saw the group keeps
    the short delay after a leave). However long a joiner takes to warm up on a loaded host, the steps
    before it joins are slow, so that it joins a step or two after it is warm, well ahead of a change
    scheduled a dozen steps later. The bits do not depend on it."""

    def __init__(self, loss, devices: int, delay_s: float = 0.02, waiting_s: float = 0.3):
        self.loss, self.devices, self.delay_s, self.waiting_s = loss, devices, delay_s, waiting_s
        self.joined = False

    def __call__(self, model, batch):
        import torch.distributed as dist

        self.joined = self.joined or (dist.is_initialized() and dist.get_world_size() >= self.devices)
        time.sleep(self.delay_s if self.joined else self.waiting_s)
        return self.loss(model, batch)


def make_job(optimizer=sgd, virtual_workers=4, global_batch=48, delay_s=0.0, dataset=None, **extra):
    return flexpar.Job(
        model=extra.pop("model", make_model),
        optimizer=optimizer,
        loss=Loss(delay_s),
        dataset=dataset if dataset is not None else make_dataset(),
        global_batch=global_batch,
        virtual_workers=virtual_workers,
        seed=7,
        **extra,
    )


def reference(job, steps: int, trace=None) -> nn.Module:
    """Plain single-process training over the same global batches.

    With `trace` (a dict), appends per step: "loss" (the global mean, or token
    mean), "grad_norm" (before clipping), "skipped" (fp16) and "scale" (fp16,
    after the step).
    """
    model = build_model(job)
    optimizer, scheduler = build_optimizer(job, model)
    loss_of = job.loss.__class__(0.0) if isinstance(job.loss, Loss) else job.loss
    size = len(job.dataset)
    precision = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(job.mixed_precision)
    scaler = torch.amp.GradScaler("cpu", **(job.grad_scaler or {})) if job.mixed_precision == "fp16" else None
    # compile=True: the forward runs compiled here too (inductor draws dropout masks its own way).
    forward = torch.compile(model, **(job.compile_options or {})) if getattr(job, "compile", False) else model
    for step in range(steps):
        losses, sums, counts = [], [], []
        for virtual_worker in range(job.virtual_workers):
            indices = batching.virtual_worker_indices(
                job.seed, step, virtual_worker, size, job.global_batch, job.virtual_workers
            )
            batch = load_batch(job, indices, batching.data_seed(job.seed, step, virtual_worker))
            torch.manual_seed(batching.virtual_worker_seed(job.seed, step, virtual_worker))
            # One autocast region per VW, as each VW's forward is one on a device.
            with torch.autocast("cpu", dtype=precision) if precision else contextlib.nullcontext():
                result = loss_of(forward, batch)
            pair = isinstance(result, tuple)
            term = result[0] if pair else result
            if pair:
                counts.append(float(result[1]))
            if precision is not None:
                # Mixed precision: backward per VW, as the textbook accumulation loop with
                # GradScaler does (and as flexpar does): fp16/bf16 forwards amplify the last-bit
                # differences of another float order of the summed gradient (module docstring).
                part = term if pair else term / job.virtual_workers
                (scaler.scale(part) if scaler is not None else part).backward()
                term = term.detach()
            (sums if pair else losses).append(term)
        if sums:  # the token mean of the whole batch: every loss_sum, then / every count
            objective, total = torch.stack(sums).sum(), sum(counts)
        else:
            objective, total = torch.stack(losses).mean(), None
        if precision is None:
            objective.backward()
        if scaler is not None:
            scaler.unscale_(optimizer)
        if total is not None:
            # / total, as a multiplication by 1 / total (as flexpar does): g / N and
            # g * (1 / N) differ in the last bit now and then, which bf16 amplifies.
            for parameter in model.parameters():
                if parameter.grad is not None:
                    parameter.grad.mul_(1.0 / total)
        norm = None
        if job.max_grad_norm is not None or trace is not None:
            norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), job.max_grad_norm or math.inf))
        skipped = False
        if scaler is not None:
            before = scaler.get_scale()
            scaler.step(optimizer)  # skipped when the gradient is not finite
            scaler.update()
            skipped = scaler.get_scale() < before
        else:
            optimizer.step()
        if scheduler is not None and not skipped:
            scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        if trace is not None:
            trace.setdefault("loss", []).append(float(objective.detach()) / (total or 1.0))
            trace.setdefault("grad_norm", []).append(norm)
            trace.setdefault("skipped", []).append(skipped)
            trace.setdefault("scale", []).append(scaler.get_scale() if scaler is not None else None)
    return model


def assert_same_parameters(model, expected, rtol=1e-5, atol=1e-7):
    for (name, got), (_, want) in zip(model.state_dict().items(), expected.state_dict().items()):
        torch.testing.assert_close(got, want, rtol=rtol, atol=atol, msg=lambda m, name=name: f"{name}: {m}")


def metrics_records(path) -> list:
    """Every record of a metrics file (JSON lines), in file order."""
    return [json.loads(line) for line in open(path)]


def device_counts(records) -> list:
    """The sequence of device-set sizes the step records went through."""
    counts = []
    for record in records:
        if record["kind"] == "step" and (not counts or counts[-1] != len(record["devices"])):
            counts.append(len(record["devices"]))
    return counts
