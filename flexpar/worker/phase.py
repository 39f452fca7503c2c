"""A device's lifecycle phases (`Phase`), which `Worker.run` (flexpar/worker/lifecycle.py) moves it through.

Lifecycle (`Phase`, flexpar/worker/phase.py), with its transitions:

    WARMING    -> WAITING     built the model, ran one forward/backward, told the coordinator
    WAITING    -> FORMING     a published generation includes this device
    FORMING    -> ACTIVE      the generation's process group formed; state is level
    ACTIVE     -> FORMING     at a step boundary, all members agreed on a newer generation
    ACTIVE     -> LEAVING     ... that leaves this device out (planned scale-in: it skips
                              that step's update, which every survivor commits, and exits
                              at the lowest CPU priority). A sharded job's leaver commits
                              it, hands its chunks over in the new generation's boundary
                              (LEAVING while it does), then exits; after a failure in that
                              hand-off it is departing again in the recovery generation
    ACTIVE     -> RECOVERING  a collective failed (a peer died or hung)
    FORMING    -> RECOVERING  forming or levelling the state failed
    RECOVERING -> FORMING     the coordinator published the survivors' generation
    RECOVERING -> LEAVING     ... without this device
    ACTIVE     -> STOPPING    all members agreed to stop after this step: the driver asked
                              (SIGTERM to it, a callback); rank 0 writes a checkpoint
    STOPPING   -> DONE
    ACTIVE     -> ORPHANED    the driver is gone: the members committed the step in flight
                              together (agreed in its statistics), or it broke off (abandoned)
    WARMING, WAITING, FORMING, RECOVERING -> ORPHANED    the driver is gone (a warming
                              device finishes its warm-up first: that needs no driver)
    ORPHANED   -> FORMING     a driver restarted with --resume re-adopted it: the state it
                              holds is kept, a generation above every one seen holds it
                              (a device the old driver had not let in yet stays a joiner)
    ORPHANED   -> DONE        no driver came back within driver_grace_s, a driver that does
                              not re-adopt answered, SIGTERM, or it was refused (a device of an
                              older generation): it exits, its last committed step on disk
    any        -> DONE        the last step committed, or the job was stopped
    any        -> LEAVING     SIGTERM to this device: it asks to leave at the next boundary
                              (preemption); a second SIGTERM or the grace period kills it

Its own module so that each part of the worker can name a phase without
importing the lifecycle.
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
