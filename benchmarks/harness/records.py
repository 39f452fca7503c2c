"""flexpar's metrics records, as the benchmarks read them (the one place they import flexpar's reader)."""

from __future__ import annotations

import json
import os
from typing import List


def metrics_records(path: str) -> List[dict]:
    """Every record of a flexpar metrics file (JSON lines), in file order, validated by flexpar."""
    from flexpar.observe.metrics import read_records

    return read_records(path)


def step_records(path: str) -> List[dict]:
    """The step records of a flexpar metrics file, in step order."""
    return sorted(
        (record for record in metrics_records(path) if record["kind"] == "step"), key=lambda record: record["step"]
    )


def json_lines(path: str) -> List[dict]:
    """The complete records of a JSON-lines file another process may still be writing.

    Blank lines and a last line without its newline (still being written) are
    left out; [] when the file does not exist (yet).
    """
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.endswith("\n") and line.strip()]
