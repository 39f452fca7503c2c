"""Training recipes: mixed precision, loss scaling, gradient clipping, token-weighted losses, compile.

Each keeps flexpar's promise that the parameters after N steps do not depend on
the device set. Where each piece sits in a step (`flexpar.worker`):

1. Every VW's forward and loss run under `autocast(job, device)` (bf16 or
   fp16). The loss is a scalar (the VW's mean) or a pair `(loss_sum, count)`
   (`flexpar.job.loss_terms`).
2. Backward runs on `loss / V` (a scalar loss) or on `loss_sum` (a pair),
   times the loss scale with fp16. The step's statistics vector, summed
   across devices with the last bucket, carries the counts of all its VWs
   (for pairs summed exactly, in float64: `flexpar.comm.gradient_sync`), how many of its
   VWs returned pairs, and (fp16) whether its own gradients hold an inf or NaN.
3. After the sum across devices, `prepare_gradients` multiplies the summed
   gradient (dense and sparse) by `1 / (total count x scale)`, measures its
   total norm (every step record's `grad_norm`), and clips it to
   `max_grad_norm` as `torch.nn.utils.clip_grad_norm_` does; the dense
   part's clip rides in the copy of the summed buckets into `.grad`
   (`GradientSync.finish(scale=...)`), so clipping costs no pass over the
   gradient of its own. The summed gradient and the statistics are the same
   on every device, so every device computes the same norm, the same clip
   factor and the same verdict.
4. fp16: a step whose gradient is not finite (any device said so in the
   statistics, or the summed norm is inf/NaN) is skipped on every device -
   no optimizer or scheduler step - and the `LossScaler` backs off; after
   `growth_interval` good steps in a row it grows. Its state travels with the
   training state (to joiners, and into checkpoints). Without a loss scaler
   (fp32, bf16) a non-finite summed gradient stops the job at that step, with
   an error that says the gradient, not the loss, is not finite: applied, it
   would make the next step fail and blame that step.

Token weighting divides after the sum: the total count is known only when
every VW has run, and the division by one number common to all devices keeps
the applied gradient exactly the gradient of the token mean of the whole
global batch.
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import sys
import warnings
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from flexpar.errors import UserCodeError

MIXED_PRECISION = {"bf16": torch.bfloat16, "fp16": torch.float16}
"""The values of `Job(mixed_precision=...)` and the dtype autocast runs in."""

SCALER_DEFAULTS = {"init_scale": 2.0**16, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 2000}
"""`Job(grad_scaler=...)` keys and their defaults: torch.amp.GradScaler's."""

COMPILE_KEYS = ("fullgraph", "dynamic", "backend", "mode", "options", "disable")
"""The keys `Job(compile_options=...)` accepts: keyword arguments of torch.compile."""


# ---------------------------------------------------------------- mixed precision


def autocast_dtype(job) -> Optional[torch.dtype]:
    return MIXED_PRECISION.get(job.mixed_precision) if job.mixed_precision else None


def autocast_problem(device_type: str, dtype: torch.dtype) -> Optional[str]:
    """Why autocast cannot run in `dtype` on `device_type` here, or None when it can.

    torch.autocast does not raise for an unsupported dtype: it warns and runs
    without autocast. That warning is turned into the reason here.
    """
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            torch.autocast(device_type=device_type, dtype=dtype)
        except Exception as error:  # an unknown device type, for example
            return f"torch.autocast(device_type={device_type!r}, dtype={dtype}) failed: {error}"
    for warning in caught:
        text = str(warning.message)
        if "not supported" in text or "Disabling" in text:
            return text.strip()
    return None


def check_mixed_precision(job, device_type: str) -> None:
    """Refuse a mixed precision this device type's autocast does not support, saying what to use."""
    dtype = autocast_dtype(job)
    if dtype is None:
        return
    problem = autocast_problem(device_type, dtype)
    if problem is None:
        return
    hint = ' Use mixed_precision="bf16" on CPU devices.' if device_type == "cpu" else ""
    raise UserCodeError(
        f"mixed_precision={job.mixed_precision!r} is not supported on {device_type} devices "
        f"by torch {torch.__version__}: {_sentence(problem)}.{hint}"
    )


def _sentence(text: str) -> str:
    """torch's warning as one line without its final period (the message adds its own) and without
    "Disabling autocast." (flexpar refuses the job rather than run it without autocast)."""
    text = " ".join(text.replace("Disabling autocast.", "").split())
    return text.rstrip(". ")


def autocast(job, device_type: str):
    """The context each VW's forward and loss run in: torch.autocast, or nothing."""
    dtype = autocast_dtype(job)
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device_type, dtype=dtype)


# ---------------------------------------------------------------- fp16 loss scaling


@dataclass
class LossScaler:
    """Dynamic loss scaling with torch.amp.GradScaler's rules, as plain numbers.

    The loss is multiplied by `scale` before backward and the gradient by
    `1 / scale` after the sum. A step with a non-finite gradient is skipped
    and the scale multiplied by `backoff_factor`; after `growth_interval`
    finite steps in a row it is multiplied by `growth_factor`. Every device
    calls `update` with the same verdict, so every device holds the same
    scale; the state travels with the training state.
    """

    init_scale: float = SCALER_DEFAULTS["init_scale"]
    growth_factor: float = SCALER_DEFAULTS["growth_factor"]
    backoff_factor: float = SCALER_DEFAULTS["backoff_factor"]
    growth_interval: int = SCALER_DEFAULTS["growth_interval"]

    def __post_init__(self):
        self.scale = float(self.init_scale)
        self.growth_tracker = 0  # finite steps in a row since the last change of the scale

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self.scale *= self.backoff_factor
            self.growth_tracker = 0
            return
        self.growth_tracker += 1
        if self.growth_tracker == self.growth_interval:
            grown = self.scale * self.growth_factor
            if math.isfinite(grown):
                self.scale = grown
            self.growth_tracker = 0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "growth_tracker": self.growth_tracker}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self.growth_tracker = int(state["growth_tracker"])


def make_scaler(job) -> Optional[LossScaler]:
    if job.mixed_precision != "fp16":
        return None
    return LossScaler(**{**SCALER_DEFAULTS, **(job.grad_scaler or {})})


# ---------------------------------------------------------------- the summed gradient


def finish_gradients(
    dense: Sequence[torch.nn.Parameter],
    sparse: Sequence[torch.nn.Parameter],
    factor: float,
    max_grad_norm: Optional[float],
) -> float:
    """Scale the gradient in `.grad` by `factor`, return its total 2-norm, clip it to `max_grad_norm`.

    `prepare_gradients` on the parameters' own gradients, then the clip's
    multiplication (one device, where no write-back of sums could carry it).
    """
    grads = [parameter.grad for parameter in dense if parameter.grad is not None]
    norm, multiplier = prepare_gradients(grads, sparse, factor, max_grad_norm)
    if multiplier is not None and grads:
        torch._foreach_mul_(grads, multiplier)
    return norm


def prepare_gradients(
    dense_sums: Sequence[Optional[torch.Tensor]],
    sparse: Sequence[torch.nn.Parameter],
    factor: float,
    max_grad_norm: Optional[float],
) -> tuple:
    """The summed gradient made the one to apply, but for the dense part's clip: (norm, multiplier or None).

    `dense_sums` (changed in place) are the dense parameters' summed
    gradients, in the model's order; the sparse parameters' summed gradients
    are in their `.grad`. Both are multiplied by `factor`, 1 / (total count x
    loss scale) (1 for a plain scalar loss in full precision: then nothing is
    touched). The norm is over dense and sparse parameters together, computed
    as `clip_grad_norm_` of the dense equivalent would. Clipping multiplies by
    `max_grad_norm / (norm + 1e-6)` when that is below 1, as `clip_grad_norm_`
    does: the sparse gradients here, the dense ones by the caller (returned
    multiplier; None: nothing to multiply), in the pass that writes the sums
    back. A non-finite norm is returned as it is and nothing is clipped (fp16
    skips that step).
    """
    grads = [grad for grad in dense_sums if grad is not None]
    for parameter in sparse:
        if parameter.grad is not None:
            # A device's own sum over its VWs is uncoalesced: duplicates must be added
            # before a norm is taken (the sum across devices is coalesced already).
            parameter.grad = parameter.grad.coalesce()
            if factor != 1.0:
                parameter.grad = parameter.grad * factor
    if factor != 1.0 and grads:
        torch._foreach_mul_(grads, factor)
    values = grads + [parameter.grad._values() for parameter in sparse if parameter.grad is not None]
    norm = total_norm(values)
    value = float(norm)
    multiplier = None
    if max_grad_norm is not None and math.isfinite(value):
        # In float32 tensor arithmetic, as clip_grad_norm_: a coefficient one bit off would
        # shift every gradient element by a bit, which fp16/bf16 forwards amplify over steps.
        coefficient = max_grad_norm / (norm + 1e-6)
        if float(coefficient) < 1.0:
            multiplier = coefficient
            for parameter in sparse:
                if parameter.grad is not None:
                    parameter.grad = parameter.grad * coefficient
    return value, multiplier


def total_norm(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The 2-norm of all `tensors` together (a 0-dim tensor), computed as torch.nn.utils.clip_grad_norm_ does."""
    if not tensors:
        return torch.zeros(())
    norms = []
    for group in _by_device_and_dtype(tensors):
        norms.extend(torch._foreach_norm(group, 2.0))
    first = norms[0].device
    return torch.linalg.vector_norm(torch.stack([norm.to(first) for norm in norms]), 2.0)


def _by_device_and_dtype(tensors):
    groups: dict = {}
    for tensor in tensors:
        groups.setdefault((tensor.device, tensor.dtype), []).append(tensor)
    return list(groups.values())


def has_nonfinite(dense: Sequence[torch.nn.Parameter], sparse: Sequence[torch.nn.Parameter]) -> bool:
    """Whether this device's own gradient (before the sum) holds an inf or NaN."""
    values = [parameter.grad for parameter in dense if parameter.grad is not None]
    values += [
        parameter.grad._values()
        for parameter in sparse
        if parameter.grad is not None and parameter.grad.layout == torch.sparse_coo
    ]
    if not values:
        return False
    norms = []
    for group in _by_device_and_dtype(values):
        norms.extend(torch._foreach_norm(group, float("inf")))
    return not bool(torch.isfinite(torch.stack([norm.float().cpu() for norm in norms])).all())


# ---------------------------------------------------------------- torch.compile


def compile_problem(device_type: str, options: Optional[dict] = None) -> Optional[str]:
    """Why torch.compile cannot run on `device_type` here, or None when it looks able to.

    Checks what is known to fail before the first compiled call: a Python
    that TorchDynamo does not support, and for the default inductor backend
    a C++ compiler (CPU) or Triton (CUDA). Anything else surfaces at the
    first compiled call, in the worker's warm-up.
    """
    try:
        from torch._dynamo.eval_frame import check_if_dynamo_supported

        check_if_dynamo_supported()
    except ImportError:
        pass
    except Exception as error:
        return f"TorchDynamo does not support this Python ({sys.version.split()[0]}): {error}"
    backend = (options or {}).get("backend", "inductor")
    if backend != "inductor":
        return None
    if device_type == "cpu":
        try:
            from torch._inductor.cpp_builder import get_cpp_compiler

            get_cpp_compiler()
        except ImportError:
            if not (shutil.which(os.environ.get("CXX", "g++")) or shutil.which("c++")):
                return "the inductor backend needs a C++ compiler (g++ or $CXX) on CPU devices, and none was found"
        except Exception as error:
            return (
                f"the inductor backend needs a working C++ compiler on CPU devices "
                f"({type(error).__name__}: {error}); install g++ or set CXX"
            )
    elif device_type == "cuda":
        try:
            from torch.utils._triton import has_triton

            if not has_triton():
                return "the inductor backend needs Triton on CUDA devices (pip install triton), and it is missing"
        except ImportError:
            pass
    return None


def check_compile(job, device_type: str) -> None:
    if not job.compile:
        return
    problem = compile_problem(device_type, job.compile_options)
    if problem is not None:
        raise UserCodeError(
            f"compile=True cannot run on {device_type} devices here: {problem}. "
            "Run without compile=True, or pass compile_options={'backend': 'aot_eager'}"
        )


def compiled(job, model: torch.nn.Module) -> torch.nn.Module:
    """What the VWs' forward calls: torch.compile(model), or the model itself.

    The compiled wrapper shares the model's parameters and buffers; state
    capture, transfer, checkpoints and the model digest use `model` itself,
    so their keys carry no `_orig_mod.` prefix.
    """
    if not job.compile:
        return model
    return torch.compile(model, **(job.compile_options or {}))


def is_compile_error(error: BaseException) -> bool:
    """Whether `error` came from TorchDynamo / inductor rather than from the user's code."""
    try:
        from torch._dynamo.exc import TorchDynamoException
    except ImportError:
        return False
    return isinstance(error, TorchDynamoException)
