"""Reading a TOML table field by field: typed getters with defaults, each error naming the field's path.

Scenario files (scenario_file.py) are read through `TableFields`, so a wrong or
unknown field is reported as `devices[2].seconds_per_vw: expected a
positive number, got 'fast'`, never as a KeyError.
"""

from __future__ import annotations

import math
from dataclasses import fields
from typing import Any, Dict, List, Tuple

REQUIRED = object()  # the default of a field that must be given


def describe(value: Any) -> str:
    if isinstance(value, str):
        return repr(value)
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (dict, list)):
        return f"a {'table' if isinstance(value, dict) else 'list'}"
    return repr(value)


class TableFields:
    """A TOML table being read: typed getters with defaults, then a check for unknown keys."""

    def __init__(self, table: Any, path: str) -> None:
        if not isinstance(table, dict):
            raise ValueError(f"{path}: expected a table, got {describe(table)}")
        self.table = table
        self.path = path
        self.used: set = set()

    def _get(self, key: str, default: Any) -> Any:
        self.used.add(key)
        if key in self.table:
            return self.table[key]
        if default is REQUIRED:
            raise ValueError(f"{self.path}.{key}: required field is missing")
        return default

    def has(self, key: str) -> bool:
        return key in self.table

    def number(
        self,
        key: str,
        default: Any = REQUIRED,
        *,
        minimum: float = -math.inf,
        positive: bool = False,
        maximum: float = math.inf,
    ) -> Any:
        value = self._get(key, default)
        if value is default and key not in self.table:
            return value
        is_number = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        if positive:
            expected = "a positive number"
            ok = is_number and value > 0
        elif maximum < math.inf:
            expected = f"a number in [{minimum:g}, {maximum:g}]"
            ok = is_number and minimum <= value <= maximum
        elif minimum > -math.inf:
            expected = f"a number >= {minimum:g}"
            ok = is_number and value >= minimum
        else:
            expected = "a number"
            ok = is_number
        if not ok:
            raise ValueError(f"{self.path}.{key}: expected {expected}, got {describe(value)}")
        return float(value)

    def integer(self, key: str, default: Any = REQUIRED, *, minimum: int = 0) -> Any:
        value = self._get(key, default)
        if value is default and key not in self.table:
            return value
        if not (isinstance(value, int) and not isinstance(value, bool) and value >= minimum):
            raise ValueError(f"{self.path}.{key}: expected an integer >= {minimum}, got {describe(value)}")
        return value

    def string(self, key: str, default: Any = REQUIRED) -> Any:
        value = self._get(key, default)
        if value is default and key not in self.table:
            return value
        if not isinstance(value, str) or not value:
            raise ValueError(f"{self.path}.{key}: expected a non-empty string, got {describe(value)}")
        return value

    def string_list(self, key: str, default: Any = REQUIRED) -> Any:
        value = self._get(key, default)
        if value is default and key not in self.table:
            return value
        if not isinstance(value, list) or not value:
            raise ValueError(f"{self.path}.{key}: expected a non-empty list of strings, got {describe(value)}")
        for index, item in enumerate(value):
            if not isinstance(item, str) or not item:
                raise ValueError(f"{self.path}.{key}[{index}]: expected a non-empty string, got {describe(item)}")
        return tuple(value)

    def integer_list(self, key: str, default: Any = REQUIRED, *, minimum: int = 1) -> Any:
        value = self._get(key, default)
        if value is default and key not in self.table:
            return value
        if not isinstance(value, list) or not value:
            raise ValueError(f"{self.path}.{key}: expected a non-empty list of integers, got {describe(value)}")
        for index, item in enumerate(value):
            if not (isinstance(item, int) and not isinstance(item, bool) and item >= minimum):
                raise ValueError(f"{self.path}.{key}[{index}]: expected an integer >= {minimum}, got {describe(item)}")
        return tuple(value)

    def sub_table(self, key: str) -> "TableFields":
        return TableFields(self._get(key, {}), f"{self.path}.{key}")

    def array_of_tables(self, key: str) -> List["TableFields"]:
        value = self._get(key, [])
        if not isinstance(value, list):
            raise ValueError(f"{self.path}.{key}: expected an array of tables ([[{key}]]), got {describe(value)}")
        return [TableFields(item, f"{self.path}.{key}[{index}]") for index, item in enumerate(value)]

    def finish(self) -> None:
        unknown = sorted(str(key) for key in self.table if key not in self.used)
        if unknown:
            raise ValueError(f"{self.path}.{unknown[0]}: unknown field; expected one of {sorted(self.used)}")


def config_values(
    cls: type,
    reader: TableFields,
    *,
    integers: Tuple[str, ...] = (),
    fractions: Tuple[str, ...] = (),
    positives: Tuple[str, ...] = (),
) -> Dict[str, Any]:
    """Keyword arguments for config dataclass ``cls`` from a table keyed by its field names.

    Every field is optional (the dataclass default applies); each is read as a
    non-negative number unless listed as an integer, a fraction in [0, 1] or
    strictly positive.
    """
    values: Dict[str, Any] = {}
    for item in fields(cls):
        if not reader.has(item.name):
            reader.used.add(item.name)
            continue
        if item.name in integers:
            values[item.name] = reader.integer(item.name, minimum=1)
        elif item.name in fractions:
            values[item.name] = reader.number(item.name, minimum=0.0, maximum=1.0)
        elif item.name in positives:
            values[item.name] = reader.number(item.name, positive=True)
        else:
            values[item.name] = reader.number(item.name, minimum=0.0)
    return values
