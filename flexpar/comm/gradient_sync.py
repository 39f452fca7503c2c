"""Gradient synchronisation: one sum across devices per step.

Dense gradients are summed in buckets (about `bucket_mb` each, in reverse
parameter order, which is roughly the order backward produces them). During
the last virtual worker's backward, a bucket is sent as soon as every gradient
in it is final, so communication overlaps the rest of backward. Buckets are
always launched in the same order on every device: collectives must match.

The last bucket is not sent from a hook but from `finish()`, right after
backward returns, with the step's small statistics vector (busy times, losses,
the counts of token-weighted losses, the generation each device has seen).
That is how the agreement on device-set changes rides inside a collective the
step does anyway, at no extra round trip: appended to the last bucket when it
is float32 (or float64).

Token-weighted losses (`(loss_sum, count)`, `exact_stats`) need the counts
summed exactly: the total count divides every gradient element, and a float32
sum rounds a total above 2**24 (or a fractional one) to another value than
one device's float64 sum, so the parameters would depend on the device set.
Their statistics go in their own float64 all-reduce, launched after every
other bucket and just before the last one, in flight together with it (the
same sequence of collectives on every device). In float64, integer counts
(below 2**53) are exact in any order; a fractional count can differ in its
53rd bit between orders, far below the float32 factor `1 / count` it becomes.
That costs a small collective per step (0.2 ms per step over gloo on the
2-core development machine for a small model's 4 kB bucket, within the
noise for a 1 MB one), paid by token-weighted jobs only: with a scalar
loss nothing in the statistics but busy times, the recorded loss and
BatchNorm running statistics (close, not identical, on several devices) sees
float32's rounding.

Sparse gradients (`nn.Embedding(sparse=True)`) are summed as indices and
values by `flexpar.comm.sparse_sync.all_reduce_sparse`, after the dense buckets.

Every device adds `(1/V) * grad` of each of its VWs (the caller scales the
loss), so the plain sum across devices is the mean over the global batch: no
device count appears in the math.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from flexpar.comm.collectives import collective, wait_for_collective
from flexpar.comm.sparse_sync import all_reduce_sparse, sparse_parameters


class _Bucket:
    def __init__(self, parameters, index: int):
        self.parameters = parameters
        self.index = index
        self.dtype = parameters[0].dtype
        self.device = parameters[0].device
        self.numel = sum(parameter.numel() for parameter in parameters)
        self.buffer: Optional[torch.Tensor] = None
        self.ready = 0
        self.work = None


class GradientSync:
    """Sums gradients across the current process group. One instance per device."""

    def __init__(self, model: nn.Module, device, bucket_mb: float = 25.0, peer_lost=None):
        self.device = torch.device(device)
        self.peer_lost = peer_lost or (lambda: None)
        sparse = {id(parameter) for parameter in sparse_parameters(model)}
        self.sparse = [p for p in model.parameters() if p.requires_grad and id(p) in sparse]
        dense = [p for p in model.parameters() if p.requires_grad and id(p) not in sparse]
        self.dense = dense  # in the model's order
        self.buckets = _make_buckets(list(reversed(dense)), int(bucket_mb * (1 << 20)))
        self.bucket_of = {id(p): bucket for bucket in self.buckets for p in bucket.parameters}
        self.world_size = 1
        # Sum the statistics exactly, in float64 (token-weighted losses: the module docstring).
        # The same on every device: the worker sets it from its warm-up's loss, the same batch everywhere.
        self.exact_stats = False
        self.armed = False
        self.next_launch = 0
        self.companion = None  # the exact sums' ExactSync, whose works `release_works` hands over too
        for parameter in dense:
            parameter.register_post_accumulate_grad_hook(self._on_gradient)

    def start_generation(self, world_size: int) -> None:
        self.world_size = world_size
        self.reset()

    def release_works(self) -> list:
        """Forget the step in flight and hand over its collectives' work handles.

        A work handle keeps its process group alive: whoever drops the last
        handle pays for the group's teardown (see `GroupReaper`).
        """
        works = [bucket.work for bucket in self.buckets if bucket.work is not None]
        if self.companion is not None:  # Job(deterministic=True): flexpar/comm/exact_sync.py
            works += self.companion.release_works()
        self.reset()
        return works

    def reset(self) -> None:
        """Forget a step in flight (after a failure, or before a new step)."""
        self.armed = False
        self.next_launch = 0
        for bucket in self.buckets:
            bucket.ready = 0
            bucket.work = None

    def arm(self) -> None:
        """The next backward is this step's last on this device: send buckets as they fill."""
        self.armed = self.world_size > 1

    def _on_gradient(self, parameter) -> None:
        if not self.armed:
            return
        bucket = self.bucket_of[id(parameter)]
        bucket.ready += 1
        # Launch in bucket order; the final bucket waits for finish() and the stats.
        while self.next_launch < len(self.buckets) - 1 and self.buckets[self.next_launch].ready == len(
            self.buckets[self.next_launch].parameters
        ):
            self._launch(self.buckets[self.next_launch])
            self.next_launch += 1

    def _launch(self, bucket: _Bucket, stats: Optional[torch.Tensor] = None) -> None:
        extra = 0 if stats is None else stats.numel()
        if bucket.buffer is None or bucket.buffer.numel() != bucket.numel + extra:
            bucket.buffer = torch.empty(bucket.numel + extra, dtype=bucket.dtype, device=bucket.device)
        offset = 0
        for parameter in bucket.parameters:
            view = bucket.buffer[offset : offset + parameter.numel()]
            if parameter.grad is None:
                view.zero_()
            else:
                view.copy_(parameter.grad.reshape(-1))
            offset += parameter.numel()
        if stats is not None:
            bucket.buffer[offset:].copy_(stats)
        bucket.work = collective(lambda: dist.all_reduce(bucket.buffer, async_op=True))

    def finish(self, stats: torch.Tensor, before_last_launch=None, scale=None) -> torch.Tensor:
        """Send what is left, wait for every sum, write the summed gradients back.

        Returns the summed statistics vector (the same on every device).
        `scale(summed_stats, dense_sums)`, if given, is called once every sum
        is in (sparse gradients already summed into `.grad`) and before the
        dense sums are written back: `dense_sums` are the summed gradients of
        `self.dense` (views of the reduced buckets, which it may change in
        place). The write-back multiplies by what it returns (None: 1), in the
        pass that copies (flexpar/recipes.py: clipping costs no pass of its own).
        With one device nothing is summed and `scale` is not called.
        """
        self.armed = False
        if self.world_size == 1:
            if before_last_launch is not None:  # the same point of the step as with peers (faults fire there)
                before_last_launch()
            return stats
        carrier = self._stats_carrier()
        # Every bucket but the last was launched in order (by the hooks or here), then the
        # statistics on their own if no bucket carries them, then the last bucket: the same
        # sequence of collectives on every device, whichever buckets a device's hooks launched.
        for bucket in self.buckets[self.next_launch : len(self.buckets) - 1]:
            self._launch(bucket)
        # Faults of the "sync" phase fire here, before the collectives that carry the statistics:
        # a device that dies at this point always breaks the step in flight. Fired after them, the
        # sums could complete on every device first (a small model, a loaded machine), and whether
        # the step committed would depend on timing.
        if before_last_launch is not None:
            before_last_launch()
        separate = work = None
        if carrier is None:  # float64: exact sums (module docstring)
            separate = stats.to(self.device, torch.float64, copy=True)
            work = collective(lambda: dist.all_reduce(separate, async_op=True))
        if self.buckets:
            final = self.buckets[-1]
            self._launch(final, stats.to(final.device, final.dtype) if final is carrier else None)
        self.next_launch = len(self.buckets)
        for bucket in self.buckets:
            wait_for_collective(bucket.work, self.peer_lost)
            if scale is None:
                _unflatten(bucket)
        if carrier is None:
            wait_for_collective(work, self.peer_lost)
            summed = separate
        else:
            summed = carrier.buffer[carrier.numel :].to(torch.float64)
        for parameter in self.sparse:
            parameter.grad = collective(functools.partial(all_reduce_sparse, parameter.grad, like=parameter))
        summed = summed.cpu()
        if scale is not None:
            multiplier = scale(summed, self._dense_sums())
            for bucket in self.buckets:
                _unflatten(bucket, multiplier)
        return summed

    def _stats_carrier(self) -> Optional[_Bucket]:
        """The last bucket, if the statistics may ride in it: float64, or float32 unless `exact_stats`."""
        if not self.buckets:
            return None
        final = self.buckets[-1]
        if final.dtype == torch.float64 or (final.dtype == torch.float32 and not self.exact_stats):
            return final
        return None

    def _dense_sums(self) -> list:
        """The reduced buckets' views of each dense parameter's summed gradient, in `self.dense` order."""
        views = {}
        for bucket in self.buckets:
            offset = 0
            for parameter in bucket.parameters:
                views[id(parameter)] = bucket.buffer[offset : offset + parameter.numel()].view_as(parameter)
                offset += parameter.numel()
        return [views[id(parameter)] for parameter in self.dense]


def _make_buckets(parameters, bucket_bytes: int) -> list:
    buckets, current, size = [], [], 0
    for parameter in parameters:
        same_kind = not current or (current[0].dtype == parameter.dtype and current[0].device == parameter.device)
        if current and (size >= bucket_bytes or not same_kind):
            buckets.append(_Bucket(current, len(buckets)))
            current, size = [], 0
        current.append(parameter)
        size += parameter.numel() * parameter.element_size()
    if current:
        buckets.append(_Bucket(current, len(buckets)))
    return buckets


def _unflatten(bucket: _Bucket, multiplier=None) -> None:
    """Write the bucket's sums into `.grad`, times `multiplier` (a number or 0-dim tensor) if given."""
    offset = 0
    for parameter in bucket.parameters:
        summed = bucket.buffer[offset : offset + parameter.numel()].view_as(parameter)
        if multiplier is not None:
            if parameter.grad is None:
                parameter.grad = summed * multiplier
            else:
                torch.mul(summed, multiplier, out=parameter.grad)
        elif parameter.grad is None:
            parameter.grad = summed.clone()
        else:
            parameter.grad.copy_(summed)
        offset += parameter.numel()
