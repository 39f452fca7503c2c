"""A device's lifecycle phases (`Phase`); their transitions are listed in flexpar/worker/lifecycle.py's module doc.

Its own module so that each part of the worker (lifecycle.py, orphan.py) can
name the phase it moves the device to without importing the other.
"""

from __future__ import annotations

import enum


class Phase(enum.Enum):
    WARMING = "warming"
    WAITING = "waiting"
    FORMING = "forming"
    ACTIVE = "active"
    RECOVERING = "recovering"
    LEAVING = "leaving"
    STOPPING = "stopping"
    ORPHANED = "orphaned"  # the driver is gone; the state is kept while it waits for a restarted one
    DONE = "done"
