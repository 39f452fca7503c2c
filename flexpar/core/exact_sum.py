"""Exact, order-free gradient sums: float -> int64 fixed point -> float (`Job(deterministic=True)`).

A float sum depends on the order of its additions, so the sum of the same VW
gradients grouped by one device set differs in its last bits from the sum
grouped by another. Integer sums do not: every VW's gradient is turned into
int64 fixed point, `round(g * 2**exponent)`, with one power-of-two exponent
per tensor that every device agrees on, the integers are summed (on the
device, then across devices, in any order, exactly), and the sum is turned
back into float once: `sum * 2**-exponent`.

The exponent of a tensor is a function of the training history only: it comes
from the previous step's largest |gradient| of any single VW in that tensor
(`exponent_for`), the same on every device (a maximum is order-free). It
leaves room for `virtual_workers` contributions of up to `2**HEADROOM_BITS`
times that largest each, so the int64 sum never overflows. A VW whose
gradient exceeds `limit` under the exponent (the gradient grew more than the
headroom, or the tensor has no exponent yet: the first step) makes the whole
step be redone with exponents learned from this step's maxima (`learned`);
every device decides that from the same summed statistics.

Accuracy: each contribution rounds by at most half a unit of `2**-exponent`,
so an element of the sum is off by at most `virtual_workers / 2 *
2**-exponent` before the final conversion to float (which rounds like any
float result). With `exponent_for(M, V)`, `2**-exponent` is at most
`2**(HEADROOM_BITS + 1 + ceil(log2 V) - 62) * M`, so the absolute error is at
most `2**(2 * ceil(log2 V) + HEADROOM_BITS - 62) * M` (`error_bound`). For
V <= 32 that is below float32's own rounding (2**-24 relative) of every element
within 2**24 of M; each doubling of V beyond costs two bits of that margin.

Pure: torch tensors in, tensors and numbers out; no processes, no clocks.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch

TOTAL_BITS = 62
"""The sum of all contributions stays below 2**62 in magnitude: int64 holds 2**63 - 1."""

HEADROOM_BITS = 3
"""A VW's gradient may grow to 2**3 = 8 times the previous step's largest before a step is redone."""


def contribution_bits(virtual_workers: int) -> int:
    """ceil(log2(virtual_workers)): the bits that `virtual_workers` summed contributions may add."""
    if virtual_workers < 1:
        raise ValueError(f"virtual_workers={virtual_workers} must be >= 1")
    return (virtual_workers - 1).bit_length()


def exponent_for(largest: float, virtual_workers: int) -> Optional[int]:
    """The fixed-point exponent for a tensor whose largest |VW gradient| was `largest`.

    None when `largest` is 0 or not finite (no information: keep the exponent
    held, see `learned`). Any VW contribution below `2**HEADROOM_BITS *
    largest` fits under it (`limit`).
    """
    if not (largest > 0.0) or not math.isfinite(largest):
        return None
    _, binary_exponent = math.frexp(largest)  # largest < 2**binary_exponent
    return TOTAL_BITS - contribution_bits(virtual_workers) - HEADROOM_BITS - binary_exponent


def limit(exponent: Optional[int], virtual_workers: int) -> float:
    """The largest |element| a VW's gradient may hold under `exponent` (0 when there is none yet).

    `virtual_workers` contributions below it each sum to below 2**TOTAL_BITS.
    """
    if exponent is None:
        return 0.0
    return math.ldexp(1.0, TOTAL_BITS - contribution_bits(virtual_workers) - exponent)


def fits(largest: float, exponent: Optional[int], virtual_workers: int) -> bool:
    """Whether a VW gradient whose largest |element| is `largest` may be converted under `exponent`.

    A zero gradient fits any exponent (even none); a non-finite one fits no
    exponent, but is never a reason to redo (see `needs_redo`).
    """
    return largest == 0.0 or largest < limit(exponent, virtual_workers)


def needs_redo(maxima: Sequence[float], exponents: Sequence[Optional[int]], virtual_workers: int) -> bool:
    """Whether the step must be redone: some tensor's largest VW gradient (over every device) did not fit.

    A non-finite maximum is not a reason: the gradient overflowed, and redoing
    the step would give the same (fp16 skips the step, else the job stops).
    """
    return any(
        math.isfinite(largest) and not fits(largest, exponent, virtual_workers)
        for largest, exponent in zip(maxima, exponents)
    )


def learned(maxima: Sequence[float], held: Sequence[Optional[int]], virtual_workers: int) -> list:
    """The exponents after a step whose largest VW gradients (over every device) were `maxima`.

    A tensor without information this step (all zero, or not finite) keeps its
    exponent. A function of the maxima and the held exponents only, so every
    device that holds the same ones learns the same.
    """
    result = []
    for largest, exponent in zip(maxima, held):
        new = exponent_for(largest, virtual_workers)
        result.append(exponent if new is None else new)
    return result


SAFE_EXPONENTS = range(-100, 101)
"""Exponents for which scaling in the gradient's own float32 is exact where it matters: 2**e is a
normal float32, and a product small enough to lose bits to underflow rounds to 0 anyway."""


def _scaled(tensor: torch.Tensor, exponent: int) -> torch.Tensor:
    """`tensor * 2**exponent`, exactly (a power of two): in float32 where that is safe, else float64."""
    if tensor.dtype == torch.float32 and exponent in SAFE_EXPONENTS:
        return tensor * math.ldexp(1.0, exponent)
    return torch.ldexp(tensor.to(torch.float64), torch.tensor(float(exponent), dtype=torch.float64))


def rounded(gradient: torch.Tensor, exponent: int, scratch: Optional[torch.Tensor] = None) -> torch.Tensor:
    """`round(gradient * 2**exponent)` (half to even) as a float tensor whose values are integers.

    Exact: the scaling is by a power of two, and the rounded value keeps at
    most the gradient's own significant bits, so it is the integer itself.
    With `scratch` (float32, the gradient's shape) a float32 gradient is
    scaled into it, saving an allocation per VW; the caller converts to
    int64 (`Tensor.copy_` into an int64 tensor converts exactly).
    """
    if gradient.dtype == torch.float32 and exponent in SAFE_EXPONENTS:
        if scratch is None:
            return (gradient * math.ldexp(1.0, exponent)).round_()
        return torch.mul(gradient, math.ldexp(1.0, exponent), out=scratch).round_()
    return _scaled(gradient, exponent).round_()


def to_fixed(gradient: torch.Tensor, exponent: Optional[int]) -> torch.Tensor:
    """`round(gradient * 2**exponent)` as int64 (half to even); the scaling is exact.

    The caller checks `fits` first; an exponent of None converts zeros only.
    """
    if exponent is None:
        return torch.zeros(gradient.shape, dtype=torch.int64, device=gradient.device)
    return rounded(gradient, exponent).to(torch.int64)


def add_fixed(accumulator: torch.Tensor, gradient: torch.Tensor, exponent: Optional[int]) -> None:
    """accumulator += to_fixed(gradient, exponent), in place (integers: exact, in any order)."""
    if exponent is None:
        return
    accumulator.add_(to_fixed(gradient, exponent))


def to_float(summed: torch.Tensor, exponent: Optional[int], dtype: torch.dtype) -> torch.Tensor:
    """The int64 sum back in float: `summed * 2**-exponent`, rounded once to `dtype`.

    float32 with a safe exponent: the int64 -> float32 conversion rounds once and
    the power-of-two scaling is exact; otherwise through float64.
    """
    if exponent is None:
        return torch.zeros(summed.shape, dtype=dtype, device=summed.device)
    if dtype == torch.float32 and exponent in SAFE_EXPONENTS:
        return summed.to(torch.float32).mul_(math.ldexp(1.0, -exponent))
    value = torch.ldexp(summed.to(torch.float64), torch.tensor(float(-exponent), dtype=torch.float64))
    return value.to(dtype)


def error_bound(exponent: Optional[int], virtual_workers: int) -> float:
    """The largest absolute error of a summed element before its conversion to float: V half-units."""
    if exponent is None:
        return 0.0
    return virtual_workers * math.ldexp(0.5, -exponent)
