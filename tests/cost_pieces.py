"""Pieces for balancing by cost in tests: a cost per sample, and a loss whose time follows it.

A sample of class 0 costs 8 units and any other 1, so the VWs of a step differ
in cost by up to 8x; `CostLoss` sleeps `delay_s` per unit of its batch's cost,
so a VW takes time in proportion to its cost, as a variable-length VW does.
Module level, so that worker processes import them by reference.
"""

from __future__ import annotations

import dataclasses
import time

import pieces
from torch import nn

LABEL_COSTS = (8.0, 1.0, 1.0)


class LabelCost:
    """The `sample_cost=` piece: sample `index` costs LABEL_COSTS[its label] (a picklable table)."""

    def __init__(self, dataset):
        self.costs = [LABEL_COSTS[int(label)] for label in dataset.tensors[1]]

    def __call__(self, index: int) -> float:
        return self.costs[index]


class BadCostAt:
    """A `sample_cost=` that returns `value` for sample `index` and 1.0 for every other."""

    def __init__(self, index: int, value):
        self.index, self.value = index, value

    def __call__(self, index: int):
        return self.value if index == self.index else 1.0


class CostLoss(pieces.Loss):
    """Cross-entropy; sleeps `delay_s` per unit of the batch's cost (none in the reference: delay 0)."""

    def __call__(self, model, batch):
        inputs, labels = batch
        if self.delay_s:
            time.sleep(self.delay_s * sum(LABEL_COSTS[int(label)] for label in labels))
        return nn.functional.cross_entropy(model(inputs), labels)


def make_cost_job(virtual_workers=8, global_batch=48, delay_s=0.0005, sample_cost=None, **extra):
    """pieces.make_job with sample_cost (LabelCost by default) and CostLoss."""
    dataset = pieces.make_dataset()
    job = pieces.make_job(
        virtual_workers=virtual_workers,
        global_batch=global_batch,
        dataset=dataset,
        sample_cost=sample_cost or LabelCost(dataset),
        **extra,
    )
    return dataclasses.replace(job, loss=CostLoss(delay_s))
