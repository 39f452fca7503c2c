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
"""

from __future__ import annotations

import collections
import json
from dataclasses import dataclass

import torch

from flexpar.core import batching


def count_vector(dataset_size: int) -> torch.Tensor:
    """A device's per-step counter: one float64 slot per sample index (summed across devices)."""
    return torch.zeros(dataset_size, dtype=torch.float64)


def consumed(counts: torch.Tensor) -> list:
    """The summed counter as a sorted index list, each index repeated as often as it was used."""
    indices = torch.nonzero(counts > 0.5).flatten().tolist()
    return [index for index in indices for _ in range(int(round(float(counts[index]))))]


def write_entry(handle, step: int, indices: list) -> None:
    handle.write(json.dumps({"step": step, "indices": indices}, separators=(",", ":")) + "\n")
    handle.flush()


def read(path) -> dict:
    """{step: [indices]} from a ledger file; a step written twice keeps its first entry."""
    entries: dict = {}
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            entry = json.loads(line)
            entries.setdefault(entry["step"], entry["indices"])
    return entries


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
