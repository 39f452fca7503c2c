"""The user's pieces, checked once in the driver before any worker starts."""

from __future__ import annotations

import contextlib
import hashlib
import math
import multiprocessing
import os
import pickle
import sys
import traceback
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Optional

import torch
from torch import nn

from flexpar.core import batching


class FitResult(NamedTuple):
    """What fit() returns: the trained model (in the calling process) and a summary."""

    model: nn.Module
    summary: dict


class UserCodeError(Exception):
    """A piece of the user's code raised, or returned something unusable."""


class TrainingError(RuntimeError):
    """The job stopped: a worker's error, or no device left. The message says which."""


@dataclass(frozen=True)
class Job:
    """A training job built from single-device pieces.

    model:          zero-argument factory returning an nn.Module (called under
                    torch.manual_seed(seed), so every device builds the same one)
    optimizer:      maps an iterable of parameters to a torch.optim.Optimizer
    loss:           loss(model, batch) -> scalar mean loss of the batch, or a pair
                    (loss_sum, count): the gradient is then the token mean of the whole
                    global batch, sum of loss_sum / sum of count over every VW and device
    dataset:        any map-style torch Dataset
    global_batch:   samples per optimizer step, independent of the device count
    virtual_workers / micro_batch: how the global batch is cut (give one)
    lr_scheduler:   optional, maps the optimizer to a scheduler stepped once per step
    eval_dataset / evaluate: optional evaluation set and evaluate(model, batch) -> dict of
                    metrics summed over the batch ({"loss_sum": ..., "correct": ..., "count": ...}),
                    run every `eval_every` steps and after the last (flexpar/evaluator.py)
    eval_batch:     samples per evaluation batch (default: the micro-batch, global_batch / V)
    mixed_precision: None, "bf16" or "fp16": each VW's forward and loss run under torch.autocast;
                    "fp16" adds dynamic loss scaling (flexpar/recipes.py), tuned by
                    grad_scaler={"init_scale", "growth_factor", "backoff_factor", "growth_interval"}
    max_grad_norm:  clip the 2-norm of the summed global gradient (dense and sparse) to this
    compile / compile_options: torch.compile the model in every worker (options: torch.compile's
                    keyword arguments, e.g. {"mode": "max-autotune"} or {"backend": "aot_eager"})
    sample_cost:    optional sample_cost(index) -> number >= 0, e.g. the token count of sample
                    `index` (cheap: called in the workers for every sample of every step); VWs are
                    then assigned to devices by predicted cost, not count (flexpar/cost_balance.py)
    """

    model: Callable[[], nn.Module]
    optimizer: Callable[[Any], torch.optim.Optimizer]
    loss: Callable[[nn.Module, Any], torch.Tensor]
    dataset: Any
    global_batch: int
    virtual_workers: Optional[int] = None
    micro_batch: Optional[int] = None
    seed: int = 0
    lr_scheduler: Optional[Callable] = None
    collate_fn: Optional[Callable] = None
    num_workers: int = 0
    eval_dataset: Any = None
    evaluate: Optional[Callable[[nn.Module, Any], dict]] = None
    eval_batch: Optional[int] = None
    mixed_precision: Optional[str] = None
    max_grad_norm: Optional[float] = None
    grad_scaler: Optional[dict] = None
    compile: bool = False
    compile_options: Optional[dict] = None
    sample_cost: Optional[Callable[[int], float]] = None

    def __post_init__(self):
        for name in ("model", "optimizer", "loss"):
            if not callable(getattr(self, name)):
                raise TypeError(f"{name}= must be a function (got {type(getattr(self, name)).__name__})")
        if self.lr_scheduler is not None and not callable(self.lr_scheduler):
            raise TypeError("lr_scheduler= must be a function of the optimizer")
        if self.sample_cost is not None and not callable(self.sample_cost):
            raise TypeError(f"sample_cost= must be a function sample_cost(index) -> number (e.g. the token "
                            f"count of sample index), not {type(self.sample_cost).__name__}")
        if not isinstance(self.global_batch, int) or self.global_batch < 1:
            raise ValueError(f"global_batch={self.global_batch!r} must be a positive whole number")
        object.__setattr__(self, "virtual_workers", self._virtual_workers())
        if not hasattr(self.dataset, "__getitem__") or not hasattr(self.dataset, "__len__"):
            raise TypeError("dataset= must be a map-style Dataset (with __getitem__ and __len__)")
        if len(self.dataset) < self.global_batch:
            raise ValueError(
                f"the dataset has {len(self.dataset)} samples, fewer than one global batch of "
                f"{self.global_batch}; use a smaller global_batch or more data"
            )
        if self.num_workers < 0:
            raise ValueError(f"num_workers={self.num_workers} must be >= 0")
        self._check_evaluation()
        self._check_recipe()

    def _check_recipe(self) -> None:
        """mixed_precision, grad_scaler, max_grad_norm, compile and compile_options (flexpar/recipes.py)."""
        from flexpar import recipes

        # The type first: a list or dict is not hashable, and `in` a dict would raise TypeError.
        if self.mixed_precision is not None and (
                not isinstance(self.mixed_precision, str) or self.mixed_precision not in recipes.MIXED_PRECISION):
            raise ValueError(f"mixed_precision={self.mixed_precision!r} must be None, \"bf16\" or \"fp16\"")
        if self.grad_scaler is not None:
            if self.mixed_precision != "fp16":
                raise ValueError("grad_scaler= tunes fp16 loss scaling; it needs mixed_precision=\"fp16\" "
                                 "(bf16 and full precision need no scaler)")
            if not isinstance(self.grad_scaler, dict) or set(self.grad_scaler) - set(recipes.SCALER_DEFAULTS):
                unknown = sorted(set(self.grad_scaler) - set(recipes.SCALER_DEFAULTS)) \
                    if isinstance(self.grad_scaler, dict) else self.grad_scaler
                raise ValueError(f"grad_scaler= takes a dict with keys {', '.join(recipes.SCALER_DEFAULTS)}; "
                                 f"got {unknown!r}")
            settings = {**recipes.SCALER_DEFAULTS, **self.grad_scaler}
            for name, ok, rule in (("init_scale", settings["init_scale"] > 0, "> 0"),
                                   ("growth_factor", settings["growth_factor"] > 1, "> 1"),
                                   ("backoff_factor", 0 < settings["backoff_factor"] < 1, "in (0, 1)")):
                if not _is_real(settings[name]) or not math.isfinite(settings[name]) or not ok:
                    raise ValueError(f"grad_scaler[{name!r}]={settings[name]!r} must be a number {rule}")
            interval = settings["growth_interval"]
            if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
                raise ValueError(f"grad_scaler['growth_interval']={interval!r} must be a whole number >= 1")
        if self.max_grad_norm is not None and (
                not _is_real(self.max_grad_norm) or not math.isfinite(self.max_grad_norm) or self.max_grad_norm <= 0):
            raise ValueError(f"max_grad_norm={self.max_grad_norm!r} must be a number > 0 (or None: no clipping)")
        if not isinstance(self.compile, bool):
            raise TypeError(f"compile={self.compile!r} must be True or False (options go in compile_options=)")
        if self.compile_options is not None:
            if not self.compile:
                raise ValueError("compile_options= needs compile=True")
            if not isinstance(self.compile_options, dict) or set(self.compile_options) - set(recipes.COMPILE_KEYS):
                unknown = sorted(set(self.compile_options) - set(recipes.COMPILE_KEYS)) \
                    if isinstance(self.compile_options, dict) else self.compile_options
                raise ValueError(f"compile_options= takes torch.compile's keyword arguments "
                                 f"({', '.join(recipes.COMPILE_KEYS)}); got {unknown!r}")
        if self.compile:
            problem = recipes.compile_problem("any")  # this Python; the device's own check runs in each worker
            if problem is not None:
                raise ValueError(f"compile=True cannot run here: {problem}")

    def _check_evaluation(self) -> None:
        if (self.eval_dataset is None) != (self.evaluate is None):
            given, missing = ("eval_dataset", "evaluate") if self.evaluate is None else ("evaluate", "eval_dataset")
            raise ValueError(f"{given}= needs {missing}= too: an evaluation is evaluate(model, batch) over eval_dataset")
        if self.evaluate is None:
            if self.eval_batch is not None:
                raise ValueError("eval_batch= needs an evaluation set (eval_dataset= and evaluate=)")
            return
        if not callable(self.evaluate):
            raise TypeError(f"evaluate= must be a function evaluate(model, batch) -> dict "
                            f"(got {type(self.evaluate).__name__})")
        if not hasattr(self.eval_dataset, "__getitem__") or not hasattr(self.eval_dataset, "__len__"):
            raise TypeError("eval_dataset= must be a map-style Dataset (with __getitem__ and __len__)")
        if len(self.eval_dataset) < 1:
            raise ValueError("eval_dataset= is empty")
        if self.eval_batch is not None and (isinstance(self.eval_batch, bool) or not isinstance(self.eval_batch, int)
                                            or self.eval_batch < 1):
            raise ValueError(f"eval_batch={self.eval_batch!r} must be a positive whole number")

    @property
    def eval_batch_size(self) -> int:
        """Samples per evaluation batch: eval_batch, else the micro-batch."""
        return self.eval_batch or self.micro_batch_size

    def _virtual_workers(self) -> int:
        if self.virtual_workers is not None and self.micro_batch is not None:
            if self.virtual_workers * self.micro_batch != self.global_batch:
                raise ValueError(
                    f"virtual_workers={self.virtual_workers} x micro_batch={self.micro_batch} != "
                    f"global_batch={self.global_batch}; give one of the two"
                )
            return self.virtual_workers
        if self.micro_batch is not None:
            if self.micro_batch < 1 or self.global_batch % self.micro_batch:
                raise ValueError(
                    f"global_batch={self.global_batch} is not divisible by micro_batch="
                    f"{self.micro_batch}; choose a micro_batch that divides it"
                )
            return self.global_batch // self.micro_batch
        virtual_workers = 1 if self.virtual_workers is None else self.virtual_workers
        if not isinstance(virtual_workers, int) or virtual_workers < 1:
            raise ValueError(f"virtual_workers={virtual_workers!r} must be a positive whole number")
        if self.global_batch % virtual_workers:
            divisors = [d for d in range(1, self.global_batch + 1) if self.global_batch % d == 0]
            raise ValueError(
                f"global_batch={self.global_batch} is not divisible by virtual_workers="
                f"{virtual_workers}; choose one of {divisors[:12]}"
            )
        return virtual_workers

    @property
    def micro_batch_size(self) -> int:
        return self.global_batch // self.virtual_workers

    def steps_per_epoch(self) -> int:
        return batching.steps_per_epoch(len(self.dataset), self.global_batch)

    def fit(self, steps=None, epochs=None, devices=None, **options) -> FitResult:
        """Train on worker processes and return the trained model here, in the driver.

        The keyword options are those of `flexpar.options.FitOptions` (schedule,
        max_devices, emulate_speeds, metrics, checkpoint_every, ...). Under
        `flexpar run`, the command line overrides them.
        """
        from flexpar.driver import launch
        from flexpar import options as options_module

        refuse_inside_worker_import()
        verbose = bool(options.get("verbose"))
        try:
            resolved = options_module.resolve(dict(steps=steps, epochs=epochs, devices=devices, **options))
            verbose = resolved.verbose
            return launch.run(self, resolved)
        except (TrainingError, UserCodeError, ValueError) as error:
            # flexpar's own checks (options, device counts, resume) raise ValueError too; one
            # raised inside the user's code or a library keeps its traceback, which is the point.
            if verbose or (isinstance(error, ValueError) and not _raised_by_flexpar(error)):
                raise
            # The message says what went wrong and where; flexpar's own frames would bury it.
            # Uncaught (a plain `python train.py`), it is shown as one line, on top.
            _show_uncaught_as_one_line()
            error.flexpar_message = True
            raise error.with_traceback(None) from None
        except KeyboardInterrupt:
            # Ctrl-C while the driver checks the job and starts its store (launch.run answers
            # it itself once the devices run): no worker is running yet.
            if verbose:
                raise
            print("flexpar: interrupted (Ctrl-C) before training started", file=sys.stderr, flush=True)
            raise SystemExit(130) from None


def _raised_by_flexpar(error: BaseException) -> bool:
    """Whether `error` was raised by flexpar's own code (its innermost frame is in this package)."""
    frames = traceback.extract_tb(error.__traceback__)
    if not frames:
        return False
    package = os.path.dirname(os.path.abspath(__file__))
    return os.path.commonpath([package, os.path.abspath(frames[-1].filename)]) == package


def _show_uncaught_as_one_line() -> None:
    """Have an uncaught flexpar error print as `flexpar: MESSAGE`, without Python's traceback.

    Only where nobody replaced Python's own hook (an IDE, IPython or a
    framework keeps theirs), and only for errors fit() raised with a message
    worded for the user; everything else reaches the previous hook unchanged.
    """
    if sys.excepthook is not sys.__excepthook__:
        return
    previous = sys.excepthook

    def hook(kind, value, trace):
        if getattr(value, "flexpar_message", False):
            print(f"flexpar: {value}", file=sys.stderr, flush=True)
        else:
            previous(kind, value, trace)

    sys.excepthook = hook


MAIN_GUARD_MESSAGE = (
    "fit() was called while a worker process imported your script. Put the training call under "
    "`if __name__ == \"__main__\":` so that workers can import the script without starting training again."
)
EXIT_MAIN_GUARD = 78  # a worker's exit code for it: the driver then reports MAIN_GUARD_MESSAGE, once


def refuse_inside_worker_import() -> None:
    """fit() called while a worker imports the user's script means a missing main guard.

    The worker exits at once with EXIT_MAIN_GUARD and no traceback; the driver,
    which sees its exit code, says so once (not once per worker).
    """
    if getattr(multiprocessing.current_process(), "_inheriting", False):
        sys.stderr.flush()
        os._exit(EXIT_MAIN_GUARD)


# ------------------------------------------------------------ driver checks


def build_model(job: Job) -> nn.Module:
    """The model factory's result, built under the job's seed (same on every device)."""
    torch.manual_seed(job.seed)
    model = job.model()
    if not isinstance(model, nn.Module):
        raise UserCodeError(f"model= returned {type(model).__name__}, not an nn.Module")
    return model


def build_optimizer(job: Job, model: nn.Module):
    optimizer = job.optimizer(model.parameters())
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise UserCodeError(f"optimizer= returned {type(optimizer).__name__}, not a torch.optim.Optimizer")
    scheduler = job.lr_scheduler(optimizer) if job.lr_scheduler is not None else None
    return optimizer, scheduler


def check_loss(value, step: int, virtual_worker: int) -> float:
    """The loss as a float; a non-scalar loss is a user error named with where it happened."""
    if not isinstance(value, torch.Tensor) or value.dim() != 0:
        shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise UserCodeError(
            f"loss(model, batch) must return a scalar tensor (the mean loss of the batch) or a pair "
            f"(loss_sum, count); at step {step}, virtual worker {virtual_worker} it returned {shape}. "
            f"Reduce it, e.g. with .mean()"
        )
    return float(value.detach())


class LossTerms(NamedTuple):
    """What one VW's loss returned: the tensor to differentiate, its value, and the pair's count (or None)."""

    tensor: torch.Tensor
    value: float
    count: Optional[float]


def loss_terms(result, step: int, virtual_worker: int) -> LossTerms:
    """A scalar loss, or a pair (loss_sum, count) with a positive finite count; anything else is a user error."""
    if not isinstance(result, (tuple, list)):
        return LossTerms(result, check_loss(result, step, virtual_worker), None)
    where = f"at step {step}, virtual worker {virtual_worker}"
    if len(result) != 2:
        raise UserCodeError(f"loss(model, batch) returned a {type(result).__name__} of {len(result)} items {where}; "
                            "return a scalar tensor (the mean loss) or a pair (loss_sum, count)")
    loss_sum, count = result
    value = check_loss(loss_sum, step, virtual_worker)
    number = None
    if isinstance(count, torch.Tensor) and count.numel() == 1 and not count.is_complex():
        number = float(count.detach())
    elif _is_real(count):
        number = float(count)
    if number is None or not math.isfinite(number) or number <= 0:
        shown = f"tensor {count.detach().cpu().tolist()!r}" if isinstance(count, torch.Tensor) else repr(count)
        raise UserCodeError(
            f"loss(model, batch) returned the pair (loss_sum, count) with count {shown} {where}; the count "
            "(for example the number of non-padding tokens) must be a positive number, and every virtual "
            "worker's batch must count at least one"
        )
    return LossTerms(loss_sum, value, number)


def _is_real(value) -> bool:
    """A real number: int or float, not bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def nonfinite_message(step: int, virtual_worker: int) -> str:
    return (
        f"the loss is not finite (NaN or infinity) at step {step}, virtual worker "
        f"{virtual_worker}; training stopped before applying that step. Lower the learning "
        "rate or check the data of that step."
    )


def model_digest(model: nn.Module) -> str:
    """Digest of parameter and buffer names, shapes and dtypes: what a joiner must match."""
    digest = hashlib.sha256()
    for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
        digest.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype};".encode())
    return digest.hexdigest()


def pickle_pieces(job: Job) -> bytes:
    """The job as bytes for the workers; each piece that cannot travel is named."""
    for name in ("model", "optimizer", "loss", "lr_scheduler", "collate_fn", "dataset", "evaluate", "eval_dataset",
                 "sample_cost"):
        piece = getattr(job, name)
        if piece is None:
            continue
        try:
            pickle.dumps(piece)
        except Exception as error:
            raise UserCodeError(
                f"{name}= cannot be sent to worker processes ({error}). Worker processes import "
                f"your pieces by name: define {name} at module level of your script or a module "
                "(not as a lambda or inside a function), and keep the dataset picklable."
            ) from None
    return pickle.dumps(job)


def first_batch_check(job: Job, model: nn.Module) -> None:
    """Run the loss on virtual worker 0 of step 0 in the driver, to report errors once."""
    from flexpar.worker.loader import load_batch

    indices = batching.virtual_worker_indices(
        job.seed, 0, 0, len(job.dataset), job.global_batch, job.virtual_workers
    )
    batch = load_batch(job, indices, batching.data_seed(job.seed, 0, 0))
    from flexpar import recipes

    if not torch.cuda.is_available():  # a CPU job: the workers' device type is known here already
        recipes.check_mixed_precision(job, "cpu")
        recipes.check_compile(job, "cpu")
    dtype = recipes.autocast_dtype(job)
    # Under autocast, as in the workers, where the driver's CPU supports it (else plain).
    precision = recipes.autocast(job, "cpu") if dtype and not recipes.autocast_problem("cpu", dtype) else None
    # Eval mode: the check must not move BatchNorm statistics of the model we return.
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), (precision or contextlib.nullcontext()):
            value = loss_terms(job.loss(model, batch), 0, 0).value
    finally:
        model.train(was_training)
    if not math.isfinite(value):
        raise UserCodeError(nonfinite_message(0, 0))
    if job.sample_cost is not None:
        check_sample_cost(job, indices)


def check_sample_cost(job: Job, indices) -> None:
    """Call sample_cost on a few indices (those of VW 0 of step 0, and the dataset's last) in the driver.

    A function that raises or returns a non-number, NaN, an infinity or a
    negative number is refused here, once, naming the index, before any
    worker starts; the workers check every value they use too.
    """
    from flexpar.worker.cost_planner import sample_costs

    sample_costs(job, list(indices)[:8] + [len(job.dataset) - 1])
