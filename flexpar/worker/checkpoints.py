"""Checkpoint files: their names, atomic writes, the newest one; written off the step loop, with retention.

The step loop pays only for a copy of the training state in memory
(`cpu_copy`): the copy is taken between two steps, so it is the committed
state and later steps cannot change it. A background thread then writes it
(`torch.save` to a temporary file, then an atomic rename, as
`write_checkpoint` does) and deletes all but the newest `keep`
checkpoints. One write is in flight at a time: a new one waits for the
previous, and a worker waits for the last before it exits, so the file a job
reports always exists.
"""

from __future__ import annotations

import os
import re
import threading
from typing import Optional

import torch

from flexpar.comm import state_transfer as training_state

_CHECKPOINT = re.compile(r"^step-(\d+)\.pt$")


def checkpoint_path(directory: str, step: int) -> str:
    return os.path.join(directory, f"step-{step:08d}.pt")


def checkpoint_step(path: str) -> int:
    """The step a checkpoint file holds, from its name (step-00000123.pt -> 123)."""
    match = _CHECKPOINT.match(os.path.basename(path))
    if match is None:
        raise ValueError(f"{path} is not a flexpar checkpoint name (step-NNNNNNNN.pt)")
    return int(match.group(1))


def temporary_path(path: str) -> str:
    """Where a writer of `path` writes before its atomic rename: its own name, so that two processes
    writing the same step to a shared folder (survivors of a lost driver) never mix their bytes."""
    return f"{path}.{os.getpid()}-{threading.get_ident()}.tmp"


def write_checkpoint(directory: str, state_bytes: bytes, step: int) -> str:
    """Write atomically (temporary file, then rename): a crash never leaves half a file."""
    os.makedirs(directory, exist_ok=True)
    path = checkpoint_path(directory, step)
    temporary = temporary_path(path)
    with open(temporary, "wb") as handle:
        handle.write(state_bytes)
    os.replace(temporary, path)
    return path


def latest_checkpoint(directory: str) -> Optional[str]:
    if not os.path.isdir(directory):
        return None
    found = sorted((int(match.group(1)), name) for name in os.listdir(directory) if (match := _CHECKPOINT.match(name)))
    return os.path.join(directory, found[-1][1]) if found else None


def read_checkpoint(path: str, device) -> dict:
    with open(path, "rb") as handle:
        return training_state.from_bytes(handle.read(), device)


def cpu_copy(state):
    """`state` with every tensor copied to fresh CPU memory (containers rebuilt, the rest shared)."""

    def copy(item):
        if isinstance(item, torch.Tensor):
            return item.detach().to("cpu", copy=True)
        return training_state.DESCEND

    return training_state.rebuild(state, copy)


def write(directory: str, step: int, state) -> str:
    """Write `state` as the checkpoint of `step`, atomically (temporary file, then rename)."""
    os.makedirs(directory, exist_ok=True)
    path = checkpoint_path(directory, step)
    temporary = temporary_path(path)
    with open(temporary, "wb") as handle:
        torch.save(state, handle)
    os.replace(temporary, path)
    return path


def prune(directory: str, keep: Optional[int]) -> list:
    """Delete all but the newest `keep` checkpoints (step-*.pt) of `directory`; returns what went."""
    if not keep or not os.path.isdir(directory):
        return []
    found = sorted((checkpoint_step(name), name) for name in os.listdir(directory) if _CHECKPOINT.match(name))
    removed = []
    for _, name in found[: max(0, len(found) - keep)]:
        path = os.path.join(directory, name)
        try:
            os.remove(path)
            removed.append(path)
        except FileNotFoundError:
            pass
    return removed


def _lowest_priority() -> None:
    """Run this thread at the lowest CPU priority (Linux: a thread's own nice value).

    The write competes with training for the same cores; at normal priority it
    took one core from the step's intra-op threads for the whole write, which
    stretched the next step by several times the write (measured: a 0.11 s
    torch.save of 302 MB cost the next step 0.75 s on 2 cores). At nice 19 it
    runs in what the training threads leave.
    """
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (AttributeError, OSError):  # not Linux, or refused: normal priority
        pass


class CheckpointWriter:
    """Writes checkpoints on a background thread, one at a time.

    `submit` (in the step loop) waits for the write in flight, if any, then
    starts a thread for this one and returns at once; `wait` returns when no
    write is in flight. A write that failed raises its error at the next
    `submit` or `wait`, in the step loop, where it stops the job with the
    reason.
    """

    def __init__(self, keep: Optional[int] = None):
        self.keep = keep
        self._thread: Optional[threading.Thread] = None
        self._error: Optional[BaseException] = None
        self.pending: Optional[str] = None  # the path being written

    def submit(self, directory: str, step: int, state) -> str:
        """Start writing `state` (already a private copy: `cpu_copy`) as step `step`; returns its path."""
        self.wait()
        path = checkpoint_path(directory, step)
        self.pending = path

        def run():
            _lowest_priority()
            try:
                write(directory, step, state)
                prune(directory, self.keep)
            except BaseException as error:  # reported in the step loop, at the next submit or wait
                self._error = error

        self._thread = threading.Thread(target=run, name="flexpar-checkpoint", daemon=True)
        self._thread.start()
        return path

    def wait(self) -> None:
        """Return when no write is in flight; raise the error of one that failed."""
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join()
        self.pending = None
        error, self._error = self._error, None
        if error is not None:
            raise RuntimeError(f"writing a checkpoint failed: {type(error).__name__}: {error}") from error

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()
