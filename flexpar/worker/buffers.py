"""The BatchNorm rule: a model's buffers averaged across devices every step, in the statistics vector.

Normalisation uses each VW's own batch statistics, so gradients and
parameters do not depend on the device set. Running statistics (buffers) are
updated by each device over its own VWs and then averaged across devices
every step, riding in the statistics vector (flexpar/worker/step_loop.py).
With one device they equal the single-process run exactly; with several,
they are the mean of per-device running averages (close, not identical).
"""

from __future__ import annotations

import torch


def buffer_vector(model, listening: bool) -> torch.Tensor:
    """This device's buffers as one float64 vector (zeros for a listener: it ran no VW, it adds nothing)."""
    buffers = [buffer.detach().reshape(-1).to("cpu", torch.float64) for buffer in model.buffers()]
    vector = torch.cat(buffers) if buffers else torch.zeros(0, dtype=torch.float64)
    return vector.zero_() if listening else vector


def set_buffers(model, averaged: torch.Tensor) -> None:
    """The contributors' mean buffers into the model (integer buffers rounded)."""
    offset = 0
    for buffer in model.buffers():
        part = averaged[offset : offset + buffer.numel()].view(buffer.shape)
        if not buffer.dtype.is_floating_point:
            part = part.round()
        buffer.copy_(part.to(buffer.device, buffer.dtype))
        offset += buffer.numel()
