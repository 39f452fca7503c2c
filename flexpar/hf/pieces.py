"""The flexpar job's pieces, built from a Trainer's model and TrainingArguments.

Each is a small picklable object: the driver builds them, the job carries
them to every device, and each device calls them (flexpar/job.py's contract).

- the model: flexpar/hf/model_file.py (`ModelFromFile`: rebuilt on a device
  from its class and config and loaded from one file the devices map; a peft
  model's frozen weights take flexpar's frozen-weight path).
- `TrainerOptimizer`: the optimizer class and keyword arguments the Trainer
  itself chooses (`Trainer.get_optimizer_cls_and_kwargs`), with its two
  parameter groups (decay / no decay, `get_decay_parameter_names`).
- `TrainerSchedule`: transformers' own `get_scheduler` with the Trainer's
  warm-up steps.
- `TrainerLoss` / `TrainerEvaluation`: the Trainer's `compute_loss`, as a sum
  over the micro-batch and the count of items in it, so that the applied
  gradient is the Trainer's loss normalised by the items of the whole
  accumulated batch (`num_items_in_batch`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from torch import nn

from flexpar.worker.loader import to_device


@dataclass(frozen=True)
class TrainerOptimizer:
    """`optimizer_class(groups, **keywords)` with the Trainer's two groups: decay and no decay.

    `decays[i]` says whether the i-th parameter of `model.parameters()` (the
    order flexpar passes them in) decays; parameters that do not train are
    left out, as the Trainer leaves them out.
    """

    optimizer_class: Any
    keywords: dict
    decays: tuple
    weight_decay: float

    def __call__(self, parameters) -> torch.optim.Optimizer:
        parameters = list(parameters)
        if len(parameters) != len(self.decays):
            raise ValueError(
                f"the model has {len(parameters)} parameters, the Trainer's decay rule was made for {len(self.decays)}"
            )
        pairs = [(parameter, decay) for parameter, decay in zip(parameters, self.decays) if parameter.requires_grad]
        groups = [
            {"params": [parameter for parameter, decay in pairs if decay], "weight_decay": self.weight_decay},
            {"params": [parameter for parameter, decay in pairs if not decay], "weight_decay": 0.0},
        ]
        return self.optimizer_class(groups, **self.keywords)


@dataclass(frozen=True)
class TrainerSchedule:
    """transformers.get_scheduler(kind, optimizer, warm-up, total steps, specific keywords)."""

    kind: str
    warmup_steps: int
    total_steps: int
    specific: dict = field(default_factory=dict)

    def __call__(self, optimizer: torch.optim.Optimizer):
        from transformers import get_scheduler

        return get_scheduler(
            self.kind,
            optimizer=optimizer,
            num_warmup_steps=self.warmup_steps,
            num_training_steps=self.total_steps,
            scheduler_specific_kwargs=dict(self.specific),
        )


@dataclass(frozen=True)
class TrainerLoss:
    """The Trainer's compute_loss on one micro-batch (a dict from the collator).

    With labels and a model that takes `num_items_in_batch` (or a
    `compute_loss_func`), returns `(summed loss, items)`: the model (or the
    function) is given `num_items_in_batch=1`, so its loss is the sum, and the
    items are counted as the Trainer counts them (`labels != -100`, after the
    shift for causal LMs). flexpar divides the summed gradient by the items
    of the whole global batch: the Trainer's normalisation. Otherwise the
    model's own (mean) loss, which flexpar averages over the micro-batches,
    as the Trainer divides it by the accumulation steps.
    """

    counts_items: bool
    shifts_labels: bool
    compute_loss_func: Optional[Callable] = None

    def outputs_and_loss(self, model: nn.Module, batch: dict):
        inputs = to_device(dict(batch), next(model.parameters()).device)
        labels = inputs.get("labels")
        if not self.counts_items or labels is None:
            outputs = model(**inputs)
            return outputs, _loss_of(outputs, inputs), None
        count_from = inputs["shift_labels"] if "shift_labels" in inputs else labels
        if self.shifts_labels and "shift_labels" not in inputs:
            count_from = labels[..., 1:]
        items = count_from.ne(-100).sum()
        if self.compute_loss_func is not None:
            labels = inputs.pop("labels")
            outputs = model(**inputs)
            return outputs, self.compute_loss_func(outputs, labels, num_items_in_batch=1), items
        outputs = model(**inputs, num_items_in_batch=1)
        return outputs, _loss_of(outputs, inputs), items

    def __call__(self, model: nn.Module, batch: dict):
        _, loss, items = self.outputs_and_loss(model, batch)
        return loss if items is None else (loss, items)


def _loss_of(outputs, inputs) -> torch.Tensor:
    if isinstance(outputs, dict) and "loss" not in outputs:
        raise ValueError(
            f"The model did not return a loss from the inputs, only the following keys: {','.join(outputs.keys())}. "
            f"For reference, the inputs it received are {','.join(inputs.keys())}."
        )
    return outputs["loss"] if isinstance(outputs, dict) else outputs[0]


@dataclass(frozen=True)
class TrainerEvaluation:
    """Evaluation during training: the Trainer's eval_loss as sums flexpar adds over every batch.

    The Trainer's eval_loss is the mean over samples of each batch's loss
    (each batch's loss counted once per sample), a batch's loss normalised by
    its own items as in training: `loss_sum` is the batch's loss times its
    samples, `count` its samples.
    """

    loss: TrainerLoss

    def __call__(self, model: nn.Module, batch: dict) -> dict:
        _, loss, items = self.loss.outputs_and_loss(model, batch)
        if items is not None:
            loss = loss / items
        samples = _batch_size(batch)
        return {"loss_sum": float(loss) * samples, "count": samples}


def _batch_size(batch: dict) -> int:
    for value in batch.values():
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            return int(value.shape[0])
    raise ValueError("cannot tell the size of an evaluation batch without a tensor in it")
