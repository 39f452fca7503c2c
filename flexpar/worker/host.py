"""What a device process does to its host: its lines on the shared stderr, its CPU priority when it leaves,
and the cores it may use."""

from __future__ import annotations

import math
import os
import sys


def yield_cores() -> None:
    """A leaving device's teardown (gloo, threads, freeing its memory) runs at the lowest priority.

    On a host it shares with survivors, the survivors' next group forms while
    this process exits; the exit is not on anyone's critical path.
    """
    try:
        os.nice(19)
    except (AttributeError, OSError):  # no os.nice on this platform, or refused: exit at normal priority
        pass


def say(line: str) -> None:
    """A line on stderr, written whole in one call: the devices of a host share their driver's stderr,
    and print's separate write of the newline let two devices' lines run into one. The stream may be
    a dead driver's pipe by now (a device outlives its driver)."""
    try:
        sys.stderr.write(line + "\n")
        sys.stderr.flush()
    except OSError:
        pass


def cpu_count(cgroup_cpu_max: str = "/sys/fs/cgroup/cpu.max") -> int:
    """The cores this process may use: its CPU affinity, capped by a cgroup v2 CPU quota.

    A container limited to 2 CPUs on a 64-core node (Kubernetes `limits.cpu`)
    sees 64 cores in its affinity mask; its quota says 2, and that is what the
    core count (devices, threads per device) must follow.
    """
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    try:
        with open(cgroup_cpu_max, encoding="ascii") as handle:
            quota, period = handle.read().split()[:2]
        if quota != "max":
            cores = min(cores, max(1, math.ceil(int(quota) / int(period))))
    except (OSError, ValueError):  # no cgroup v2 quota here
        pass
    return cores


def process_age_s() -> float:
    """Seconds since this process started (Linux's /proc; 0.0 where unknown): a joiner's start-up, as
    measured when it begins to build the model, for its join event."""
    try:
        with open("/proc/self/stat") as handle:
            ticks = int(handle.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as handle:
            uptime = float(handle.read().split()[0])
        return max(0.0, uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return 0.0
