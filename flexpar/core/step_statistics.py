"""The step's statistics vector: where each figure sits, and the messages its verdicts give.

Every device adds its own figures into one small vector that rides in the
step's last gradient bucket (flexpar.comm.gradient_sync); after the sum every device reads
the same numbers, so every decision taken from them is agreed.
"""

from __future__ import annotations

from typing import Optional


class StatsLayout:
    """Where each figure sits in a step's statistics vector (summed across devices).

    busy seconds and newest generation seen, one slot per rank; the loss; the
    first non-finite VW (+1) per rank; the stop request (the driver asked to
    stop, or is gone: any device's 1 stops all); the recipes' figures (the sum
    of the counts of (loss_sum, count) losses, how many VWs returned such a
    pair, and - fp16 - how many devices' own gradients overflowed: any makes
    every device skip the step); each device's optimizer-state KiB, one slot
    per rank (for the step record); each device's previous step time (wall
    seconds, one slot per rank: a streamed join sizes its slices by the
    members' step times, flexpar/worker/streaming.py); a streaming dataset's
    items read and pass ends met (summed over devices); then, with `Job(deterministic=True)`
    (`virtual_workers` and `tensors` > 0), each VW's loss term and count in its
    own slot (summed in VW order afterwards: the same float sum on any device
    set), each rank's largest |VW gradient| per tensor (the exact sums'
    exponents, flexpar/comm/exact_sync.py) and each rank's checksum per tensor
    of the parameters it holds (the determinism check) and a code of its device
    kind, one slot per rank (`mixed_kinds_message`); then the BatchNorm
    buffers. A slot written by one rank only sums exactly (x + 0 + ... = x).
    """

    def __init__(self, world: int, virtual_workers: int = 0, tensors: int = 0):
        self.busy = slice(0, world)
        self.seen = slice(world, 2 * world)
        self.loss = 2 * world
        self.bad = slice(2 * world + 1, 3 * world + 1)
        self.stop = 3 * world + 1
        self.count = 3 * world + 2
        self.pairs = 3 * world + 3
        self.overflow = 3 * world + 4
        self.optimizer = slice(3 * world + 5, 4 * world + 5)
        self.previous_step_s = slice(4 * world + 5, 5 * world + 5)
        self.stream_read = 5 * world + 5  # a streaming job: items its devices took from the streams this step
        self.pass_ends = 5 * world + 6  # a streaming job: pass ends its devices met in this step's chunks
        end = 5 * world + 7
        self.world, self.tensors = world, tensors
        self.virtual_worker_loss = slice(end, end + virtual_workers)
        self.virtual_worker_count = slice(end + virtual_workers, end + 2 * virtual_workers)
        end += 2 * virtual_workers
        self.maxima = slice(end, end + world * tensors)  # rank r's tensor t at r * tensors + t
        self.checksums = slice(end + world * tensors, end + 2 * world * tensors)
        end += 2 * world * tensors
        self.kinds = slice(end, end + (world if virtual_workers else 0))  # each rank's device kind (a code)
        self.size = self.kinds.stop
        self.buffers = slice(self.size, None)

    def rank_part(self, section: slice, rank: int) -> slice:
        """Rank `rank`'s `tensors` slots of a per-rank, per-tensor section (maxima, checksums)."""
        return slice(section.start + rank * self.tensors, section.start + (rank + 1) * self.tensors)


def nonfinite_gradient_message(step: int, norm: float) -> str:
    """A summed gradient with an inf or NaN, every VW's loss being finite (a non-finite loss stops earlier)."""
    return (
        f"the gradient is not finite (its norm is {norm}) at step {step}, although the loss of every virtual "
        "worker is finite: some operation's derivative overflowed (sqrt, log or pow near 0, a division by a "
        "tiny number, an overflow in reduced precision); training stopped before applying that step. Guard "
        "that operation or lower the learning rate."
    )


def mixed_loss_message(step: int, first_kind: Optional[tuple] = None, virtual_worker: Optional[int] = None) -> str:
    """A loss that returned a pair at some VWs of a step and a scalar at others."""
    if first_kind is not None:
        kinds = {True: "a pair (loss_sum, count)", False: "a scalar"}
        where = (
            f"virtual worker {first_kind[0]} returned {kinds[first_kind[1]]}, virtual worker "
            f"{virtual_worker} {kinds[not first_kind[1]]}"
        )
    else:
        where = "some virtual workers returned a pair (loss_sum, count) and others a scalar"
    return (
        f"at step {step}, {where}; loss(model, batch) must return the same kind for every batch "
        "(a pair weights each VW by its count, a scalar weighs every VW alike)"
    )


def mixed_kinds_message(kind: str, device: str, others: list) -> str:
    """Job(deterministic=True) on devices of different kinds: what still holds (said once).

    `kind` is `device`'s kind; `others` the devices whose kind differs from it.
    """
    return (
        f"devices of different kinds train together ({device} is {kind}, {', '.join(others)} "
        f"{'is' if len(others) == 1 else 'are'} not): Job(deterministic=True) still sums "
        "exactly and every device holds the same parameters, but each kind's kernels round a VW's own "
        "gradient differently, so the result matches a run on the same kinds, not a run on one device"
    )
