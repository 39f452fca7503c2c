"""Frozen weights: what never travels, and the content check that makes that safe.

A parameter is *frozen* when `requires_grad` is False on the model the factory
returns. Every device builds it with the factory (which loads the pretrained
files on its own host), so it never travels to joiners, is never synchronised
and, by default, is never written to checkpoints. What makes that safe is a
digest per frozen tensor (and per buffer, as built), compared with the job's
reference before a device is admitted and before a checkpoint is resumed.

Pure functions of tensors and names: no processes, sockets or clocks.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

import torch
from torch import nn

SHOWN = 3  # differing names a message lists before it counts the rest


def tensor_digest(tensor: torch.Tensor) -> str:
    """sha256 of the tensor's dtype, shape and bytes (hardware sha256: ~1.3 GB/s a core on the dev machine)."""
    digest = hashlib.sha256(f"{str(tensor.dtype).removeprefix('torch.')}:{list(tensor.shape)}:".encode())
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    if flat.numel():
        digest.update(flat.view(torch.uint8).numpy())  # a view, no copy on the CPU; hashlib releases the GIL
    return digest.hexdigest()


def frozen_tensors(model: nn.Module) -> dict:
    """name -> tensor of what every device builds and nothing sends: frozen parameters, then every buffer.

    Each tensor once, under its first name (tied weights count once). Buffers are
    taken as built, persistent or not: a buffer that training changes travels
    anyway; its initial value must still match, or the model is another one.
    """
    found: dict = {}
    seen: set = set()
    for name, parameter in model.named_parameters():
        if not parameter.requires_grad and id(parameter) not in seen:
            seen.add(id(parameter))
            found[name] = parameter
    for name, buffer in model.named_buffers():
        if id(buffer) not in seen:
            seen.add(id(buffer))
            found[name] = buffer
    return found


def tensor_digests(tensors: Mapping[str, torch.Tensor], mapper=map) -> dict:
    """name -> `tensor_digest`, in the mapping's order.

    `mapper`: `map`, or a thread pool's `map` (hashlib releases the GIL): the
    core starts no threads itself.
    """
    return dict(zip(tensors, mapper(tensor_digest, tensors.values())))


def frozen_digests(model: nn.Module, mapper=map) -> dict:
    """name -> `tensor_digest` of every frozen tensor (`frozen_tensors`), in the model's order (`mapper`: as above)."""
    return tensor_digests(frozen_tensors(model), mapper)


def combined_digest(digests: Mapping[str, str]) -> str:
    """One sha256 over the whole table (names and digests, in order): what a device's `ready` carries."""
    return hashlib.sha256("".join(f"{name}={digest};" for name, digest in digests.items()).encode()).hexdigest()


def differing(reference: Mapping[str, str], reported: Mapping[str, str]) -> list:
    """Names whose digests differ or that one side lacks: the reference's order, then the reported's extras."""
    names = [name for name, digest in reference.items() if reported.get(name) != digest]
    return names + [name for name in reported if name not in reference]


def frozen_problem(reference: Mapping[str, str], reported: Mapping[str, str], where: str = "this device") -> str:
    """Why `reported` (a device's or a checkpoint's digests) does not match the job's `reference`; "" if it does."""
    names = differing(reference, reported)
    if not names:
        return ""
    described = []
    for name in names[:SHOWN]:
        if name not in reported:
            described.append(f"{name} (frozen in the job, trainable or missing on {where})")
        elif name not in reference:
            described.append(f"{name} (frozen on {where}, trainable or missing in the job)")
        else:
            described.append(name)
    more = f" and {len(names) - SHOWN} more" if len(names) > SHOWN else ""
    return (
        f"the frozen weights on {where} differ from the job's: {', '.join(described)}{more} "
        f"({len(names)} of {len(reference)} frozen tensors and buffers). Every device builds the frozen part "
        "with the model factory and must get the same values: make the factory deterministic (it runs under "
        "torch.manual_seed(seed); no other randomness or per-host choices) and load the same pretrained "
        "files (the same path and version) everywhere"
    )


@dataclass(frozen=True)
class ModelLayout:
    """The model's state_dict keys by role; tied weights list every alias."""

    trainable: frozenset
    frozen: frozenset
    buffers: frozenset  # persistent buffers (state_dict keys)


def model_layout(model: nn.Module) -> ModelLayout:
    keys = set(model.state_dict(keep_vars=True))
    trainable, frozen = set(), set()
    for name, parameter in model.named_parameters(remove_duplicate=False):
        (trainable if parameter.requires_grad else frozen).add(name)
    buffers = {name for name, _ in model.named_buffers(remove_duplicate=False)} & keys
    return ModelLayout(frozenset(trainable & keys), frozenset(frozen & keys), frozenset(buffers))


def travelling_keys(layout: ModelLayout, changed_buffers) -> frozenset:
    """What a device sends of its model: every trainable parameter and the buffers that changed."""
    return layout.trainable | (layout.buffers & frozenset(changed_buffers))


def load_problem(layout: ModelLayout, received: Sequence[str]) -> str:
    """Why a received model state cannot be loaded over this model ("" when it can).

    Every trainable parameter must be there; frozen parameters and unchanged
    buffers may be missing (the factory built them); nothing unknown may be.
    """
    received = set(received)
    unknown = sorted(received - layout.trainable - layout.frozen - layout.buffers)
    missing = sorted(layout.trainable - received)
    if unknown:
        return f"the received model state holds tensors this model does not have: {', '.join(unknown[:SHOWN])}"
    if missing:
        return f"the received model state lacks trainable parameters: {', '.join(missing[:SHOWN])}"
    return ""


def flipped(flags: Sequence[tuple]) -> list:
    """Names of parameters whose requires_grad is no longer what it was when the model was built.

    `flags`: (name, parameter, requires_grad when built) for every parameter.
    """
    return [name for name, parameter, built in flags if parameter.requires_grad != built]


def flip_message(name: str, now_trainable: bool, step: int) -> str:
    became, was = (
        ("trainable (requires_grad=True)", "frozen") if now_trainable else ("frozen (requires_grad=False)", "trainable")
    )
    return (
        f"parameter {name} became {became} at step {step}; it was {was} when the model factory returned the "
        "model. flexpar settles which parameters train when the model is built (frozen ones are built by every "
        "device and never sent to joiners or written to checkpoints), so a change during training would "
        "silently diverge. Set requires_grad in the model factory; to train another set of parameters, start a "
        "new job"
    )


def factory_reference(factory) -> Optional[dict]:
    """{"name": "module:qualname"[, "fields": {...}]} when `flexpar export` can rebuild `factory` by name, else None.

    A module-level function or class, or an instance of a module-level
    dataclass whose fields are plain JSON values. Lambdas, local functions
    and partials cannot be named: None.
    """
    is_instance = dataclasses.is_dataclass(factory) and not isinstance(factory, type)
    target = type(factory) if is_instance else factory
    module, qualname = getattr(target, "__module__", None), getattr(target, "__qualname__", None)
    if not isinstance(module, str) or not isinstance(qualname, str) or "<" in qualname:
        return None
    if not is_instance:
        return {"name": f"{module}:{qualname}"} if callable(factory) else None
    fields = {field.name: getattr(factory, field.name) for field in dataclasses.fields(factory)}
    try:
        if json.loads(json.dumps(fields)) != fields:
            return None
    except (TypeError, ValueError):
        return None
    return {"name": f"{module}:{qualname}", "fields": fields}
