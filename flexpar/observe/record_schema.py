"""The metrics records' schema, stated once (metrics.schema.json beside this file), and the check that applies it.

The schema is a standard JSON Schema (draft 2020-12): the tests validate
records against it with the `jsonschema` library, and anyone can. flexpar
itself needs the check at run time without that library (it is not a core
dependency): the driver's `MetricsWriter` refuses a record that does not
follow the schema, and `flexpar plot` (`read_records`) refuses a file with
one, naming the line and the field. So `validate_record` reads the same
schema file and applies the keywords it uses: type, const, enum, required,
properties, additionalProperties, minimum, maximum, minLength, minItems,
uniqueItems, items, minProperties, propertyNames, local `$ref`s, and, on a
record kind, `if`/`then`/`else` over its fields (an `adopt` event must have
`no_driver_s` and `steps_lost`; other events must not: a `false` schema). A
keyword it does not know is refused when the schema is loaded, so the file
cannot say more than this check enforces.

Two of flexpar's own keywords (JSON Schema treats unknown keywords as
annotations) state what standard keywords cannot: `x-allow-non-finite`
(numbers are finite unless it is set: a diverged loss is recorded as NaN)
and `x-aligned-with` (an array with one entry per device); `x-entry`
names what an array's entries are, for the messages. The one rule
left to code is a step's `virtual_worker_sets` holding every VW once
(`_check_virtual_worker_sets`).

Why not `jsonschema` at run time as well: a second validator that exists
only where an optional package is installed would give the same file two
verdicts; its messages (paths as deques, "is not of type 'integer'") are
not the one-line `field 'busy_s[0]' must be >= 0, got -1.0` the writer and
the plot report. The tests hold the two to the same verdicts
(tests/observe/test_metrics.py).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Mapping, Optional

SCHEMA_PATH = Path(__file__).with_name("metrics.schema.json")

_KNOWN_KEYWORDS = frozenset(
    "$schema $id $ref $defs title description oneOf type const enum required properties additionalProperties "
    "minimum maximum minLength minItems uniqueItems items minProperties propertyNames if then else "
    "x-allow-non-finite x-aligned-with x-entry".split()
)
_TYPE_NAMES = {"object": "a dict", "array": "a list", "string": "a str", "integer": "an int", "number": "a float"}


def load_schema(path: Path = SCHEMA_PATH) -> dict:
    """The schema file, checked to use only the keywords `validate_record` applies."""
    schema = json.loads(path.read_text(encoding="utf-8"))
    _check_keywords(schema, "#")
    return schema


def _check_keywords(node: Any, where: str) -> None:
    if isinstance(node, list):
        for index, item in enumerate(node):
            _check_keywords(item, f"{where}/{index}")
        return
    if not isinstance(node, dict):
        return
    unknown = sorted(set(node) - _KNOWN_KEYWORDS)
    if unknown:
        raise ValueError(f"{SCHEMA_PATH.name} {where}: keyword(s) {unknown} are not applied by flexpar's check")
    for key in ("properties", "$defs"):
        for name, child in node.get(key, {}).items():
            _check_keywords(child, f"{where}/{key}/{name}")
    for key in ("items", "additionalProperties", "propertyNames", "oneOf", "if", "then", "else"):
        if key in node:
            _check_keywords(node[key], f"{where}/{key}")


SCHEMA = load_schema()
RECORD_SCHEMAS = {
    branch["$ref"].rsplit("/", 1)[1]: SCHEMA["$defs"][branch["$ref"].rsplit("/", 1)[1]] for branch in SCHEMA["oneOf"]
}
"""The schema of each record kind ("step", "event", "eval")."""


def required_keys(kind: str) -> tuple:
    """Every key a record of `kind` must have, in schema order."""
    return tuple(RECORD_SCHEMAS[kind]["required"])


def optional_keys(kind: str) -> tuple:
    """The keys a record of `kind` may have beyond the required ones, in schema order."""
    schema = RECORD_SCHEMAS[kind]
    return tuple(key for key in schema["properties"] if key not in schema["required"])


# ---------------------------------------------------------------- the check


def _type_name(value: Any) -> str:
    kind = type(value)
    return kind.__name__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"


def _resolve(schema: Mapping[str, Any]) -> dict:
    """`schema` with its local `$ref` merged in (the referring node's own keywords win)."""
    if "$ref" not in schema:
        return dict(schema)
    target = SCHEMA
    for part in schema["$ref"].removeprefix("#/").split("/"):
        target = target[part]
    merged = _resolve(target)
    merged.update({key: value for key, value in schema.items() if key != "$ref"})
    return merged


def _has_type(value: Any, type_name: str) -> bool:
    # Records are Python values: bool is an int subclass but never a sensible count; an int
    # is fine where a float is expected (JSON has one number type); the balancer hands out tuples.
    if type_name == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if type_name == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if type_name == "array":
        return isinstance(value, (list, tuple))
    if type_name == "object":
        return isinstance(value, Mapping)
    if type_name == "string":
        return isinstance(value, str)
    raise ValueError(f"{SCHEMA_PATH.name}: type {type_name!r} is not applied by flexpar's check")


def _check(value: Any, schema: Mapping[str, Any], field: str) -> None:
    """Raise ValueError naming `field` unless `value` follows `schema`."""
    schema = _resolve(schema)
    if "const" in schema and value != schema["const"]:
        raise ValueError(f"field {field!r} must be {schema['const']!r}, got {value!r}")
    if "enum" in schema and value not in schema["enum"]:
        raise ValueError(f"field {field!r} must be one of {', '.join(schema['enum'])}; got {value!r}")
    type_name = schema.get("type")
    if type_name is not None and not _has_type(value, type_name):
        raise ValueError(f"field {field!r} must be {_TYPE_NAMES[type_name]}, got {_type_name(value)} {value!r}")
    if type_name in ("number", "integer"):
        _check_number(value, schema, field)
    elif type_name == "string":
        if len(value) < schema.get("minLength", 0):
            raise ValueError(f"field {field!r} must be a non-empty string, got {value!r}")
    elif type_name == "array":
        _check_array(value, schema, field)
    elif type_name == "object":
        _check_object(value, schema, field)


def _check_number(value: Any, schema: Mapping[str, Any], field: str) -> None:
    if not math.isfinite(value):
        if not schema.get("x-allow-non-finite", False):
            raise ValueError(f"field {field!r} must be finite, got {value}")
        return
    if "minimum" in schema and value < schema["minimum"]:
        raise ValueError(f"field {field!r} must be >= {schema['minimum']}, got {value}")
    if "maximum" in schema and value > schema["maximum"]:
        raise ValueError(f"field {field!r} must be <= {schema['maximum']}, got {value}")


def _check_array(value: Any, schema: Mapping[str, Any], field: str) -> None:
    entry = schema.get("x-entry", "entry")
    if len(value) < schema.get("minItems", 0):
        raise ValueError(f"field {field!r} must name at least one {entry}, got an empty list")
    if "items" in schema:
        for position, item in enumerate(value):
            _check(item, schema["items"], f"{field}[{position}]")
    if schema.get("uniqueItems") and len(set(value)) != len(value):
        repeated = sorted({item for item in value if list(value).count(item) > 1})
        raise ValueError(
            f"field {field!r} names a{'n' if entry[0] in 'aeiou' else ''} {entry} more than once: {repeated}"
        )


def _check_object(value: Mapping[str, Any], schema: Mapping[str, Any], field: str) -> None:
    if len(value) < schema.get("minProperties", 0):
        raise ValueError(f"field {field!r} must be a non-empty dict, got {value!r}")
    if "propertyNames" in schema:
        for name in value:
            if not isinstance(name, str):
                raise ValueError(f"field {field!r} has the key {name!r}; its keys must be strings")
            _check(name, {"type": "string", **schema["propertyNames"]}, f"{field} key")
    extra = schema.get("additionalProperties", True)
    if isinstance(extra, Mapping):
        for name, item in value.items():
            if name not in schema.get("properties", {}):
                _check(item, extra, f"{field}[{name!r}]")


def _check_fields(record: Mapping[str, Any], kind: str) -> None:
    """A whole record of `kind`: keys present and known, every field, then the fields aligned with `devices`."""
    schema = RECORD_SCHEMAS[kind]
    properties = schema["properties"]
    missing = [key for key in schema["required"] if key not in record]
    if missing:
        raise ValueError(f"{kind} record: field {', '.join(repr(key) for key in missing)} is missing")
    # Unknown keys are refused rather than ignored so that a typo ("los") or a field the
    # schema does not know fails where it is written, not in a plot later.
    unknown = [key for key in record if key not in properties]
    if unknown:
        raise ValueError(
            f"{kind} record: field {', '.join(repr(key) for key in unknown)} is not part of the schema "
            f"(allowed: {', '.join(properties)})"
        )
    for key, field_schema in properties.items():
        if key in record:
            _check(record[key], field_schema, key)
    for key, field_schema in properties.items():
        other = field_schema.get("x-aligned-with")
        if other is not None and key in record and len(record[key]) != len(record[other]):
            raise ValueError(
                f"field {key!r} has {len(record[key])} entries but {other!r} has {len(record[other])}; "
                "they must be aligned (one entry per device)"
            )
    if "if" in schema:
        _check_conditional(record, schema, kind)
    if "virtual_worker_sets" in record:
        _check_virtual_worker_sets(record)


def _check_conditional(record: Mapping[str, Any], schema: Mapping[str, Any], kind: str) -> None:
    """`if`/`then`/`else` over a record's fields: the branch's required fields, and its `false` fields (refused).

    The condition is a set of fields' own schemas (e.g. `event` const `adopt`),
    met when every one of them that the record has follows it.
    """
    condition = schema["if"]["properties"]
    met = True
    for name, rule in condition.items():
        try:
            if name in record:
                _check(record[name], rule, name)
        except ValueError:
            met = False
    described = " and ".join(f"{name} is {_resolve(rule).get('const')!r}" for name, rule in condition.items())
    branch = schema.get("then" if met else "else") or {}
    missing = [key for key in branch.get("required", ()) if key not in record]
    if missing:
        raise ValueError(f"{kind} record: field {', '.join(repr(key) for key in missing)} is missing ({described})")
    refused = [key for key, rule in branch.get("properties", {}).items() if rule is False and key in record]
    if refused:
        raise ValueError(
            f"{kind} record: {', '.join(repr(key) for key in refused)} only belong to a record where {described}"
        )


def _check_virtual_worker_sets(record: Mapping[str, Any]) -> None:
    """Each device's VW ids: as many as its ``assignment`` count, every VW id 0..V-1 exactly once over all."""
    sets, counts = record["virtual_worker_sets"], record["assignment"]
    for position, (members, count) in enumerate(zip(sets, counts)):
        if len(members) != count:
            raise ValueError(
                f"field 'virtual_worker_sets[{position}]' has {len(members)} VWs but "
                f"'assignment[{position}]' is {count}"
            )
    every = sorted(member for members in sets for member in members)
    if every != list(range(len(every))):
        raise ValueError("field 'virtual_worker_sets' must hold every VW id 0..V-1 exactly once")


def validate_record(record: Any) -> None:
    """Raise ValueError, naming the field and the problem, unless `record` follows the schema.

    Checks presence of every key (and no others), types (bool is not an int,
    an int is accepted for a float), ranges (counts >= 1, durations >= 0,
    imbalance in [0, 1]), finiteness, and that per-device lists align with
    ``devices``. Returns None for a valid record.
    """
    if not isinstance(record, Mapping):
        raise ValueError(f"a record must be a dict, got {_type_name(record)}")
    kinds = tuple(RECORD_SCHEMAS)
    if "kind" not in record:
        raise ValueError(f"field 'kind' is missing; it must be {_either(kinds)}")
    kind: Optional[str] = record["kind"] if isinstance(record["kind"], str) else None
    if kind not in RECORD_SCHEMAS:
        raise ValueError(f"field 'kind' must be {_either(kinds)}, got {record['kind']!r}")
    _check_fields(record, kind)


def _either(kinds: tuple) -> str:
    quoted = [repr(kind) for kind in kinds]
    return ", ".join(quoted[:-1]) + " or " + quoted[-1]
