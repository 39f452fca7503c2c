"""The rules of a restarted driver's adoption window (flexpar/core/adoption.py decides what it finds).

A driver restarted with `--resume` starts with an adoption window open
(`Membership.adoption`): devices that outlived the old driver report
(`Reported`). Nothing forms while the window is open. When it closes
(`adoption.closeable`), the members of the newest generation that reported
form the next generation, numbered above every number any device saw; devices
of an older generation are refused (fencing); joiners stay joiners (warm ones
join in that generation, cold ones finish their warm-up); local devices that
did not come back are replaced by fresh ones, which join at a boundary.
Nothing reported: the driver resumes from its newest checkpoint
(`NothingToAdopt`, then the initial devices start), every reporter refused.
A report of another job stops the restarted driver (`Decline`), never the
devices. Scale requests wait until the window has closed (refused). After the window: a late member of the
generation the job was re-adopted from joins like a joiner (its state is
levelled at its boundary); anyone older is refused.
"""

from __future__ import annotations

import dataclasses

from flexpar.core import adoption
from flexpar.core.membership.events import Decline, Evict, NothingToAdopt, Refuse
from flexpar.core.membership.state import Membership, known, publish, spawn

NOTHING_TO_ADOPT_REFUSAL = (
    "the restarted driver found no member of the job to re-adopt and resumes from the newest checkpoint: join it again"
)


def on_reported(state: Membership, event) -> tuple:
    """A device that outlived the old driver reported (or said it is still finishing its step)."""
    report = event.report
    if state.adoption is not None:
        if event.problem:
            reason = f"device {report.device_id}, waiting at this address, cannot be re-adopted: {event.problem}"
            return dataclasses.replace(state, stopped=True), [Decline(reason)]
        return dataclasses.replace(state, adoption=adoption.add_report(state.adoption, report)), []
    if not report.final or report.device_id in state.starting:
        return state, []  # a notice after the window (its report follows), or a report seen twice
    if event.problem:
        return _refused(state, report.device_id, event.problem)
    why = adoption.late_report_verdict(report, state.adopted_from, known(state, report.device_id))
    if why is None and state.finishing:
        why = "the job is stopping after the step in flight"
    if why is None and state.device_count >= state.max_devices:
        why = f"the job already has {state.device_count} devices, its maximum (--max-devices {state.max_devices})"
    if why is not None:
        return _refused(state, report.device_id, why)
    # Back late: a member of the generation the job was re-adopted from (its state is levelled at its
    # boundary), or a joiner of the old driver: both join like any joiner.
    if report.warm or report.generation > 0:
        return dataclasses.replace(state, waiting=state.waiting + (report.device_id,)), []
    return dataclasses.replace(state, starting=state.starting + (report.device_id,)), []


def _refused(state: Membership, device_id: str, reason: str) -> tuple:
    return dataclasses.replace(state, dead=state.dead | {device_id}), [Refuse(device_id, reason)]


def on_seen_waiting(state: Membership, event) -> tuple:
    """Devices seen waiting on the driver's host: the open window waits for them (nothing after it)."""
    if state.adoption is None:
        return state, []
    return dataclasses.replace(state, adoption=adoption.seen_waiting(state.adoption, event.device_ids)), []


def on_tick(state: Membership, now: float) -> tuple:
    """The window closes when flexpar/core/adoption.py says it may."""
    if adoption.closeable(state.adoption, state.dead, now):
        return close(state)
    return state, []


def close(state: Membership) -> tuple:
    """Re-adopt the newest generation's members that reported, or resume from the checkpoint."""
    window = state.adoption
    result = adoption.outcome(window, state.dead)
    reporters = tuple(r.device_id for r in window.reports if r.device_id not in state.dead)
    # Device ids are never reused within a job: fresh local devices number above every one named.
    next_local = max([state.next_local] + [adoption.local_index(d) + 1 for d in adoption.ids_in(window)])
    state = dataclasses.replace(state, adoption=None, next_local=next_local)
    if not result.members:
        # The job resumes from its newest checkpoint with fresh devices, as a restart always did; the
        # reporters (joiners, devices of older generations) are refused for good: join it again.
        state = dataclasses.replace(state, dead=state.dead | set(reporters))
        why = (
            "no device of the job's newest generation reported"
            if not reporters
            else f"no member of the job's newest generation came back ({len(reporters)} other devices reported)"
        )
        refusals = [Refuse(d, NOTHING_TO_ADOPT_REFUSAL) for d in reporters]
        state, spawned = spawn(state, max(0, min(state.initial_devices, _room(state))))
        return state, refusals + [NothingToAdopt(why, window.checkpoint_path)] + spawned
    refusals = [
        Refuse(d, adoption.late_report_verdict(report, result.from_generation, False) or "its generation is stale")
        for d, report in window.by_device().items()
        if d in result.stale
    ]
    # The job's own devices first; devices that announced themselves while the window was open
    # (new joiners) take what room --max-devices leaves, in the order they came.
    arrivals = state.waiting + state.starting
    room = state.max_devices - len(result.members) - len(result.warm_joiners) - len(result.cold_joiners)
    over = arrivals[max(0, room) :]
    full = f"the job already has {state.max_devices} devices, its maximum (--max-devices {state.max_devices})"
    refusals += [Refuse(d, full) for d in over]
    ready = tuple(d for d in state.waiting if d not in over)
    state = dataclasses.replace(
        state,
        adopted_from=result.from_generation,
        generation=result.next_generation - 1,
        starting=result.cold_joiners + tuple(d for d in state.starting if d not in over),
        waiting=(),
        dead=state.dead | set(result.stale) | set(over),
    )
    note = adoption.Adopted(result.from_generation, result.step, result.lost_at, result.steps_lost, result.not_back)
    joined = result.warm_joiners + ready
    state, (published,) = publish(
        state, members=result.members + joined, joined=joined, left=(), failed=result.not_back
    )
    restore = window.checkpoint_path if window.checkpoint_step > result.step else ""
    actions = refusals + [dataclasses.replace(published, adopted=note, restore=restore)]
    # This host's devices that did not come back (they died with the driver, as in a container
    # restart) are replaced by fresh ones, which join at a step boundary like any joiner.
    back = sum(1 for d in result.members if adoption.local_index(d) >= 0)
    count = max(0, min(state.initial_devices - back, _room(state)))
    if count:
        state, spawned = spawn(state, count)
        actions += spawned
    return state, actions


def _room(state: Membership) -> int:
    """Devices this host may still start: under --max-devices and its local capacity."""
    room = state.max_devices - state.device_count
    if state.local_capacity is not None:
        room = min(room, state.local_capacity - state.local_count)
    return room


def leave_requested(state: Membership, device_id: str) -> tuple:
    """SIGTERM to a device that reported in the open window: it is let go (it never rejoins)."""
    state = dataclasses.replace(state, dead=state.dead | {device_id})
    return state, [Evict(device_id, "it was asked to stop (SIGTERM) before it was re-adopted")]


SCALING_REFUSAL = "the restarted driver is re-adopting the job's devices; ask again once it has (a few seconds)"
