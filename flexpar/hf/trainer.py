"""`flexpar.hf.Trainer`: transformers.Trainer's interface, trained by a flexpar Job.

A script written for `transformers.Trainer` runs with only its import
changed. The Trainer is built as transformers builds it (this class
subclasses it: `evaluate()`, `predict()`, `save_model()`, `log()` and the
callback handler are transformers' own, run in the driver on the trained
model); `train()` is flexpar's: the model, optimizer, schedule, loss, data
order and options are taken from the Trainer and its TrainingArguments
(flexpar/hf/pieces.py, plan.py, order.py), trained by `flexpar.Job.fit()` on
whatever device set runs it, and the driver's records become the Trainer's
state, logs, callbacks and checkpoint folders (progress.py).
"""

from __future__ import annotations

import os
import time
from typing import Optional

import torch
import transformers
from transformers.trainer_callback import ExportableState, TrainerState
from transformers.trainer_utils import TrainOutput, get_last_checkpoint, speed_metrics

from flexpar import job as job_module
from flexpar import options as options_module
from flexpar.hf import model_file, pieces, progress
from flexpar.hf import plan as plan_module
from flexpar.hf.order import TrainerOrder
from flexpar.hf.refusals import refused
from flexpar.observe.metrics import read_records


class Trainer(transformers.Trainer):
    """transformers.Trainer whose `train()` runs on an elastic device set with flexpar.

    Takes transformers.Trainer's arguments, plus `flexpar={...}`: `world_size`
    (the devices the script was written for: the global batch is
    per_device_train_batch_size x gradient_accumulation_steps x world_size;
    also FLEXPAR_WORLD_SIZE; default 1), `virtual_workers`, `deterministic`,
    and any option of `flexpar.Job.fit()` (`devices`, `schedule`, ...;
    `flexpar run`'s flags override them). What flexpar cannot honour stops
    the script with one line naming the argument (flexpar/hf/plan.py).
    """

    def __init__(self, model=None, args=None, *positional, flexpar: Optional[dict] = None, **keywords):
        names = ("data_collator", "train_dataset", "eval_dataset", "processing_class", "model_init")
        keywords.update(zip(names, positional))
        flexpar = {**plan_module.environment_options(), **(flexpar or {})}
        if args is None:
            args = transformers.TrainingArguments(output_dir="trainer_output")
        refused(
            plan_module.refuse_subclass(type(self), Trainer)
            or plan_module.refuse_arguments(args)
            or plan_module.refuse_report_to(args.report_to)
            or plan_module.refuse_constructor(
                keywords.get("optimizers"),
                keywords.get("optimizer_cls_and_kwargs"),
                keywords.get("train_dataset"),
                keywords.get("eval_dataset"),
                args,
            )
            or plan_module.refuse_flexpar_options(flexpar or {})
        )
        report_to = list(args.report_to or ())
        super().__init__(model=model, args=args, **keywords)
        self.flexpar_options = dict(flexpar or {})
        self.flexpar_trackers = plan_module.trackers_of(report_to)
        from transformers.integrations import get_reporting_integration_callbacks

        for callback in get_reporting_integration_callbacks(report_to):  # flexpar's trackers log instead
            self.remove_callback(callback)
        self.flexpar_summary = None
        self.data_seed = None  # the Trainer's sampler seed, taken when train() starts

    # ------------------------------------------------------------ train

    def train(self, resume_from_checkpoint=None, trial=None, ignore_keys_for_eval=None, **keywords) -> TrainOutput:
        """Train with flexpar; returns the Trainer's TrainOutput and leaves the trained model in `self.model`."""
        job_module.refuse_inside_worker_import()
        if trial is not None or keywords:
            refused("train(trial=...) (hyper-parameter search) is not run by flexpar: call train() without it")
        if self.train_dataset is None:
            raise ValueError("Trainer: training requires a train_dataset.")
        self._refuse_length_options()
        args = self.args
        if self.model_init is not None:  # as the Trainer: the seed set, then the model built
            transformers.set_seed(args.seed)
            self.model = self.call_model_init()
        # The Trainer's sampler takes the global generator's seed when it is built (after the model).
        self.data_seed = args.data_seed if args.data_seed is not None else torch.random.initial_seed()
        checkpoint = self._checkpoint_to_resume(resume_from_checkpoint)
        job, plan, rates = self.build_job()
        self._start_state(plan)
        folder = os.path.join(args.output_dir, progress.FLEXPAR_FOLDER)
        resume = self._prepare_flexpar_folder(folder, checkpoint)
        bridge = progress.TrainerProgress(self, plan, rates, folder if self._saves() else None)
        bridge.replay(self._delivered_records())
        start = time.time()  # on_train_begin: at the job's start event (progress.py)
        model, summary = job.fit(steps=plan.steps, **self._fit_options(plan, folder, resume, bridge))
        self.flexpar_summary = summary
        self.model = self.model_wrapped = model.to(args.device)
        bridge.mirror_checkpoints()
        runtime_steps = max(bridge.steps_run, 1)
        metrics = speed_metrics("train", start, num_samples=plan.global_batch * runtime_steps, num_steps=runtime_steps)
        metrics["train_loss"] = bridge.total_loss / max(bridge.steps_trained, 1)
        self.log(metrics)
        self.control = self.callback_handler.on_train_end(args, self.state, self.control)
        return TrainOutput(self.state.global_step, metrics["train_loss"], metrics)

    def _refuse_length_options(self) -> None:
        """--steps / --epochs (or flexpar={'steps': ...}) would cut the Trainer's order short or overrun it."""
        command_line = options_module._command_line.get() or {}
        for name in ("steps", "epochs"):
            if command_line.get(name) is not None or name in self.flexpar_options:
                refused(
                    f"--{name} / flexpar={{'{name}': ...}}: the Trainer's length is TrainingArguments' "
                    "max_steps or num_train_epochs: set it there"
                )

    def _start_state(self, plan) -> None:
        """A fresh TrainerState for this run, as the Trainer's _init_training_state makes it."""
        callbacks = self.callback_handler.callbacks + [self.control]
        self.state = TrainerState(stateful_callbacks=[cb for cb in callbacks if isinstance(cb, ExportableState)])
        self.state.train_batch_size = self.args.per_device_train_batch_size
        self.state.compute_steps(self.args, plan.steps)
        self.state.init_training_references(self, plan.steps, plan.epochs, None)

    def build_job(self):
        """The flexpar Job of this Trainer, its RunPlan and the replica of its learning-rate schedule."""
        args, model = self.args, self.model
        options = self.flexpar_options
        world_size = plan_module.world_size_of(options)
        collator = self._get_collator_with_removed_columns(self.data_collator, description="training")
        train_dataset = self._without_unused_columns(self.train_dataset, "training")
        counts_items = self._counts_items(collator, train_dataset)
        devices = plan_module.devices_wanted(options, options_module._command_line.get() or {})
        plan = plan_module.plan_run(
            args, len(train_dataset), world_size, options.get("virtual_workers"), counts_items, devices
        )
        if devices > plan.virtual_workers:
            refused(
                f"the run may reach {devices} devices, but the Trainer's batch is {plan.virtual_workers} "
                "micro-batch(es) "
                "(gradient_accumulation_steps x world_size) and its loss a mean per micro-batch, so each device "
                "needs one: set flexpar={'virtual_workers': N} (or FLEXPAR_HF_OPTIONS) with N >= the devices, "
                "which averages N smaller micro-batches instead, or raise gradient_accumulation_steps"
            )
        optimizer_class, keywords = self.optimizer_cls_and_kwargs or self.get_optimizer_cls_and_kwargs(args, model)
        refused(plan_module.refuse_optimizer(optimizer_class))
        decay = set(self.get_decay_parameter_names(model))
        names = [name for name, _ in model.named_parameters()]
        schedule = pieces.TrainerSchedule(
            str(getattr(args.lr_scheduler_type, "value", args.lr_scheduler_type)),
            args.get_warmup_steps(plan.steps),
            plan.steps,
            dict(args.lr_scheduler_kwargs or {}),
        )
        checkpointing = None
        if getattr(args, "activation_checkpointing", None) or args.gradient_checkpointing:
            keywords_of = getattr(args, "activation_checkpointing_kwargs", None) or args.gradient_checkpointing_kwargs
            checkpointing = dict(keywords_of or {})
        factory = model_file.save_model_file(model, os.path.join(args.output_dir, "flexpar-model"), checkpointing)
        loss = pieces.TrainerLoss(counts_items, bool(self._loss_shifts_labels), self.compute_loss_func)
        eval_dataset = self.eval_dataset if self._evaluates() else None
        job = job_module.Job(
            model=factory,
            optimizer=pieces.TrainerOptimizer(
                optimizer_class, dict(keywords), tuple(n in decay for n in names), args.weight_decay
            ),
            loss=loss,
            dataset=TrainerOrder(
                train_dataset,
                self.data_seed if self.data_seed is not None else (args.data_seed or args.seed),
                args.seed,
                plan.steps,
                plan.global_batch,
                self._epoch_samples(),
            ),
            global_batch=plan.global_batch,
            virtual_workers=plan.virtual_workers,
            seed=args.seed,
            lr_scheduler=schedule,
            collate_fn=collator,
            num_workers=args.dataloader_num_workers,
            eval_dataset=None if eval_dataset is None else self._without_unused_columns(eval_dataset, "evaluation"),
            evaluate=None if eval_dataset is None else pieces.TrainerEvaluation(loss),
            eval_batch=args.per_device_eval_batch_size if eval_dataset is not None else None,
            mixed_precision="bf16" if args.bf16 else "fp16" if args.fp16 else None,
            max_grad_norm=args.max_grad_norm or None,
            deterministic=bool(options.get("deterministic", False)),
            compile=bool(args.torch_compile),
            compile_options=self._compile_options(),
        )
        return job, plan, progress.LearningRates(schedule, args.learning_rate)

    # ------------------------------------------------------------ pieces of train()

    def _counts_items(self, collator, dataset) -> bool:
        """Whether the loss is normalised by items (the Trainer's num_items_in_batch path)."""
        if not (self.model_accepts_loss_kwargs or self.compute_loss_func is not None):
            return False
        batch = collator([dataset[0]])
        return isinstance(batch, dict) and "labels" in batch

    def _without_unused_columns(self, dataset, description: str):
        import datasets

        if isinstance(dataset, datasets.Dataset):
            return self._remove_unused_columns(dataset, description=description)
        return dataset

    def _epoch_samples(self) -> Optional[int]:
        """The samples of an epoch the Trainer trains: all, or whole micro-batches (dataloader_drop_last)."""
        if not self.args.dataloader_drop_last:
            return None
        micro = self.args.per_device_train_batch_size
        return len(self.train_dataset) // micro * micro

    def _compile_options(self) -> Optional[dict]:
        """torch_compile_backend / torch_compile_mode as torch.compile's keywords (torch_compile=True)."""
        if not self.args.torch_compile:
            return None
        options = {"backend": self.args.torch_compile_backend, "mode": self.args.torch_compile_mode}
        return {key: value for key, value in options.items() if value is not None} or None

    def _strategy(self, name: str) -> str:
        value = getattr(self.args, name)
        return str(getattr(value, "value", value))

    def _evaluates(self) -> bool:
        return self.eval_dataset is not None and self._strategy("eval_strategy") != "no"

    def _saves(self) -> bool:
        return self._strategy("save_strategy") != "no"

    def _fit_options(self, plan, folder: str, resume: bool, bridge) -> dict:
        args = self.args
        options = {key: value for key, value in self.flexpar_options.items() if key not in plan_module.FLEXPAR_KEYS}
        options.setdefault("run_dir", os.path.join(args.output_dir, "flexpar-runs"))
        options.setdefault("log_every", max(int(self.state.logging_steps or 10), 1))
        options["callbacks"] = (*tuple(options.get("callbacks", ())), bridge)
        options["trackers"] = tuple(dict.fromkeys((*options.get("trackers", ()), *self.flexpar_trackers)))
        if self._evaluates():
            options["eval_every"] = bridge.eval_interval()
        if self._saves():
            every = plan.steps_per_epoch if self._strategy("save_strategy") == "epoch" else int(self.state.save_steps)
            options.update(checkpoint_dir=folder, checkpoint_every=every, resume=resume)
        return options

    def _delivered_records(self) -> list:
        """The records of this job that a driver before this one delivered: under `flexpar run --resume`
        (a restarted driver, which continues the job's metrics file), that file's records; else none."""
        command_line = options_module._command_line.get() or {}
        path = command_line.get("metrics") or self.flexpar_options.get("metrics")
        if not command_line.get("resume") or not path or not os.path.isfile(path):
            return []
        return read_records(path)

    def _checkpoint_to_resume(self, resume_from_checkpoint) -> Optional[str]:
        """The checkpoint-N folder to resume from (True: the newest under output_dir), or None."""
        if resume_from_checkpoint in (None, False):
            return None
        if resume_from_checkpoint is True:
            folder = get_last_checkpoint(self.args.output_dir)
            if folder is None:
                raise ValueError(f"No valid checkpoint found in output directory ({self.args.output_dir})")
            return folder
        if not os.path.isfile(os.path.join(resume_from_checkpoint, progress.STATE_FILE)):
            refused(
                f"train(resume_from_checkpoint={resume_from_checkpoint!r}): no {progress.STATE_FILE} there; "
                "flexpar resumes from the checkpoint-N folders flexpar.hf.Trainer writes"
            )
        return resume_from_checkpoint

    def _prepare_flexpar_folder(self, folder: str, checkpoint: Optional[str]) -> bool:
        """flexpar's checkpoint folder for this run: emptied, holding the checkpoint to resume from if any.

        Its old files are hard links of (or copies in) the checkpoint-N folders.
        A `flexpar run --resume` (a restarted driver) keeps it as it is.
        """
        command_line = options_module._command_line.get() or {}
        if command_line.get("resume"):
            return True
        os.makedirs(folder, exist_ok=True)
        for name in os.listdir(folder):
            if name.startswith("step-"):
                os.remove(os.path.join(folder, name))
        if checkpoint is None:
            return False
        previous = TrainerState.load_from_json(os.path.join(checkpoint, "trainer_state.json"))
        step = previous.global_step
        os.link(os.path.join(checkpoint, progress.STATE_FILE), os.path.join(folder, f"step-{step:08d}.pt"))
        self.state.log_history = list(previous.log_history)
        self.state.global_step = step
        self.state.epoch = previous.epoch
        return True
