"""A restarted driver's side of re-adoption: its adoption window, and this host's devices it did not start.

A driver started with `--resume` opens an adoption window (flexpar/core/adoption.py
decides; the coordinator turns the devices' reports into events) before it
starts anything: `run_window` steps the coordinator until the window has
closed. Devices this host's earlier driver started are not this process's
children: `AdoptedProcess` stands in for their `multiprocessing.Process`, by
pid (with its start time, so a reused pid is never taken for it).
"""

from __future__ import annotations

import dataclasses
import os
import signal
import time
from typing import Optional

from flexpar.comm.waiting import process_start
from flexpar.core import adoption, membership
from flexpar.errors import TrainingError


def open_window(
    state: membership.Membership, checkpoint: Optional[str], checkpoint_step: int, clock=time.monotonic
) -> membership.Membership:
    """`state` with an adoption window open from now (the newest checkpoint is read only if newer)."""
    window = adoption.Adoption(
        deadline=clock() + adoption.ADOPTION_WINDOW_S, checkpoint_step=checkpoint_step, checkpoint_path=checkpoint or ""
    )
    return dataclasses.replace(state, adoption=window)


def run_window(coordinator, waker, poll_s: float = 0.05) -> None:
    """Step the coordinator until the adoption window has closed (TrainingError if a device of another
    job made this driver decline: the devices keep waiting for their own)."""
    while coordinator.state.adoption is not None and coordinator.declined is None:
        coordinator.step()
        waker.woken.wait(poll_s)
        waker.woken.clear()
    if coordinator.declined is not None:
        raise TrainingError(coordinator.declined)


def adopted_summary(coordinator) -> str:
    """The banner's line about the re-adopted job (from the generation the window published)."""
    publish = next(action for action in reversed(coordinator.published) if action.adopted is not None)
    note = publish.adopted
    back = [d for d in publish.members if d not in publish.joined]
    text = (
        f"re-adopted {len(back)} device{'s' if len(back) != 1 else ''} ({', '.join(back)}) holding step "
        f"{note.step} from generation {note.from_generation}; "
        + (f"rank 0 reads {publish.restore}, which is newer" if publish.restore else "no checkpoint read")
    )
    if note.not_back:
        text += f"; not back: {', '.join(note.not_back)}"
    if publish.joined:
        text += f"; joining with them: {', '.join(publish.joined)}"
    spawned = [d for d in coordinator.state.starting if d.startswith("local-") and d not in coordinator.reports]
    if spawned:
        text += f"; starting {', '.join(spawned)} in their place"
    return text


class AdoptedProcess:
    """A worker process of this host that an earlier driver started, now watched and stopped by pid.

    The part of `multiprocessing.Process` that `LocalDevices` uses: `pid`,
    `is_alive`, `kill`, `join`, `exitcode` (always None: only its parent,
    the old fork server, learns it).
    """

    def __init__(self, pid: int):
        self.pid = pid
        self.exitcode = None
        self._started = process_start(pid)

    def is_alive(self) -> bool:
        return self._started is not None and process_start(self.pid) == self._started

    def kill(self) -> None:
        if self.is_alive():
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def join(self, timeout: Optional[float] = None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.is_alive() and (deadline is None or time.monotonic() < deadline):
            time.sleep(0.05)
