"""A device whose driver is gone (`Phase.ORPHANED`): it keeps its state and waits for a restarted one.

The members stopped after the step in flight (committed together while the
collectives still worked, or broken off when they failed too). Each device
writes the last committed step as before (so nothing is lost should no driver
come back, or the devices die meanwhile), says so once, and waits up to
`driver_grace_s` for a driver at the same address. A driver restarted with
`--resume` re-adopts it: the device reports what it holds (flexpar/core/adoption.py's
`DeviceReport`), and the restarted driver's first generation, numbered above
every one any device saw, holds it; `Boundaries.enter` then brings every member to
the latest committed step, in memory. Without one, it exits as before, naming
the checkpoint and the resume command. A device never trains while no driver
is there: it trains again only in a generation a driver published.

`Worker._orphaned` (flexpar/worker/lifecycle.py) puts the device's state in
order (the stream and the step in flight dropped, the rescue checkpoint
written); `wait_for_a_driver`, here, waits and talks to the driver. It holds
no state of its own: what it learns (the new driver's salt and settings) it
returns to the worker.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from flexpar.comm import waiting
from flexpar.comm.protocol import get_json
from flexpar.core import resume_words
from flexpar.worker.device_link import DriverLost


def wait_for_a_driver(
    link,
    args,
    settings,
    path: str,
    committed: int,
    generation: int,
    seen: int,
    lost_at: float,
    report: Callable,
    say: Callable,
) -> tuple:
    """Wait for a restarted driver; returns (generation, record, salt, settings) of the one that re-adopted
    this device: the generation it is let in to, and the driver's salt and run settings (a dict).

    `path`: where the rescue checkpoint of committed step `committed` is ("" if this device held
    no committed state); `generation`: the last it trained in; `report(salt)`: what this device
    tells a driver (core.adoption.DeviceReport's fields). Raises DriverLost (the process ends with
    exit code 4, or 0 when let go by SIGTERM) when none comes within the grace, or the one that
    answers does not re-adopt (started without --resume); Evicted when it refuses this device (a
    device of an older generation: fenced off).
    """
    grace = settings.driver_grace_s
    if grace <= 0:
        why = "the job's driver is gone (its store stopped answering)"
        raise DriverLost(_gone(path, why, committed, settings, say))
    where = address(settings, args)
    holds = bool(path)
    if holds:
        say(
            f"the job's driver is gone; the last committed step, {committed}, is in {path}. "
            f"Waiting up to {grace:g} s for a driver at {where} to re-adopt this device; restart it with: "
            f"{resume_command(settings)}"
        )
    else:
        say(
            f"the job's driver is gone; waiting up to {grace:g} s for a driver at {where} "
            "(this device holds no committed state yet)"
        )
    note = {"device_id": args.device_id, "address": where, "since": lost_at, "until": lost_at + grace}
    resume = resume_command(settings) if holds else ""  # `flexpar status` repeats it during the gap
    waiting.write(args.port, dict(note, step=committed, generation=generation, resume=resume))
    try:
        return _await(link, args, settings, path, committed, seen, report, say)
    finally:
        waiting.remove(args.port, args.device_id)


def _await(link, args, settings, path: str, committed: int, seen: int, report: Callable, say: Callable) -> tuple:
    while True:
        driver = link.await_driver()
        if driver is None:
            if link.leave_requested_at is not None:
                why = "asked to stop (SIGTERM) while it waited for a driver"
                raise DriverLost(_gone(path, why, committed, settings, say), let_go=True)
            why = (
                f"the job's driver is gone and none came back to {address(settings, args)} within "
                f"{settings.driver_grace_s:g} s"
            )
            raise DriverLost(_gone(path, why, committed, settings, say))
        if not driver.get("adopting"):
            why = (
                f"the job's driver is gone, and the driver now at {address(settings, args)} was started without "
                "--resume: it does not re-adopt this device"
            )
            raise DriverLost(_gone(path, why, committed, settings, say))
        try:
            link.rejoin()
            salt = link.store.get("job/salt").decode()
            link.send("adopt", **report(salt))
            # Joining: a late member is let in at a later boundary; a refused one is Evicted here.
            generation, record = link.wait_for_generation(seen, joining=True)
            new_settings = get_json(link.store, "job/settings")
        except (DriverLost, RuntimeError):
            continue  # that driver went again before it re-adopted this device: wait for the next
        return generation, record, salt, new_settings


def _gone(path: str, why: str, committed: int, settings, say: Callable) -> str:
    """The last line of a device whose driver did not come back: where the state is, how to resume."""
    if not path:
        text = f"{why}; this device held no committed state"
    else:
        text = f"{why}; the last committed step, {committed}, is in {path}. Resume with: {resume_command(settings)}"
    say(text)
    return text


def address(settings, args) -> str:
    """Where the job's driver listens (HOST:PORT, as this device reaches it)."""
    return settings.address or f"{args.host}:{args.port}"


def resume_command(settings) -> str:
    """The command that resumes this job (the driver's, with its pins; flexpar.driver.launch.resume_command)."""
    directory = settings.checkpoint_dir or settings.rescue_dir
    return settings.resume_command or f"flexpar run --resume --checkpoint-dir {directory} {settings.script or 'SCRIPT'}"


def as_it_is(settings, members: tuple):
    """`settings` whose resume command describes the job as it is when the driver is lost: where the
    command names a device count (the script's own `--devices N`, kept after `--`), flexpar's
    `--devices` with this host's members now, which overrides it (flexpar/core/resume_words.py);
    otherwise the count stays out and re-adoption decides it."""
    command = resume_words.with_device_count(resume_command(settings), resume_words.local_count(members), always=False)
    return dataclasses.replace(settings, resume_command=command)
