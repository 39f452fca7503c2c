"""A digest of a tensor's bytes computed where the tensor lives (a GPU's memory stays on the GPU).

The non-deterministic-factory check (flexpar/core/factory_checks.py) hashes
every device's untrained trainable part. sha256 (flexpar/core/frozen.py)
runs on the CPU only, so a CUDA device had to copy its whole model to the
host for it; `tensor_lanes` reduces the bytes on the tensor's own device and
brings back two integers per tensor.

What it computes, exactly: the tensor's bytes read as little-endian 16-bit
words x_0 .. x_{n-1} (0 .. 65535; an odd byte count is padded with a zero
byte) give, per lane with base g, the polynomial hash

    H = sum_i x_i * g**i  (mod p),  p = 2**31 - 1,

with the two bases LANE_BASES (primitive roots of p). Every operation is an
int64 one whose result stays below 2**63 (a word times a power < 2**47, a row
of ROW of them < 2**63, a power times a power < 2**62), so it is exact and its
order is defined by the word positions alone: the same bytes give the same
lanes on a CPU and on a GPU, whatever the kernel's summation order. One
changed word changes each lane (x_i moves by d, 0 < |d| < p, and g**i is a
unit mod p), so equal digests of two tensors of one dtype and shape that
differ in one element cannot happen; other differences collide with a
probability of about 2**-31 per lane.

Not a cryptographic hash (it proves nothing to an adversary): it compares
the builds of one job's devices, all running the same flexpar version, and
is never written anywhere. The frozen weights' digests, which checkpoints
and exports store, stay sha256 (flexpar/core/frozen.py).

Pure functions of tensors: no processes, sockets or clocks.
"""

from __future__ import annotations

import hashlib
from typing import Mapping

import torch

PRIME = 2**31 - 1
LANE_BASES = (16807, 48271)  # primitive roots of PRIME (the minimal standard generators' multipliers)
ROW = 2**16  # words per row: a row's sum of word x power stays below 65536 * 65535 * PRIME < 2**63
BLOCK_ROWS = 64  # rows reduced at once: bounds the int64 temporaries to BLOCK_ROWS * ROW * 8 bytes (32 MiB)

_ROW_POWERS: dict = {}  # (base, device) -> g**0 .. g**(ROW - 1) mod PRIME on that device


def powers(base: int, count: int, device: torch.device) -> torch.Tensor:
    """base**0 .. base**(count - 1) mod PRIME as int64 on `device`, by doubling (each product < 2**62)."""
    result = torch.ones(1, dtype=torch.int64, device=device)
    while result.numel() < count:
        result = torch.cat([result, result * pow(base, result.numel(), PRIME) % PRIME])
    return result[:count]


def _row_powers(base: int, device: torch.device) -> torch.Tensor:
    key = (base, str(device))
    if key not in _ROW_POWERS:
        _ROW_POWERS[key] = powers(base, ROW, device)
    return _ROW_POWERS[key]


def _words(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as int16 words, flat, on its own device (a view when it is contiguous)."""
    flat = tensor.detach().contiguous().reshape(-1)
    raw = flat.view(torch.uint8) if flat.dtype != torch.uint8 else flat
    if raw.numel() % 2:
        raw = torch.cat([raw, raw.new_zeros(1)])
    return raw.view(torch.int16)


def tensor_lanes(tensor: torch.Tensor) -> tuple:
    """The two lanes (ints in [0, PRIME)) of the tensor's bytes, reduced on the tensor's device (module doc)."""
    words = _words(tensor)
    device = words.device
    rows = -(-words.numel() // ROW)
    row_powers = [_row_powers(base, device) for base in LANE_BASES]
    sums = torch.empty(len(LANE_BASES), rows, dtype=torch.int64, device=device)
    for start in range(0, rows, BLOCK_ROWS):  # BLOCK_ROWS rows at a time; the last row may be short
        block = words[start * ROW : (start + BLOCK_ROWS) * ROW].to(torch.int64) & 0xFFFF
        whole, short = divmod(block.numel(), ROW)
        for lane, weights in enumerate(row_powers):
            if whole:
                sums[lane, start : start + whole] = (block[: whole * ROW].view(whole, ROW) * weights).sum(dim=1)
            if short:
                sums[lane, start + whole] = (block[whole * ROW :] * weights[:short]).sum()
    # Row r's words sit at r * ROW + j: its sum times (base**ROW)**r, each factor < PRIME.
    shifts = torch.stack([powers(pow(base, ROW, PRIME), rows, device) for base in LANE_BASES])
    return tuple(int(lane) % PRIME for lane in ((sums % PRIME) * shifts % PRIME).sum(dim=1).tolist())


def values_digest(tensors: Mapping[str, torch.Tensor]) -> str:
    """sha256 (hex) over each tensor's name, dtype, shape and lanes, in the mapping's order."""
    digest = hashlib.sha256()
    for name, tensor in tensors.items():
        dtype = str(tensor.dtype).removeprefix("torch.")
        lanes = tensor_lanes(tensor)
        digest.update(f"{name}:{dtype}:{list(tensor.shape)}:{lanes[0]}:{lanes[1]};".encode())
    return digest.hexdigest()
