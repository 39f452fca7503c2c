"""The processes a benchmark starts: ports and cores for them, and their end, always.

A benchmark starts many processes: flexpar's workers, DDP ranks, torchrun
agents, probe processes, soak jobs in sessions of their own. Whatever ends a
benchmark (its last line, an error, Ctrl-C, SIGTERM), none of them may be
left running on a machine others share: `started` ends multiprocessing
children, `run_in_own_group` a command and everything it started, and
`end_descendants` (which `harness.run` calls last) whatever is still left.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
from typing import Iterator, List, Optional, Sequence, Tuple


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free when asked (another process may take it later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def cpu_count() -> int:
    """The number of cores this process may run on (at least 1)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


# ---------------------------------------------------------------- the process tree, from /proc


def children(pid: int) -> List[int]:
    """Child pids of `pid`, from /proc/PID/task/TID/children (one small read per thread).

    Reading only this process's own tree keeps a watcher cheap: it shares the
    machine with the processes it measures.
    """
    found: List[int] = []
    try:
        threads = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return found
    for thread in threads:
        try:
            with open(f"/proc/{pid}/task/{thread}/children") as handle:
                found += [int(child) for child in handle.read().split()]
        except (OSError, ValueError):
            continue
    return found


def command_line(pid: int) -> str:
    """The command line of `pid`, arguments joined by spaces; "" once it is gone."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            return handle.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def descendants(pid: int) -> List[Tuple[int, int]]:
    """(pid, depth) of every process below `pid` (its children at depth 1)."""
    found: List[Tuple[int, int]] = []
    pending = [(child, 1) for child in children(pid)]
    while pending:
        child, depth = pending.pop()
        pending += [(grandchild, depth + 1) for grandchild in children(child)]
        found.append((child, depth))
    return found


def workers(pid: int) -> List[int]:
    """Descendants of `pid` that do work: all but multiprocessing's helpers.

    The helpers are the fork server (a direct child, which forks workers) and
    the resource tracker; both end with the interpreter that started them.
    """
    found = []
    for child, depth in descendants(pid):
        command = command_line(child)
        if "resource_tracker" in command or (depth == 1 and "forkserver" in command):
            continue
        found.append(child)
    return found


def end_descendants() -> List[int]:
    """SIGKILL every process this one started, directly or not, that still runs (helpers aside); their pids."""
    ended = []
    for pid in workers(os.getpid()):
        try:
            os.kill(pid, signal.SIGKILL)
            ended.append(pid)
        except (ProcessLookupError, PermissionError):
            continue
    return ended


# ---------------------------------------------------------------- ending what was started


@contextlib.contextmanager
def started(processes: Sequence, grace_s: float) -> Iterator[Sequence]:
    """Start multiprocessing `processes`; when the block ends, every one of them has ended.

    After a normal exit each gets `grace_s` seconds to finish on its own;
    after an error or Ctrl-C none waits. Then the ones still alive are killed.
    """
    running = []
    finished = False
    try:
        for process in processes:
            process.start()
            running.append(process)
        yield processes
        finished = True
    finally:
        for process in running:
            if finished:
                process.join(timeout=grace_s)
            if process.is_alive():
                process.kill()
            process.join()


def kill_group(pid: int) -> None:
    """SIGKILL the process group led by `pid`: a command started in a session of its own and all it started
    (orphans keep the group; stopped processes die with SIGKILL too)."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def run_in_own_group(
    command: Sequence[str], timeout_s: float, stdout, stderr, env: Optional[dict] = None, cwd: Optional[str] = None
) -> Optional[int]:
    """Run `command` in a session of its own: its exit status, or None when it ran past `timeout_s`.

    Its own session, so that no terminal signal reaches it and its whole group
    can be killed; that happens when it ends, in every case. `env`, `cwd`: as
    subprocess.Popen's (None: this process's).
    """
    process = subprocess.Popen(list(command), stdout=stdout, stderr=stderr, start_new_session=True, env=env, cwd=cwd)
    try:
        return process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return None
    finally:
        kill_group(process.pid)
        process.wait()


def commands_said(path: str, marker: str) -> List[str]:
    """The commands that a job's output file gives after `marker` ("restart it with: CMD"), one per
    whole line, in order; a last line still being written is left out (its command may be cut)."""
    text = open(path).read() if os.path.exists(path) else ""
    return [line.split(marker, 1)[1] for line in text.split("\n")[:-1] if marker in line]
