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

import contextlib
import os
import re
import shutil
import threading
from typing import Optional

import torch

from flexpar.comm import state_transfer as training_state
from flexpar.core.shard_state import join_states, shaped, slice_state

_CHECKPOINT = re.compile(r"^step-(\d+)\.pt$")
_FOLDER = re.compile(r"^step-(\d+)\.optimizer$")
_PART = re.compile(r"^part-(\d+)-of-(\d+)\.pt$")


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
    return _write_atomically(checkpoint_path(directory, step), lambda handle: handle.write(state_bytes))


def _write_atomically(path: str, fill) -> str:
    """`fill(handle)` writes a temporary file of this writer's own, renamed to `path` once whole."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    temporary = temporary_path(path)
    with open(temporary, "wb") as handle:
        fill(handle)
    os.replace(temporary, path)
    return path


def parts_folder(path: str) -> str:
    """Where a sharded job's checkpoint keeps its optimizer-state parts: step-N.pt -> step-N.optimizer/."""
    return path[: -len(".pt")] + ".optimizer"


def part_path(directory: str, step: int, part: int, parts: int) -> str:
    """Part `part` of `parts` (one per chunk of the partition; written by its primary)."""
    return os.path.join(parts_folder(checkpoint_path(directory, step)), f"part-{part}-of-{parts}.pt")


def complete_parts(path: str) -> Optional[list]:
    """The part files of checkpoint `path` when they are all there ([] for an unsharded one), else None.

    A sharded checkpoint is complete when `step-N.pt` and all K parts of the
    partition it records exist (each written by its own device: one may be
    missing while it is still written, or if its writer died). Only that K
    counts: a step written again with another part count (a rollback after a
    failure, a resume on another device count) may leave the earlier
    partition's parts beside it until its writer removes them
    (`remove_other_partitions`), and they must never be read with the new file.
    """
    if not os.path.isfile(path):
        return None
    folder = parts_folder(path)
    if not os.path.isdir(folder):
        return []  # an unsharded job's (a sharded job writes its part before step-N.pt)
    by_count: dict = {}
    for name in os.listdir(folder):
        match = _PART.match(name)
        if match:
            by_count.setdefault(int(match.group(2)), set()).add(int(match.group(1)))
    complete = [count for count, found in sorted(by_count.items()) if found >= set(range(count))]
    if not complete:
        return None
    recorded = recorded_parts(path)
    if recorded is not None:
        complete = [count for count in complete if count == recorded]
    elif len(complete) > 1:
        return None  # a checkpoint that does not say which (older than the record): neither set is sure
    if not complete:
        return None
    return [os.path.join(folder, f"part-{index}-of-{complete[0]}.pt") for index in range(complete[0])]


def recorded_parts(path: str) -> Optional[int]:
    """The part count a sharded checkpoint's `step-N.pt` records (None: unreadable, or written before
    it was recorded). Memory-mapped: only the file's index is read, not its tensors."""
    try:
        common = _load(path)
    except Exception:  # noqa: BLE001  (a file being replaced, or not a checkpoint: no count to go by)
        return None
    optimizer = common.get("optimizer") if isinstance(common, dict) else None
    sharded = optimizer.get("sharded") if isinstance(optimizer, dict) else None
    parts = sharded.get("parts") if isinstance(sharded, dict) else None
    return parts if isinstance(parts, int) else None


def remove_other_partitions(directory: str, step: int, parts: int) -> None:
    """Remove the parts of step `step` that belong to a partition into other than `parts` parts."""
    folder = parts_folder(checkpoint_path(directory, step))
    for name in os.listdir(folder) if os.path.isdir(folder) else ():
        match = _PART.match(name)
        if match and int(match.group(2)) != parts:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(folder, name))


def checkpoint_steps(directory: str) -> list:
    """The steps with a checkpoint file or a parts folder in `directory`, ascending ([] if it does not exist)."""
    if not os.path.isdir(directory):
        return []
    steps = set()
    for name in os.listdir(directory):
        match = _CHECKPOINT.match(name) or _FOLDER.match(name)
        if match:
            steps.add(int(match.group(1)))
    return sorted(steps)


def latest_checkpoint(directory: str) -> Optional[str]:
    """The newest complete checkpoint of `directory` (see `complete_parts`), or None."""
    if not os.path.isdir(directory):
        return None
    for step in reversed(checkpoint_steps(directory)):
        path = checkpoint_path(directory, step)
        if complete_parts(path) is not None:
            return path
    return None


def read_checkpoint(path: str, device, with_optimizer: bool = True) -> dict:
    """A checkpoint's state; a sharded job's has its optimizer state assembled into torch.optim's format.

    `with_optimizer=False` (export): the parts are not read.
    """
    with open(path, "rb") as handle:
        state = training_state.from_bytes(handle.read(), device)
    optimizer = state.get("optimizer")
    if with_optimizer and isinstance(optimizer, dict) and optimizer.get("sharded"):
        state["optimizer"] = CheckpointReader(path).plain_optimizer_state(device)
    return state


class CheckpointReader:
    """Reads any range of any parameter's optimizer state from a checkpoint, sharded or not.

    The files are opened with `mmap=True`: a device reads the pages of its own
    ranges only, so a sharded job resumes on any device count, each device
    reading what its new chunks need, and an unsharded job's checkpoint
    resumes sharded the same way.
    """

    def __init__(self, path: str):
        parts = complete_parts(path)
        if parts is None:
            raise ValueError(f"{path} is not a complete checkpoint (a part of its optimizer state is missing)")
        self.common = _load(path)
        optimizer = self.common["optimizer"]
        self.sharded = bool(optimizer.get("sharded"))
        self.segments: dict = {}  # parameter number -> [(start, stop, state)], ascending
        for part in parts if self.sharded else ():
            for segment in _load(part)["segments"]:
                self.segments.setdefault(segment["parameter"], []).append(
                    (segment["start"], segment["stop"], segment["state"])
                )
        for found in self.segments.values():
            found.sort(key=lambda item: item[0])

    def plain_param_groups_and_replicated(self) -> dict:
        """{"param_groups", "state"}: every parameter's state of an unsharded checkpoint, the
        replicated parameters' of a sharded one."""
        optimizer = self.common["optimizer"]
        return {"param_groups": optimizer["param_groups"], "state": optimizer.get("state", {})}

    def segment_state(self, number: int, start: int, stop: int, numel: int) -> dict:
        """The optimizer state of elements [start, stop) of parameter `number` (torch.optim's numbering)."""
        if not self.sharded:
            whole = self.common["optimizer"]["state"].get(number, {})
            return slice_state(whole, start, stop, numel) if whole else {}
        parts, lengths, cursor = [], [], start
        for low, high, state in self.segments.get(number, ()):
            if high <= cursor or low >= stop:
                continue
            if low > cursor:
                break
            end = min(stop, high)
            parts.append(slice_state(state, cursor - low, end - low, high - low))
            lengths.append(end - cursor)
            cursor = end
        if cursor < stop:
            raise ValueError(
                f"the checkpoint holds no optimizer state for elements {cursor}-{stop} of parameter {number}"
            )
        return join_states(parts, lengths)

    def plain_optimizer_state(self, device) -> dict:
        """The whole optimizer state in torch.optim's format (an unsharded job resuming a sharded one)."""
        optimizer = self.common["optimizer"]
        state = dict(optimizer.get("state", {}))
        shapes = optimizer["sharded"]["shapes"]
        for number, shape in shapes.items():
            size = torch.Size(shape)
            joined = self.segment_state(int(number), 0, size.numel(), size.numel())
            if joined:
                state[int(number)] = shaped(joined, size)
        moved = {number: {key: _on(value, device) for key, value in entry.items()} for number, entry in state.items()}
        return {"state": moved, "param_groups": optimizer["param_groups"]}


def _load(path: str):
    return torch.load(path, map_location="cpu", weights_only=True, mmap=True)


def _on(value, device):
    return value.to(device) if isinstance(value, torch.Tensor) else value


def cpu_copy(state):
    """`state` with every tensor copied to fresh CPU memory (containers rebuilt, the rest shared)."""

    def copy(item):
        if isinstance(item, torch.Tensor):
            return item.detach().to("cpu", copy=True)
        return training_state.DESCEND

    return training_state.rebuild(state, copy)


def write(directory: str, step: int, state) -> str:
    """Write `state` as the checkpoint of `step`, atomically (temporary file, then rename)."""
    return write_file(checkpoint_path(directory, step), state)


def write_file(path: str, state) -> str:
    """torch.save `state` to `path` atomically (a temporary file of this writer's own, then rename)."""
    return _write_atomically(path, lambda handle: torch.save(state, handle))


def prune(directory: str, keep: Optional[int]) -> list:
    """Delete the checkpoints older than the newest `keep` complete ones; returns what went.

    A checkpoint still being written (newer than those kept, some part
    missing) is never deleted; a sharded one goes with its parts folder.
    """
    if not keep or not os.path.isdir(directory):
        return []
    steps = checkpoint_steps(directory)
    complete = [step for step in steps if complete_parts(checkpoint_path(directory, step)) is not None]
    if len(complete) <= keep:
        return []
    oldest_kept = complete[-keep]
    removed = []
    for step in steps:
        if step >= oldest_kept:
            break
        path = checkpoint_path(directory, step)
        try:
            os.remove(path)
            removed.append(path)
        except FileNotFoundError:
            pass
        if os.path.isdir(parts_folder(path)):
            shutil.rmtree(parts_folder(path), ignore_errors=True)
            removed.append(parts_folder(path))
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
        """Start writing `state` (already a private copy: `cpu_copy`) as step `step`; returns its path.

        An unsharded checkpoint: a parts folder of the same step (a sharded
        checkpoint of this run's past that was never completed) goes once the
        file is in place, so that the new file is read whole, never with stale parts.
        """
        path = checkpoint_path(directory, step)
        return self.submit_files(directory, step, [(path, state)], stale=parts_folder(path))

    def submit_files(
        self,
        directory: str,
        step: int,
        files: list,
        stale: Optional[str] = None,
        other_partitions: Optional[int] = None,
    ) -> str:
        """Start writing [(path, state)] in order (private copies), the checkpoint of `step`; returns its path.

        A sharded job's device writes its part first and (rank 0) `step-N.pt`
        last, so that `step-N.pt` implies its parts folder exists. An existing
        file is replaced (atomically), never kept: a write is never skipped.
        `stale`: a folder removed once the files are written. `other_partitions`: a sharded
        `step-N.pt`'s part count; parts of this step into another count go once it is written.
        """
        self.wait()
        path = checkpoint_path(directory, step)
        self.pending = path

        def run():
            _lowest_priority()
            try:
                for file_path, state in files:
                    write_file(file_path, state)
                if stale and os.path.isdir(stale):
                    shutil.rmtree(stale)
                if other_partitions is not None:
                    remove_other_partitions(directory, step, other_partitions)
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
