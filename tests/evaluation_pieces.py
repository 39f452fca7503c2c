"""Evaluation and callback pieces for the tests, importable by worker processes (as `pieces` is)."""

from __future__ import annotations

import time

import pieces
import torch
from torch import nn

import flexpar

EVAL_SIZE = 997  # divisible by nothing convenient (it is prime)


def make_eval_dataset(size: int = EVAL_SIZE):
    return pieces.make_dataset(size, seed=1)


class Evaluate:
    """Summed loss, correct answers and count of a batch; `delay_s` of sleep per batch (slow evaluations)."""

    def __init__(self, delay_s: float = 0.0):
        self.delay_s = delay_s

    def __call__(self, model, batch):
        if self.delay_s:
            time.sleep(self.delay_s)
        inputs, labels = batch
        logits = model(inputs)
        return {
            "loss_sum": nn.functional.cross_entropy(logits, labels, reduction="sum"),
            "correct": (logits.argmax(dim=1) == labels).sum(),
            "count": len(labels),
        }


def make_job(delay_s=0.0, eval_delay_s=0.0, eval_batch=None, **extra):
    return pieces.make_job(
        delay_s=delay_s,
        eval_dataset=make_eval_dataset(),
        evaluate=Evaluate(eval_delay_s),
        eval_batch=eval_batch,
        **extra,
    )


class Recorder(flexpar.Callback):
    """Keeps every record it is given, in order; stops at `stop_step` (from `stop_hook`)."""

    def __init__(self, stop_hook=None, stop_step=None):
        self.calls = []
        self.stop_hook, self.stop_step = stop_hook, stop_step

    def _record(self, hook, record):
        self.calls.append((hook, record))
        if hook == self.stop_hook and record["step"] == self.stop_step:
            return flexpar.STOP
        return None

    def on_step(self, record):
        return self._record("on_step", record)

    def on_event(self, record):
        return self._record("on_event", record)

    def on_eval(self, record):
        return self._record("on_eval", record)

    def on_end(self, summary):
        self.calls.append(("on_end", summary))

    def of(self, hook):
        return [record for name, record in self.calls if name == hook]


def assert_metrics_equal(got: dict, want: dict, rtol=1e-6):
    assert sorted(got) == sorted(want)
    for key in want:
        if key == "count" or key == "correct":
            assert got[key] == want[key], (key, got[key], want[key])
        else:
            assert abs(got[key] - want[key]) <= rtol * max(1.0, abs(want[key])), (key, got[key], want[key])


def trained_reference(job, steps):
    """The single-process reference model after `steps` steps, in eval-ready form."""
    model = pieces.reference(job, steps)
    return model


def without_delays(job):
    """The job with an evaluate that does not sleep (the same sums, at once)."""
    import dataclasses

    return dataclasses.replace(job, evaluate=Evaluate(0.0))


def evaluate_reference(job, steps):
    from flexpar.worker.evaluator import evaluate_all

    return evaluate_all(without_delays(job), trained_reference(job, steps))


def torch_threads_one():
    torch.set_num_threads(1)
