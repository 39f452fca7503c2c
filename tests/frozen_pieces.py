"""Fine-tuning pieces for the tests, importable by worker processes: a model with a frozen
"pretrained" trunk read from a file, and a loss wrapper that makes steps long enough for joins."""

from __future__ import annotations

import time
from dataclasses import dataclass

import pieces
import torch
from torch import nn

WIDTH = 256  # the trunk: 69k frozen parameters (277 kB), the head 4k trainable


def write_trunk(path, seed: int = 11, perturbed: str = "") -> None:
    """The "pretrained" trunk's weights; `perturbed`: one tensor's name to change by one ulp-ish step."""
    generator = torch.Generator().manual_seed(seed)
    weights = {
        "0.weight": torch.randn(WIDTH, pieces.FEATURES, generator=generator) * 0.3,
        "0.bias": torch.randn(WIDTH, generator=generator) * 0.1,
        "2.weight": torch.randn(WIDTH, WIDTH, generator=generator) * 0.06,
        "2.bias": torch.randn(WIDTH, generator=generator) * 0.1,
    }
    if perturbed:
        weights[perturbed][0].add_(1e-3)
    torch.save(weights, str(path))


class FrozenTrunkModel(nn.Module):
    def __init__(self, trunk_weights: dict):
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(pieces.FEATURES, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH), nn.Tanh())
        self.trunk.load_state_dict(trunk_weights)
        self.trunk.requires_grad_(False)
        self.register_buffer("input_scale", torch.full((pieces.FEATURES,), 0.5))  # persistent, never changes
        self.head = nn.Sequential(nn.Dropout(0.1), nn.Linear(WIDTH, 16), nn.Tanh(), nn.Linear(16, pieces.CLASSES))

    def forward(self, inputs):
        return self.head(self.trunk(inputs * self.input_scale))


@dataclass(frozen=True)
class FrozenTrunk:
    """The model factory: the trunk loaded from `path` (every device reads its own file) and frozen."""

    path: str

    def __call__(self) -> nn.Module:
        return FrozenTrunkModel(torch.load(self.path, weights_only=True))


@dataclass(frozen=True)
class SlowLoss:
    """`loss(model, batch)` after `delay_s` of sleep: steps long enough for a joiner to arrive."""

    loss: object
    delay_s: float = 0.0

    def __call__(self, model, batch):
        if self.delay_s:
            time.sleep(self.delay_s)
        return self.loss(model, batch)
