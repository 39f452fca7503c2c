"""What a device process does to its host: its lines on the shared stderr, its CPU priority when it leaves."""

from __future__ import annotations

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
