"""What a Trainer's arguments mean for flexpar: the refusals, and the job's numbers.

`refusal(...)` returns the one line that stops a script whose arguments
flexpar cannot honour (naming the argument and what to do instead), or None.
`RunPlan` holds the numbers of the run, computed as transformers.Trainer
computes them on one device (`set_initial_training_values`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass
from typing import Optional

import torch

from flexpar.options import FitOptions, parse_schedule

TRACKERS = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}
"""report_to names and the flexpar tracker each maps onto (flexpar/observe/trackers.py)."""

SCHEDULES = (
    "linear",
    "cosine",
    "cosine_with_restarts",
    "polynomial",
    "constant",
    "constant_with_warmup",
    "inverse_sqrt",
    "cosine_with_min_lr",
    "warmup_stable_decay",
)
"""lr_scheduler_type values whose schedule is a pure function of the step (transformers.get_scheduler)."""

OVERRIDES = (
    "compute_loss",
    "training_step",
    "create_optimizer",
    "create_scheduler",
    "create_optimizer_and_scheduler",
    "get_train_dataloader",
    "_get_train_sampler",
    "_inner_training_loop",
)
"""Trainer methods that run inside transformers' own training loop, which flexpar replaces."""

FLEXPAR_KEYS = ("world_size", "virtual_workers", "deterministic")
"""flexpar.hf.Trainer(flexpar={...}) keys of its own; every other key is a `fit()` option."""


def refuse_subclass(trainer_class, base_class) -> Optional[str]:
    """A Trainer subclass that overrides a method of the training loop (TRL's trainers do): refused."""
    for name in OVERRIDES:
        if getattr(trainer_class, name, None) is not getattr(base_class, name, None):
            return (
                f"{trainer_class.__name__} overrides Trainer.{name}, which runs inside transformers' training "
                "loop; flexpar runs its own loop on every device and cannot call it: put a custom loss in "
                "Trainer(compute_loss_func=...) or the model's forward, and the optimizer in TrainingArguments"
            )
    return None


def refuse_constructor(optimizers, optimizer_cls_and_kwargs, train_dataset, eval_dataset, args) -> Optional[str]:
    """The constructor's arguments that flexpar cannot honour."""
    if optimizers is not None and any(item is not None for item in optimizers):
        return (
            "optimizers= holds optimizer/scheduler instances, which cannot be rebuilt on every device: set "
            "TrainingArguments(optim=, learning_rate=, lr_scheduler_type=, ...) or pass "
            "optimizer_cls_and_kwargs=(torch.optim.SomeClass, {...})"
        )
    if optimizer_cls_and_kwargs is not None and not _is_torch_optimizer(optimizer_cls_and_kwargs[0]):
        return (
            f"optimizer_cls_and_kwargs= names {optimizer_cls_and_kwargs[0]!r}, not a torch.optim optimizer class; "
            "flexpar builds torch.optim optimizers on every device: name one"
        )
    if train_dataset is not None and not hasattr(train_dataset, "__len__"):
        return (
            "train_dataset= has no length (an iterable dataset); flexpar.hf.Trainer reproduces the Trainer's "
            "sampler over a map-style dataset: give a map-style one (datasets.Dataset, torch Dataset), or use "
            "flexpar.Job with the iterable one"
        )
    if isinstance(eval_dataset, dict) and str(getattr(args, "eval_strategy", "no")) not in (
        "no",
        "IntervalStrategy.NO",
    ):
        return (
            "eval_dataset= is a dict and eval_strategy evaluates during training; flexpar evaluates one set "
            "during training: give one eval set, or set eval_strategy='no' and call trainer.evaluate() per set"
        )
    return None


def _value(option) -> str:
    return getattr(option, "value", option)


def refuse_arguments(args) -> Optional[str]:
    """TrainingArguments that flexpar cannot honour, one line each."""
    checks = [
        (
            args.deepspeed,
            "deepspeed=",
            "flexpar shards optimizer state itself: remove deepspeed= (pass "
            "flexpar={'shard_optimizer': True} is not needed for small jobs)",
        ),
        (
            args.fsdp not in (None, "", [], ()),
            "fsdp=",
            "flexpar trains data-parallel with a full model per device: remove fsdp=",
        ),
        (
            _value(args.train_sampling_strategy) != "random" if hasattr(args, "train_sampling_strategy") else False,
            f"train_sampling_strategy={_value(getattr(args, 'train_sampling_strategy', ''))!r}",
            "flexpar reproduces the Trainer's random sampler only: remove it (group_by_length too)",
        ),
        (
            getattr(args, "group_by_length", False),
            "group_by_length=True",
            "flexpar reproduces the Trainer's random sampler only: remove it",
        ),
        (
            args.label_smoothing_factor != 0,
            f"label_smoothing_factor={args.label_smoothing_factor}",
            "not reproduced by flexpar: remove it, or put the smoothing in compute_loss_func=",
        ),
        (
            args.auto_find_batch_size,
            "auto_find_batch_size=True",
            "flexpar keeps the global batch fixed: give per_device_train_batch_size",
        ),
        (
            _value(args.save_strategy) == "best" or args.load_best_model_at_end,
            "save_strategy='best' / load_best_model_at_end=True",
            "not supported by flexpar: save by steps or epochs",
        ),
        (
            _value(args.lr_scheduler_type) not in SCHEDULES,
            f"lr_scheduler_type={_value(args.lr_scheduler_type)!r}",
            f"flexpar steps the schedule on every device from the step alone: use one of {', '.join(SCHEDULES)}",
        ),
        (
            getattr(args, "neftune_noise_alpha", None) is not None,
            "neftune_noise_alpha=",
            "not reproduced by flexpar: remove it",
        ),
        (
            _value(getattr(args, "include_num_input_tokens_seen", "no")) not in ("no", False),
            "include_num_input_tokens_seen=",
            "not counted by flexpar: remove it",
        ),
        (getattr(args, "use_liger_kernel", False), "use_liger_kernel=True", "not applied by flexpar: remove it"),
        (
            args.push_to_hub,
            "push_to_hub=True",
            "flexpar does not push checkpoints: call trainer.push_to_hub() after train()",
        ),
        ((args.eval_delay or 0) > 0, f"eval_delay={args.eval_delay}", "not applied by flexpar: remove it"),
    ]
    for failed, name, fix in checks:
        if failed:
            return f"TrainingArguments({name}): {fix}"
    return None


def refuse_report_to(report_to) -> Optional[str]:
    for name in report_to or ():
        if name not in TRACKERS and name not in ("none", "all"):
            return (
                f"TrainingArguments(report_to=[{name!r}]): flexpar's trackers are {', '.join(TRACKERS)}; "
                "report to one of them, or remove it"
            )
    return None


def trackers_of(report_to) -> tuple:
    names = list(report_to or ())
    if "all" in names:
        return ()  # transformers' "all" means every integration installed: taken as none here, said in the guide
    return tuple(TRACKERS[name] for name in names if name in TRACKERS)


def _is_torch_optimizer(optimizer_class) -> bool:
    return isinstance(optimizer_class, type) and optimizer_class.__module__.startswith("torch.optim")


def refuse_optimizer(optimizer_class) -> Optional[str]:
    if _is_torch_optimizer(optimizer_class):
        return None
    return (
        f"TrainingArguments(optim=...) chose {getattr(optimizer_class, '__name__', optimizer_class)}, which is not "
        "a torch.optim optimizer; flexpar runs torch.optim optimizers: use optim='adamw_torch' (or another torch one)"
    )


def refuse_flexpar_options(options: dict) -> Optional[str]:
    known = set(FLEXPAR_KEYS) | {field.name for field in dataclasses.fields(FitOptions)}
    for key in options:
        if key not in known:
            return f"flexpar={{{key!r}: ...}}: not a flexpar option (its keys: {', '.join(FLEXPAR_KEYS)} and fit()'s)"
    return None


@dataclass(frozen=True)
class RunPlan:
    """The run's numbers, as transformers.Trainer computes them on one device."""

    steps: int
    steps_per_epoch: int
    global_batch: int
    virtual_workers: int
    micro_batch: int
    epochs: int

    @property
    def epoch_fraction(self) -> float:
        return 1.0 / self.steps_per_epoch


def plan_run(
    args, dataset_size: int, world_size: int, virtual_workers: Optional[int], counts_items: bool, devices: int = 1
) -> RunPlan:
    """Steps and batches: the global batch is per-device batch x accumulation x world size.

    The virtual workers default to accumulation x world size: one VW per
    micro-batch the Trainer runs, of its per-device batch (the same work per
    forward as the Trainer's). Where the run may reach more `devices` than
    that and the loss is normalised by its items (its result does not depend
    on the cut), the fewest VWs, a multiple of that, which give every device
    one and divide the global batch.
    """
    micro = args.per_device_train_batch_size
    accumulation = args.gradient_accumulation_steps
    global_batch = micro * accumulation * world_size
    batches = dataset_size // micro if args.dataloader_drop_last else math.ceil(dataset_size / micro)
    batches = math.ceil(batches / world_size)
    steps_per_epoch = max(batches // accumulation + int(batches % accumulation > 0), 1)
    steps = args.max_steps if args.max_steps > 0 else math.ceil(args.num_train_epochs * steps_per_epoch)
    if virtual_workers is None:
        virtual_workers = accumulation * world_size
        if counts_items and devices > virtual_workers:
            fitting = [
                v for v in range(devices, global_batch + 1) if v % virtual_workers == 0 and global_batch % v == 0
            ]
            virtual_workers = fitting[0] if fitting else virtual_workers
    epochs = math.ceil(steps / steps_per_epoch)
    return RunPlan(steps, steps_per_epoch, global_batch, virtual_workers, global_batch // virtual_workers, epochs)


def devices_wanted(options: dict, command_line: dict) -> int:
    """The most devices the run may reach, from fit()'s options and the command line (which wins)."""
    merged = {**options, **{key: value for key, value in command_line.items() if value is not None}}
    initial = merged.get("devices")
    if initial is None:
        initial = torch.cuda.device_count() or 1
    peak, count = initial, initial
    for change in sorted(parse_schedule(merged.get("schedule")), key=lambda change: change.step):
        count += change.delta
        peak = max(peak, count)
    return max(peak, merged.get("max_devices") or 1)


def environment_options() -> dict:
    """flexpar= options from the environment, for a script left unchanged: FLEXPAR_HF_OPTIONS (a JSON object)."""
    text = os.environ.get("FLEXPAR_HF_OPTIONS")
    if not text:
        return {}
    try:
        options = json.loads(text)
    except ValueError:
        options = None
    if not isinstance(options, dict):
        raise ValueError(f"FLEXPAR_HF_OPTIONS={text!r} is not a JSON object of flexpar options")
    return options


def world_size_of(options: dict) -> int:
    """The world size the script was written for: flexpar={'world_size': N}, else FLEXPAR_WORLD_SIZE, else 1."""
    value = options.get("world_size", os.environ.get("FLEXPAR_WORLD_SIZE", 1))
    try:
        value = int(value)
    except (TypeError, ValueError):
        value = 0
    if value < 1:
        raise ValueError(f"world_size={value!r} (the devices the script was written for) must be a positive integer")
    return value
