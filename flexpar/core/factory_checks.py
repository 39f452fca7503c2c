"""What a model factory must build the same on every device: the shapes, and the trainable start.

The model factory runs on every device (and in the driver, for its checks)
under `torch.manual_seed(seed)`, so a deterministic factory builds the same
model everywhere and nothing need travel. A factory that depends on another
source (`torch.Generator().seed()`, `random` or numpy without a seed, the
time, the process) builds something else in each process:

- other shapes: a device is refused when it says it is ready, and the
  refusal names the first differing tensor and its two shapes
  (`shape_problem`, against the driver's build);
- other values: at every boundary before the first step, each device that
  holds the untrained model reports one number derived from its trainable
  part's digests (one slot of the stock's all-reduce,
  flexpar/comm/state_transfer.py); where they differ, the source's values
  are sent to the others, as DDP's first broadcast does, and one warning
  names the difference (`start_values_warning`).

Frozen weights and buffers as built are checked by digest before a device is
admitted (flexpar/core/frozen.py: sha256, which checkpoints store); the start
digest is reduced on the device instead (flexpar/core/device_digest.py).

Pure functions of tensors and names: no processes, sockets or clocks.
"""

from __future__ import annotations

from typing import Mapping

import torch
from torch import nn

from flexpar.core import device_digest, frozen

DIGEST_BITS = 48  # of the combined digest a device reports: float64 holds them exactly


def start_digest(tensors: Mapping[str, torch.Tensor]) -> float:
    """A number in [1, 2**48] that names the values of `tensors` (their names, dtypes, shapes and bytes).

    Equal tensors give equal numbers, on a CPU and on a GPU alike; different
    ones differ but with probability about 2**-48 (one changed element always
    changes it). 0 is left for "reports nothing" (a device that holds no
    untrained model). Computed where the tensors live (flexpar/core/device_digest.py):
    a GPU's trainable part is not copied to the host for it. Never stored: the
    devices of one job (one flexpar version) compare it in one boundary.
    """
    combined = device_digest.values_digest(tensors)
    return float(int(combined[: DIGEST_BITS // 4], 16) + 1)


def differing_names(own: Mapping[str, torch.Tensor], received: Mapping[str, torch.Tensor]) -> list:
    """Names of `received` whose values are not `own`'s (or that `own` lacks), in `received`'s order."""
    return [name for name, tensor in received.items() if name not in own or not _same(own[name], tensor)]


def _same(one: torch.Tensor, other: torch.Tensor) -> bool:
    if one.dtype != other.dtype or one.shape != other.shape:
        return False
    return bool(torch.equal(one.detach().to("cpu"), other.detach().to("cpu")))


def start_values_warning(source: str, differing: list, names: list) -> str:
    """The one warning of a job whose devices' factories built different trainable values.

    `differing`: the devices whose values were not `source`'s; `names`: what
    differed on the first of them.
    """
    shown = ", ".join(names[: frozen.SHOWN]) + (
        f" and {len(names) - frozen.SHOWN} more" if len(names) > frozen.SHOWN else ""
    )
    return (
        f"warning: the model factory built other trainable values on {' and '.join(differing)} than on {source} "
        f"({shown} differ on {differing[0]}); every device now starts from {source}'s. The factory draws from an "
        "unseeded or per-process random source (such as torch.Generator().seed()) where flexpar runs it under "
        "torch.manual_seed(seed): use the default generator, or seed your own in the factory (e.g. "
        "torch.Generator().manual_seed(0)), so that runs on one and on several devices start the same"
    )


def model_shapes(model: nn.Module) -> list:
    """[name, shape, dtype] of every parameter and buffer, in the model's order: what a device's `ready` carries."""
    tensors = list(model.named_parameters()) + list(model.named_buffers())
    return [[name, list(tensor.shape), str(tensor.dtype).removeprefix("torch.")] for name, tensor in tensors]


def shape_problem(reference: list, reported: list, where: str) -> str:
    """Why the model `where` reported (`model_shapes`) is not the job's `reference`; "" if it is.

    Names the first tensor that differs (its two shapes or dtypes, or the
    side that lacks it), and the likely cause.
    """
    job, device = _by_name(reference), _by_name(reported)
    differing = [name for name in job if device.get(name) != job[name]] + [name for name in device if name not in job]
    if not differing:
        return ""
    name = differing[0]
    if name not in device:
        first = f"{name} is missing on {where} (the driver's build has it)"
    elif name not in job:
        first = f"{where} has {name}, which the driver's build lacks"
    else:
        (shape, dtype), (job_shape, job_dtype) = device[name], job[name]
        first = (
            f"{name} is {shape} on {where} but {job_shape} as the driver built it"
            if shape != job_shape
            else f"{name} is {dtype} on {where} but {job_dtype} as the driver built it"
        )
    more = f" ({len(differing) - 1} more differ)" if len(differing) > 1 else ""
    return (
        f"the model differs from the job's: {first}{more}. The model factory builds other shapes in other "
        "processes: make them depend only on the script and its arguments (not on an unseeded random draw, the "
        "time, the host or an environment variable), and join with the same script and model code"
    )


def _by_name(rows: list) -> dict:
    """name -> (shape, dtype) of `model_shapes` rows; a malformed row (a peer's message) is left out."""
    return {row[0]: (row[1], row[2]) for row in rows if isinstance(row, (list, tuple)) and len(row) == 3}
