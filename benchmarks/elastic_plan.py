"""The job of benchmarks/elastic.py and the changes of its rounds: sizes, schedule, faults (no processes).

The job's single-device pieces are restart_worker.py's (plain PyTorch, which
its torchrun baseline trains too). Simulator validation (sim_validation.py)
reads the names of the changes and trains this job in its probe.
"""

from __future__ import annotations

import restart_worker
import torch
from restart_worker import adam, cross_entropy, make_dataset

GLOBAL_BATCH = 24
VIRTUAL_WORKERS = 6  # splits evenly over 2 and 3 devices


# The changes of a flexpar round, in order: "+1" (a device joins), "kill" (the
# newest member is killed during backward) and "-1" (the newest member leaves).
# A scale-in costs a few milliseconds with a heavy tail and a failure less than
# a step: a round has several of each (over a run's six, a scale-in's boundary
# record read 2 to 11 ms and a failure's 0.15 to 0.26 s, so a median of six
# moved by a third between runs).
ROUND_CHANGES = ("+1", "kill", "+1", "-1", "+1", "-1", "+1", "kill", "+1", "-1", "+1", "-1", "+1", "kill")
# The names of each kind's changes, in order; each figure is a median over every
# round's changes of its kind.
SCALE_OUTS = (
    "scale_out",
    "scale_out_again",
    "scale_out_third",
    "scale_out_fourth",
    "scale_out_fifth",
    "scale_out_sixth",
    "scale_out_seventh",
)
SCALE_INS = ("scale_in", "scale_in_again", "scale_in_third", "scale_in_fourth")
FAILURES = ("failure", "failure_again", "failure_third")


def planned_device_counts(changes=ROUND_CHANGES, devices: int = 2) -> list:
    """The device counts a round goes through when every change fires as planned."""
    counts = [devices]
    for change in changes:
        counts.append(counts[-1] + (1 if change == "+1" else -1))
    return counts


PLANNED_DEVICE_COUNTS = planned_device_counts()


class Settings:
    """The size of one invocation: full (default) or --quick."""

    def __init__(self, quick: bool, rounds: int):
        self.quick = quick
        self.model_name = "small" if quick else "full"
        self.rounds = rounds
        # flexpar schedule: step indices of the changes, spaced so that each change
        # has settled before the next fires. A joiner needs seconds (start, import the
        # script, build, warm up) before it is admitted: about 3 full-size steps, or
        # 12 of the quick model's short ones; `lead` leaves room beyond that, since the
        # fault can only fire once the joiner trains, and a "-1" that fires before
        # the joiner is admitted would cancel it instead of removing it. After a
        # leave or a kill, 4 steps on 2 devices give the change's generation a
        # normal step.
        lead = 16 if quick else 6
        self.change_steps = []
        step = 3
        for change in ROUND_CHANGES:
            self.change_steps.append(step)
            step += lead if change == "+1" else 4
        self.steps = step
        self.join_steps = self._steps_of("+1")
        self.leave_steps = self._steps_of("-1")
        # The third agent starts once the old set has committed a step (it then needs
        # seconds of `import torch` before it reaches the rendezvous, while the old
        # set trains on); the new set runs 3 steps: 2 intervals give a normal step.
        self.baseline_old_steps = 1
        self.baseline_new_steps = 3
        self.broadcast_repeats = 1 if quick else 2
        # flexpar's own transfer between 3 processes on 2 cores took 0.12 to 0.68 s
        # from one repeat to the next on the development machine: its parts are
        # medians over more repeats (about 0.5 s each).
        self.transfer_repeats = 1 if quick else 9
        # A joiner receives in a process that never held the state: fresh processes
        # (before the joiner received the model in place) took 0.29-0.34 s (median)
        # where a long-lived receiver took 0.18-0.24 s.
        self.fresh_receivers = 1 if quick else 7
        # Rounds are repeated while time allows: no new round starts that would push
        # the run past this (the floor measurement, ~30 s, comes after the rounds).
        self.budget_s = 330.0

    def _steps_of(self, kind: str) -> tuple:
        return tuple(step for step, change in zip(self.change_steps, ROUND_CHANGES) if change == kind)

    @property
    def schedule(self) -> str:
        return ",".join(
            f"{step}:{change}" for step, change in zip(self.change_steps, ROUND_CHANGES) if change != "kill"
        )

    @property
    def faults(self) -> str:
        # Joiners are numbered from local-2 on, in order; a kill hits the newest.
        faults, joined = [], 0
        for step, change in zip(self.change_steps, ROUND_CHANGES):
            joined += change == "+1"
            if change == "kill":
                faults.append(f"{step}:local-{1 + joined}:backward")
        return ",".join(faults)


def make_job(model, global_batch: int = GLOBAL_BATCH, virtual_workers: int = VIRTUAL_WORKERS):
    """The job as flexpar trains it: `model` (a factory), Adam, cross-entropy, the dataset, seed 0.

    checkpoint.py trains it too, with its own batch and model factories (the
    workers must import that script, for its instrumentation).
    """
    import flexpar

    return flexpar.Job(
        model=model,
        optimizer=adam,
        loss=cross_entropy,
        dataset=make_dataset(),
        global_batch=global_batch,
        virtual_workers=virtual_workers,
        seed=0,
    )


def model_factory(settings: Settings):
    return restart_worker.MODELS[settings.model_name]


def one_virtual_worker_batch():
    """A batch of one VW of this job (the first samples): what a warm-up or a probe's step runs."""
    return make_dataset()[: GLOBAL_BATCH // VIRTUAL_WORKERS]


def trained_state(settings: Settings):
    """Model and Adam after one step, so the optimizer holds its full state."""
    torch.manual_seed(0)
    model = model_factory(settings)()
    optimizer = adam(model.parameters())
    inputs, labels = make_dataset()[:4]
    cross_entropy(model, (inputs, labels)).backward()
    optimizer.step()
    return model, optimizer
