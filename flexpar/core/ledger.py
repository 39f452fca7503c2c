"""The sample ledger: which samples each committed step consumed, counted, not inferred.

With `sample_ledger=True` (for tests and the fault soak), every device counts
the sample indices its virtual workers actually loaded in a step; the counts
are summed across devices in that step, so the sum is what the committed
update was computed from, whichever devices ran which VWs, and across any
join, leave or failure. Rank 0 attaches it to the step's record and the
driver writes one line per committed step to `ledger.jsonl` in the run
directory.

`audit` compares a ledger with what the steps should have consumed (the pure
`batching` order) and counts samples lost (expected, never consumed) and
repeated (consumed more often than expected), step by step.

A streaming dataset's items have no index: the ledger names each by `[group,
pass, index]` (its stream group, the pass, its place in that pass of the
group's stream: flexpar/core/stream_split.py), and an entry whose step ended
a pass carries the `pass_ends` (with the items left out); under `epochs=`, the pass ends no
step meets (the last pass's) are added by the driver at the job's end (`write_job_end`), so
every item of the job's passes is named trained or left out. `audit_stream`
derives each step's items from the split and those pass ends alone
(`stream_split.plan_chunks`) and counts the same lost and repeated, and the
items left out by pass ends.
"""

from __future__ import annotations

import collections
import json
import os
from dataclasses import dataclass
from typing import Optional

import torch

from flexpar.core import batching
from flexpar.core.stream_split import StreamSplit, plan_chunks


def count_vector(dataset_size: int) -> torch.Tensor:
    """A device's per-step counter: one float64 slot per sample index (summed across devices)."""
    return torch.zeros(dataset_size, dtype=torch.float64)


def consumed(counts: torch.Tensor) -> list:
    """The summed counter as a sorted index list, each index repeated as often as it was used."""
    indices = torch.nonzero(counts > 0.5).flatten().tolist()
    return [index for index in indices for _ in range(int(round(float(counts[index]))))]


def write_entry(handle, step: int, indices: list, pass_ends: Optional[list] = None) -> None:
    entry = {"step": step, "indices": indices}
    if pass_ends:  # a streaming dataset's pass ends met in this step (and the items they left out)
        entry["pass_ends"] = pass_ends
    handle.write(json.dumps(entry, separators=(",", ":")) + "\n")
    handle.flush()


def write_job_end(path, steps: int, pass_ends: list) -> None:
    """Append the pass ends the job's end met (`stream_split.job_end_pass_ends`, dated `steps`) to the
    ledger file at `path`, as one `{"job_end": steps, "pass_ends": [...]}` line (no step's entry: `read`
    skips it, `read_pass_ends` takes it); once: a driver resumed at the job's last step adds none again."""
    ends = [ended.to_dict() if hasattr(ended, "to_dict") else dict(ended) for ended in pass_ends]
    if not ends:
        return
    if os.path.exists(path):
        with open(path, encoding="utf-8") as handle:
            if any('"job_end"' in line and json.loads(line).get("job_end") == steps for line in handle):
                return
    with open(path, "a", encoding="utf-8") as handle:
        handle.write(json.dumps({"job_end": steps, "pass_ends": ends}, separators=(",", ":")) + "\n")


def read(path) -> dict:
    """{step: [indices]} from a ledger file; a step written twice keeps its first entry (the job's end
    line, which names no step, is not one)."""
    entries: dict = {}
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            entry = json.loads(line)
            if "step" in entry:
                entries.setdefault(entry["step"], entry["indices"])
    return entries


def read_pass_ends(path) -> list:
    """The pass ends a streaming job's ledger file records, one per (group, pass), by step."""
    ends: dict = {}
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            for ended in json.loads(line).get("pass_ends", []):
                ends.setdefault((ended["group"], ended["pass"]), ended)
    return sorted(ends.values(), key=lambda ended: (ended["step"], ended["group"], ended["pass"]))


@dataclass(frozen=True)
class Audit:
    steps_missing: int  # committed steps without a ledger entry
    samples_lost: int  # expected in a step, not consumed by it
    samples_repeated: int  # consumed by a step more often than expected

    @property
    def clean(self) -> bool:
        return self.steps_missing == 0 and self.samples_lost == 0 and self.samples_repeated == 0


def audit(entries: dict, seed: int, dataset_size: int, global_batch: int, steps: int) -> Audit:
    """Compare ledger `entries` of steps 0..steps-1 with the steps' global batches."""
    missing = lost = repeated = 0
    for step in range(steps):
        if step not in entries:
            missing += 1
            continue
        expected = collections.Counter(batching.global_batch_indices(seed, step, dataset_size, global_batch).tolist())
        got = collections.Counter(entries[step])
        lost += sum((expected - got).values())
        repeated += sum((got - expected).values())
    extra = [step for step in entries if not 0 <= step < steps]
    repeated += sum(len(entries[step]) for step in extra)
    return Audit(missing, lost, repeated)


@dataclass(frozen=True)
class StreamAudit(Audit):
    items_left_out: int = 0  # items pass ends left out ("drop"), as the recorded pass ends say
    pass_ends_differing: int = 0  # recorded pass ends that are not where the stream's pass lengths put them


def audit_stream(
    entries: dict, pass_ends: list, split: StreamSplit, batch: int, steps: int, pass_end: str = "drop"
) -> StreamAudit:
    """Compare a streaming job's ledger `entries` ({step: [[group, pass, index], ...]}) of steps
    0..steps-1 with the items each step should have trained, given the recorded `pass_ends` (the
    lengths of the passes that ended; a pass not ended is taken as long enough). A pass end dated
    `steps` is one the job's end met (`epochs=`: stream_split.job_end_pass_ends), planned as the
    step after the last would meet it."""
    chunk = split.chunk(batch)
    expected: dict = {step: collections.Counter() for step in range(steps)}
    planned_ends = []
    for group in range(split.groups):
        lengths = [e["items"] for e in sorted(pass_ends, key=lambda e: e["pass"]) if e["group"] == group]
        chunks, ends = plan_chunks(lengths + [chunk * (steps + 2)], chunk, steps + 1, pass_end, group)
        planned_ends += [ended.to_dict() for ended in ends]
        for step, places in enumerate(chunks[:steps]):
            expected[step].update((group, pass_, index) for pass_, index in places)
    missing = lost = repeated = 0
    for step in range(steps):
        if step not in entries:
            missing += 1
            continue
        got = collections.Counter(tuple(item) for item in entries[step])
        lost += sum((expected[step] - got).values())
        repeated += sum((got - expected[step]).values())
    repeated += sum(len(entries[step]) for step in entries if not 0 <= step < steps)
    recorded = {(e["group"], e["pass"]): (e["step"], list(e["left_out"])) for e in pass_ends}
    planned = {(e["group"], e["pass"]): (e["step"], list(e["left_out"])) for e in planned_ends}
    differing = sum(1 for key in set(recorded) | set(planned) if recorded.get(key) != planned.get(key))
    left_out = sum(e["left_out"][1] - e["left_out"][0] for e in pass_ends if e["left_out"])
    return StreamAudit(missing, lost, repeated, left_out, differing)
