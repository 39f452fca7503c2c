"""What `Job(...)` accepts: every argument checked on construction, before anything runs.

`check_arguments(job)` is called by `Job.__post_init__` (flexpar/job.py) and
raises an ArgumentError naming the first bad argument and its fix; on the way
it resolves `job.virtual_workers` (from micro_batch where that was given).
The driver's checks that need a built model or a first batch come later
(flexpar/driver/job_checks.py).
"""

from __future__ import annotations

import math
import warnings

import torch
from torch import nn

from flexpar import recipes
from flexpar.core.stream_split import PASS_ENDS
from flexpar.data import describe, is_stream
from flexpar.data.eval_items import EvalItems
from flexpar.errors import ArgumentError
from flexpar.worker.user_code import is_real


def check_arguments(job) -> None:
    """Every argument, checked before anything runs: ArgumentError naming the first bad one."""
    _check_pieces(job)
    if isinstance(job.global_batch, bool) or not isinstance(job.global_batch, int) or job.global_batch < 1:
        raise ArgumentError(f"global_batch={job.global_batch!r} must be a positive whole number")
    object.__setattr__(job, "virtual_workers", resolve_virtual_workers(job))
    if is_stream(job.dataset):
        _check_stream(job)
    elif not hasattr(job.dataset, "__getitem__") or not hasattr(job.dataset, "__len__"):
        raise ArgumentError(
            "dataset= must be a map-style Dataset (with __getitem__ and __len__) or an iterable one "
            "(a torch IterableDataset)"
        )
    elif job.pass_end != "drop":
        raise ArgumentError(
            f"pass_end={job.pass_end!r} is for an iterable dataset=: a map-style epoch drops its last "
            "incomplete global batch"
        )
    elif len(job.dataset) < job.global_batch:
        raise ArgumentError(
            f"the dataset has {len(job.dataset)} samples, fewer than one global batch of "
            f"{job.global_batch}; use a smaller global_batch or more data"
        )
    if isinstance(job.num_workers, bool) or not isinstance(job.num_workers, int) or job.num_workers < 0:
        raise ArgumentError(f"num_workers={job.num_workers!r} must be a whole number >= 0")
    _check_evaluation(job)
    _check_recipe(job)
    _check_sharding(job)


def _check_stream(job) -> None:
    """An iterable dataset: what flexpar/data refuses (one line each), and what streaming jobs do not
    support yet (docs/guide.md, streaming datasets)."""
    source = describe(job.dataset)
    if source.note:  # what flexpar changed in the pipeline (flexpar/data/sources.py), said once
        warnings.warn(f"flexpar: {source.note}", stacklevel=5)  # at the Job(...) call
    if job.sample_cost is not None:
        raise ArgumentError(
            "sample_cost= takes a sample's index, and a streaming dataset has none: balancing by cost "
            "is for map-style datasets (not supported with an iterable dataset= yet)"
        )
    if job.shard_optimizer:
        raise ArgumentError(
            "shard_optimizer= with an iterable dataset= is not supported yet: train the stream with "
            "shard_optimizer=False, or use a map-style dataset"
        )
    if job.pass_end not in PASS_ENDS:
        raise ArgumentError(f"pass_end={job.pass_end!r} must be one of {', '.join(map(repr, PASS_ENDS))}")


def _check_pieces(job) -> None:
    """model, optimizer, loss, lr_scheduler and sample_cost are functions; a model or optimizer
    given where its factory is expected gets the factory to write instead."""
    if isinstance(job.model, nn.Module):
        kind = type(job.model).__name__
        raise ArgumentError(
            f"model= takes a function that builds the model, not a model ({kind}): define "
            f"`def make_model(): return {kind}(...)` at module level and pass model=make_model "
            "(every device builds its own copy from it)"
        )
    if isinstance(job.optimizer, torch.optim.Optimizer):
        raise ArgumentError(
            "optimizer= takes a function that builds the optimizer from the parameters, not an optimizer "
            f"({type(job.optimizer).__name__}): define `def make_optimizer(parameters): return "
            f"{_optimizer_call(job.optimizer)}` at module level and pass optimizer=make_optimizer "
            "(a lambda cannot be sent to the devices)"
        )
    for name in ("model", "optimizer", "loss"):
        if not callable(getattr(job, name)):
            raise ArgumentError(f"{name}= must be a function (got {type(getattr(job, name)).__name__})")
    if job.lr_scheduler is not None and not callable(job.lr_scheduler):
        raise ArgumentError("lr_scheduler= must be a function of the optimizer")
    if job.sample_cost is not None and not callable(job.sample_cost):
        raise ArgumentError(
            f"sample_cost= must be a function sample_cost(index) -> number (e.g. the token "
            f"count of sample index), not {type(job.sample_cost).__name__}"
        )


def _check_sharding(job) -> None:
    """shard_optimizer and shard_redundancy (the optimizer itself is checked by the driver)."""
    if job.shard_optimizer not in (False, True, "elements", "parameters") or not isinstance(
        job.shard_optimizer, (bool, str)
    ):
        raise ArgumentError(
            f'shard_optimizer={job.shard_optimizer!r} must be False, True (= "elements": the state cut '
            'anywhere, for element-wise optimizers) or "parameters" (each parameter\'s state kept whole)'
        )
    redundancy = job.shard_redundancy
    if redundancy is None:
        return
    if not job.shard_optimizer:
        raise ArgumentError("shard_redundancy= needs shard_optimizer=True (without sharding every device holds all)")
    if isinstance(redundancy, bool) or not isinstance(redundancy, int) or redundancy < 1:
        raise ArgumentError(
            f"shard_redundancy={redundancy!r} must be a whole number >= 1: the copies of each part of the "
            "optimizer state (2, the default, survives any one failure)"
        )


def _check_recipe(job) -> None:
    """mixed_precision, grad_scaler, max_grad_norm, compile, compile_options, deterministic (flexpar/recipes.py)."""
    if not isinstance(job.deterministic, bool):
        raise ArgumentError(
            f"deterministic={job.deterministic!r} must be True (exact, order-free gradient sums: bit-for-bit "
            "the same training on any device set) or False"
        )
    # The type first: a list or dict is not hashable, and `in` a dict would raise TypeError.
    if job.mixed_precision is not None and (
        not isinstance(job.mixed_precision, str) or job.mixed_precision not in recipes.MIXED_PRECISION
    ):
        raise ArgumentError(f'mixed_precision={job.mixed_precision!r} must be None, "bf16" or "fp16"')
    if job.grad_scaler is not None:
        if job.mixed_precision != "fp16":
            raise ArgumentError(
                'grad_scaler= tunes fp16 loss scaling; it needs mixed_precision="fp16" '
                "(bf16 and full precision need no scaler)"
            )
        unknown = _not_keywords_of(job.grad_scaler, recipes.SCALER_DEFAULTS)
        if unknown is not None:
            raise ArgumentError(
                f"grad_scaler= takes a dict with keys {', '.join(recipes.SCALER_DEFAULTS)}; got {unknown!r}"
            )
        settings = {**recipes.SCALER_DEFAULTS, **job.grad_scaler}
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
    if job.max_grad_norm is not None and (
        not is_real(job.max_grad_norm) or not math.isfinite(job.max_grad_norm) or job.max_grad_norm <= 0
    ):
        raise ArgumentError(f"max_grad_norm={job.max_grad_norm!r} must be a number > 0 (or None: no clipping)")
    if not isinstance(job.compile, bool):
        raise ArgumentError(f"compile={job.compile!r} must be True or False (options go in compile_options=)")
    if job.compile_options is not None:
        if not job.compile:
            raise ArgumentError("compile_options= needs compile=True")
        unknown = _not_keywords_of(job.compile_options, recipes.COMPILE_KEYS)
        if unknown is not None:
            raise ArgumentError(
                f"compile_options= takes torch.compile's keyword arguments "
                f"({', '.join(recipes.COMPILE_KEYS)}); got {unknown!r}"
            )
    if job.compile:
        problem = recipes.compile_problem("any")  # this Python; the device's own check runs in each worker
        if problem is not None:
            raise ArgumentError(f"compile=True cannot run here: {problem}")


def _check_evaluation(job) -> None:
    if (job.eval_dataset is None) != (job.evaluate is None):
        given, missing = ("eval_dataset", "evaluate") if job.evaluate is None else ("evaluate", "eval_dataset")
        raise ArgumentError(f"{given}= needs {missing}= too: an evaluation is evaluate(model, batch) over eval_dataset")
    if job.evaluate is None:
        if job.eval_batch is not None:
            raise ArgumentError("eval_batch= needs an evaluation set (eval_dataset= and evaluate=)")
        return
    if not callable(job.evaluate):
        raise ArgumentError(
            f"evaluate= must be a function evaluate(model, batch) -> dict (got {type(job.evaluate).__name__})"
        )
    if is_stream(job.eval_dataset):  # read once, here: its items in its order (flexpar/data/eval_items.py)
        object.__setattr__(job, "eval_dataset", EvalItems.read(job.eval_dataset))
    if not hasattr(job.eval_dataset, "__getitem__") or not hasattr(job.eval_dataset, "__len__"):
        raise ArgumentError(
            "eval_dataset= must be a map-style Dataset (with __getitem__ and __len__) or a finite iterable one"
        )
    if len(job.eval_dataset) < 1:
        raise ArgumentError("eval_dataset= is empty")
    if job.eval_batch is not None and (
        isinstance(job.eval_batch, bool) or not isinstance(job.eval_batch, int) or job.eval_batch < 1
    ):
        raise ArgumentError(f"eval_batch={job.eval_batch!r} must be a positive whole number")


def resolve_virtual_workers(job) -> int:
    """virtual_workers as given, or from micro_batch (global_batch / micro_batch), or 1."""
    for name in ("virtual_workers", "micro_batch"):
        value = getattr(job, name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ArgumentError(f"{name}={value!r} must be a positive whole number")
    if job.virtual_workers is not None and job.micro_batch is not None:
        if job.virtual_workers * job.micro_batch != job.global_batch:
            raise ArgumentError(
                f"virtual_workers={job.virtual_workers} x micro_batch={job.micro_batch} != "
                f"global_batch={job.global_batch}; give one of the two"
            )
        return job.virtual_workers
    if job.micro_batch is not None:
        if job.micro_batch < 1 or job.global_batch % job.micro_batch:
            raise ArgumentError(
                f"global_batch={job.global_batch} is not divisible by micro_batch="
                f"{job.micro_batch}; choose a micro_batch that divides it"
            )
        return job.global_batch // job.micro_batch
    virtual_workers = 1 if job.virtual_workers is None else job.virtual_workers
    if not isinstance(virtual_workers, int) or virtual_workers < 1:
        raise ArgumentError(f"virtual_workers={virtual_workers!r} must be a positive whole number")
    if job.global_batch % virtual_workers:
        divisors = [d for d in range(1, job.global_batch + 1) if job.global_batch % d == 0]
        raise ArgumentError(
            f"global_batch={job.global_batch} is not divisible by virtual_workers="
            f"{virtual_workers}; choose one of {divisors[:12]}"
        )
    return virtual_workers


def _optimizer_call(optimizer: torch.optim.Optimizer) -> str:
    """The call that builds `optimizer` again, e.g. `torch.optim.AdamW(parameters, lr=0.001)`."""
    kind = type(optimizer).__name__
    where = "torch.optim." if getattr(torch.optim, kind, None) is type(optimizer) else ""
    rate = optimizer.defaults.get("lr")
    rate_text = f"lr={rate!r}" if isinstance(rate, (int, float)) and not isinstance(rate, bool) else "lr=..."
    return f"{where}{kind}(parameters, {rate_text})"


def _not_keywords_of(value, allowed):
    """None where `value` is a dict whose keys are all in `allowed`; else what to name in the error:
    the unknown keys, sorted, or the value itself where it is no dict."""
    if not isinstance(value, dict):
        return value
    unknown = sorted(set(value) - set(allowed))
    return unknown or None
