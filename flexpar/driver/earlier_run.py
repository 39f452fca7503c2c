"""What a resumed driver reads of its job's earlier run: the metrics file and the ledger it goes on from.

A resumed job (`--resume`: re-adopted devices or a checkpoint) appends to its
metrics file and ledger. The driver loop starts from what they hold: each
record is written and handed to a callback once (flexpar.core.delivery), the
job's time counts from its first start, and the display's pass goes on where
the earlier driver's stopped.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Optional

from flexpar.core import delivery
from flexpar.core import ledger as sample_ledger
from flexpar.observe.log_lines import passes_ended
from flexpar.observe.metrics import resume_point


@dataclass(frozen=True)
class EarlierRun:
    """What the job's files held when this driver started (a new job: nothing).

    ``started``: the job's first start (unix seconds; None: unknown);
    ``last_step``: its last step record; ``delivered``: what the metrics file
    says was delivered; ``evals``, ``events``: its eval and event records, in
    order; ``stream_passes``: a streaming dataset's passes ended, by stream
    group; ``generation``: the newest generation any record carries (an event,
    a join or an adoption, may have come after the last step record);
    ``ledger_steps``: the steps the ledger file holds.
    """

    started: Optional[float] = None
    last_step: Optional[dict] = None
    delivered: delivery.Delivery = field(default_factory=delivery.Delivery)
    evals: tuple = ()
    events: tuple = ()
    stream_passes: dict = field(default_factory=dict)
    generation: int = 1
    ledger_steps: frozenset = frozenset()


def read_earlier_run(metrics_path: str, run_dir: str) -> EarlierRun:
    """The earlier run of a resumed job, from its metrics file and its run directory's ledger."""
    started, last_step, records = resume_point(metrics_path)
    ledger_path = os.path.join(run_dir, "ledger.jsonl")
    return EarlierRun(
        started=started,
        last_step=last_step,
        delivered=delivery.Delivery.of_records(records),
        evals=tuple(record for record in records if record["kind"] == "eval"),
        events=tuple(record for record in records if record["kind"] == "event"),
        stream_passes=passes_ended(records),
        generation=max([1] + [record.get("generation", 1) for record in records]),
        ledger_steps=frozenset(sample_ledger.read(ledger_path)) if os.path.exists(ledger_path) else frozenset(),
    )
