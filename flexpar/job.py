"""The job: the user's single-device pieces, checked on construction, and `fit()`, which trains them.

The checks of every argument are flexpar/job_arguments.py (`Job.__post_init__` calls them).

`Job.fit()` resolves the options (flexpar/options.py) and hands the job to
the driver (`flexpar.driver.launch.run`), which checks it further, starts the
worker processes and returns the trained model. The workers never import
this module for its code: they unpickle the `Job` they are sent and call
its pieces through flexpar/worker/user_code.py.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import traceback
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Optional, Union

import torch
from torch import nn

from flexpar import options as options_module
from flexpar import recipes  # noqa: F401  (kept: tests patch flexpar.job.recipes)
from flexpar.core import batching
from flexpar.data import is_stream, pass_count
from flexpar.driver import launch
from flexpar.errors import ArgumentError, TrainingError, UserCodeError
from flexpar.job_arguments import check_arguments
from flexpar.worker.settings import EXIT_MAIN_GUARD


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
                    run every `eval_every` steps and after the last (flexpar/worker/evaluator.py); an
                    iterable evaluation set is read once, here, into the list of its items
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
    pass_end:       an iterable dataset only: "drop" (default) leaves out the items of a pass that do not
                    fill a step's share of a stream; "carry" fills it from the next pass (docs/guide.md)
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
    pass_end: str = "drop"

    def __post_init__(self):
        try:
            check_arguments(self)  # flexpar/job_arguments.py; resolves virtual_workers
        except ArgumentError as error:
            # The message names the argument and the fix; flexpar's frames would only bury it.
            raise show_to_the_user(error) from None

    @property
    def streaming(self) -> bool:
        """Whether dataset= is an iterable (streaming) dataset (flexpar/data)."""
        return is_stream(self.dataset)

    @property
    def eval_batch_size(self) -> int:
        """Samples per evaluation batch: eval_batch, else the micro-batch."""
        return self.eval_batch or self.micro_batch_size

    @property
    def micro_batch_size(self) -> int:
        return self.global_batch // self.virtual_workers

    def steps_per_epoch(self) -> int:
        if self.streaming:
            raise ArgumentError(
                "a streaming dataset's length is not known, so it has no steps per epoch: fit(epochs=N) "
                "counts its first N passes (steps_for_epochs)"
            )
        return batching.steps_per_epoch(len(self.dataset), self.global_batch)

    def steps_for_epochs(self, epochs: int) -> int:
        """The steps of `epochs` epochs: a stream's passes are read and counted first (data/pass_count.py)."""
        if self.streaming:
            return pass_count.steps_for_epochs(self, epochs)
        return epochs * self.steps_per_epoch()

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


def refuse_inside_worker_import() -> None:
    """fit() called while a worker imports the user's script means a missing main guard.

    The worker exits at once with EXIT_MAIN_GUARD and no traceback; the driver,
    which sees its exit code, says so once (not once per worker).
    """
    if getattr(multiprocessing.current_process(), "_inheriting", False):
        sys.stderr.flush()
        os._exit(EXIT_MAIN_GUARD)
