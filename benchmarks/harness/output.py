"""What a benchmark shows and keeps: the printed table, numbers in text, the JSON document."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def print_table(rows: Sequence[Mapping[str, Any]], columns: Sequence[str], title: str = "") -> None:
    """Print `rows` (mappings) as an aligned text table with the given column order ('-' for a missing value)."""
    cells = [[_cell(row.get(column)) for column in columns] for row in rows]
    widths = [max([len(column)] + [len(line[index]) for line in cells]) for index, column in enumerate(columns)]
    if title:
        print(title)
    print("  ".join(column.ljust(width) for column, width in zip(columns, widths)))
    print("  ".join("-" * width for width in widths))
    for line in cells:
        print("  ".join(cell.ljust(width) for cell, width in zip(line, widths)))


def fmt(value: Optional[float]) -> str:
    """A figure in running text: three significant digits, '-' when it was not measured."""
    return "-" if value is None else f"{value:.3g}"


def write_json(path: Optional[str], data: Any) -> None:
    """Write `data` as indented JSON to `path` (folders created); nothing when path is None."""
    if path is None:
        return
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(data, indent=2, sort_keys=True, default=str) + "\n")


def progress(name: str) -> Callable[[str], None]:
    """A printer of progress lines `name: message` on stderr (stdout, the figures, flushed first)."""

    def say(message: str) -> None:
        sys.stdout.flush()
        print(f"{name}: {message}", file=sys.stderr, flush=True)

    return say
