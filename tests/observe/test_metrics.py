"""Tests for flexpar.observe.metrics: record schema, validation, JSON lines, the shared pure helpers.

The live display is tested in test_display.py and the timeline plot in
test_plot.py; all three use the synthetic run of metrics_pieces.py.
"""

from __future__ import annotations

import ast
import json
import logging
import subprocess
import sys
from pathlib import Path

import pieces
import pytest
from metrics_pieces import TOTAL_STEPS, synthetic_run, write_run

from flexpar.observe.metrics import (
    EVENT_KEYS,
    EVENT_KINDS,
    STEP_KEYS,
    MetricsWriter,
    device_change,
    event_label,
    format_split,
    read_records,
    rebalance_change,
    validate_record,
)

FLEXPAR = Path(__file__).resolve().parents[2] / "flexpar" / "observe"


@pytest.fixture
def records() -> list[dict]:
    return synthetic_run()


@pytest.fixture
def metrics_file(tmp_path, records):
    path = tmp_path / "run" / "metrics.jsonl"
    write_run(path, records)
    return path


def step_record() -> dict:
    return next(record for record in synthetic_run() if record["kind"] == "step" and record["step"] == 35)


def event_record(kind: str = "join") -> dict:
    return next(record for record in synthetic_run() if record["kind"] == "event" and record["event"] == kind)


# --- schema -------------------------------------------------------------------


def test_synthetic_records_cover_the_schema_and_validate(records):
    for record in records:
        validate_record(record)
        expected = STEP_KEYS if record["kind"] == "step" else EVENT_KEYS
        assert tuple(record) == expected
    assert {record["event"] for record in records if record["kind"] == "event"} <= set(EVENT_KINDS)
    assert [record["step"] for record in records if record["kind"] == "step"] == list(range(TOTAL_STEPS))


STEP_BREAKAGES = [
    ("missing loss", lambda r: r.pop("loss"), "'loss'"),
    ("unknown key", lambda r: r.update(los=1.0), "'los'"),
    ("bool step", lambda r: r.update(step=True), "'step'"),
    ("negative step", lambda r: r.update(step=-1), "'step'"),
    ("string loss", lambda r: r.update(loss="0.5"), "'loss'"),
    ("generation zero", lambda r: r.update(generation=0), "'generation'"),
    ("nan throughput", lambda r: r.update(samples_per_s=float("nan")), "'samples_per_s'"),
    ("negative step time", lambda r: r.update(step_time_s=-0.1), "'step_time_s'"),
    ("devices not a list", lambda r: r.update(devices="local-0"), "'devices'"),
    ("no devices", lambda r: r.update(devices=[], assignment=[], busy_s=[]), "'devices'"),
    ("integer device id", lambda r: r["devices"].__setitem__(0, 3), "'devices[0]'"),
    ("repeated device", lambda r: r["devices"].__setitem__(1, r["devices"][0]), "'devices'"),
    ("negative VWs", lambda r: r["assignment"].__setitem__(0, -1), "'assignment[0]'"),
    ("float VWs", lambda r: r["assignment"].__setitem__(1, 2.0), "'assignment[1]'"),
    ("short busy", lambda r: r["busy_s"].pop(), "'busy_s'"),
    ("short assignment", lambda r: r["assignment"].pop(), "'assignment'"),
    ("negative busy", lambda r: r["busy_s"].__setitem__(0, -1.0), "'busy_s[0]'"),
    ("imbalance above one", lambda r: r.update(imbalance=1.5), "'imbalance'"),
    ("negative lr", lambda r: r.update(lr=-0.1), "'lr'"),
    ("unknown kind", lambda r: r.update(kind="steps"), "'kind'"),
    ("missing kind", lambda r: r.pop("kind"), "'kind'"),
]


@pytest.mark.parametrize("breakage", STEP_BREAKAGES, ids=[name for name, _, _ in STEP_BREAKAGES])
def test_bad_step_records_are_rejected_naming_the_field(breakage):
    _name, damage, field = breakage
    record = step_record()
    validate_record(record)
    damage(record)
    with pytest.raises(ValueError, match=field.replace("[", r"\[").replace("]", r"\]")):
        validate_record(record)


EVENT_BREAKAGES = [
    ("unknown event", lambda r: r.update(event="crash"), "'event'"),
    ("missing stall", lambda r: r.pop("stall_s"), "'stall_s'"),
    ("negative stall", lambda r: r.update(stall_s=-0.5), "'stall_s'"),
    ("detail not text", lambda r: r.update(detail=None), "'detail'"),
    ("infinite time", lambda r: r.update(time=float("inf")), "'time'"),
    ("step record key", lambda r: r.update(loss=0.1), "'loss'"),
]


@pytest.mark.parametrize("breakage", EVENT_BREAKAGES, ids=[name for name, _, _ in EVENT_BREAKAGES])
def test_bad_event_records_are_rejected_naming_the_field(breakage):
    _name, damage, field = breakage
    record = event_record()
    validate_record(record)
    damage(record)
    with pytest.raises(ValueError, match=field):
        validate_record(record)


def test_schedule_and_stop_are_event_kinds():
    assert {"schedule", "stop"} <= set(EVENT_KINDS)
    schedule = event_record("schedule")
    validate_record(schedule)
    validate_record({**schedule, "event": "stop", "detail": "SIGTERM to the driver; stopped after step 41"})


def test_tolerated_values():
    record = step_record()
    record.update(loss=float("nan"), lr=0, devices=tuple(record["devices"]))
    validate_record(record)  # diverged loss, an int for a float, tuples from the balancer
    event = event_record()
    event.update(event="end", devices=[])
    validate_record(event)  # nobody left at the end
    with pytest.raises(ValueError, match="must be a dict"):
        validate_record([("kind", "step")])


# --- JSON lines -----------------------------------------------------------------


def test_writer_writes_one_flushed_line_per_record_and_creates_folders(tmp_path, records):
    path = tmp_path / "a" / "b" / "metrics.jsonl"
    writer = MetricsWriter(path)
    writer.write(records[0])
    writer.write(records[1])
    # Flushed: readable by another reader before close.
    assert read_records(path) == records[:2]
    writer.close()
    writer.close()
    lines = path.read_text().splitlines()
    assert [json.loads(line) for line in lines] == records[:2]
    with pytest.raises(ValueError, match="closed"):
        writer.write(records[2])


def test_writer_refuses_an_invalid_record_without_writing(tmp_path):
    path = tmp_path / "metrics.jsonl"
    with MetricsWriter(path) as writer:
        bad = step_record()
        bad["imbalance"] = 2.0
        with pytest.raises(ValueError, match="'imbalance'"):
            writer.write(bad)
        writer.write(step_record())
    assert len(path.read_text().splitlines()) == 1


def test_read_records_round_trips_nan_loss(tmp_path):
    record = step_record()
    record["loss"] = float("nan")
    path = tmp_path / "metrics.jsonl"
    with MetricsWriter(path) as writer:
        writer.write(record)
    [read] = read_records(path)
    assert read["loss"] != read["loss"]


def test_read_records_drops_a_truncated_last_line_only(tmp_path, metrics_file, records, caplog):
    text = metrics_file.read_text()
    truncated = tmp_path / "truncated.jsonl"
    truncated.write_text(text + json.dumps(step_record())[:40])
    with caplog.at_level(logging.WARNING, logger="flexpar"):
        assert read_records(truncated) == records
    assert "truncated" in caplog.text

    lines = text.splitlines()
    lines[3] = lines[3][:30]
    corrupt = tmp_path / "corrupt.jsonl"
    corrupt.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=r"corrupt\.jsonl:4: not valid JSON"):
        read_records(corrupt)

    invalid = tmp_path / "invalid.jsonl"
    bad = step_record()
    bad["generation"] = 0
    invalid.write_text(lines[0] + "\n" + json.dumps(bad) + "\n")
    with pytest.raises(ValueError, match=r"invalid\.jsonl:2: field 'generation'"):
        read_records(invalid)


# --- pure helpers -----------------------------------------------------------------


def test_device_change_and_event_labels():
    assert device_change(["a", "b"], ["b", "c", "d"]) == (["c", "d"], ["a"])
    join = {"event": "join", "devices": ["a", "b", "c"], "stall_s": 0.2149}
    assert event_label(join, ["a", "b"]) == "+1 join (stall 0.21 s)"
    failure = {"event": "failure", "devices": ["a"], "stall_s": 0.8}
    assert event_label(failure, ["a", "b", "c"]) == "-2 failure (stall 0.80 s)"
    assert event_label({"event": "leave", "devices": ["a"], "stall_s": 0.0}, ["a"]) == "leave"


def test_rebalance_change_reads_the_workers_detail():
    event = {"event": "rebalance", "detail": "[8, 8] -> [9, 7]"}
    assert rebalance_change(event) == ([8, 8], [9, 7])
    assert format_split([9, 7]) == "9,7"
    assert rebalance_change({"event": "rebalance", "detail": "[12,11,6,3]->[12, 12, 6, 2]"}) == (
        [12, 11, 6, 3],
        [12, 12, 6, 2],
    )
    assert rebalance_change({"event": "rebalance", "detail": "assignment 6 5 5"}) is None
    assert rebalance_change({"event": "join", "detail": "[8, 8] -> [9, 7]"}) is None


# --- module structure ----------------------------------------------------------------


def test_metrics_imports_neither_the_display_nor_the_plot():
    # display and plot import from metrics, never the reverse (no import circle),
    # and reading or writing records needs neither rich nor matplotlib.
    tree = ast.parse((FLEXPAR / "metrics.py").read_text())
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    imported |= {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    assert not {"flexpar.observe.display", "flexpar.observe.plot", "rich", "matplotlib"} & imported
    for module in ("display", "plot"):
        source = ast.parse((FLEXPAR / f"{module}.py").read_text())
        assert "flexpar.observe.metrics" in {
            node.module for node in ast.walk(source) if isinstance(node, ast.ImportFrom)
        }
    check = (
        "import sys, flexpar.observe.metrics, flexpar.observe.display, flexpar.observe.plot; "
        "print(sorted(m for m in ('rich', 'matplotlib') if m in sys.modules))"
    )
    completed = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, check=True, timeout=60)
    assert completed.stdout.strip() == "[]"  # both extras stay lazy


def test_step_records_of_balancing_by_cost_carry_their_sets_and_costs():
    """The optional keys `cost` and `virtual_worker_sets` (Job(sample_cost=...)): checked when present."""
    import copy

    from flexpar.observe.metrics import validate_record

    record = {
        "kind": "step",
        "step": 3,
        "time": 1.0,
        "elapsed_s": 2.0,
        "loss": 0.5,
        "samples_per_s": 10.0,
        "step_time_s": 0.1,
        "generation": 1,
        "devices": ["a", "b"],
        "assignment": [3, 1],
        "busy_s": [0.05, 0.04],
        "imbalance": 0.2,
        "lr": 0.1,
        "grad_norm": 1.0,
        "cost": [30.0, 28.0],
        "virtual_worker_sets": [[0, 2, 3], [1]],
    }
    validate_record(record)
    for change, message in (
        (lambda r: r.update(virtual_worker_sets=[[0, 2], [1, 3]]), "has 2 VWs"),
        (lambda r: r.update(virtual_worker_sets=[[0, 2, 2], [1]]), "exactly once"),
        (lambda r: r.update(cost=[30.0]), "'cost' has 1 entries"),
        (lambda r: r.update(cost=[-1.0, 2.0]), r"cost\[0\]"),
        (lambda r: r.update(costs=[1.0, 2.0]), "'costs' is not part of the schema"),
    ):
        broken = copy.deepcopy(record)
        change(broken)
        with pytest.raises(ValueError, match=message):
            validate_record(broken)


# --- the schema file, read by jsonschema ------------------------------------------------

jsonschema = pytest.importorskip("jsonschema", reason="jsonschema checks the schema file (pip install -e '.[test]')")

SCHEMA_FILE = FLEXPAR / "metrics.schema.json"

# Breakages whose rule is one of flexpar's own keywords (finiteness, alignment with `devices`)
# or Python's types (a float 2.0 is an integer to JSON Schema, not to flexpar): a standard
# validator does not see them, flexpar's does (the tests above).
BEYOND_JSON_SCHEMA = {"nan throughput", "float VWs", "short busy", "short assignment", "infinite time"}


def _standard_validator():
    schema = json.loads(SCHEMA_FILE.read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def test_the_schema_file_is_a_valid_json_schema_and_every_record_kind_is_in_it():
    validator = _standard_validator()
    kinds = {branch["$ref"].rsplit("/", 1)[1] for branch in validator.schema["oneOf"]}
    assert kinds == {"step", "event", "eval"}
    assert tuple(validator.schema["$defs"]["step"]["required"]) == STEP_KEYS


def test_the_records_of_a_run_follow_the_schema_file(metrics_file):
    validator = _standard_validator()
    for line in metrics_file.read_text().splitlines():
        errors = [error.message for error in validator.iter_errors(json.loads(line))]
        assert not errors, (line, errors)


@pytest.mark.parametrize(
    "breakage", STEP_BREAKAGES + EVENT_BREAKAGES, ids=[name for name, _, _ in STEP_BREAKAGES + EVENT_BREAKAGES]
)
def test_the_schema_file_refuses_what_flexpar_refuses(breakage):
    name, damage, _field = breakage
    record = step_record() if (name, damage, _field) in STEP_BREAKAGES else event_record()
    damage(record)
    with pytest.raises(ValueError):
        validate_record(record)  # flexpar's own check refuses every breakage
    if name in BEYOND_JSON_SCHEMA:
        pytest.skip("a rule beyond standard JSON Schema (see record_schema.py)")
    assert not _standard_validator().is_valid(json.loads(json.dumps(record)))


def test_the_records_of_a_real_job_follow_the_schema_file(tmp_path, train):
    """A job with an evaluation and balancing by cost writes every kind of record and the optional keys."""
    import cost_pieces
    import evaluation_pieces

    job = evaluation_pieces.make_job(sample_cost=cost_pieces.LabelCost(pieces.make_dataset()))
    train(job, steps=3, devices=2, eval_every=2, metrics=str(tmp_path / "metrics.jsonl"))
    validator = _standard_validator()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert {record["kind"] for record in records} == {"step", "event", "eval"}
    assert all("virtual_worker_sets" in record for record in records if record["kind"] == "step")
    for record in records:
        errors = [error.message for error in validator.iter_errors(record)]
        assert not errors, (record, errors)
