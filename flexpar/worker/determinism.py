"""`Job(deterministic=True)`: the step loop's part of bit-for-bit training on any device set.

`StepLoop` calls `ExactSteps` around a step when the job is deterministic
(`Worker.exact` is then an `flexpar.comm.exact_sync.ExactSync`):

- `statistics`: each VW's loss term and count in its own slot of the
  statistics vector, this device's largest |VW gradient| per tensor, and the
  checksums of the parameters it holds at the step's start.
- `resolve`: after the sums, the loss and the count of the step are
  summed in VW order (the same float sum on any device set); a checksum that
  differs between devices stops the job (a determinism breach, naming the step
  and the first tensor); a VW gradient that did not fit its exponent makes
  every device redo the step.
- `record`: the digest of the training state after the step, in the
  step's record (rank 0).

`make_deterministic` sets up each VW's own forward and backward: one intra-op
thread on CPU devices (the same count on every device, in every run),
`torch.use_deterministic_algorithms(True)` and the cuBLAS workspace on CUDA.
"""

from __future__ import annotations

import hashlib
import os
import struct
import sys
import zlib

import torch

from flexpar.comm.exact_sync import parameter_checksums
from flexpar.core.step_statistics import StatsLayout, mixed_kinds_message
from flexpar.errors import DeterminismBreach

DETERMINISTIC_THREADS = 1
"""Intra-op threads of every CPU device of a deterministic job: one count for every device and every run
(a reduction split over more threads adds in another order)."""


def make_deterministic(device: torch.device) -> None:
    """Make this process's kernels give the same bits for the same inputs (before any kernel runs)."""
    if device.type == "cpu":
        torch.set_num_threads(DETERMINISTIC_THREADS)
    else:
        # cuBLAS reads it when its first handle is made: this worker sets it before the model moves there.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False


def device_kind(device: torch.device) -> str:
    """The kind of `device` whose kernels round alike: "cpu", or the CUDA device's name."""
    if device.type == "cuda":
        return f"cuda ({torch.cuda.get_device_name(device)})"
    return device.type


def breach_message(step: int, tensor: str, ranks: list) -> str:
    return (
        f"determinism breach before step {step}: devices {ranks[0]} and {ranks[1]} hold different values of "
        f"parameter {tensor!r} (Job(deterministic=True) keeps every device's state bit-for-bit equal); "
        "something in the optimizer, the model or the loss is not deterministic on one device"
    )


class ExactSteps:
    """`Job(deterministic=True)`: the step loop's part of exact sums around one step (the module docstring).

    It holds the job's `ExactSync` (flexpar/comm/exact_sync.py: the sums'
    exponents, training state) and says once, on rank 0, when the members'
    devices are of different kinds (`kinds_said`). The device set it works
    for is passed with every call: it holds nothing that changes with it.
    """

    def __init__(self, exact, model, device, records):
        self.exact = exact
        self.model = model
        self.device = device
        self.records = records
        self.kinds_said = False

    def trained_parameters(self) -> list:
        return self.exact.dense + self.exact.sparse

    def statistics(self, stats: torch.Tensor, slots: StatsLayout, terms: list, rank: int, holds_all: bool) -> None:
        """This device's part of the exact-sum figures (see the module docstring); `holds_all`: every
        trained parameter's value here is the committed step's (sharded, or streaming: not all yet)."""
        for virtual_worker, loss_term, count in terms:
            stats[slots.virtual_worker_loss.start + virtual_worker] = loss_term
            stats[slots.virtual_worker_count.start + virtual_worker] = count
        stats[slots.rank_part(slots.maxima, rank)] = torch.tensor(self.exact.maxima, dtype=torch.float64)
        if holds_all:
            checksums = parameter_checksums(self.trained_parameters())
            stats[slots.rank_part(slots.checksums, rank)] = torch.tensor(checksums, dtype=torch.float64)
        else:
            stats[slots.rank_part(slots.checksums, rank)] = -1.0
        stats[slots.kinds.start + rank] = zlib.crc32(device_kind(self.device).encode())

    def resolve(self, summed: torch.Tensor, slots: StatsLayout, step: int, members: tuple, rank: int) -> bool:
        """After the sums: check the devices agree, fix the loss and count, True if the step is redone."""
        self._check_checksums(summed, slots, step, members)
        self._say_mixed_kinds(summed, slots, members, rank)
        summed[slots.loss] = _ordered_sum(summed[slots.virtual_worker_loss].tolist())
        summed[slots.count] = _ordered_sum(summed[slots.virtual_worker_count].tolist())
        per_rank = summed[slots.maxima].view(slots.world, slots.tensors)
        maxima = per_rank.max(dim=0).values.tolist() if slots.tensors else []
        return self.exact.resolve(maxima)

    def _say_mixed_kinds(self, summed: torch.Tensor, slots: StatsLayout, members: tuple, rank: int) -> None:
        """Rank 0 says once, if the members' devices are of different kinds, what then holds."""
        codes = summed[slots.kinds].tolist()
        if rank != 0 or self.kinds_said or len(set(codes)) < 2:
            return
        self.kinds_said = True
        others = [members[other] for other, code in enumerate(codes) if code != codes[0]]
        message = mixed_kinds_message(device_kind(self.device), members[0], others)
        print(f"flexpar: note: {message}", file=sys.stderr, flush=True)

    def _check_checksums(self, summed: torch.Tensor, slots: StatsLayout, step: int, members: tuple) -> None:
        if slots.world < 2 or not slots.tensors:
            return
        rows = summed[slots.checksums].view(slots.world, slots.tensors)
        holders = [rank for rank in range(slots.world) if float(rows[rank, 0]) >= 0]
        if len(holders) < 2:
            return
        first = rows[holders[0]]
        for rank in holders[1:]:
            differs = (rows[rank] != first).nonzero()
            if differs.numel():
                names = {id(parameter): name for name, parameter in self.model.named_parameters()}
                tensor = names.get(id(self.trained_parameters()[int(differs[0, 0])]), "?")
                raise DeterminismBreach(breach_message(step, tensor, [members[holders[0]], members[rank]]))

    def record(self, step: int) -> None:
        """The digest of the training state after `step` in its record (the newest kept): say how in
        docs/metrics.md."""
        digest = hashlib.sha256(struct.pack("<q", step))
        for checksum in parameter_checksums(self.trained_parameters()):
            digest.update(struct.pack("<q", checksum))
        for exponent in self.exact.committed:
            digest.update(struct.pack("<q", -(2**62) if exponent is None else exponent))
        record = self.records.last
        record["digest"] = digest.hexdigest()[:16]
        record["redone"] = self.exact.redone


def _ordered_sum(values: list) -> float:
    """The float64 sum in slot (VW) order: one fixed order, whatever the device set."""
    total = 0.0
    for value in values:
        total += value
    return total
