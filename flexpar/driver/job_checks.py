"""The driver's checks of a job, once, before any worker starts: errors are reported here, once.

`pickle_pieces` names a piece that cannot travel to the workers;
`first_batch_check` runs the loss on VW 0 of step 0 (under the job's
autocast where the driver's CPU supports it) and checks `sample_cost` on a
few indices; `check_sharding` refuses an optimizer that cannot be sharded
the way the job asks; `check_checkpoint_folder` takes the folder where the
run's checkpoints go (a lock held until the run ends) and refuses a fresh run
into a folder that holds another run's checkpoints. `job` is a `flexpar.Job`.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import math
import os
import pickle
import socket
import time
from typing import Optional

import torch
from torch import nn

from flexpar import recipes
from flexpar.core import batching
from flexpar.core.shard_state import ELEMENTWISE, UNSHARDABLE
from flexpar.errors import UserCodeError
from flexpar.worker import checkpoints
from flexpar.worker.cost_planner import sample_costs
from flexpar.worker.loader import first_batch
from flexpar.worker.user_code import loss_terms, nonfinite_message


def pickle_pieces(job) -> bytes:
    """The job as bytes for the workers; each piece that cannot travel is named."""
    for name in (
        "model",
        "optimizer",
        "loss",
        "lr_scheduler",
        "collate_fn",
        "dataset",
        "evaluate",
        "eval_dataset",
        "sample_cost",
    ):
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


def first_batch_check(job, model: nn.Module) -> None:
    """Run the loss on virtual worker 0 of step 0 in the driver, to report errors once."""
    batch = first_batch(job)
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
        with torch.no_grad(), precision or contextlib.nullcontext():
            value = loss_terms(job.loss(model, batch), 0, 0).value
    finally:
        model.train(was_training)
    if not math.isfinite(value):
        raise UserCodeError(nonfinite_message(0, 0))
    if job.sample_cost is not None:  # map-style only (Job refuses it with a stream)
        indices = batching.virtual_worker_indices(
            job.seed, 0, 0, len(job.dataset), job.global_batch, job.virtual_workers
        )
        check_sample_cost(job, indices)


def check_sample_cost(job, indices) -> None:
    """Call sample_cost on a few indices (those of VW 0 of step 0, and the dataset's last) in the driver.

    A function that raises or returns a non-number, NaN, an infinity or a
    negative number is refused here, once, naming the index, before any
    worker starts; the workers check every value they use too.
    """
    sample_costs(job, list(indices)[:8] + [len(job.dataset) - 1])


def check_sharding(job, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """With shard_optimizer: an optimizer whose step can be split the way the job asks, on the model's parameters.

    "elements" cuts a parameter's state anywhere, which only an optimizer that
    updates each element on its own can step: the element-wise classes of
    torch.optim (flexpar/core/shard_state.py's ELEMENTWISE, by exact class, so a
    subclass that changes the update is not taken on trust). "parameters" keeps
    each parameter's state whole: any optimizer whose step treats each parameter
    on its own. LBFGS (a line search over all parameters at once) neither.
    """
    if not job.shard_optimizer:
        return
    kind = type(optimizer)
    name = kind.__name__
    known = kind.__module__.startswith("torch.optim") and name in ELEMENTWISE
    if name in UNSHARDABLE and kind.__module__.startswith("torch.optim"):
        raise UserCodeError(
            f"shard_optimizer={job.shard_optimizer!r}: torch.optim.{name}'s step is a line search over all "
            "parameters at once, so its state cannot be split across devices; use shard_optimizer=False"
        )
    if job.shard_optimizer != "parameters" and not known:
        raise UserCodeError(
            f"shard_optimizer=True splits parameters into element ranges, which only an optimizer that updates "
            f"each element on its own can step; {kind.__module__}.{name} is not one flexpar knows (it knows "
            f'{", ".join(ELEMENTWISE)} of torch.optim). Use shard_optimizer="parameters" (each parameter\'s '
            "state whole, on its devices) if its step treats each parameter on its own, or shard_optimizer=False"
        )
    own = {id(parameter) for parameter in model.parameters()}
    if any(id(p) not in own for group in optimizer.param_groups for p in group["params"]):
        raise UserCodeError(
            "shard_optimizer: the optimizer steps tensors that are not the model's parameters; build it on "
            "model.parameters() (or a subset of them)"
        )


LOCK_NAME = ".flexpar.lock"


class FolderLock:
    """An exclusive `flock` on `LOCK_NAME` in a checkpoint folder, held by the driver for its run.

    The file names its holder (pid, host, when), which a refusal quotes, and
    is removed when the run ends. The kernel drops the lock when its holder is
    gone (exit, crash, SIGKILL), so a file left by a crash never blocks a
    restarted driver. The
    descriptor is not inherited by the processes the driver starts (Python's
    descriptors are close-on-exec, and the fork server is a fresh process), so
    devices that outlive a lost driver do not keep the folder from its `--resume`.
    """

    def __init__(self, descriptor: int, path: str):
        self.descriptor, self.path = descriptor, path

    def release(self) -> None:
        if self.descriptor >= 0:
            with contextlib.suppress(OSError):
                os.unlink(self.path)  # still held: a run that opened this file finds it gone (lock_folder)
            os.close(self.descriptor)  # closing the only descriptor of the open file drops the flock
            self.descriptor = -1

    def __enter__(self) -> "FolderLock":
        return self

    def __exit__(self, *exception) -> None:
        self.release()

    def __del__(self) -> None:
        self.release()


def lock_folder(folder: str, where: str) -> FolderLock:
    """Take `folder`'s lock (made if missing), or raise naming the run that holds it."""
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, LOCK_NAME)
    while True:
        descriptor = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if _same_file(descriptor, path):
                break
            # Its holder ended and removed the file between our open and our lock: take the new one.
            os.close(descriptor)
        except BlockingIOError:
            holder = _holder(descriptor)
            os.close(descriptor)
            raise ValueError(
                f"{where} is in use by another flexpar run{holder}: two runs writing the same checkpoint folder "
                "would overwrite each other's steps; wait for it to end, or give this run another folder"
            ) from None
        except BaseException:
            os.close(descriptor)
            raise
    record = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}).encode()
    os.ftruncate(descriptor, 0)
    os.pwrite(descriptor, record + b"\n", 0)
    return FolderLock(descriptor, path)


def _same_file(descriptor: int, path: str) -> bool:
    try:
        named = os.stat(path)
    except FileNotFoundError:
        return False
    opened = os.fstat(descriptor)
    return (named.st_dev, named.st_ino) == (opened.st_dev, opened.st_ino)


def _holder(descriptor: int) -> str:
    """The holder the lock file names, as " (pid 123 on host h, since 17:02:11)"; "" if unreadable.

    The holder writes its record just after it takes the lock, so a run refused
    in between finds the file empty (or truncated): it reads again for up to a
    second before it gives up on naming the holder.
    """
    for _ in range(50):
        try:
            record = json.loads(os.pread(descriptor, 4096, 0) or b"null")
            since = time.strftime("%H:%M:%S", time.localtime(record["since"]))
            return f" (pid {record['pid']} on host {record['host']}, since {since})"
        except OSError:
            return ""
        except (ValueError, TypeError, KeyError):
            time.sleep(0.02)
    return ""


def checkpoint_folder(options) -> tuple:
    """(folder, how the refusals name it, the resume flags to offer): where this run's checkpoints go.

    `checkpoint_dir`, or without one the run directory of `--metrics`, where a
    driver-lost rescue goes; (None, "", "") for a fresh run directory.
    """
    if options.checkpoint_dir:
        return (
            options.checkpoint_dir,
            f"checkpoint_dir {options.checkpoint_dir}",
            "--resume (fit(resume=True))",
        )
    if options.metrics:
        folder = os.path.dirname(os.path.abspath(options.metrics))
        return (
            folder,
            f"the run directory {folder} (of --metrics {options.metrics}, where a driver-lost rescue goes)",
            f"--resume --checkpoint-dir {folder} (fit(resume=True, checkpoint_dir=...))",
        )
    return None, "", ""


def check_checkpoint_folder(options) -> Optional[FolderLock]:
    """Take the folder where this run's checkpoints go; a run that does not resume starts with none there.

    That is `checkpoint_dir`, or without one the run directory, where the
    devices write the last step should the driver be lost (it is a fresh
    folder unless `metrics=` names one). Another run's checkpoints there
    would lie beside this run's, same names, same steps: `--resume` and
    `export` would take whichever step is newest, a write would replace the
    other run's file of its step, and keeping the newest K would delete this
    run's own. So it is refused here, before any worker starts, naming the
    two ways on (only one, another folder, where the folder holds unfinished
    checkpoints alone, which `--resume` cannot take). `options` is a `FitOptions`.

    The folder is locked first (`lock_folder`), and the lock is returned for
    the caller to hold until the run ends: two runs started at the same
    instant into one empty folder would otherwise both find it empty. A run
    that resumes takes the lock too (a live run's folder is not resumed
    under it). None for a fresh run directory, which no other run names.
    """
    folder, where, resume = checkpoint_folder(options)
    if folder is None:
        return None
    lock = lock_folder(folder, where)
    try:
        if not options.resume:
            _refuse_other_runs_checkpoints(folder, where, resume)
    except BaseException:
        lock.release()
        raise
    return lock


def _refuse_other_runs_checkpoints(folder: str, where: str, resume: str) -> None:
    steps = checkpoints.checkpoint_steps(folder)
    if not steps:
        return
    if checkpoints.latest_checkpoint(folder) is None:
        # Only unfinished writes (a sharded checkpoint's parts, or a step-N.pt whose parts never all
        # came): --resume would find nothing to continue from, so it is not offered as the way on.
        raise ValueError(
            f"{where} holds another run's unfinished checkpoints ({_step_list(steps)}), which --resume cannot "
            "continue from: remove its step-* files and folders, or give this run another folder"
        )
    raise ValueError(
        f"{where} holds another run's checkpoints ({_step_list(steps)}): continue that run with "
        f"{resume}, or give this run another folder"
    )


def _step_list(steps: list) -> str:
    """ "step 40", "steps 20, 40, 60", or for many "steps 10, 20, 30, ..., 990, 1000; 100 in all"."""
    if len(steps) == 1:
        return f"step {steps[0]}"
    if len(steps) <= 6:
        return "steps " + ", ".join(map(str, steps))
    shown = [*map(str, steps[:3]), "...", *map(str, steps[-2:])]
    return "steps " + ", ".join(shown) + f"; {len(steps)} in all"
