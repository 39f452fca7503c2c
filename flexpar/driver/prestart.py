"""The driver's first phase: everything that can be checked before any process starts.

`check_job(job, options)` is the first room of `flexpar.driver.launch.run`
(the checkpoint folder was checked and taken before it): it detects the
devices, builds the model and optimizer once here, runs the one-time checks
of flexpar/driver/job_checks.py, starts hashing the frozen part in the
background, pickles the job's pieces and, with `resume=True`, checks the
newest checkpoint against this run; it returns a `CheckedJob`, which the
rooms after it read instead of the options, or raises the first problem found.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Optional

import torch

from flexpar.core import frozen
from flexpar.data import pass_count, pass_record
from flexpar.driver.fork_server import worker_context
from flexpar.driver.job_checks import check_sharding, checkpoint_folder, first_batch_check, pickle_pieces
from flexpar.driver.local_devices import detect_devices
from flexpar.options import FitOptions
from flexpar.worker import checkpoints, evaluator
from flexpar.worker.user_code import build_model, build_optimizer


@dataclasses.dataclass(frozen=True)
class CheckedJob:
    """What the checks before any process starts resolved: the rooms after them read it, not the options."""

    context: object  # how worker processes start (fork_server.worker_context)
    kind: str
    available: int
    backend: str
    initial: int
    max_devices: int
    model: torch.nn.Module
    eval_keys: tuple
    reference: Future  # the frozen digests of the driver's own build, hashed in the background
    payload: bytes
    total_steps: int
    newest: Optional[str]  # with --resume: the newest checkpoint, if any
    epoch_count: Optional[pass_count.EpochCount] = None  # epochs= over a stream: its pass lengths and steps


def check_job(job, options: FitOptions) -> CheckedJob:
    """Everything that can be checked before any process starts (the folder was checked and taken before);
    raises the first problem found."""
    kind, available, backend = detect_devices(options.backend)
    context = worker_context(options.verbose)
    initial = options.devices or (available if kind == "cuda" else 1)
    max_devices = options.validate_devices(initial, available, kind, job.virtual_workers)
    model = build_model(job)
    optimizer, _ = build_optimizer(job, model)
    check_sharding(job, model, optimizer)
    first_batch_check(job, model)
    if options.eval_every and job.evaluate is None:
        raise ValueError(
            f"eval_every={options.eval_every} needs an evaluation set: "
            "Job(..., eval_dataset=DATASET, evaluate=FUNCTION)"
        )
    eval_keys = evaluator.metric_keys(job, model) if job.evaluate is not None else ()
    # The job's frozen digests: the driver's own build is the reference (its frozen part is the
    # one the result completes). Hashed in the background while the workers start.
    digesting = ThreadPoolExecutor(1, thread_name_prefix="flexpar-digest")
    reference = digesting.submit(_reference_digests, model, available if kind == "cpu" else os.cpu_count() or 1)
    digesting.shutdown(wait=False)
    payload = pickle_pieces(job)
    epoch_count = _count_stream_epochs(job, options)
    total_steps = epoch_count.steps if epoch_count else options.steps or job.steps_for_epochs(options.epochs)
    # --resume: devices that outlived the job's driver first (an adoption window), else the newest checkpoint.
    newest = checkpoints.latest_checkpoint(options.checkpoint_dir) if options.resume else None
    if newest is not None:
        note = resume_note(newest, checkpoints.checkpoint_step(newest), total_steps)
        if note and not options.quiet:
            print(f"flexpar: {note}", file=sys.stderr, flush=True)
        _check_resumed_frozen_part(newest, reference.result())
    return CheckedJob(
        context=context,
        kind=kind,
        available=available,
        backend=backend,
        initial=initial,
        max_devices=max_devices,
        model=model,
        eval_keys=tuple(eval_keys),
        reference=reference,
        payload=payload,
        total_steps=total_steps,
        newest=newest,
        epoch_count=epoch_count,
    )


def _count_stream_epochs(job, options: FitOptions) -> Optional[pass_count.EpochCount]:
    """`epochs=` over a stream: its passes counted before the devices start, or with `--resume` taken from
    the run's record where it was counted for this job and dataset (pass_record.py); None otherwise."""
    if options.steps is not None or not job.streaming:
        return None
    recorded = (pass_record.read(checkpoint_folder(options)[0]) or {}) if options.resume else None
    counted = pass_count.count_epochs(job, options.epochs, recorded)
    if not options.quiet:
        print(f"flexpar: {counted.note}", file=sys.stderr, flush=True)
    return counted


def _reference_digests(model, threads: int) -> dict:
    with ThreadPoolExecutor(max(1, min(8, threads))) as pool:
        return frozen.frozen_digests(model, pool.map)


def resume_note(newest: str, step: int, total_steps: int) -> str:
    """What a resume from `newest` (step `step`) to `total_steps` says in one line, or refuses with.

    A checkpoint past the run's last step is refused (the run cannot train
    backwards, and ending with the newer model under an older step count
    would be something other than asked); one at the last step has nothing
    to train, which the run says, then ends at once with the model as it is.
    """
    if step > total_steps:
        raise ValueError(
            f"resume: the newest checkpoint, {newest}, is step {step}, past this run's last step {total_steps}: "
            f"nothing to train; ask for more than {step} steps to train on, or `flexpar export {newest}` for its model"
        )
    if step == total_steps:
        return f"nothing to train: the newest checkpoint, {newest}, is step {step}, this run's last step"
    return ""


def _check_resumed_frozen_part(path: str, reference: dict) -> None:
    """Refuse, before any worker starts, a checkpoint whose frozen part is not the one this factory builds."""
    state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)  # maps: reads only what is used
    recorded = ((state.get("extra") or {}).get("frozen") or {}).get("digests")
    if recorded is None:  # written before frozen digests existed: its frozen tensors were the factory's anyway
        return
    problem = frozen.frozen_problem(reference, recorded, where=f"the checkpoint {path}")
    if problem:
        raise ValueError(f"{problem}; resume with the same model factory and pretrained files")
