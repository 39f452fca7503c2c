"""Exact gradient sums across VWs and devices (`Job(deterministic=True)`).

The float path (flexpar/comm/gradient_sync.py) accumulates a device's VWs in
`.grad` and all-reduces float buckets: the result depends on how the VWs were
grouped into devices. Here, right after each VW's backward, its gradient is
turned into int64 fixed point (flexpar/core/exact_sum.py) and added to an int64
accumulator, and `.grad` is cleared for the next VW; the accumulator is
all-reduced as int64 (in buckets, then the float64 statistics) and an int64
sparse all-reduce of the embedding gradients' values sum them exactly; then
every sum is turned back into float once, into `.grad`. Integer sums are
exact in any order: the gradient is the same bits for any device set.

Each dense gradient is converted in its post-accumulate hook, as soon as
backward has produced it; during the device's last VW, each bucket of the
int64 accumulator (GradientSync's grouping) is sent as soon as all of its
gradients are in, overlapping communication with the rest of that backward as
the float path does. What it costs against the float path: the int64
accumulator holds 8 bytes per gradient element, twice a float32 gradient on
the wire, and each VW pays a pass that converts its gradient.

The exponents (one per dense, then sparse, parameter) are agreed through the
step's statistics vector (`StatsLayout.maxima`: each device's largest |VW
gradient| per tensor in its own slots, so their sum across devices is exact
and the maximum over slots is the same everywhere): no collective of their
own. They are part of the training state (`state_dict`): a joiner and a
resumed job continue with the same ones.
"""

from __future__ import annotations

import functools
import math
import types
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from flexpar.comm.collectives import collective, wait_for_collective
from flexpar.comm.sparse_sync import all_reduce_sparse
from flexpar.core import exact_sum


class ExactSync:
    """A device's exact gradient sums: accumulate VW by VW, all-reduce as int64, convert back once.

    `buckets`: the dense parameters grouped as GradientSync's buckets (in
    reverse model order, roughly the order backward produces them); the int64
    accumulator is laid out bucket after bucket so that each bucket is one
    contiguous slice, sent as soon as the last VW's backward has converted
    every gradient in it.
    """

    def __init__(self, dense, sparse, virtual_workers: int, buckets: Optional[Sequence[Sequence]] = None):
        self.dense = list(dense)
        self.sparse = list(sparse)
        self.virtual_workers = virtual_workers
        self.tensors = len(self.dense) + len(self.sparse)
        self.committed: list = [None] * self.tensors  # the exponents of the committed state
        self.working: list = list(self.committed)  # this attempt's exponents (a redo learns new ones)
        self.pending: Optional[list] = None  # the exponents to commit with the step in flight
        self.redone = 0  # times the step in flight was redone (its record says so)
        buckets = [list(bucket) for bucket in buckets] if buckets is not None else [list(reversed(self.dense))]
        device = self.dense[0].device if self.dense else torch.device("cpu")
        self.flat = torch.zeros(sum(p.numel() for p in self.dense), dtype=torch.int64, device=device)
        self.index_of = {id(parameter): index for index, parameter in enumerate(self.dense)}
        self.views: list = [None] * len(self.dense)
        self.bucket_of: dict = {}
        self.ranges = []  # each bucket's slice of `flat`
        self.bucket_indices: list = []  # each bucket's dense indices
        offset = 0
        for number, bucket in enumerate(buckets):
            start = offset
            self.bucket_indices.append([self.index_of[id(parameter)] for parameter in bucket])
            for parameter in bucket:
                index = self.index_of[id(parameter)]
                self.views[index] = self.flat[offset : offset + parameter.numel()].view(parameter.shape)
                self.bucket_of[id(parameter)] = number
                offset += parameter.numel()
            self.ranges.append((start, offset, len(bucket)))
        # Each VW's conversion runs in these (sized for the largest dense gradient) instead of
        # allocating two temporaries per gradient: fresh pages cost as much as the conversion.
        largest = max((p.numel() for p in self.dense), default=0)
        self.float_scratch = torch.empty(largest, dtype=torch.float32, device=device)
        self.int_scratch = torch.empty(largest, dtype=torch.int64, device=device)
        # A view of `flat` is written (not added to) by its first contribution of a step, which
        # saves zeroing `flat` and one int64 read per element; `_zero_unwritten` fills the rest.
        self.written = [False] * len(self.dense)
        self.ready = [0] * len(self.ranges)
        self.works: list = []
        self.armed = False
        self.next_launch = 0
        self.sparse_parts: list = [[] for _ in self.sparse]
        self.maxima = [0.0] * self.tensors
        self.nonfinite = False
        for parameter in self.dense:
            parameter.register_post_accumulate_grad_hook(self._on_gradient)

    # ------------------------------------------------------------ one step

    def begin(self, redo: bool) -> None:
        """Start an attempt at a step: a redo keeps the exponents it learned, a first attempt the committed ones."""
        if not redo:
            self.working = list(self.committed)
            self.redone = 0
        self.pending = None
        self.written = [False] * len(self.dense)
        self.sparse_parts = [[] for _ in self.sparse]
        self.maxima = [0.0] * self.tensors
        self.nonfinite = False
        self.release_works()
        self._clear()

    def arm(self, world: int) -> None:
        """The next backward is this step's last on this device: send buckets as they fill."""
        self.armed = world > 1

    def release_works(self) -> list:
        """Forget the collectives in flight and hand over their work handles (see GradientSync.release_works)."""
        works, self.works = [work for work in self.works if work is not None], []
        self.armed, self.next_launch, self.ready = False, 0, [0] * len(self.ranges)
        return works

    def _on_gradient(self, parameter) -> None:
        """A dense gradient of the running VW is final: into the int64 sum, `.grad` cleared."""
        grad = parameter.grad
        if grad is None:
            return
        index = self.index_of[id(parameter)]
        self._add(index, grad)
        parameter.grad = None
        if not self.armed:
            return
        self.ready[self.bucket_of[id(parameter)]] += 1
        while self.next_launch < len(self.ranges) and self.ready[self.next_launch] == self.ranges[self.next_launch][2]:
            self._launch(self.next_launch)

    def _launch(self, number: int) -> None:
        self._zero_unwritten(self.bucket_indices[number])
        start, stop, _ = self.ranges[number]
        part = self.flat[start:stop]
        self.works.append(collective(lambda: dist.all_reduce(part, async_op=True)))
        self.next_launch = number + 1

    def _add(self, index: int, grad: torch.Tensor) -> None:
        """One VW's gradient of tensor `index` (dense, or a coalesced sparse one) into the sum."""
        amax = largest_magnitude(grad._values() if grad.is_sparse else grad)
        if not math.isfinite(amax):
            self.maxima[index] = math.inf
            self.nonfinite = True
            return
        self.maxima[index] = max(self.maxima[index], amax)
        exponent = self.working[index]
        if exponent is None or not exact_sum.fits(amax, exponent, self.virtual_workers):
            return  # zero, or the step is redone (every device learns so from the maxima)
        if index < len(self.dense):
            self._add_dense(index, grad, exponent)
        else:
            fixed = exact_sum.to_fixed(grad._values(), exponent)
            part = torch.sparse_coo_tensor(grad._indices(), fixed, tuple(grad.shape), is_coalesced=True)
            self.sparse_parts[index - len(self.dense)].append(part)

    def _add_dense(self, index: int, grad: torch.Tensor, exponent: int) -> None:
        """views[index] (+)= round(grad * 2**exponent): the first contribution of a step writes."""
        view = self.views[index]
        numel = view.numel()
        scratch = self.float_scratch[:numel].view(view.shape) if grad.dtype == torch.float32 else None
        fixed = exact_sum.rounded(grad, exponent, scratch)  # integers held in float: exact
        if not self.written[index]:
            view.copy_(fixed)  # float -> int64: exact for integer values
            self.written[index] = True
            return
        integers = self.int_scratch[:numel].view(view.shape)
        integers.copy_(fixed)
        view.add_(integers)

    def _zero_unwritten(self, indices) -> None:
        """The views no contribution wrote this step (no gradient, or zero, or not fitting) hold zero."""
        for index in indices:
            if not self.written[index]:
                self.views[index].zero_()
                self.written[index] = True

    def add_virtual_worker(self) -> None:
        """After a VW's backward: what the hooks did not take (sparse gradients) into the sum; `.grad` cleared."""
        for offset, parameter in enumerate(self.sparse):
            if parameter.grad is not None:
                self._add(len(self.dense) + offset, parameter.grad.coalesce())
        for index, parameter in enumerate(self.dense):  # a gradient its hook did not see (set by hand)
            if parameter.grad is not None:
                self._add(index, parameter.grad)
        self.armed = False
        self._clear()

    def finish(self, stats: torch.Tensor, world: int, before_launch=None, peer_lost=None) -> torch.Tensor:
        """Sum the statistics (float64) and the int64 gradients across devices; returns the summed statistics.

        The buckets the last VW's hooks did not send go first, in order, then
        the statistics: the same sequence of collectives on every device. The
        gradient stays int64 until `resolve` decides whether it is used.
        """
        self.armed = False
        self.local_sparse = [self._local_sparse(index) for index in range(len(self.sparse))]
        if world == 1:
            self._zero_unwritten(range(len(self.dense)))
            if before_launch is not None:
                before_launch()
            return stats.to("cpu", torch.float64)
        while self.next_launch < len(self.ranges):
            self._launch(self.next_launch)
        if before_launch is not None:  # faults of the "sync" phase: before the statistics' collective
            before_launch()
        summed = stats.to(self.flat.device, torch.float64, copy=True)
        self.works.append(collective(lambda: dist.all_reduce(summed, async_op=True)))
        for work in self.works:
            wait_for_collective(work, peer_lost or (lambda: None))
        self.works = []
        for index, parameter in enumerate(self.sparse):
            like = types.SimpleNamespace(shape=parameter.shape, dtype=torch.int64, device=parameter.device)
            self.local_sparse[index] = collective(
                functools.partial(all_reduce_sparse, self.local_sparse[index], like=like)
            )
        return summed.cpu()

    def resolve(self, global_maxima: Sequence[float]) -> bool:
        """After the sums: True if the step must be redone (then with exponents learned from `global_maxima`).

        Otherwise writes the summed gradient into `.grad` (a tensor whose
        largest VW gradient was not finite gets NaN: the step's verdict skips
        it under fp16, or stops the job) and keeps the exponents to commit.
        """
        learned = exact_sum.learned(global_maxima, self.working, self.virtual_workers)
        if exact_sum.needs_redo(global_maxima, self.working, self.virtual_workers):
            self.working = learned
            self.redone += 1
            return True
        self.pending = learned
        for index, parameter in enumerate(self.dense):
            value = exact_sum.to_float(self.views[index], self.working[index], parameter.dtype)
            if not math.isfinite(global_maxima[index]):
                value.fill_(math.nan)
            parameter.grad = value
        for offset, parameter in enumerate(self.sparse):
            index = len(self.dense) + offset
            summed = self.local_sparse[offset].coalesce()
            values = exact_sum.to_float(summed._values(), self.working[index], parameter.dtype)
            if not math.isfinite(global_maxima[index]):
                values.fill_(math.nan)
            parameter.grad = torch.sparse_coo_tensor(summed._indices(), values, tuple(parameter.shape))
        return False

    def commit(self) -> None:
        """The step in flight is committed: its learned exponents are the next step's."""
        if self.pending is not None:
            self.committed, self.pending = self.pending, None

    # ------------------------------------------------------------ state

    def state_dict(self) -> dict:
        return {"exponents": list(self.committed)}

    def load_state_dict(self, state: dict) -> None:
        exponents = list(state["exponents"])
        if len(exponents) != self.tensors:
            raise ValueError(f"the state holds {len(exponents)} exact-sum exponents, this model {self.tensors}")
        self.committed = [None if value is None else int(value) for value in exponents]
        self.working = list(self.committed)

    # ------------------------------------------------------------ helpers

    def _local_sparse(self, offset: int) -> Optional[torch.Tensor]:
        parts = self.sparse_parts[offset]
        if not parts:
            return None
        return functools.reduce(torch.add, parts).coalesce()  # int64: exact in any order

    def _clear(self) -> None:
        for parameter in self.dense + self.sparse:
            parameter.grad = None


def largest_magnitude(tensor: torch.Tensor) -> float:
    """max |element| (inf if any element is inf or NaN; 0 for no elements), from one aminmax pass
    (25 times faster than an inf-norm on the CPU)."""
    if tensor.numel() == 0:
        return 0.0
    low, high = (float(value) for value in torch.aminmax(tensor))
    if not (math.isfinite(low) and math.isfinite(high)):
        return math.inf
    return max(-low, high)


def parameter_checksums(parameters: Sequence[torch.Tensor]) -> list:
    """Per tensor, the sum of its bytes read as int64 words (or of its elements' bit patterns as integers
    where it cannot be read so), modulo 2**52 (exact in float64).

    One pass over the parameters; equal values give equal checksums on any
    device, in any summation order (integer sums wrap modulo 2**64).
    """
    result = []
    for parameter in parameters:
        data = parameter.detach().contiguous().reshape(-1)
        try:  # 8 bytes at a time where the layout allows: 10 times faster than widening each element
            total = int(data.view(torch.int64).sum())
        except RuntimeError:
            bits = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}[data.element_size()]
            total = int(data.view(bits).sum(dtype=torch.int64))
        result.append(total % (1 << 52))
    return result
