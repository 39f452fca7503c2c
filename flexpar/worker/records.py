"""The step records and events a worker keeps, and rank 0 publishes (flexpar.observe.metrics)."""

from __future__ import annotations

import collections
import time
from typing import Optional

from flexpar.core import balance, delivery

# The records a device keeps for sending again (flexpar.core.delivery): those the driver has not
# acknowledged, a handful while it relays them; this bounds them should it acknowledge none for long.
RECORDS_KEPT = 1024


class WorkerRecords:
    """Part of `flexpar.worker.Worker` (its attributes are the worker's own; see there)."""

    # ------------------------------------------------------------ metrics (rank 0)

    def _keep(self, record: dict) -> None:
        """Keep `record` until the driver acknowledges it (flexpar.core.delivery): a rank 0 sends the
        records it keeps again at every boundary, so one the driver never got (its predecessor died
        before writing it, or a dying rank 0 took it along) is delivered then, in order."""
        kept = delivery.unacknowledged(self.recent_records, self.link.acknowledged)
        if len(kept) != len(self.recent_records):
            self.recent_records = collections.deque(kept, maxlen=RECORDS_KEPT)
        self.recent_records.append(record)

    def _publish_kept(self, record: dict) -> None:
        """An event record of rank 0: kept (an event the driver never got is sent again) and published."""
        self._keep(record)
        self.link.publish(record)

    def _step_record(self, step, loss, step_time, busy, assignment, grad_norm=0.0) -> dict:
        # Every device keeps the record of its last committed step; only rank 0
        # publishes it. It travels with the state, so a rank 0 that was brought
        # level after a failure can publish the step it did not commit itself.
        record = {
            "kind": "step",
            "step": step,
            "time": self.committed_wall,
            "elapsed_s": 0.0,  # filled in by the driver, which knows the job's start
            "loss": loss,
            "samples_per_s": self.job.global_batch / max(step_time, 1e-9),
            "step_time_s": step_time,
            "generation": self.generation,
            "devices": list(self.members),
            "assignment": list(assignment),
            "busy_s": busy,
            "imbalance": balance.imbalance(self._without_listeners(busy)),
            "lr": float(self.optimizer.param_groups[0]["lr"]),
            "grad_norm": grad_norm,  # of the applied gradient, before clipping (inf/nan: an fp16 skip)
        }
        if self.stream is not None:  # a streamed join: how much of the state each listener holds
            share = round(self.stream.plan.delivered_share(self.stream.rounds_done), 4)
            record["joining"] = {self.members[rank]: share for rank in self.stream.listeners}
        return record

    def _publish_event(self, event: str, detail: str, stall_s: float, state_bytes_sent: Optional[int] = None) -> None:
        extra = {} if state_bytes_sent is None else {"state_bytes_sent": int(state_bytes_sent)}
        self._publish_kept(
            {
                **extra,
                "kind": "event",
                "event": event,
                "step": self.committed,
                "time": time.time(),
                "generation": self.generation,
                "devices": list(self.members),
                "stall_s": stall_s,
                "detail": detail,
            }
        )

    def _publish_generation_event(self, record: dict, previous_members: tuple, stall: float) -> None:
        recovered, self.recovering = self.recovering, False
        sent = getattr(self, "boundary_bytes", 0)  # the state this boundary sent, all senders
        if record.get("adopted"):  # the first generation of a restarted driver: one record says what came back
            self._publish_adoption(record, stall)
            record = dict(record, failed=[])
        # A stream that goes on past a failure or a leave says so in its event (flexpar/worker/streaming.py).
        goes_on = ""
        if self.stream_note.startswith("the stream"):  # goes on from the members left
            goes_on = f"; {self.stream_note}"
        elif self.stream_note.startswith("streamed to") and not record["joined"]:  # a listener that stayed
            goes_on = f"; the stream starts over, {self.stream_note}"
        if record["failed"]:
            self._publish_event("failure", "failed: " + ", ".join(record["failed"]) + goes_on, stall, sent)
        if record["left"] and recovered and not record["failed"]:
            # A planned leave ends gracefully at a boundary and breaks no collective; this
            # generation follows a broken one, so a leaver died on the way (its grace ran
            # out, or a second SIGTERM): the others lost the step in flight, as in a failure.
            self._publish_event(
                "failure", "failed: " + ", ".join(record["left"]) + " (while leaving)" + goes_on, stall, sent
            )
        elif record["left"]:
            self._publish_event("leave", "left: " + ", ".join(record["left"]) + goes_on, stall, sent)
        if record["joined"]:
            kind = "start" if self.generation == 1 else "join"
            joined = record["joined"]
            if kind == "join":  # a joiner's warm-up (compile included) was paid before the stall began
                warmups, digests = record.get("warmup_s") or {}, record.get("digest_s") or {}
                joined = [
                    device
                    + (f" (warm-up {warmups[device]:.2f} s" if device in warmups else "")
                    + (f", frozen digest {digests[device]:.2f} s" if device in digests and device in warmups else "")
                    + (")" if device in warmups else "")
                    for device in joined
                ]
            note = f"; {self.stream_note}" if kind == "join" and self.stream_note else ""
            self._publish_event(kind, "joined: " + ", ".join(joined) + note, 0.0 if kind == "start" else stall, sent)

    def _publish_adoption(self, record: dict, stall: float) -> None:
        """The `adopt` event (flexpar.observe.metrics): how long the job had no driver and what it lost."""
        adopted = record["adopted"]
        no_driver_s = max(0.0, time.time() - adopted["lost_at"])
        back = [d for d in self.members if d not in record["joined"]]
        lost = adopted["steps_lost"]
        detail = (
            f"re-adopted by a restarted driver: {', '.join(back)} (generation {adopted['from_generation']} -> "
            f"{self.generation}); no driver for {no_driver_s:.2f} s; {lost} step{'s' if lost != 1 else ''} "
            "in flight lost"
        )
        if adopted["not_back"]:
            detail += "; not back: " + ", ".join(adopted["not_back"])
        if record["joined"]:
            detail += "; joined: " + ", ".join(record["joined"])
        self._publish_kept(
            {
                "kind": "event",
                "event": "adopt",
                "step": self.committed,
                "time": time.time(),
                "generation": self.generation,
                "devices": list(self.members),
                "stall_s": stall,
                "detail": detail,
                "no_driver_s": no_driver_s,
                "steps_lost": int(lost),
            }
        )
