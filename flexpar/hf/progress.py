"""The driver's side of a flexpar.hf.Trainer run: Trainer state, logs, TrainerCallbacks, checkpoint folders.

`TrainerProgress` is a flexpar callback (flexpar/callbacks.py): it runs in
the driver, gets every step and evaluation record once (across re-adoptions
and resumes, flexpar's promise), and turns them into what a Trainer user
sees: `state.global_step`, `state.epoch`, `state.log_history` (entries as
`Trainer.log` writes them), the TrainerCallback events in the Trainer's
order (epoch begin, step begin, pre-optimizer step, optimizer step, step
end, log, evaluate, save, epoch end), and `checkpoint-N` folders under
`output_dir`, one per flexpar checkpoint, with `save_total_limit` applied.
"""

from __future__ import annotations

import copy
import os
import re
import shutil
from typing import Optional

import torch

from flexpar.callbacks import STOP, Callback
from flexpar.hf.plan import RunPlan
from flexpar.worker import checkpoints

STATE_FILE = "flexpar-state.pt"
"""A checkpoint-N folder's flexpar training state (a hard link to flexpar's step-N.pt where it can be)."""
FLEXPAR_FOLDER = "flexpar-checkpoints"
_STEP_FILE = re.compile(r"^step-(\d+)\.pt$")


class LearningRates:
    """The learning rate the Trainer logs at a step: the rate its last optimizer step used, from a replica schedule.

    (flexpar's step records carry the rate after the scheduler's step; the Trainer logs the one before it.)
    """

    def __init__(self, schedule, learning_rate: float):
        self.parameter = torch.nn.Parameter(torch.zeros(1))
        self.optimizer = torch.optim.SGD([self.parameter], lr=learning_rate)
        self.scheduler = schedule(self.optimizer)
        self.steps = 0

    def used_by(self, step: int) -> float:
        """The rate of step `step` (counted from 0)."""
        while self.steps < step:
            self.optimizer.step()
            self.scheduler.step()
            self.steps += 1
        return float(self.scheduler.get_last_lr()[0])


class TrainerProgress(Callback):
    """flexpar's records -> the Trainer's state, logs, callbacks and checkpoint folders (driver only)."""

    never_stops = False

    def __init__(self, trainer, plan: RunPlan, rates: LearningRates, flexpar_folder: Optional[str]):
        self.trainer, self.plan, self.rates = trainer, plan, rates
        self.flexpar_folder = flexpar_folder
        self.losses_since_log, self.steps_since_log = 0.0, 0
        self.total_loss, self.steps_trained = 0.0, 0  # over the whole run (train_loss)
        self.steps_run = 0  # by this driver (the speed metrics)
        self.replaying = False
        self.continued = False  # whether a driver before this one began the run (replay)
        self.last_grad_norm = None
        self.mirrored: set = set()
        self.began = False

    # ------------------------------------------------------------ the start

    def on_event(self, record: dict):
        """The job's start begins the Trainer's run; an `adopt` (a restarted driver re-adopting the devices)
        does not: it began under the driver that was lost."""
        if record.get("event") in ("start", "adopt"):
            self.begin(re_adopted=record["event"] == "adopt")
        return None

    def begin(self, re_adopted: bool) -> None:
        """on_train_begin once per run: for every callback at its start, for transformers' own display
        callbacks only in a driver that re-adopted the devices."""
        if self.began:
            return
        self.began = True
        trainer = self.trainer
        if not re_adopted:
            trainer.control = trainer.callback_handler.on_train_begin(trainer.args, trainer.state, trainer.control)
        else:
            self.restart_display()

    def restart_display(self) -> None:
        """transformers' own callbacks (progress bar, printer) begin again in this driver; the user's saw
        on_train_begin under the driver that was lost, and do not see it twice."""
        trainer = self.trainer
        for callback in trainer.callback_handler.callbacks:
            if type(callback).__module__.startswith("transformers."):
                callback.on_train_begin(trainer.args, trainer.state, trainer.control)

    # ------------------------------------------------------------ steps

    def on_step(self, record: dict):
        trainer, state, args = self.trainer, self.trainer.state, self.trainer.args
        handler, step = trainer.callback_handler, record["step"] + 1
        if state.global_step >= step:
            return None  # a resumed run's records before the resume point are not this run's
        if not self.replaying:  # a first record beyond the state this driver holds: it re-adopted devices mid-run
            self.begin(re_adopted=self.continued or state.global_step < step - 1)
        per_epoch = self.plan.steps_per_epoch
        if (step - 1) % per_epoch == 0:
            trainer.control = handler.on_epoch_begin(args, state, trainer.control)
        trainer.control = handler.on_step_begin(args, state, trainer.control)
        trainer.control = handler.on_pre_optimizer_step(args, state, trainer.control)
        trainer.control = handler.on_optimizer_step(args, state, trainer.control)
        state.global_step = step
        state.epoch = step / per_epoch
        self.losses_since_log += float(record["loss"])
        self.steps_since_log += 1
        self.total_loss += float(record["loss"])
        self.steps_trained += 1
        self.steps_run += 0 if self.replaying else 1
        self.last_grad_norm = record.get("grad_norm")
        trainer.control = handler.on_step_end(args, state, trainer.control)
        if trainer.control.should_log:
            self.log_training()
        if not self.replaying:
            self.mirror_checkpoints()
        if step % per_epoch == 0:
            trainer.control = handler.on_epoch_end(args, state, trainer.control)
        if trainer.control.should_training_stop and step < self.plan.steps:
            return STOP
        return None

    def log_training(self) -> None:
        logs = {"loss": self.losses_since_log / max(self.steps_since_log, 1)}
        if self.last_grad_norm is not None:
            logs["grad_norm"] = float(self.last_grad_norm)
        logs["learning_rate"] = self.rates.used_by(self.trainer.state.global_step - 1)
        self.losses_since_log, self.steps_since_log = 0.0, 0
        self.trainer.control.should_log = False
        self.trainer.log(logs)

    def replay(self, records: list) -> None:
        """The records a driver before this one delivered (its metrics file, which a driver restarted with
        `--resume` continues): the state, logs and loss sums they made, as if this driver had seen them.

        The TrainerCallbacks saw them under that driver and are not called again: only transformers'
        DefaultFlowCallback (which decides when to log, evaluate and save) runs while they replay.
        """
        from transformers.trainer_callback import DefaultFlowCallback

        handler = self.trainer.callback_handler
        callbacks = handler.callbacks
        handler.callbacks = [callback for callback in callbacks if isinstance(callback, DefaultFlowCallback)]
        self.replaying, self.continued = True, bool(records)
        try:
            for record in records:
                if record["kind"] == "step":
                    self.on_step(record)
                elif record["kind"] == "eval":
                    self.on_eval(record)
        finally:
            handler.callbacks, self.replaying = callbacks, False

    # ------------------------------------------------------------ evaluations

    def on_eval(self, record: dict):
        trainer, state = self.trainer, self.trainer.state
        step = record["step"]
        eval_steps = self.eval_interval()
        if eval_steps is None or step % eval_steps != 0 or step > self.plan.steps:
            return None  # flexpar's evaluation after the last step, which the Trainer does not run
        sums = record["metrics"]
        metrics = {"eval_loss": sums["loss_sum"] / max(sums["count"], 1)}
        trainer.log(metrics)
        trainer.control = trainer.callback_handler.on_evaluate(trainer.args, state, trainer.control, metrics)
        trainer.control.should_evaluate = False
        return None

    def eval_interval(self) -> Optional[int]:
        strategy = getattr(self.trainer.args.eval_strategy, "value", self.trainer.args.eval_strategy)
        if strategy == "steps":
            return int(self.trainer.state.eval_steps or self.trainer.args.eval_steps)
        if strategy == "epoch":
            return self.plan.steps_per_epoch
        return None

    # ------------------------------------------------------------ checkpoints

    def mirror_checkpoints(self) -> None:
        """A checkpoint-N folder for each flexpar checkpoint written so far, then save_total_limit."""
        if self.flexpar_folder is None or not os.path.isdir(self.flexpar_folder):
            return
        for name in sorted(os.listdir(self.flexpar_folder)):
            match = _STEP_FILE.match(name)
            if match and int(match.group(1)) not in self.mirrored:
                step, source = int(match.group(1)), os.path.join(self.flexpar_folder, name)
                if self.mirrored_before(step, source):
                    self.mirrored.add(step)  # by the driver this one re-adopted the devices from
                else:
                    self.mirror(step, source)
        rotate_checkpoints(self.trainer.args.output_dir, self.trainer.args.save_total_limit)

    def mirror(self, step: int, source: str) -> None:
        trainer = self.trainer
        folder = os.path.join(trainer.args.output_dir, f"checkpoint-{step}")
        os.makedirs(folder, exist_ok=True)
        target = os.path.join(folder, STATE_FILE)
        if os.path.exists(target):
            os.remove(target)
        try:
            os.link(source, target)
        except OSError:
            shutil.copyfile(source, target)
        save_weights(trainer, source, folder)
        state = self.state_at(step)
        state.save_to_json(os.path.join(folder, "trainer_state.json"))
        self.mirrored.add(step)
        trainer.control = trainer.callback_handler.on_save(trainer.args, state, trainer.control)
        trainer.control.should_save = False

    def mirrored_before(self, step: int, source: str) -> bool:
        """Whether checkpoint-`step` already holds `source` itself (a hard link made by a driver before this one)."""
        target = os.path.join(self.trainer.args.output_dir, f"checkpoint-{step}", STATE_FILE)
        try:
            return os.path.samefile(source, target)
        except OSError:
            return False

    def state_at(self, step: int):
        """The Trainer's state as it was after step `step` (a checkpoint is mirrored a step or two after it)."""
        state = copy.deepcopy(self.trainer.state)
        state.global_step, state.epoch = step, step / self.plan.steps_per_epoch
        state.log_history = [entry for entry in state.log_history if entry.get("step", 0) <= step]
        return state


def save_weights(trainer, source: str, folder: str) -> None:
    """The checkpoint's model and optimizer in `folder` as transformers' own checkpoint holds them.

    `model.safetensors` and `config.json` (the model's `save_pretrained`, by `Trainer._save`; a peft
    model's adapter, `adapter_model.safetensors` and `adapter_config.json`), the processing class and
    `training_args.bin`: `from_pretrained(folder)` loads the checkpoint's weights. flexpar's
    checkpoint holds the trainable state (frozen weights and unchanged buffers by digest): the rest
    of the state_dict is the script's model's own, which the devices built theirs from. Unless
    `save_only_model`, `optimizer.pt` and `scheduler.pt` too (torch.optim's and the schedule's
    state_dicts; flexpar's optimizer has the Trainer's parameter groups), so that
    `transformers.Trainer` resumes from the folder as from its own.
    """
    from transformers.trainer import OPTIMIZER_NAME, SCHEDULER_NAME

    with_optimizer = not trainer.args.save_only_model
    state = checkpoints.read_checkpoint(source, torch.device("cpu"), with_optimizer=with_optimizer)
    trainer._save(folder, state_dict={**trainer.model.state_dict(), **state["model"]})
    if with_optimizer:
        torch.save(state["optimizer"], os.path.join(folder, OPTIMIZER_NAME))
        torch.save(state["scheduler"], os.path.join(folder, SCHEDULER_NAME))


def checkpoint_folders(output_dir: str) -> list:
    """The checkpoint-N folders under `output_dir` that hold flexpar's state, oldest first: [(N, path)]."""
    if not os.path.isdir(output_dir):
        return []
    found = []
    for name in os.listdir(output_dir):
        match = re.match(r"^checkpoint-(\d+)$", name)
        path = os.path.join(output_dir, name)
        if match and os.path.isfile(os.path.join(path, STATE_FILE)):
            found.append((int(match.group(1)), path))
    return sorted(found)


def rotate_checkpoints(output_dir: str, limit: Optional[int]) -> None:
    """Keep the newest `limit` checkpoint-N folders (the Trainer's save_total_limit)."""
    if not limit:
        return
    folders = checkpoint_folders(output_dir)
    for _, path in folders[: max(len(folders) - limit, 0)]:
        shutil.rmtree(path, ignore_errors=True)
