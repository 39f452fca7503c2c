"""The step records and events a worker keeps, and rank 0 publishes (flexpar.observe.metrics)."""

from __future__ import annotations

import collections
import json
import time
from typing import Optional

from flexpar.core import balance, delivery

# The records a device keeps for sending again (flexpar.core.delivery): those the driver has not
# acknowledged, a handful while it relays them; this bounds them should it acknowledge none for long.
RECORDS_KEPT = 1024


class RecordQueue:
    """The records this device committed or published that the driver has not acknowledged.

    Invariant: `kept` holds them in the order they were made, the newest
    last, without those the driver acknowledged by the time the newest was
    kept (`link.acknowledged`, flexpar.core.delivery), and at most
    RECORDS_KEPT. Every device keeps its step and eval records (they travel
    with the state, so a rank 0 brought level after a failure can publish a
    step it did not commit); rank 0 publishes them, and keeps its events.
    A new rank 0 sends every kept record again at its first boundary
    (`publish_all`), so none is lost with a rank 0 or a driver.

    `after_failure`: the next generation follows a failed collective (its
    event says a leaver that left then failed); cleared by the rank 0 that
    publishes that generation's events.
    """

    def __init__(self, link):
        self.link = link
        self.kept: collections.deque = collections.deque(maxlen=RECORDS_KEPT)
        self.after_failure = False

    @property
    def last(self) -> Optional[dict]:
        """The newest record kept (a step's, an evaluation's or an event), None if none."""
        return self.kept[-1] if self.kept else None

    def last_step_time(self) -> float:
        """The newest record's step time (0.0 where it is no step's: an event)."""
        return float(self.kept[-1].get("step_time_s", 0.0)) if self.kept else 0.0

    def median_step_time(self, last: int = 5) -> float:
        """The median step time of the newest `last` step records (0.0 if none)."""
        steps = [record for record in self.kept if record.get("kind") == "step"][-last:]
        measured = sorted(float(record["step_time_s"]) for record in steps)
        return measured[len(measured) // 2] if measured else 0.0

    def to_json(self) -> str:
        return json.dumps(list(self.kept))

    def load_json(self, text: str) -> None:
        """The records a peer or a checkpoint sent with its state replace this device's."""
        self.kept = collections.deque(json.loads(text), maxlen=RECORDS_KEPT)

    def note_failure(self) -> None:
        """A collective failed: the next generation's events follow a broken step."""
        self.after_failure = True

    def keep(self, record: dict) -> None:
        """Keep `record` until the driver acknowledges it (flexpar.core.delivery): a rank 0 sends the
        records it keeps again at every boundary, so one the driver never got (its predecessor died
        before writing it, or a dying rank 0 took it along) is delivered then, in order."""
        kept = delivery.unacknowledged(self.kept, self.link.acknowledged)
        if len(kept) != len(self.kept):
            self.kept = collections.deque(kept, maxlen=RECORDS_KEPT)
        self.kept.append(record)

    def publish_kept(self, record: dict) -> None:
        """An event record of rank 0: kept (an event the driver never got is sent again) and published."""
        self.keep(record)
        self.link.publish(record)

    def publish_all(self) -> None:
        """A new rank 0: every record the driver has not acknowledged, again, in order."""
        for kept in self.kept:
            self.link.publish(kept)

    def publish_event(
        self,
        event: str,
        detail: str,
        stall_s: float,
        *,
        step: int,
        generation: int,
        members: tuple,
        state_bytes_sent: Optional[int] = None,
        stream_moves: Optional[dict] = None,
        fields: Optional[dict] = None,
    ) -> None:
        """An event of rank 0 after committed step `step`, in `generation` of `members` (`stream_moves`:
        a streaming job's cost of reaching its moved streams' positions, DataStreams.open_at_boundary;
        `fields`: more of the record's fields, such as a join's way and predictions)."""
        extra = {} if state_bytes_sent is None else {"state_bytes_sent": int(state_bytes_sent)}
        extra.update(stream_moves or {})
        extra.update(fields or {})
        self.publish_kept(
            {
                **extra,
                "kind": "event",
                "event": event,
                "step": step,
                "time": time.time(),
                "generation": generation,
                "devices": list(members),
                "stall_s": stall_s,
                "detail": detail,
            }
        )

    def publish_generation_events(
        self,
        record: dict,
        stall: float,
        sent: int,
        stream_note: str,
        *,
        step: int,
        generation: int,
        members: tuple,
        stream_moves: Optional[dict] = None,
        join_fields: Optional[dict] = None,
    ) -> None:
        """Rank 0 at a boundary: what the generation `record` changed (adopt, failure, leave, start,
        join), with the boundary's stall and the bytes it sent (all senders), and what reaching the
        streams' positions cost (`stream_moves`, in each event but adopt); `join_fields`: the join
        event's record of the way it took (flexpar/worker/join_way.py `event_fields`)."""
        recovered, self.after_failure = self.after_failure, False
        where = {"step": step, "generation": generation, "members": members}
        sent_with = {"state_bytes_sent": sent, "stream_moves": stream_moves}
        if record.get("adopted"):  # the first generation of a restarted driver: one record says what came back
            self.publish_kept(adoption_record(record, stall, **where))
            record = dict(record, failed=[])
        # A stream that goes on past a failure or a leave says so in its event (flexpar/worker/streaming.py).
        goes_on = ""
        if stream_note.startswith("the stream"):  # goes on from the members left
            goes_on = f"; {stream_note}"
        elif stream_note.startswith(("streamed", "streaming")) and not record["joined"]:  # a listener that stayed
            goes_on = f"; the stream starts over, {stream_note}"
        if record["failed"]:
            self.publish_event(
                "failure", "failed: " + ", ".join(record["failed"]) + goes_on, stall, **where, **sent_with
            )
        if record["left"] and recovered and not record["failed"]:
            # A planned leave ends gracefully at a boundary and breaks no collective; this
            # generation follows a broken one, so a leaver died on the way (its grace ran
            # out, or a second SIGTERM): the others lost the step in flight, as in a failure.
            detail = "failed: " + ", ".join(record["left"]) + " (while leaving)" + goes_on
            self.publish_event("failure", detail, stall, **where, **sent_with)
        elif record["left"]:
            self.publish_event("leave", "left: " + ", ".join(record["left"]) + goes_on, stall, **where, **sent_with)
        if record["joined"]:
            kind = "start" if generation == 1 else "join"
            joined = record["joined"]
            if kind == "join":  # what a joiner's start took was paid before the stall began
                joined = [device + joiner_times(record, device) for device in joined]
            note = f"; {stream_note}" if kind == "join" and stream_note else ""
            detail = "joined: " + ", ".join(joined) + note
            self.publish_event(
                kind,
                detail,
                0.0 if kind == "start" else stall,
                **where,
                **sent_with,
                fields=join_fields if kind == "join" else None,
            )


JOIN_TIMES = (
    ("startup_s", "start-up"),
    ("build_s", "model build"),
    ("warmup_s", "warm-up"),
    ("digest_s", "frozen digest"),
)
"""The parts of a joiner's start a join event names, by the generation record's key, in the order they ran."""


def joiner_times(record: dict, device: str) -> str:
    """What `device`'s start took, as its join event says it: " (start-up 2.10 s, model build 0.31 s,
    warm-up 0.17 s)" (each part its "ready" reported; "" for a device without a warm-up, which joined
    no other way)."""
    if device not in (record.get("warmup_s") or {}):
        return ""
    parts = [f"{name} {record[key][device]:.2f} s" for key, name in JOIN_TIMES if device in (record.get(key) or {})]
    return f" ({', '.join(parts)})"


def adoption_record(record: dict, stall: float, *, step: int, generation: int, members: tuple) -> dict:
    """The `adopt` event (flexpar.observe.metrics): how long the job had no driver and what it lost."""
    adopted = record["adopted"]
    no_driver_s = max(0.0, time.time() - adopted["lost_at"])
    back = [d for d in members if d not in record["joined"]]
    lost = adopted["steps_lost"]
    detail = (
        f"re-adopted by a restarted driver: {', '.join(back)} (generation {adopted['from_generation']} -> "
        f"{generation}); no driver for {no_driver_s:.2f} s; {lost} step{'s' if lost != 1 else ''} "
        "in flight lost"
    )
    if adopted["not_back"]:
        detail += "; not back: " + ", ".join(adopted["not_back"])
    if record["joined"]:
        detail += "; joined: " + ", ".join(record["joined"])
    return {
        "kind": "event",
        "event": "adopt",
        "step": step,
        "time": time.time(),
        "generation": generation,
        "devices": list(members),
        "stall_s": stall,
        "detail": detail,
        "no_driver_s": no_driver_s,
        "steps_lost": int(lost),
    }


def step_record(
    step: int,
    loss: float,
    step_time: float,
    busy: list,
    assignment: tuple,
    grad_norm: float,
    *,
    wall: float,
    global_batch: int,
    generation: int,
    members: tuple,
    contributors_busy: list,
    lr: float,
) -> dict:
    """The record of a committed step (flexpar.observe.metrics): every device keeps it, rank 0 publishes it."""
    return {
        "kind": "step",
        "step": step,
        "time": wall,
        "elapsed_s": 0.0,  # filled in by the driver, which knows the job's start
        "loss": loss,
        "samples_per_s": global_batch / max(step_time, 1e-9),
        "step_time_s": step_time,
        "generation": generation,
        "devices": list(members),
        "assignment": list(assignment),
        "busy_s": busy,
        "imbalance": balance.imbalance(contributors_busy),
        "lr": lr,
        "grad_norm": grad_norm,  # of the applied gradient, before clipping (inf/nan: an fp16 skip)
    }
