"""The model built in the script, as the devices (and `flexpar export`) rebuild it: one folder, no pickle.

`save_model_file(model, folder)` writes, once, in the driver:

    model.pt              the model's state_dict (torch.save; each device maps it: torch.load(mmap=True))
    config.json           the (base) model's config, as its save_pretrained writes it
    adapter_config.json   a peft model's adapter config, as peft's save_pretrained writes it
    flexpar-model.json    the model's class and its config's class (module:qualname), dtype, attention
                          implementation, the names of its frozen parameters, gradient checkpointing

and returns `ModelFromFile(folder)`, the job's model factory. Its one field
is the folder's path, a plain JSON value, so a checkpoint records it
(flexpar/core/frozen.py's `factory_record`) and `flexpar export` rebuilds the
model by itself, a peft model's adapter included. Everything in the folder
is read as data (JSON, `weights_only` tensors): the classes it names are
imported by name, as a recorded factory's is, never unpickled.
"""

from __future__ import annotations

import importlib
import json
import os
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

MODEL_FILE = "model.pt"
DESCRIPTION_FILE = "flexpar-model.json"


def _is_peft(model: nn.Module) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "get_base_model")


def _name_of(kind: type) -> str:
    return f"{kind.__module__}:{kind.__qualname__}"


def _named(name: str, folder: str):
    module_name, _, qualname = name.partition(":")
    target = importlib.import_module(module_name)
    try:
        for part in qualname.split("."):
            target = getattr(target, part)
    except AttributeError:
        where = "the training script (flexpar export: --script SCRIPT)" if module_name == "__main__" else module_name
        raise ValueError(f"{folder}/{DESCRIPTION_FILE} names {name}, which is not in {where}") from None
    return target


@dataclass(frozen=True)
class ModelFromFile:
    """Rebuild the script's model from `folder`: class(config), peft wrapping, then the saved state (mmap).

    Promised: the rebuilt model has the saved parameters and persistent buffers bit for bit, the same
    `requires_grad` for every parameter, the saved dtype and attention implementation, and gradient
    checkpointing when asked.
    """

    folder: str

    def __post_init__(self):
        if not isinstance(self.folder, str) or not os.path.isabs(self.folder):
            raise ValueError(f"ModelFromFile(folder={self.folder!r}): the folder must be an absolute path (a str)")

    def __call__(self) -> nn.Module:
        with open(os.path.join(self.folder, DESCRIPTION_FILE), encoding="utf-8") as handle:
            description = json.load(handle)
        config = _named(description["config_class"], self.folder).from_pretrained(self.folder)
        if description.get("attn_implementation"):
            config._attn_implementation = description["attn_implementation"]
        model = _named(description["model_class"], self.folder)(config).to(getattr(torch, description["dtype"]))
        if description.get("peft"):
            from peft import PeftConfig, get_peft_model

            model = get_peft_model(model, PeftConfig.from_pretrained(self.folder))
        state = torch.load(os.path.join(self.folder, MODEL_FILE), mmap=True, weights_only=True, map_location="cpu")
        model.load_state_dict(state, strict=True)
        frozen = set(description["frozen"])
        for name, parameter in model.named_parameters():
            parameter.requires_grad_(name not in frozen)
        if description.get("gradient_checkpointing") is not None:
            enable_checkpointing(model, dict(description["gradient_checkpointing"]))
        return model


def enable_checkpointing(model: nn.Module, keywords: dict) -> None:
    """Activation (gradient) checkpointing as the Trainer turns it on (activation_checkpointing_kwargs)."""
    every_n_layers, offload = keywords.pop("every_n_layers", 1), keywords.pop("offload", False)
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(
            activation_checkpointing_kwargs=keywords or None, every_n_layers=every_n_layers, offload=offload
        )
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=keywords or None)


def _peft_config(model: nn.Module):
    configs = dict(model.peft_config)
    if len(configs) != 1:
        raise ValueError(
            f"flexpar.hf.Trainer: the peft model has {len(configs)} adapters ({', '.join(configs)}); "
            "train one adapter at a time"
        )
    return next(iter(configs.values()))


def save_model_file(model: nn.Module, folder: str, gradient_checkpointing: Optional[dict]) -> ModelFromFile:
    """Write `model` to `folder` once (the files above) and return the factory that rebuilds it from there."""
    folder = os.path.abspath(folder)
    os.makedirs(folder, exist_ok=True)
    peft = _is_peft(model)
    base = model.get_base_model() if peft else model
    if peft:
        _peft_config(model).save_pretrained(folder)
    base.config.save_pretrained(folder)
    description = {
        "model_class": _name_of(type(base)),
        "config_class": _name_of(type(base.config)),
        "attn_implementation": getattr(base.config, "_attn_implementation", None),
        "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        "peft": peft,
        "frozen": [name for name, parameter in model.named_parameters() if not parameter.requires_grad],
        "gradient_checkpointing": gradient_checkpointing,
    }
    _replace(os.path.join(folder, MODEL_FILE), lambda path: torch.save(model.state_dict(), path))
    _replace(os.path.join(folder, DESCRIPTION_FILE), lambda path: _write_json(description, path))
    return ModelFromFile(folder)


def _write_json(value: dict, path: str) -> None:
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(value, handle, indent=1)


def _replace(path: str, write) -> None:
    """`write(temporary)` then rename it to `path`: a reader never sees half a file."""
    temporary = path + f".{os.getpid()}.tmp"
    write(temporary)
    os.replace(temporary, path)
