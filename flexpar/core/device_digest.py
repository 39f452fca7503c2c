"""A digest of a tensor's bytes computed where the tensor lives (a GPU's memory stays on the GPU).

The non-deterministic-factory check (flexpar/core/factory_checks.py) hashes
every device's untrained trainable part. sha256 (flexpar/core/frozen.py)
runs on the CPU only, so a CUDA device had to copy its whole model to the
host for it; `tensor_lanes` reduces the bytes on the tensor's own device and
brings back two integers per tensor.

What it computes, exactly: the tensor's bytes read as little-endian signed
16-bit words s_0 .. s_{n-1} (-32768 .. 32767; an odd byte count is padded
with a zero byte) give, per lane with base g, the polynomial hash

    H = sum_i s_i * g**i  (mod p),  p = 2**31 - 1,

with the two bases LANE_BASES (primitive roots of p). It is computed as one
float64 matrix product of the words, CHUNK to a row, with the powers
g**0 .. g**(CHUNK-1) (BLAS on a CPU, cuBLAS on a GPU: as fast as sha256 on a
CPU core), then int64 arithmetic: every partial sum of a row is an integer
below 2**53 in magnitude (CHUNK words of at most 2**15 times powers below
2**31), so float64 holds it exactly whatever the order of the additions, and
every int64 product stays below 2**62. The result is therefore exact and
defined by the word positions alone: the same bytes give the same lanes on a
CPU and on a GPU, whatever the kernels' summation order. One changed word
changes each lane (s_i moves by d, 0 < |d| < p, and g**i is a unit mod p),
so two tensors of one dtype and shape that differ in one element never share
a digest; other differences collide with a probability of about 2**-31 per
lane.

Not a cryptographic hash (it proves nothing to an adversary): it compares
the builds of one job's devices, all running the same flexpar version, and
is never written anywhere. The frozen weights' digests, which checkpoints
and exports store, stay sha256 (flexpar/core/frozen.py).

Pure functions of tensors: no processes, sockets or clocks.
"""

from __future__ import annotations

import hashlib
from typing import Mapping, Optional

import torch

PRIME = 2**31 - 1
LANE_BASES = (16807, 48271)  # primitive roots of PRIME (the minimal standard generators' multipliers)
CHUNK = 128  # words per row of the product: |a row's partial sums| < 128 * 2**15 * 2**31 = 2**53
BLOCK = 2**21  # words converted to float64 at once (16 MiB), a multiple of CHUNK


def powers(base: int, count: int, device: torch.device) -> torch.Tensor:
    """base**0 .. base**(count - 1) mod PRIME as int64 on `device`, by doubling (each product < 2**62)."""
    result = torch.ones(1, dtype=torch.int64, device=device)
    while result.numel() < count:
        result = torch.cat([result, result * pow(base, result.numel(), PRIME) % PRIME])
    return result[:count]


def row_weights(device: torch.device) -> torch.Tensor:
    """[CHUNK, lanes] float64 on `device`: g**0 .. g**(CHUNK - 1) mod PRIME per lane (exact: each < 2**31)."""
    return torch.stack([powers(base, CHUNK, device) for base in LANE_BASES], dim=1).to(torch.float64)


def _words(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as int16 words, flat, on its own device (a view when it is contiguous)."""
    flat = tensor.detach().contiguous().reshape(-1)
    raw = flat.view(torch.uint8) if flat.dtype != torch.uint8 else flat
    if raw.numel() % 2:
        raw = torch.cat([raw, raw.new_zeros(1)])
    return raw.view(torch.int16)


def tensor_lanes(tensor: torch.Tensor, weights: Optional[torch.Tensor] = None) -> tuple:
    """The two lanes (ints in [0, PRIME)) of the tensor's bytes, reduced on the tensor's device (module doc).
    `weights`: `row_weights` of that device, where the caller hashes many tensors (made here otherwise)."""
    words = _words(tensor)
    device = words.device
    rows = -(-words.numel() // CHUNK)
    sums = torch.empty(rows, len(LANE_BASES), dtype=torch.int64, device=device)
    weights = row_weights(device) if weights is None else weights
    done = 0
    for start in range(0, words.numel(), BLOCK):
        block = words[start : start + BLOCK]
        if block.numel() % CHUNK:  # the last words, padded with zeros to a row (only they are copied)
            block = torch.nn.functional.pad(block, (0, CHUNK - block.numel() % CHUNK))
        products = block.view(-1, CHUNK).to(torch.float64) @ weights  # exact integers (module doc)
        sums[done : done + products.shape[0]] = products.to(torch.int64)
        done += products.shape[0]
    # Row r's words sit at r * CHUNK + j: its sum times (g**CHUNK)**r, each factor < PRIME.
    shifts = torch.stack([powers(pow(base, CHUNK, PRIME), rows, device) for base in LANE_BASES], dim=1)
    return tuple(int(lane) % PRIME for lane in ((sums % PRIME) * shifts % PRIME).sum(dim=0).tolist())


def lanes_by_name(tensors: Mapping[str, torch.Tensor]) -> dict:
    """name -> `tensor_lanes` of each tensor, in the mapping's order (the row weights made once per device)."""
    weights: dict = {}  # device -> row_weights
    lanes = {}
    for name, tensor in tensors.items():
        if tensor.device not in weights:
            weights[tensor.device] = row_weights(tensor.device)
        lanes[name] = tensor_lanes(tensor, weights[tensor.device])
    return lanes


def values_digest(tensors: Mapping[str, torch.Tensor]) -> str:
    """sha256 (hex) over each tensor's name, dtype, shape and lanes, in the mapping's order."""
    digest = hashlib.sha256()
    for name, (first, second) in lanes_by_name(tensors).items():
        tensor = tensors[name]
        dtype = str(tensor.dtype).removeprefix("torch.")
        digest.update(f"{name}:{dtype}:{list(tensor.shape)}:{first}:{second};".encode())
    return digest.hexdigest()
