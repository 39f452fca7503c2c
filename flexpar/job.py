"""The job: the user's single-device pieces, checked on construction, and `fit()`, which trains them.

`Job.fit()` resolves the options (flexpar/options.py) and hands the job to
the driver (`flexpar.driver.launch.run`), which checks it further, starts the
worker processes and returns the trained model. The workers never import
this module for its code: they unpickle the `Job` they are sent and call
its pieces through flexpar/worker/user_code.py.
"""

from __future__ import annotations

import math
import multiprocessing
import os
import sys
import traceback
import warnings
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Optional, Union

import torch
from torch import nn

from flexpar import options as options_module
from flexpar import recipes
from flexpar.core import batching
from flexpar.data import describe, is_stream
from flexpar.driver import launch
from flexpar.errors import ArgumentError, TrainingError, UserCodeError
from flexpar.worker.settings import EXIT_MAIN_GUARD
from flexpar.worker.user_code import is_real


class FitResult(NamedTuple):
    """What fit() returns: the trained model (in the calling process) and a summary."""

    model: nn.Module
    summary: dict


@dataclass(frozen=True)
class Job:
    """A training job built from single-device pieces.

    model:          zero-argument factory returning an nn.Module (called under
                    torch.manual_seed(seed), so every device builds the same one)
    optimizer:      maps an iterable of parameters to a torch.optim.Optimizer
    loss:           loss(model, batch) -> scalar mean loss of the batch, or a pair
                    (loss_sum, count): the gradient is then the token mean of the whole
                    global batch, sum of loss_sum / sum of count over every VW and device
    dataset:        any map-style torch Dataset, or an iterable one (a torch IterableDataset, a Hugging
                    Face datasets.IterableDataset): split into V streams, one per VW, whose positions are
                    training state (docs/guide.md, streaming datasets); fit() then needs steps=
    global_batch:   samples per optimizer step, independent of the device count
    virtual_workers / micro_batch: how the global batch is cut (give one)
    lr_scheduler:   optional, maps the optimizer to a scheduler stepped once per step
    eval_dataset / evaluate: optional evaluation set and evaluate(model, batch) -> dict of
                    metrics summed over the batch ({"loss_sum": ..., "correct": ..., "count": ...}),
                    run every `eval_every` steps and after the last (flexpar/worker/evaluator.py)
    eval_batch:     samples per evaluation batch (default: the micro-batch, global_batch / V)
    mixed_precision: None, "bf16" or "fp16": each VW's forward and loss run under torch.autocast;
                    "fp16" adds dynamic loss scaling (flexpar/recipes.py), tuned by
                    grad_scaler={"init_scale", "growth_factor", "backoff_factor", "growth_interval"}
    max_grad_norm:  clip the 2-norm of the summed global gradient (dense and sparse) to this
    compile / compile_options: torch.compile the model in every worker (options: torch.compile's
                    keyword arguments, e.g. {"mode": "max-autotune"} or {"backend": "aot_eager"})
    sample_cost:    optional sample_cost(index) -> number >= 0, e.g. the token count of sample
                    `index` (cheap: called in the workers for every sample of every step); VWs are
                    then assigned to devices by predicted cost, not count (flexpar/core/cost_balance/)
    shard_optimizer: False, True (= "elements") or "parameters": partition the optimizer state
                    across the current devices, each stepping its part, resharded live at every
                    change of the device set (flexpar/worker/shards.py). "elements" cuts anywhere
                    and needs an element-wise optimizer (SGD, Adam, AdamW, Adagrad, RMSprop, ...);
                    "parameters" keeps each parameter's state whole (any per-parameter optimizer)
    shard_redundancy: copies of each part of the sharded state (default: 2, at most one per
                    device, so one failure loses nothing); 1 saves the most memory, and a failure
                    then stops the job, naming the latest checkpoint
    deterministic:  True: exact, order-free gradient sums (int64 fixed point), so the parameters, optimizer
                    state and recorded losses are bit-for-bit those of the one-device run on any device set
                    and schedule; costs memory and time (docs/guide.md), and CPU devices run 1 thread each
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
    shard_optimizer: Union[bool, str] = False
    shard_redundancy: Optional[int] = None
    deterministic: bool = False

    def __post_init__(self):
        try:
            self._check_arguments()
        except ArgumentError as error:
            # The message names the argument and the fix; flexpar's frames would only bury it.
            raise show_to_the_user(error) from None

    def _check_arguments(self) -> None:
        """Every argument, checked before anything runs: ArgumentError naming the first bad one."""
        self._check_pieces()
        if isinstance(self.global_batch, bool) or not isinstance(self.global_batch, int) or self.global_batch < 1:
            raise ArgumentError(f"global_batch={self.global_batch!r} must be a positive whole number")
        object.__setattr__(self, "virtual_workers", self._virtual_workers())
        if is_stream(self.dataset):
            self._check_stream()
        elif not hasattr(self.dataset, "__getitem__") or not hasattr(self.dataset, "__len__"):
            raise ArgumentError(
                "dataset= must be a map-style Dataset (with __getitem__ and __len__) or an iterable one "
                "(a torch IterableDataset)"
            )
        elif len(self.dataset) < self.global_batch:
            raise ArgumentError(
                f"the dataset has {len(self.dataset)} samples, fewer than one global batch of "
                f"{self.global_batch}; use a smaller global_batch or more data"
            )
        if isinstance(self.num_workers, bool) or not isinstance(self.num_workers, int) or self.num_workers < 0:
            raise ArgumentError(f"num_workers={self.num_workers!r} must be a whole number >= 0")
        self._check_evaluation()
        self._check_recipe()
        self._check_sharding()

    def _check_stream(self) -> None:
        """An iterable dataset: what flexpar/data refuses (one line each), and what streaming jobs do not
        support yet (docs/guide.md, streaming datasets)."""
        source = describe(self.dataset)
        if source.note:  # what flexpar changed in the pipeline (flexpar/data/sources.py), said once
            warnings.warn(f"flexpar: {source.note}", stacklevel=5)  # at the Job(...) call
        if self.sample_cost is not None:
            raise ArgumentError(
                "sample_cost= takes a sample's index, and a streaming dataset has none: balancing by cost "
                "is for map-style datasets (not supported with an iterable dataset= yet)"
            )
        if self.shard_optimizer:
            raise ArgumentError(
                "shard_optimizer= with an iterable dataset= is not supported yet: train the stream with "
                "shard_optimizer=False, or use a map-style dataset"
            )

    @property
    def streaming(self) -> bool:
        """Whether dataset= is an iterable (streaming) dataset (flexpar/data)."""
        return is_stream(self.dataset)

    def _check_pieces(self) -> None:
        """model, optimizer, loss, lr_scheduler and sample_cost are functions; a model or optimizer
        given where its factory is expected gets the factory to write instead."""
        if isinstance(self.model, nn.Module):
            kind = type(self.model).__name__
            raise ArgumentError(
                f"model= takes a function that builds the model, not a model ({kind}): define "
                f"`def make_model(): return {kind}(...)` at module level and pass model=make_model "
                "(every device builds its own copy from it)"
            )
        if isinstance(self.optimizer, torch.optim.Optimizer):
            raise ArgumentError(
                "optimizer= takes a function that builds the optimizer from the parameters, not an optimizer "
                f"({type(self.optimizer).__name__}): define `def make_optimizer(parameters): return "
                f"{_optimizer_call(self.optimizer)}` at module level and pass optimizer=make_optimizer "
                "(a lambda cannot be sent to the devices)"
            )
        for name in ("model", "optimizer", "loss"):
            if not callable(getattr(self, name)):
                raise ArgumentError(f"{name}= must be a function (got {type(getattr(self, name)).__name__})")
        if self.lr_scheduler is not None and not callable(self.lr_scheduler):
            raise ArgumentError("lr_scheduler= must be a function of the optimizer")
        if self.sample_cost is not None and not callable(self.sample_cost):
            raise ArgumentError(
                f"sample_cost= must be a function sample_cost(index) -> number (e.g. the token "
                f"count of sample index), not {type(self.sample_cost).__name__}"
            )

    def _check_sharding(self) -> None:
        """shard_optimizer and shard_redundancy (the optimizer itself is checked by the driver)."""
        if self.shard_optimizer not in (False, True, "elements", "parameters") or not isinstance(
            self.shard_optimizer, (bool, str)
        ):
            raise ArgumentError(
                f'shard_optimizer={self.shard_optimizer!r} must be False, True (= "elements": the state cut '
                'anywhere, for element-wise optimizers) or "parameters" (each parameter\'s state kept whole)'
            )
        redundancy = self.shard_redundancy
        if redundancy is None:
            return
        if not self.shard_optimizer:
            raise ArgumentError(
                "shard_redundancy= needs shard_optimizer=True (without sharding every device holds all)"
            )
        if isinstance(redundancy, bool) or not isinstance(redundancy, int) or redundancy < 1:
            raise ArgumentError(
                f"shard_redundancy={redundancy!r} must be a whole number >= 1: the copies of each part of the "
                "optimizer state (2, the default, survives any one failure)"
            )

    def _check_recipe(self) -> None:
        """mixed_precision, grad_scaler, max_grad_norm, compile, compile_options, deterministic (flexpar/recipes.py)."""
        if not isinstance(self.deterministic, bool):
            raise ArgumentError(
                f"deterministic={self.deterministic!r} must be True (exact, order-free gradient sums: bit-for-bit "
                "the same training on any device set) or False"
            )
        # The type first: a list or dict is not hashable, and `in` a dict would raise TypeError.
        if self.mixed_precision is not None and (
            not isinstance(self.mixed_precision, str) or self.mixed_precision not in recipes.MIXED_PRECISION
        ):
            raise ArgumentError(f'mixed_precision={self.mixed_precision!r} must be None, "bf16" or "fp16"')
        if self.grad_scaler is not None:
            if self.mixed_precision != "fp16":
                raise ArgumentError(
                    'grad_scaler= tunes fp16 loss scaling; it needs mixed_precision="fp16" '
                    "(bf16 and full precision need no scaler)"
                )
            if not isinstance(self.grad_scaler, dict) or set(self.grad_scaler) - set(recipes.SCALER_DEFAULTS):
                unknown = (
                    sorted(set(self.grad_scaler) - set(recipes.SCALER_DEFAULTS))
                    if isinstance(self.grad_scaler, dict)
                    else self.grad_scaler
                )
                raise ArgumentError(
                    f"grad_scaler= takes a dict with keys {', '.join(recipes.SCALER_DEFAULTS)}; got {unknown!r}"
                )
            settings = {**recipes.SCALER_DEFAULTS, **self.grad_scaler}
            for name, ok, rule in (
                ("init_scale", settings["init_scale"] > 0, "> 0"),
                ("growth_factor", settings["growth_factor"] > 1, "> 1"),
                ("backoff_factor", 0 < settings["backoff_factor"] < 1, "in (0, 1)"),
            ):
                if not is_real(settings[name]) or not math.isfinite(settings[name]) or not ok:
                    raise ArgumentError(f"grad_scaler[{name!r}]={settings[name]!r} must be a number {rule}")
            interval = settings["growth_interval"]
            if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
                raise ArgumentError(f"grad_scaler['growth_interval']={interval!r} must be a whole number >= 1")
        if self.max_grad_norm is not None and (
            not is_real(self.max_grad_norm) or not math.isfinite(self.max_grad_norm) or self.max_grad_norm <= 0
        ):
            raise ArgumentError(f"max_grad_norm={self.max_grad_norm!r} must be a number > 0 (or None: no clipping)")
        if not isinstance(self.compile, bool):
            raise ArgumentError(f"compile={self.compile!r} must be True or False (options go in compile_options=)")
        if self.compile_options is not None:
            if not self.compile:
                raise ArgumentError("compile_options= needs compile=True")
            if not isinstance(self.compile_options, dict) or set(self.compile_options) - set(recipes.COMPILE_KEYS):
                unknown = (
                    sorted(set(self.compile_options) - set(recipes.COMPILE_KEYS))
                    if isinstance(self.compile_options, dict)
                    else self.compile_options
                )
                raise ArgumentError(
                    f"compile_options= takes torch.compile's keyword arguments "
                    f"({', '.join(recipes.COMPILE_KEYS)}); got {unknown!r}"
                )
        if self.compile:
            problem = recipes.compile_problem("any")  # this Python; the device's own check runs in each worker
            if problem is not None:
                raise ArgumentError(f"compile=True cannot run here: {problem}")

    def _check_evaluation(self) -> None:
        if (self.eval_dataset is None) != (self.evaluate is None):
            given, missing = ("eval_dataset", "evaluate") if self.evaluate is None else ("evaluate", "eval_dataset")
            raise ArgumentError(
                f"{given}= needs {missing}= too: an evaluation is evaluate(model, batch) over eval_dataset"
            )
        if self.evaluate is None:
            if self.eval_batch is not None:
                raise ArgumentError("eval_batch= needs an evaluation set (eval_dataset= and evaluate=)")
            return
        if not callable(self.evaluate):
            raise ArgumentError(
                f"evaluate= must be a function evaluate(model, batch) -> dict (got {type(self.evaluate).__name__})"
            )
        if not hasattr(self.eval_dataset, "__getitem__") or not hasattr(self.eval_dataset, "__len__"):
            raise ArgumentError(
                "eval_dataset= must be a map-style Dataset (with __getitem__ and __len__): an iterable "
                "evaluation set is not supported yet"
            )
        if len(self.eval_dataset) < 1:
            raise ArgumentError("eval_dataset= is empty")
        if self.eval_batch is not None and (
            isinstance(self.eval_batch, bool) or not isinstance(self.eval_batch, int) or self.eval_batch < 1
        ):
            raise ArgumentError(f"eval_batch={self.eval_batch!r} must be a positive whole number")

    @property
    def eval_batch_size(self) -> int:
        """Samples per evaluation batch: eval_batch, else the micro-batch."""
        return self.eval_batch or self.micro_batch_size

    def _virtual_workers(self) -> int:
        for name in ("virtual_workers", "micro_batch"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ArgumentError(f"{name}={value!r} must be a positive whole number")
        if self.virtual_workers is not None and self.micro_batch is not None:
            if self.virtual_workers * self.micro_batch != self.global_batch:
                raise ArgumentError(
                    f"virtual_workers={self.virtual_workers} x micro_batch={self.micro_batch} != "
                    f"global_batch={self.global_batch}; give one of the two"
                )
            return self.virtual_workers
        if self.micro_batch is not None:
            if self.micro_batch < 1 or self.global_batch % self.micro_batch:
                raise ArgumentError(
                    f"global_batch={self.global_batch} is not divisible by micro_batch="
                    f"{self.micro_batch}; choose a micro_batch that divides it"
                )
            return self.global_batch // self.micro_batch
        virtual_workers = 1 if self.virtual_workers is None else self.virtual_workers
        if not isinstance(virtual_workers, int) or virtual_workers < 1:
            raise ArgumentError(f"virtual_workers={virtual_workers!r} must be a positive whole number")
        if self.global_batch % virtual_workers:
            divisors = [d for d in range(1, self.global_batch + 1) if self.global_batch % d == 0]
            raise ArgumentError(
                f"global_batch={self.global_batch} is not divisible by virtual_workers="
                f"{virtual_workers}; choose one of {divisors[:12]}"
            )
        return virtual_workers

    @property
    def micro_batch_size(self) -> int:
        return self.global_batch // self.virtual_workers

    def steps_per_epoch(self) -> int:
        if self.streaming:
            raise ArgumentError(
                "epochs= needs the steps of an epoch, and a streaming dataset's length is not known: give "
                "steps= (steps beyond the end of the stream start its next pass)"
            )
        return batching.steps_per_epoch(len(self.dataset), self.global_batch)

    def fit(self, steps=None, epochs=None, devices=None, **options) -> FitResult:
        """Train on worker processes and return the trained model here, in the driver.

        The keyword options are those of `flexpar.options.FitOptions` (schedule,
        max_devices, emulate_speeds, metrics, checkpoint_every, ...). Under
        `flexpar run`, the command line overrides them.
        """
        refuse_inside_worker_import()
        verbose = bool(options.get("verbose"))
        try:
            resolved = options_module.resolve(dict(steps=steps, epochs=epochs, devices=devices, **options))
            verbose = resolved.verbose
            return FitResult(*launch.run(self, resolved))
        except (TrainingError, UserCodeError, ValueError) as error:
            # flexpar's own checks (options, device counts, resume) raise ValueError too; one
            # raised inside the user's code or a library keeps its traceback, which is the point.
            if verbose or (
                isinstance(error, ValueError) and not isinstance(error, ArgumentError) and not _raised_by_flexpar(error)
            ):
                raise
            raise show_to_the_user(error) from None
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


def show_to_the_user(error: Exception) -> Exception:
    """`error`, worded for the user, made ready to be shown as one line: the one place that does it.

    Job() and fit() raise what this returns. Uncaught under a plain `python
    train.py`, it prints as `flexpar: MESSAGE` and nothing else; `flexpar run`
    prints the same line itself (flexpar/cli/run_command.py). Its traceback is
    cut to the frames from the raise outwards, so a notebook (IPython shows
    every error with its traceback, its convention, and keeps its own hook)
    shows the user's line and the message, not flexpar's insides. Errors
    flexpar does not mark (its own bugs, the user's code) keep their traceback.
    """
    _show_uncaught_as_one_line()
    error.flexpar_message = True
    return error.with_traceback(None)


def _show_uncaught_as_one_line() -> None:
    """Have an uncaught flexpar error print as `flexpar: MESSAGE`, without Python's traceback.

    Only where nobody replaced Python's own hook (an IDE, IPython or a
    framework keeps theirs), and only for errors marked by `show_to_the_user`;
    everything else reaches the previous hook unchanged.
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


def _optimizer_call(optimizer: torch.optim.Optimizer) -> str:
    """The call that builds `optimizer` again, e.g. `torch.optim.AdamW(parameters, lr=0.001)`."""
    kind = type(optimizer).__name__
    where = "torch.optim." if getattr(torch.optim, kind, None) is type(optimizer) else ""
    rate = optimizer.defaults.get("lr")
    rate_text = f"lr={rate!r}" if isinstance(rate, (int, float)) and not isinstance(rate, bool) else "lr=..."
    return f"{where}{kind}(parameters, {rate_text})"


def refuse_inside_worker_import() -> None:
    """fit() called while a worker imports the user's script means a missing main guard.

    The worker exits at once with EXIT_MAIN_GUARD and no traceback; the driver,
    which sees its exit code, says so once (not once per worker).
    """
    if getattr(multiprocessing.current_process(), "_inheriting", False):
        sys.stderr.flush()
        os._exit(EXIT_MAIN_GUARD)
