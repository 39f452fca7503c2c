"""Optimizer state of parameter slices: cut, joined, and shaped back into torch.optim's own format (pure).

An element-wise optimizer's state for a parameter is per-element tensors
(Adam's `exp_avg`, SGD's `momentum_buffer`, ...) and per-parameter scalars
(`step`, ASGD's `eta` and `mu`, NAdam's `mu_product`). A slice of the
parameter's elements has the same slice of the per-element tensors and the
same scalars, so the state of any range is cut from, or joined into, the
state of a larger one. A tensor that is neither (Adafactor's row and column
factors) means the optimizer is not element-wise: cutting it is an error
(`NotElementwise`), and such an optimizer is sharded by whole parameters
only (`shard_optimizer="parameters"`).
"""

from __future__ import annotations

from typing import Sequence

import torch

# The optimizers whose update of each element reads only that element's state, gradient and value
# (and per-parameter scalars): cut at any element, their slices step exactly as the whole does
# (bitwise on CPU for these classes, in the experiments of docs/recipes.md#sharded-optimizer-state).
ELEMENTWISE = (
    "SGD",
    "Adam",
    "AdamW",
    "Adagrad",
    "RMSprop",
    "Adamax",
    "NAdam",
    "RAdam",
    "Adadelta",
    "ASGD",
    "Rprop",
    "SparseAdam",
)
# Optimizers that couple all parameters in one step: no partition can split them.
UNSHARDABLE = ("LBFGS",)


class NotElementwise(ValueError):
    """A state tensor that is neither one value per element nor a scalar."""


def _per_element(value, length: int, key: str) -> bool:
    if not isinstance(value, torch.Tensor) or value.dim() == 0:
        return False
    if value.numel() != length:
        raise NotElementwise(
            f"optimizer state {key!r} has {value.numel()} elements for a parameter slice of {length}: "
            "the optimizer is not element-wise"
        )
    return True


def slice_state(state: dict, start: int, stop: int, length: int, copy: bool = True) -> dict:
    """The state of elements [start, stop) of a slice of `length` elements.

    `copy`: the tensors are fresh (else views of `state`'s, for sending).
    """

    def cut(key, value):
        if _per_element(value, length, key):
            part = value.reshape(-1)[start:stop]
            return part.clone() if copy else part
        return value.clone() if copy and isinstance(value, torch.Tensor) else value

    return {key: cut(key, value) for key, value in state.items()}


def join_states(parts: Sequence[dict], lengths: Sequence[int]) -> dict:
    """The state of consecutive slices as one (per-element tensors concatenated; scalars from the first).

    Every part of one parameter has the same history (it was stepped whenever
    the parameter had a gradient), so either all parts are empty or none is,
    and their scalars agree; a disagreement is an error, never averaged away.
    """
    if not parts:
        return {}
    if len(parts) == 1:
        return dict(parts[0])
    if not all(parts):
        if any(parts):
            raise ValueError("the slices of one parameter disagree on whether it was ever stepped")
        return {}
    first, length = parts[0], lengths[0]
    joined = {}
    for key, value in first.items():
        if _per_element(value, length, key):
            joined[key] = torch.cat([part[key].reshape(-1) for part in parts])
            continue
        for part in parts[1:]:
            other = part[key]
            same = torch.equal(other, value) if isinstance(value, torch.Tensor) else other == value
            if not same:
                raise ValueError(f"the slices of one parameter disagree on its {key!r}")
        joined[key] = value
    return joined


def shaped(state: dict, shape: torch.Size) -> dict:
    """A whole parameter's flat state with its per-element tensors in the parameter's shape."""
    length = shape.numel()
    return {key: value.reshape(shape) if _per_element(value, length, key) else value for key, value in state.items()}


def state_nbytes(states) -> int:
    """The bytes of the tensors in optimizer states (an iterable of per-parameter state dicts)."""
    return sum(value.nbytes for state in states for value in state.values() if isinstance(value, torch.Tensor))
