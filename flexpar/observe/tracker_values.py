"""What the trackers (trackers.py) log of the job's records: names, values and the step on the x axis.

The x axis of every tracker is the metrics file's step, so that a step has
the same number in every view: a step record is logged at its `step` (from
0), an evaluation at its `step` (the steps done before it: the evaluation
after step 7 is at 8), an event at its `step` (the step it took effect
before); in W&B, the metric `step` (wandb's own `_step` only counts rows).
Names:

    train/loss, train/samples_per_s, train/step_time_s, train/lr, train/imbalance,
    train/grad_norm, train/devices, train/generation   from each step record
    train/skipped_step                                 1 at an fp16 step skipped for an inf/NaN gradient,
                                                       whose grad_norm (inf or NaN) is not logged: one
                                                       such point wrecks a plot's scale (MLflow's SQL
                                                       stores even keep an inf as 1.8e308)
    eval/<metric>                                      each summed metric of an evaluation
    eval/<name>_mean                                   with a `count` metric: each other one / count
                                                       (loss_sum -> eval/loss_mean, correct -> eval/correct_mean)
    event/<event>/stall_s                              each event's stall (join, leave, failure, ...)

`Tracker` is the trackers' base: it turns each record into these values and
hands them to its `log`, which each tracker carries out in its own library.
"""

from __future__ import annotations

import math

from flexpar.callbacks import Callback
from flexpar.core import evaluation

_STEP_FIELDS = ("loss", "samples_per_s", "step_time_s", "lr", "imbalance")


def step_values(record: dict) -> dict:
    """What a tracker logs of a step record: {name: value}, every value finite (module docstring)."""
    values = {f"train/{field}": float(record[field]) for field in _STEP_FIELDS}
    grad_norm = float(record["grad_norm"])
    if math.isfinite(grad_norm):
        values["train/grad_norm"] = grad_norm
    else:  # fp16: the step was skipped and the loss scale backed off
        values["train/skipped_step"] = 1.0
    values["train/devices"] = float(len(record["devices"]))
    values["train/generation"] = float(record["generation"])
    return values


def eval_values(record: dict) -> dict:
    """What a tracker logs of an eval record: each summed metric, and per-sample means with a `count`."""
    metrics = record["metrics"]
    values = {f"eval/{key}": float(value) for key, value in sorted(metrics.items())}
    for name, value in sorted(evaluation.means(metrics).items()):
        values[f"eval/{name}_mean"] = float(value)
    return values


class Tracker(Callback):
    """Base of the trackers: never stops the job, so the devices never wait on it."""

    never_stops = True
    name = ""

    def __init__(self, run_dir: str, resume: bool = False):
        self.run_dir = run_dir
        self.resume = resume

    def on_step(self, record):
        self.log(step_values(record), record["step"], record["time"])

    def on_eval(self, record):
        self.log(eval_values(record), record["step"], record["time"])

    def on_event(self, record):
        self.log({f"event/{record['event']}/stall_s": float(record["stall_s"])}, record["step"], record["time"])

    def log(self, values: dict, step: int, wall: float) -> None:
        raise NotImplementedError

    def finish_tracking(self, failed: bool = False) -> None:
        """Flush and close (the driver calls it when the job ends, well or not)."""
