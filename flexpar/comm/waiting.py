"""Reports of devices waiting for a restarted driver, in files on their host, for `flexpar status`.

A device that lost its driver (`Phase.ORPHANED`, flexpar/worker/orphan.py)
writes one small JSON file under a folder of its own user on its host, named
by the job's port and its device id, and removes it when a restarted driver
re-adopts it or it exits. While nothing answers at the job's address, `flexpar
status` reads the files of that port: those of live processes still within
their grace are the devices waiting. The store cannot carry this: it was the
driver's, and it is gone. Only devices of the host where `flexpar status`
runs are seen (documented in docs/guide.md, "Losing the driver").
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from typing import Optional

from flexpar.core.membership.state import id_order


def folder() -> str:
    """Where this user's waiting devices write: $XDG_RUNTIME_DIR/flexpar/waiting, else a private temp folder."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    base = (
        os.path.join(runtime, "flexpar") if runtime else os.path.join(tempfile.gettempdir(), f"flexpar-{os.getuid()}")
    )
    path = os.path.join(base, "waiting")
    os.makedirs(path, mode=0o700, exist_ok=True)
    return path


def process_start(pid: int) -> Optional[int]:
    """The process's start time (clock ticks since boot, field 22 of /proc/PID/stat); None if gone or a zombie.

    A pid with its start time names one process for good: a pid reused by
    another process has another start time.
    """
    try:
        with open(f"/proc/{pid}/stat") as handle:
            fields = handle.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] == "Z" else int(fields[19])


def _path(port: int, device_id: str, base: Optional[str]) -> str:
    directory = os.path.join(base or folder(), str(port))
    os.makedirs(directory, mode=0o700, exist_ok=True)
    return os.path.join(directory, f"{device_id}.json")


def write(port: int, report: dict, base: Optional[str] = None) -> str:
    """Write this process's report atomically; `report` holds device_id, address, since, until (wall
    clock: when it noticed the loss, when its grace ends), step (its last committed), generation and
    resume (the resume command the device printed, "" when it holds no committed step)."""
    report = dict(report, pid=os.getpid(), process_start=process_start(os.getpid()))
    path = _path(port, report["device_id"], base)
    temporary = f"{path}.{os.getpid()}.tmp"
    with open(temporary, "w", encoding="utf-8") as handle:
        json.dump(report, handle)
    os.replace(temporary, path)
    return path


def remove(port: int, device_id: str, base: Optional[str] = None) -> None:
    try:
        os.remove(_path(port, device_id, base))
    except OSError:
        pass


def read(port: int, now: Optional[float] = None, base: Optional[str] = None) -> list:
    """The reports of devices still waiting at `port` on this host, in id order; files of ended processes
    are removed."""
    now = time.time() if now is None else now
    directory = os.path.join(base or folder(), str(port))
    found = []
    for name in sorted(os.listdir(directory)) if os.path.isdir(directory) else ():
        if not name.endswith(".json"):
            continue
        try:
            with open(os.path.join(directory, name), encoding="utf-8") as handle:
                report = json.load(handle)
        except (OSError, ValueError):
            continue
        alive = process_start(report.get("pid", -1)) == report.get("process_start")
        if alive and now < report.get("until", 0):
            found.append(report)
        elif not alive:
            remove(port, report.get("device_id", name[: -len(".json")]), base)
    return sorted(found, key=lambda report: id_order(report["device_id"]))


def describe(address: str, reports: list, now: float) -> str:
    """One line: no driver; N devices waiting since T at ADDRESS (up to S s more): who, holding which step,
    and the resume command the devices printed (the job's own, with --resume), which re-adopts them."""
    since = time.strftime("%H:%M:%S", time.localtime(min(r["since"] for r in reports)))
    left = max(0.0, max(r["until"] for r in reports) - now)
    who = ", ".join(
        f"{r['device_id']} (step {r['step']})" if r.get("step", -1) >= 0 else r["device_id"] for r in reports
    )
    count = f"{len(reports)} device{'s' if len(reports) != 1 else ''}"
    command = next((r["resume"] for r in reports if r.get("resume")), "")
    how = (
        f"restart the driver to re-adopt them: {command}"
        if command
        else ("restart the driver with the job's resume command (--resume) to re-adopt them")
    )
    return f"no driver; {count} waiting since {since} at {address} (up to {left:.0f} s more): {who}; {how}"
