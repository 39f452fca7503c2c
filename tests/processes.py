"""Which processes this test session started and left running (conftest's session-end check).

A process is the suite's when its environment carries this session's marker
(SESSION_VARIABLE, set when conftest is imported, before any test starts a
process, so everything the suite starts inherits it: a soak's driver in its own
session, a `python -m flexpar` command, their workers, and those orphaned to
init, which no longer descend from us) or when it descends from this process
(a child started with an environment of its own). Nothing else is: other
people's runs and other pytest sessions (their own marker) are never counted,
so never killed.

Left running means any of the suite's processes except this one and the
helpers of the libraries this process uses, which end with it: its
multiprocessing fork server and resource tracker (the fork server's children,
flexpar's workers, are not helpers), and torch's compile-worker pool.
"""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass
from typing import Optional

SESSION_VARIABLE = "PYTEST_FLEXPAR_SESSION"

# Direct children of this process that end with it (they watch a pipe from it).
_HELPERS = ("from multiprocessing.forkserver import main", "from multiprocessing.resource_tracker import main")
# Direct children that end with this process together with the pools they start.
_HELPER_POOLS = ("torch/_inductor/compile_worker",)


@dataclass(frozen=True)
class Process:
    parent: int
    command: str
    name: str
    session: Optional[str] = None  # SESSION_VARIABLE in its environment; None: absent or unreadable


def mark_this_session() -> str:
    """Set a marker no other session shares; every process started from here on inherits it."""
    os.environ[SESSION_VARIABLE] = f"{os.getpid()}-{secrets.token_hex(8)}"
    return os.environ[SESSION_VARIABLE]


def table() -> dict:
    """{pid: Process} of every live (not zombie) process, from /proc."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as handle:
                stat = handle.read()
            with open(f"/proc/{entry}/cmdline", "rb") as handle:
                command = handle.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()
        if fields[0] != "Z":
            found[int(entry)] = Process(int(fields[1]), command, name, _session_of(int(entry)))
    return found


def _session_of(pid: int) -> Optional[str]:
    prefix = SESSION_VARIABLE.encode() + b"="
    try:
        with open(f"/proc/{pid}/environ", "rb") as handle:
            variables = handle.read().split(b"\0")
    except OSError:  # another user's process, or gone
        return None
    for variable in variables:
        if variable.startswith(prefix):
            return variable[len(prefix) :].decode(errors="replace")
    return None


def strays(processes: dict, me: int, session: str) -> list:
    """(pid, name, command) of the suite's processes in `processes` that are left running.

    `me`: this process's pid; `session`: its marker (mark_this_session).
    """
    helpers = {
        pid
        for pid, process in processes.items()
        if process.parent == me and any(helper in process.command for helper in _HELPERS)
    }
    pools = {
        pid
        for pid, process in processes.items()
        if process.parent == me and any(pool in process.command for pool in _HELPER_POOLS)
    }
    found = []
    for pid, process in processes.items():
        if pid == me or pid in helpers or pid in pools:
            continue
        lineage = _ancestors(processes, pid)
        if pools & set(lineage):
            continue
        if process.session == session or me in lineage:
            found.append((pid, process.name, process.command[:120]))
    return sorted(found)


def _ancestors(processes: dict, pid: int) -> list:
    """`pid`'s parent, its parent, ... as far as `processes` knows (cycles cut)."""
    chain, seen = [], {pid}
    parent = processes[pid].parent
    while parent in processes and parent not in seen:
        chain.append(parent)
        seen.add(parent)
        parent = processes[parent].parent
    if parent not in seen:
        chain.append(parent)
    return chain
