"""`flexpar export CHECKPOINT -o model.safetensors`: a checkpoint's model weights as safetensors.

The file holds the model's state_dict (parameters and buffers) and nothing
else, so any program loads it without flexpar or pickle:

    model.load_state_dict(safetensors.torch.load_file("model.safetensors"))

A fine-tuning job's checkpoint holds the trainable state only (its frozen
weights are the factory's, checked by digest): export rebuilds the model with
the factory the checkpoint names, checks the frozen digests, loads the trained
tensors and writes the whole model. Any other checkpoint holds the whole
model and is written as it is, with no factory (and no `--script`). The
files get the mode the user's umask gives, as `torch.save`'s do. For a peft model it also writes the
adapter alone with peft's own `save_pretrained` (loadable with
`PeftModel.from_pretrained(base, ADAPTER)`).

Needs the `safetensors` package (`pip install -e ".[safetensors]"` in flexpar's checkout).
"""

from __future__ import annotations

import importlib
import os
from typing import Optional

import torch

from flexpar.core import frozen
from flexpar.driver.join import import_script_as_main
from flexpar.worker import checkpoints

EXTRA_HINT = 'pip install safetensors (or pip install -e ".[safetensors]" in flexpar\'s checkout)'


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


def adapter_folder(output: str) -> str:
    """Where a peft adapter goes by default: `lora.safetensors` -> `lora-adapter`."""
    root, extension = os.path.splitext(output)
    return (root if extension == ".safetensors" else output) + "-adapter"


def _named(name: str):
    """`module:qualname` (or `module.qualname`) -> the object."""
    module_name, _, qualname = name.partition(":") if ":" in name else name.rpartition(".")
    target = importlib.import_module(module_name)
    for part in qualname.split("."):
        target = getattr(target, part)
    return target


def resolve_factory(recorded: Optional[dict], script: Optional[str], name: Optional[str], checkpoint: str):
    """The model factory that rebuilds a checkpoint's model: `name` if given, else the one the checkpoint names.

    A factory defined in the training script needs `script` (a checkpoint
    never chooses which file export runs).
    """
    if script:
        import_script_as_main(os.path.abspath(script))
    if name:
        return _named(name if ":" in name or "." in name else f"__main__:{name}")
    if recorded is None:
        raise ValueError(
            f"{checkpoint} holds the trainable weights only and its model factory could not be recorded "
            "(a lambda, a local function or a partial): name it with --model MODULE:NAME (or --script SCRIPT "
            "--model NAME)"
        )
    module = recorded["name"].split(":", 1)[0]
    if module in ("__main__", "__mp_main__") and not script:
        raise ValueError(
            f"{checkpoint}'s model factory ({recorded['name']}) is defined in the training script: "
            f"flexpar export {checkpoint} --script SCRIPT"
        )
    target = _named(recorded["name"].replace("__mp_main__:", "__main__:"))
    return target(**recorded["fields"]) if "fields" in recorded else target


def rebuild_model(state: dict, factory, checkpoint: str) -> torch.nn.Module:
    """The factory's model under the job's seed, its frozen part checked, the checkpoint's tensors loaded."""
    entry = state["extra"]["frozen"]
    torch.manual_seed(int(entry.get("seed", 0)))
    model = factory()
    problem = frozen.frozen_problem(entry["digests"], frozen.frozen_digests(model), where="the model built here")
    if problem:
        raise ValueError(f"cannot export {checkpoint}: {problem}")
    layout = frozen.model_layout(model)
    problem = frozen.load_problem(layout, list(state["model"]))
    if problem:
        raise ValueError(f"cannot export {checkpoint}: {problem}")
    model.load_state_dict({k: v for k, v in state["model"].items() if k not in layout.frozen}, strict=False)
    return model


def export(checkpoint: str, output: str, **options) -> str:
    """Write the model weights of flexpar checkpoint `checkpoint` to `output` (safetensors); returns `output`.

    `options`: those of `export_with_adapter` (where a peft adapter goes, how to rebuild the model).
    """
    return export_with_adapter(checkpoint, output, **options)[0]


def export_with_adapter(
    checkpoint: str,
    output: str,
    adapter: Optional[str] = None,
    script: Optional[str] = None,
    model: Optional[str] = None,
) -> tuple:
    """`export`, and for a peft model its adapter to `adapter` (default `adapter_folder(output)`).

    Returns (`output`, the adapter's folder or None).
    """
    save_file = _safetensors()
    if not os.path.isfile(checkpoint):
        raise ValueError(f"no such checkpoint: {checkpoint}")
    try:
        state = checkpoints.read_checkpoint(checkpoint, torch.device("cpu"), with_optimizer=False)
    except Exception as error:  # not a torch file, or not one weights_only can read
        raise ValueError(
            f"{checkpoint} is not a readable flexpar checkpoint ({type(error).__name__}: "
            f"{str(error).splitlines()[0] if str(error) else ''})"
        ) from None
    entry = (state.get("extra") or {}).get("frozen") if isinstance(state, dict) else None
    built = None
    if needs_factory(entry):
        factory = resolve_factory(entry.get("factory"), script, model, checkpoint)
        built = rebuild_model(state, factory, checkpoint)
        state = {"model": built.state_dict(), "step": state.get("step", "")}
    tensors = model_tensors(state)
    folder = os.path.dirname(os.path.abspath(output))
    os.makedirs(folder, exist_ok=True)
    metadata = {"format": "pt", "flexpar_step": str(state.get("step", ""))}
    temporary = output + ".tmp"
    save_file(tensors, temporary, metadata=metadata)
    follow_umask(temporary)
    os.replace(temporary, output)
    if built is not None and entry.get("peft"):
        adapter = adapter or adapter_folder(output)
        built.save_pretrained(adapter)  # peft's own layout: adapter_config.json, adapter_model.safetensors
        weights = os.path.join(adapter, "adapter_model.safetensors")  # peft's name; owner-only as safetensors writes it
        if os.path.isfile(weights):
            follow_umask(weights)
        return output, adapter
    return output, None


def needs_factory(entry: Optional[dict]) -> bool:
    """Whether a checkpoint's model must be rebuilt by its factory to be exported.

    Only when the checkpoint lacks part of the state_dict (frozen weights and
    buffers that stayed as built, stored as digests) or the model is a peft
    model (its adapter is written by peft's `save_pretrained`); a checkpoint
    that holds the whole state_dict (`complete`, or no digest at all: nothing
    frozen and no buffer, as an earlier flexpar recorded it) is written as it is.
    """
    if entry is None:
        return False
    return bool(entry.get("peft")) or not (entry.get("complete") or not entry.get("digests"))


def follow_umask(path: str) -> None:
    """Give `path` the mode a new file gets from the user's umask (0644 under the usual 022).

    safetensors writes its files owner-only (0600); a model is shared like
    any file `torch.save` writes, so it gets the mode `open()` would give it.
    """
    os.chmod(path, 0o666 & ~_umask())


def _umask() -> int:
    """This process's umask (read from /proc where it is there: setting it to read it is not thread-safe)."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    current = os.umask(0o022)
    os.umask(current)
    return current
