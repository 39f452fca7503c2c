"""Membership decisions of the control plane, as pure data: the state, and `decide`.

`decide(state, event) -> (state, actions)` is the whole policy of who trains in
which generation. It has no store, no processes and no clock: the coordinator
(`flexpar.driver.coordinator.Coordinator`) turns store keys, process exits and the time into
events, and carries out the actions. Tests drive `decide` directly.

Rules, in one place:
- Generation 0 is empty. Generation 1 forms once the initial devices are warm.
- A new generation is published only when the current one has formed (every
  member joined its process group) or has failed; joiners and planned leaves
  that arrive meanwhile wait. This keeps at most one generation in formation.
- Planned changes (join, leave) keep existing members in their order and
  append joiners, so ranks stay stable.
- After a failure report, the generation is rebuilt from the members that
  reported themselves alive once every member is accounted for (reported, dead,
  or silent for longer than the grace period).
- A scale request is carried out whole or refused whole, and answered either
  way (`Answer`): it must fit under `max_devices`, and devices this host starts
  must fit under `local_capacity` (its cores or GPUs; None with oversubscribe).
  At least one device always stays (scaling.py answers scale requests).
- A device that asks to leave (preemption: SIGTERM) leaves at the next
  generation like a planned scale-in; one still on its way is cancelled.
- A scheduled leave is decided a few steps ahead of its step (`ScaleBy.at_step`,
  flexpar/core/schedule.py): the generation that drops its devices is published
  with that step as its first (`Publish.from_step`), and the members commit the
  steps before it first, so a leave at step N takes effect exactly at the
  boundary before N. Other planned changes that arrive meanwhile ride with it.
- A device that died, was evicted or cancelled, or was refused (over
  --max-devices when it announced itself, or at its warm-up: another model,
  another version) never comes back under its id: its process exits on the
  refusal, and a later message under that id (a late or replayed
  announcement) admits nothing. Before refusals counted so, a device refused
  at its warm-up could be counted again by a late announcement, after its
  place on this host had gone to another: this host's devices then exceeded
  local_capacity (tests/core/test_membership.py pins that sequence).
- A restarted driver (`--resume`) starts with an adoption window open: nothing
  forms until it closes; then the devices that outlived the old driver are
  re-adopted, fenced off or kept as joiners (readoption.py states those rules).
- Hand-off (`hand_off=True`: a job that shards its optimizer state, where a
  leaver holds state no one else may hold): planned leavers are not simply
  dropped, they are `departing` in the generation that drops them: they meet
  its members once to hand their state over, then exit. A departing device
  that reports a failure (the hand-off broke off) is departing again in the
  recovery generation, and a recovery waits for departing devices as for
  members (reported, dead, or silent past the grace), so a failure during a
  hand-off loses nothing a surviving copy holds.
- Once the job is finishing (SIGTERM to the driver, a callback, its last
  device preempted: every member stops after the step in flight), nothing
  changes the device set any more: leave requests are moot (the devices stop
  anyway), scale requests are refused, and no planned generation is
  published; only a failure is still recovered from, so that the survivors
  can stop together. A whole host's SIGTERM (SLURM's scancel, systemd) reaches
  the driver and its devices at once: the stop wins over their leaves.
- Once a member says it finished (`Finished`: it committed the job's last
  step, or the agreed stop, and ends), the job is over: no generation is
  published any more, not even a recovery (there is no step left to train;
  a generation of joiners only would hold none of the state), the members'
  exits are their normal end, not failures, and nobody is evicted for
  silence. Joiners still on their way are not admitted: the driver tells
  them the job ended once rank 0 handed the result over.
"""

from __future__ import annotations

import dataclasses

from flexpar.core.membership import readoption, scaling
from flexpar.core.membership.events import (
    Announced,
    Event,
    Evict,
    Exited,
    FailureReported,
    Finished,
    FinishJob,
    FinishRequested,
    Formed,
    HandedOff,
    LeaveRequested,
    Note,
    Ready,
    Refuse,
    Reported,
    ScaleBy,
    SeenWaiting,
    Start,
    Tick,
)
from flexpar.core.membership.state import Membership, id_order, known, publish, spawn, stop

# --------------------------------------------------------------- decisions


def decide(state: Membership, event: Event) -> tuple:
    """The next membership state and the actions that carry it out."""
    if state.stopped:
        return state, ()
    handler = _HANDLERS[type(event)]
    state, actions = handler(state, event)
    state, more = _advance(state)
    return state, tuple(actions) + tuple(more)


def _on_start(state, event):
    return spawn(state, event.local_devices)


def _on_announced(state, event):
    if event.device_id in state.starting or known(state, event.device_id):
        return state, []
    if event.device_id.startswith("local-"):
        # This host's ids are named by its driver, which counted each one against the host when it
        # spawned it; one it did not start here (a replayed or stale message) is not let in uncounted.
        return _refused(state, event.device_id, "it is not a device this host's driver started")
    if state.device_count >= state.max_devices:
        reason = (
            f"the job already has {state.device_count} devices, its maximum "
            f"(--max-devices {state.max_devices}); start the job with a larger --max-devices"
        )
        return _refused(state, event.device_id, reason)
    return dataclasses.replace(state, starting=state.starting + (event.device_id,)), []


def _refused(state, device_id, reason):
    """Refuse `device_id` for good: its id is retired with the dead (see the rules above)."""
    return dataclasses.replace(state, dead=state.dead | {device_id}), [Refuse(device_id, reason)]


def _on_ready(state, event):
    if event.device_id not in state.starting:
        # Only a device on its way is admitted: one refused when it announced itself (over
        # --max-devices) may finish its warm-up before it reads the refusal; a cancelled or
        # dead one stays out (its refusal or eviction was sent already).
        return state, []
    starting = tuple(d for d in state.starting if d != event.device_id)
    state = dataclasses.replace(state, starting=starting)
    if event.problem:
        return _refused(state, event.device_id, event.problem)
    if known(state, event.device_id):
        return state, []
    return dataclasses.replace(state, waiting=state.waiting + (event.device_id,)), []


def _on_formed(state, event):
    if event.generation != state.generation:
        return state, []
    return dataclasses.replace(state, formed=state.formed | {event.device_id}), []


def _on_failure(state, event):
    if event.generation != state.generation or event.device_id not in state.members + state.departing:
        return state, []
    if event.device_id in state.survivors:
        return state, []
    since = state.failure_since if state.failure_since is not None else event.now
    return (
        dataclasses.replace(state, survivors=state.survivors + (event.device_id,), failure_since=since),
        [],
    )


def _on_handed_off(state, event):
    if event.generation != state.generation or event.device_id not in state.departing:
        return state, []
    return dataclasses.replace(state, departing=tuple(d for d in state.departing if d != event.device_id)), []


def _on_exited(state, event):
    device = event.device_id
    state = dataclasses.replace(
        state,
        dead=state.dead | {device},
        starting=tuple(d for d in state.starting if d != device),
        waiting=tuple(d for d in state.waiting if d != device),
    )
    if state.ended:  # a member's normal end (or a death after the last step: nothing to recover)
        return state, []
    if (device in state.members and device not in state.leaving) or device in state.departing:
        # A member died (or a departing device before it handed its state over): the others
        # will see it in their next collective. Start the grace clock now so a member that
        # hangs instead of failing is not waited for.
        since = state.failure_since if state.failure_since is not None else event.now
        state = dataclasses.replace(state, failure_since=since)
    return state, []


def _on_leave_requested(state, event):
    device = event.device_id
    if state.adoption is not None and device in state.adoption.by_device():
        return readoption.leave_requested(state, device)
    if state.finishing:
        return state, [Note(f"{device} got SIGTERM; the job stops at the next step boundary anyway")]
    if device in state.waiting or device in state.starting:
        state = scaling.drop(state, (), (device,))
        return state, [
            Evict(device, "it was asked to stop (SIGTERM) before it was admitted"),
            Note(f"{device} got SIGTERM before it was admitted: cancelled"),
        ]
    if device not in state.members or device in state.leaving or device in state.dead:
        return state, []
    staying = [m for m in state.members if m not in state.leaving and m not in state.dead]
    if len(staying) <= 1:
        # Nobody can take its VWs over: the job stops at the next step boundary, as
        # after a SIGTERM to the driver (final checkpoint when checkpointing is on).
        return _on_finish_requested(state, FinishRequested(f"its last device, {device}, got SIGTERM"))
    return scaling.drop(state, (device,), ()), [Note(f"{device} got SIGTERM: it leaves at the next step boundary")]


def _on_finish_requested(state, event):
    if state.finishing:
        return state, []
    return dataclasses.replace(state, finishing=True), [FinishJob(event.reason, quiet=event.quiet)]


def _on_finished(state, event):
    """A member committed the job's last step (or the agreed stop): the job is over (rules above).

    Only members train, so only they finish; one may have been dropped already from a generation
    published during the last step, which its members never formed (a preempted rank 0 among them).
    A device still on its way never trained: its word is not taken.
    """
    if event.device_id in state.starting or event.device_id in state.waiting:
        return state, []
    result_from = event.device_id if event.rank_0 else state.result_from
    return dataclasses.replace(state, ended=True, finishing=True, result_from=result_from), []


def _on_tick(state, event):
    """Members silent for longer than the grace period after a failure count as dead; an open
    adoption window closes when it may (readoption.py)."""
    if state.adoption is not None:
        return readoption.on_tick(state, event.now)
    if state.ended:  # members that already ended are not waited for, nor evicted
        return state, []
    if state.failure_since is None or event.now - state.failure_since < state.grace_s:
        return state, []
    silent = [m for m in state.members + state.departing if m not in state.survivors and m not in state.dead]
    state = dataclasses.replace(state, dead=state.dead | set(silent))
    return state, [Evict(m) for m in silent]


_HANDLERS = {
    Start: _on_start,
    Announced: _on_announced,
    Ready: _on_ready,
    Formed: _on_formed,
    FailureReported: _on_failure,
    HandedOff: _on_handed_off,
    Exited: _on_exited,
    ScaleBy: scaling.on_scale,
    LeaveRequested: _on_leave_requested,
    FinishRequested: _on_finish_requested,
    Finished: _on_finished,
    Tick: _on_tick,
    Reported: readoption.on_reported,
    SeenWaiting: readoption.on_seen_waiting,
}


def _advance(state: Membership):
    """Publish the next generation when the rules allow it."""
    if state.adoption is not None:  # nothing forms before a restarted driver's adoption window closed
        return state, ()
    if state.generation == 0:
        if state.finishing:  # asked to stop before anything trained: nothing to finish
            return stop(state, STOPPED_BEFORE_START)
        if len(state.waiting) >= state.initial_devices or (state.waiting and not state.starting):
            # The first device set in id order, whoever warmed up first: ranks are predictable.
            members = tuple(sorted(state.waiting, key=id_order))
            return publish(state, members=members, joined=members, left=(), failed=())
        if not state.waiting and not state.starting and state.dead:
            return stop(state, NO_DEVICE_STARTED)
        return state, ()
    if state.ended:  # the last step is committed: nothing is published after it
        return state, ()
    if state.failure_since is not None:
        return _recover(state)
    if not state.is_formed or state.finishing:
        return state, ()
    if state.waiting or state.leaving:
        members = tuple(m for m in state.members if m not in state.leaving) + state.waiting
        departing = state.leaving if state.hand_off else ()
        return publish(
            state,
            members=members,
            joined=state.waiting,
            left=state.leaving,
            failed=(),
            departing=departing,
            from_step=state.leaving_from,
        )
    return state, ()


STOPPED_BEFORE_START = "it was asked to stop before training started"
NO_DEVICE_STARTED = (
    "no device could start; see the messages above (a script whose fit() call is not under "
    '`if __name__ == "__main__":` stops its workers this way)'
)


def _recover(state: Membership):
    """Rebuild the generation from the survivors once every member is accounted for.

    With `hand_off`, leavers and departing devices hold state: the recovery
    waits for them too, and those alive are departing in the new generation.
    """
    accounted = set(state.survivors) | state.dead | (set() if state.hand_off else set(state.leaving))
    if not set(state.members + state.departing) <= accounted:
        return state, ()
    # A survivor that died before the new generation was published (reported, then exited) failed too.
    alive = set(state.survivors) - state.dead
    members = tuple(m for m in state.members if m in alive and m not in state.leaving)
    failed = tuple(m for m in state.members if m not in alive and m not in state.leaving)
    failed += tuple(d for d in state.departing if d not in alive)  # died handing over
    departing = tuple(d for d in state.departing + state.leaving if d in alive) if state.hand_off else ()
    members = members + state.waiting
    if not members:
        return stop(state, f"every device failed ({', '.join(failed)}); no worker is left")
    return publish(state, members=members, joined=state.waiting, left=state.leaving, failed=failed, departing=departing)
