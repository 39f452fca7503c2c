"""One device's frozen part: its digests as built, which buffers changed, the requires_grad flags.

The model part of every state this device hands on (to a joiner, into a
checkpoint, as the job's result) is `FrozenPart.travelling`: the trainable
parameters and the buffers that changed since the factory built them. What
stays is the same on every device, which the digests (flexpar/core/frozen.py)
prove before the device is admitted.
"""

from __future__ import annotations

import collections
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from flexpar.core import device_digest, frozen
from flexpar.errors import UserCodeError


class FrozenPart:
    """Built right after the model factory returns, before the model moves to its device."""

    def __init__(self, model: torch.nn.Module, threads: int = 1):
        self.layout = frozen.model_layout(model)
        # Parameter objects survive `model.to(device)`: the flags stay valid. Buffers are
        # replaced by a move, so everything about buffers goes by name.
        self.flags = [(name, parameter, parameter.requires_grad) for name, parameter in model.named_parameters()]
        started = time.perf_counter()
        with ThreadPoolExecutor(max(1, threads)) as pool:
            self.digests = frozen.frozen_digests(model, pool.map)
        self.digest_s = time.perf_counter() - started
        self.combined = frozen.combined_digest(self.digests)
        # Compared on the device the buffers move to (device_digest: the same lanes on a CPU and a GPU).
        self.built_buffers = _buffer_digests(model, self.layout.buffers)
        self.warm_changed: frozenset = frozenset()

    def note_warm_up(self, changed) -> None:
        """Buffers the warm-up's forward moved (BatchNorm statistics): they always travel."""
        self.warm_changed = frozenset(changed) & self.layout.buffers

    def changed_buffers(self, model: torch.nn.Module) -> set:
        """Persistent buffers that differ from what the factory built (the warm-up's, or any other now)."""
        changed = set(self.warm_changed)
        now = _buffer_digests(model, set(self.built_buffers) - changed)
        return changed | {name for name, digest in now.items() if digest != self.built_buffers[name]}

    def travelling(self, model: torch.nn.Module) -> collections.OrderedDict:
        """The model's state_dict less the frozen part, `_metadata` kept."""
        full = model.state_dict()
        keys = frozen.travelling_keys(self.layout, self.changed_buffers(model))
        subset = collections.OrderedDict((key, value) for key, value in full.items() if key in keys)
        subset._metadata = getattr(full, "_metadata", None)
        return subset

    def complete(self, model: torch.nn.Module, copied: dict) -> collections.OrderedDict:
        """`copied` (a CPU copy of `travelling`) completed to the whole state_dict, in its order.

        Frozen parameters are the live tensors (they never change: `check_flags`);
        the buffers that stayed as built are copied (one may change while a write is in flight).
        """
        full = model.state_dict()
        whole = collections.OrderedDict()
        for key, value in full.items():
            if key in copied:
                whole[key] = copied[key]
            elif key in self.layout.frozen:
                whole[key] = value.detach()
            else:
                whole[key] = value.detach().to("cpu", copy=True)
        whole._metadata = getattr(full, "_metadata", None)
        return whole

    def load(self, model: torch.nn.Module, model_state: dict) -> None:
        """Load a received or checkpointed model state; frozen tensors in it are ignored (the factory's stay)."""
        problem = frozen.load_problem(self.layout, list(model_state))
        if problem:
            raise ValueError(problem)
        frozen_keys = self.layout.frozen
        kept = collections.OrderedDict((key, value) for key, value in model_state.items() if key not in frozen_keys)
        kept._metadata = getattr(model_state, "_metadata", None)
        model.load_state_dict(kept, strict=False)

    def check_flags(self, step: int) -> None:
        """Raise UserCodeError naming the first parameter whose requires_grad changed since the model was built."""
        names = frozen.flipped(self.flags)
        if names:
            parameter = next(p for name, p, _ in self.flags if name == names[0])
            raise UserCodeError(frozen.flip_message(names[0], parameter.requires_grad, step))

    def checkpoint_entry(self, complete: bool, factory: dict | None, seed: int, peft: bool) -> dict:
        """What a checkpoint's extra["frozen"] holds: the digests that resume and export check, and how to rebuild."""
        return {
            "digests": dict(self.digests),
            "complete": complete,
            "factory": factory,
            "seed": seed,
            "peft": peft,
        }


def _buffer_digests(model: torch.nn.Module, names) -> dict:
    """name -> (dtype, shape, lanes) of the model's buffers named in `names`, reduced where they live
    (flexpar/core/device_digest.py)."""
    buffers = {name: buffer for name, buffer in model.named_buffers(remove_duplicate=False) if name in names}
    lanes = device_digest.lanes_by_name(buffers)
    return {name: (buffer.dtype, tuple(buffer.shape), lanes[name]) for name, buffer in buffers.items()}
