"""The gradient a step applies: made from the sums (flexpar/recipes.py), and every device's verdict on it."""

from __future__ import annotations

import math
from typing import Optional

import torch

from flexpar import recipes
from flexpar.core.step_statistics import StatsLayout, nonfinite_gradient_message
from flexpar.errors import UserCodeError


class AppliedGradient:
    """The summed gradient made the one to apply, and the verdict on it (apply, skip, or stop).

    Invariant: `norm` is the norm, before clipping, of the gradient last
    prepared (`prepare`): the step in flight's, or a sharded member's pending
    step's until it is applied. Everything here is a function of the summed
    gradient and statistics, which every device holds alike, so every device
    reaches the same norm and the same verdict. The fp16 loss scaler (part
    of the training state, saved and restored with it) backs off or grows
    here.
    """

    def __init__(self, job, sync, scaler):
        self.job = job
        self.sync = sync
        self.scaler = scaler
        self.norm = 0.0

    def prepare(self, summed: torch.Tensor, dense_sums: Optional[list], slots: StatsLayout):
        """Make the summed gradient the one to apply: divided by the global count (pairs) and the
        loss scale (fp16), measured, clipped (flexpar/recipes.py).

        Called by `GradientSync.finish` with the summed statistics and the dense
        sums before they are written back (it returns the clip's multiplier,
        which the write-back applies), or, on one device, with `dense_sums`
        None after the step's backward.
        """
        pairs, count = round(float(summed[slots.pairs])), float(summed[slots.count])
        scale = self.scaler.scale if self.scaler is not None else 1.0
        factor = 1.0 / ((count if pairs else 1.0) * scale) if (pairs or scale != 1.0) else 1.0
        if dense_sums is None:
            self.norm = recipes.finish_gradients(self.sync.dense, self.sync.sparse, factor, self.job.max_grad_norm)
            return None
        self.norm, multiplier = recipes.prepare_gradients(dense_sums, self.sync.sparse, factor, self.job.max_grad_norm)
        return multiplier

    def verdict(self, summed: torch.Tensor, slots: StatsLayout, step: int) -> tuple:
        """(the applied gradient's norm before clipping, whether every device skips this step).

        fp16: a step is skipped (no optimizer or scheduler step) when a device's
        own gradient overflowed (the statistics say so) or the sum is not
        finite, and the loss scale backs off; otherwise it may grow. Without a
        loss scaler a non-finite summed gradient stops the job here, naming the
        step: applied, it would make the next step's loss fail and blame that
        step.
        """
        norm = self.norm
        if self.scaler is None:
            if not math.isfinite(norm):
                raise UserCodeError(nonfinite_gradient_message(step, norm))
            return norm, False
        skip = float(summed[slots.overflow]) > 0 or not math.isfinite(norm)
        self.scaler.update(found_inf=skip)
        return norm, skip
