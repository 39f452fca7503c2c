"""`flexpar export CHECKPOINT -o model.safetensors`: a checkpoint's model weights as safetensors.

The file holds the model's state_dict (parameters and buffers) and nothing
else, so any program loads it without flexpar or pickle:

    model.load_state_dict(safetensors.torch.load_file("model.safetensors"))

Needs the `safetensors` package (`pip install flexpar[safetensors]`).
"""

from __future__ import annotations

import os

import torch

from flexpar.worker import checkpoints

EXTRA_HINT = "pip install safetensors (or flexpar[safetensors])"


def _safetensors():
    try:
        from safetensors.torch import save_file
    except ImportError:
        raise ImportError(
            f"flexpar export writes safetensors files and needs the safetensors package: {EXTRA_HINT}"
        ) from None
    return save_file


def model_tensors(state: dict) -> dict:
    """The model's tensors of a checkpoint's state, each its own contiguous CPU copy.

    safetensors refuses tensors that share memory (tied weights): each is
    copied, and `load_state_dict` fills tied parameters from either name.
    """
    model = state.get("model") if isinstance(state, dict) else None
    if not isinstance(model, dict):
        raise ValueError("this file holds no model state (a flexpar checkpoint has a 'model' entry)")
    tensors = {}
    for name, value in model.items():
        if isinstance(value, torch.Tensor):
            tensors[name] = value.detach().to("cpu").contiguous().clone()
    if not tensors:
        raise ValueError("the checkpoint's model state holds no tensors")
    return tensors


def export(checkpoint: str, output: str) -> str:
    """Write the model weights of flexpar checkpoint `checkpoint` to `output` (safetensors); returns `output`."""
    save_file = _safetensors()
    if not os.path.isfile(checkpoint):
        raise ValueError(f"no such checkpoint: {checkpoint}")
    try:
        state = checkpoints.read_checkpoint(checkpoint, torch.device("cpu"))
    except Exception as error:  # not a torch file, or not one weights_only can read
        raise ValueError(
            f"{checkpoint} is not a readable flexpar checkpoint ({type(error).__name__}: "
            f"{str(error).splitlines()[0] if str(error) else ''})"
        ) from None
    tensors = model_tensors(state)
    folder = os.path.dirname(os.path.abspath(output))
    os.makedirs(folder, exist_ok=True)
    metadata = {"format": "pt", "flexpar_step": str(state.get("step", ""))}
    temporary = output + ".tmp"
    save_file(tensors, temporary, metadata=metadata)
    os.replace(temporary, output)
    return output
