"""How a scale request is answered: carried out whole or refused whole, as pure data.

A request (`ScaleBy`: `flexpar scale`, a schedule entry) must fit under
`max_devices`, and devices this host starts must fit under `local_capacity`
(its cores or GPUs; None with oversubscribe); at least one device always
stays. Growing spawns local devices, which join at a boundary once warm.
Shrinking cancels devices still on their way first (they hold nothing yet),
then drops the most recently joined members, so ranks 0.. stay stable. A
scheduled leave (`ScaleBy.at_step`) sets the step the next generation trains
from. Every request is answered either way (`Answer`). decide.py calls
`on_scale` for each `ScaleBy`; its rules say when a request is refused outright
(an open adoption window, a finishing or ended job).
"""

from __future__ import annotations

import dataclasses

from flexpar.core.membership import readoption
from flexpar.core.membership.events import Answer, Evict, Note
from flexpar.core.membership.state import spawn


def on_scale(state, event):
    """The answer to a scale request (`ScaleBy`), and the state that carries it out."""
    if state.adoption is not None:
        return _refusal(state, event, readoption.SCALING_REFUSAL)
    if state.ended:
        return _refusal(state, event, "the job has ended (its last step is committed)")
    if state.finishing:
        return _refusal(state, event, "the job is stopping after the step in flight")
    if event.delta == 0:
        return state, [
            Answer(
                event.request_id,
                True,
                f"already at {_devices(state.device_count)}; nothing changes",
                state.device_count,
            )
        ]
    if event.delta > 0:
        return _grow(state, event)
    return _shrink(state, event)


def _devices(count: int) -> str:
    return f"{count} device" + ("" if count == 1 else "s")


def _more(count: int) -> str:
    return f"{count} more device{' does' if count == 1 else 's do'} not fit"


def _refusal(state, event, reason):
    answer = Answer(event.request_id, False, reason, state.device_count)
    return state, [answer, Note(f"refused to scale by {event.delta:+d}: {reason}")]


def _grow(state, event):
    room = state.max_devices - state.device_count
    if event.delta > room:
        return _refusal(
            state,
            event,
            (
                f"the job has {_devices(state.device_count)} and may grow to {state.max_devices} "
                f"(--max-devices {state.max_devices}), so {_more(event.delta)}; start the job "
                "with a larger --max-devices"
            ),
        )
    if state.local_capacity is not None and state.local_count + event.delta > state.local_capacity:
        return _refusal(
            state,
            event,
            (
                f"this host runs {_devices(state.local_count)} and has room for {state.local_capacity} "
                f"(its cores or GPUs), so {_more(event.delta)}; pass --oversubscribe to the job "
                "to run more CPU processes than cores, or add devices from other hosts with `flexpar join`"
            ),
        )
    state, actions = spawn(state, event.delta)
    started = actions[0].device_ids
    target = state.device_count
    answer = Answer(
        event.request_id,
        True,
        f"{target - event.delta} -> {target} devices: starting {', '.join(started)}; "
        "each joins at a step boundary once warm",
        target,
        started=started,
    )
    return state, actions + [answer]


def _shrink(state, event):
    # Devices still on their way leave first (they hold nothing yet), then the most
    # recently joined members: ranks 0.. stay stable.
    staying = [m for m in state.members if m not in state.leaving]
    pending = list(state.waiting) + list(state.starting)
    remove = -event.delta
    if remove > len(staying) + len(pending) - 1:
        return _refusal(
            state,
            event,
            (
                f"the job has {_devices(state.device_count)} and at least one must stay; "
                f"ask for at most {-(len(staying) + len(pending) - 1)}"
                if len(staying) + len(pending) > 1
                else f"the job has {_devices(state.device_count)} and at least one must stay"
            ),
        )
    cancelled = tuple(pending[len(pending) - min(remove, len(pending)) :])
    leavers = tuple(staying[len(staying) - (remove - len(cancelled)) :]) if remove > len(cancelled) else ()
    state = drop(state, leavers, cancelled)
    if leavers and event.at_step is not None:  # scheduled: the generation trains from that step on
        earliest = event.at_step if state.leaving_from is None else min(state.leaving_from, event.at_step)
        state = dataclasses.replace(state, leaving_from=earliest)
    answer = Answer(
        event.request_id,
        True,
        f"{state.device_count + remove} -> {state.device_count} devices"
        + (f"; {', '.join(leavers)} leave at the next step boundary" if leavers else "")
        + (f"; cancelled {', '.join(cancelled)}, still starting" if cancelled else ""),
        state.device_count,
        leaving=leavers,
        cancelled=cancelled,
    )
    evictions = [Evict(device, "the job was scaled down before it was admitted") for device in cancelled]
    return state, evictions + [answer]


def drop(state, leavers, cancelled):
    """Members `leavers` leave at the next generation; devices `cancelled`, still on their way, never join."""
    return dataclasses.replace(
        state,
        leaving=state.leaving + tuple(leavers),
        waiting=tuple(d for d in state.waiting if d not in cancelled),
        starting=tuple(d for d in state.starting if d not in cancelled),
        dead=state.dead | set(cancelled),
    )
