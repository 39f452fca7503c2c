"""The pass lengths a driver counted for `epochs=` over a stream, kept where the run keeps its state.

Counting reads every pass of the stream once in the driver (flexpar/data/pass_count.py). A resumed or
re-adopting driver (`--resume`) would count them again before it starts: a full re-read of a long stream,
while the devices that outlived the earlier driver wait on `driver_grace_s`. So the first driver writes
what it counted to `stream-passes.json` in the run's checkpoint folder (the folder `--resume` is given:
`checkpoint_dir`, or the run directory), and a resumed driver takes the lengths from there when they
were counted for the same job and dataset (`fingerprint`: the dataset's type, kind, shards and plain
description, the split, the chunk, pass_end, the seed and the loader processes) and over at least the
passes it needs; otherwise it counts again and says why.

What the fingerprint cannot see is the data itself: a dataset whose files changed under the same
description resumes with the old counts (as its checkpoint's stream positions assume the old data too).
"""

from __future__ import annotations

import json
import os
import re
from typing import Optional

RECORD_FILE = "stream-passes.json"
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def fingerprint(job, source, groups: int, chunk: int) -> dict:
    """What the pass lengths depend on, in plain values: two jobs with equal fingerprints read passes of
    the same lengths (object addresses are left out of the dataset's description: they differ per run)."""
    dataset = type(source.dataset)
    return {
        "dataset": f"{dataset.__module__}.{dataset.__qualname__}",
        "description": _ADDRESS.sub("", repr(source.dataset))[:2000],
        "kind": source.kind,
        "shards": source.shards,
        "stateful": source.stateful,
        "virtual_workers": job.virtual_workers,
        "groups": groups,
        "chunk": chunk,
        "pass_end": job.pass_end,
        "seed": job.seed,
        "num_workers": job.num_workers,
    }


def reusable(record: Optional[dict], expected: dict, passes: int) -> tuple:
    """(lengths or None, why not): the first `passes` pass lengths of each group from `record` when it
    was counted for `expected` over `passes` passes or more; else None and the reason, in a few words."""
    if not record:
        return None, "no count recorded"
    if record.get("fingerprint") != expected:
        recorded = record.get("fingerprint") or {}
        differing = sorted(key for key in set(recorded) | set(expected) if recorded.get(key) != expected.get(key))
        return None, f"the recorded count was of another job or dataset ({', '.join(differing)} differ)"
    lengths = record.get("lengths") or []
    if not lengths or min(len(group) for group in lengths) < passes:
        return None, f"the recorded count covers fewer than {passes} passes"
    return [list(group[:passes]) for group in lengths], ""


def read(folder: Optional[str]) -> Optional[dict]:
    """The record in `folder`, or None (no folder, no record, or one that does not parse)."""
    if not folder:
        return None
    try:
        with open(os.path.join(folder, RECORD_FILE), encoding="utf-8") as handle:
            record = json.load(handle)
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def write(folder: str, expected: dict, lengths: list) -> None:
    """Record `lengths` (`[group][pass]`) counted for `expected` in `folder` (written whole, then renamed:
    a driver killed mid-write leaves the previous record or none, never half of one)."""
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, RECORD_FILE)
    partial = f"{path}.{os.getpid()}.tmp"
    with open(partial, "w", encoding="utf-8") as handle:
        json.dump({"fingerprint": expected, "lengths": lengths}, handle)
    os.replace(partial, path)
