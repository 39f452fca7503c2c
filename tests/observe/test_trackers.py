"""Trackers: TensorBoard, MLflow and CSV files of a real job, read back with each library's own reader."""

import csv
import importlib.util
import math
import os
import pathlib

import evaluation_pieces as ep
import pytest

from flexpar import FitOptions
from flexpar.observe import trackers


def _installed(module):
    return importlib.util.find_spec(module) is not None


def test_unknown_and_missing_trackers_are_refused_naming_what_to_install(monkeypatch):
    with pytest.raises(ValueError, match="unknown tracker 'neptune': choose from tensorboard, mlflow, wandb, csv"):
        FitOptions(steps=1, trackers=["neptune"])
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mlflow" else real(name, *a))
    with pytest.raises(ValueError, match=r'the mlflow tracker needs the mlflow package.*pip install -e "\.\[mlflow\]"'):
        FitOptions(steps=1, trackers=["csv", "mlflow"])
    assert FitOptions(steps=1, trackers="csv").trackers == ("csv",)


def test_a_missing_tracker_stops_fit_before_any_worker_starts(train, monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(ValueError, match="tensorboard tracker needs"):
        train(ep.make_job(), steps=2, devices=2, trackers=["tensorboard"])


def _wandb_offline(environment, folder) -> None:
    """W&B with no network and nothing written outside `folder` (its settings, cache and data folders)."""
    environment.setenv("WANDB_MODE", "offline")
    environment.delenv("WANDB_DIR", raising=False)
    environment.delenv("WANDB_PROJECT", raising=False)
    for variable, name in (("WANDB_CONFIG_DIR", "config"), ("WANDB_CACHE_DIR", "cache"), ("WANDB_DATA_DIR", "data")):
        environment.setenv(variable, str(folder / "wandb-home" / name))


@pytest.fixture(scope="module")
def tracked_run(tmp_path_factory):
    """One real job (2 devices, a failure, evaluations) with every tracker that is installed (W&B offline)."""
    names = ["csv"] + [name for name in ("tensorboard", "mlflow", "wandb") if _installed(name)]
    folder = tmp_path_factory.mktemp("tracked")
    job = ep.make_job(virtual_workers=4, eval_batch=50)
    with pytest.MonkeyPatch.context() as environment:
        _wandb_offline(environment, folder)
        try:
            return _fit_tracked(job, names, folder)
        finally:
            _stop_wandb_service(names)


def _stop_wandb_service(names) -> None:
    """wandb keeps a service process until its process exits; a test stops it (no stray processes)."""
    if "wandb" in names:
        import wandb

        wandb.teardown()


def _fit_tracked(job, names, folder):
    model, summary = job.fit(
        steps=8,
        devices=2,
        eval_every=4,
        trackers=names,
        faults="5:local-1:forward",
        metrics=str(folder / "metrics.jsonl"),
        display=False,
        quiet=True,
        oversubscribe=True,
        timeout_s=10.0,
    )
    return summary


def test_csv_parses(tracked_run):
    with open(os.path.join(tracked_run["run_dir"], "csv", "metrics.csv"), newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert list(rows[0]) == ["time", "kind", "step", "name", "value", "detail"]
    losses = [(int(row["step"]), float(row["value"])) for row in rows if row["name"] == "train/loss"]
    assert [step for step, _ in losses] == list(range(8)), "x axis: the metrics file's step"
    norms = [float(row["value"]) for row in rows if row["name"] == "train/grad_norm"]
    assert len(norms) == 8 and all(norm > 0 for norm in norms)
    evals = {(int(row["step"]), row["name"]): float(row["value"]) for row in rows if row["kind"] == "eval"}
    assert evals[(8, "eval/count")] == ep.EVAL_SIZE
    assert evals[(8, "eval/loss_mean")] == pytest.approx(evals[(8, "eval/loss_sum")] / ep.EVAL_SIZE)
    assert evals[(8, "eval/loss_sum")] == pytest.approx(tracked_run["eval"]["metrics"]["loss_sum"])
    assert {row["name"] for row in rows if row["kind"] == "event"} >= {"event/start/stall_s", "event/failure/stall_s"}


@pytest.mark.skipif(
    not _installed("tensorboard"), reason="the tensorboard package is not installed (flexpar[tensorboard])"
)
def test_tensorboard_files_read_back_with_tensorboards_reader(tracked_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(os.path.join(tracked_run["run_dir"], "tensorboard"))
    accumulator.Reload()
    tags = accumulator.Tags()["scalars"]
    assert {
        "train/loss",
        "train/lr",
        "train/grad_norm",
        "eval/loss_sum",
        "eval/correct_mean",
        "event/failure/stall_s",
    } <= set(tags)
    assert [event.step for event in accumulator.Scalars("train/loss")] == list(range(8))
    evals = accumulator.Scalars("eval/loss_sum")
    assert [event.step for event in evals] == [4, 8]
    assert evals[-1].value == pytest.approx(tracked_run["eval"]["metrics"]["loss_sum"], rel=1e-6)
    assert "events/text_summary" in accumulator.Tags()["tensors"]  # each event as text


@pytest.mark.skipif(not _installed("mlflow"), reason="the mlflow package is not installed (flexpar[mlflow])")
def test_mlflow_run_reads_back_through_mlflows_api(tracked_run, monkeypatch):
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri="file:" + os.path.join(tracked_run["run_dir"], "mlruns"))
    experiment = client.get_experiment_by_name("flexpar")
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.status == "FINISHED"
    assert run.info.run_name == os.path.basename(tracked_run["run_dir"])
    history = client.get_metric_history(run.info.run_id, "train/loss")
    assert sorted(metric.step for metric in history) == list(range(8))
    evals = sorted(client.get_metric_history(run.info.run_id, "eval/correct"), key=lambda metric: metric.step)
    assert [metric.step for metric in evals] == [4, 8]
    assert evals[-1].value == tracked_run["eval"]["metrics"]["correct"]
    assert client.get_metric_history(run.info.run_id, "event/failure/stall_s")


def wandb_history(run_folder) -> tuple:
    """(the run's id, its logged rows) from an offline W&B run's .wandb file, read with wandb's own protobuf.

    The file is a LevelDB-style log (wandb's `datastore`): a 7-byte header, then 32 KiB blocks of
    chunks, each with a 7-byte header (checksum, length, type: 1 full, 2 first, 3 middle, 4 last).
    """
    import json

    from wandb.proto import wandb_internal_pb2

    (path,) = run_folder.glob("run-*.wandb")
    data, position, pending, rows, run_id = path.read_bytes(), 7, b"", [], None
    assert data[:4] == b":W&B"
    while position + 7 <= len(data):
        room = 32768 - position % 32768
        if room < 7:  # too little room for a chunk header: the block is padded
            position += room
            continue
        length, kind = int.from_bytes(data[position + 4 : position + 6], "little"), data[position + 6]
        pending += data[position + 7 : position + 7 + length]
        position += 7 + length
        if kind not in (1, 4):
            continue
        record = wandb_internal_pb2.Record()
        record.ParseFromString(pending)
        pending = b""
        if record.WhichOneof("record_type") == "run":
            run_id = record.run.run_id
        elif record.WhichOneof("record_type") == "history":
            rows.append(
                {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            )
    return run_id, rows


@pytest.mark.skipif(not _installed("wandb"), reason="the wandb package is not installed (flexpar[wandb])")
def test_wandb_offline_run_reads_back_and_a_resumed_job_continues_it(tracked_run, tmp_path, monkeypatch):
    """trackers=["wandb"] with WANDB_MODE=offline: no network, a run in RUN_DIR/wandb whose rows carry the
    metrics file's step as `step`; a resumed job (a restarted driver) logs into the same run."""
    run_dir = tracked_run["run_dir"]
    (folder,) = (pathlib.Path(run_dir) / "wandb").glob("offline-run-*")
    run_id, rows = wandb_history(folder)
    losses = [(row["step"], row["train/loss"]) for row in rows if "train/loss" in row]
    assert [step for step, _ in losses] == list(range(8)), "x axis: the metrics file's step"
    assert all(math.isfinite(loss) for _, loss in losses)
    evals = [row for row in rows if "eval/loss_sum" in row]
    assert [row["step"] for row in evals] == [4, 8]
    assert evals[-1]["eval/loss_sum"] == pytest.approx(tracked_run["eval"]["metrics"]["loss_sum"])
    assert evals[-1]["eval/count"] == ep.EVAL_SIZE
    assert any("event/failure/stall_s" in row for row in rows)

    _wandb_offline(monkeypatch, tmp_path)
    try:
        resumed = trackers.create(["wandb"], run_dir, resume=True)[0]
        resumed.on_step({**_STEP, "step": 8, "loss": 0.125})
        resumed.finish_tracking()
    finally:
        _stop_wandb_service(["wandb"])
    (later,) = [other for other in (pathlib.Path(run_dir) / "wandb").glob("offline-run-*") if other != folder]
    resumed_id, resumed_rows = wandb_history(later)
    assert resumed_id == run_id and [(row["step"], row["train/loss"]) for row in resumed_rows] == [(8, 0.125)]

    # wandb's own refusal (online without a login, as wandb words it): one line before any worker starts.
    import wandb

    def no_login(**settings):
        raise wandb.errors.UsageError("No API key configured. Use `wandb login` to log in.")

    monkeypatch.setattr(wandb, "init", no_login)
    with pytest.raises(ValueError, match=r"wandb tracker cannot start a run \(No API key.*WANDB_MODE=offline"):
        trackers.WandbTracker(str(tmp_path / "online"))


def test_trackers_are_callbacks_and_log_the_metrics_files_step_on_the_x_axis(tmp_path):
    """One numbering everywhere: the step record of step 0 is at 0 in the CSV (and every tracker), as in
    metrics.jsonl (they logged it at 1)."""
    tracker = trackers.create(["csv"], str(tmp_path))[0]
    assert isinstance(tracker, trackers.Tracker)
    step = {**_STEP, "time": 1.0}
    tracker.on_step(step)
    tracker.finish_tracking()
    rows = list(csv.DictReader(open(tmp_path / "csv" / "metrics.csv")))
    assert {row["step"] for row in rows} == {"0"} and len(rows) == 8
    assert {row["name"]: float(row["value"]) for row in rows}["train/grad_norm"] == 0.5


_STEP = {
    "kind": "step",
    "step": 0,
    "time": 1700000000.0,
    "elapsed_s": 0.0,
    "loss": 2.0,
    "samples_per_s": 10.0,
    "step_time_s": 0.1,
    "generation": 1,
    "devices": ["local-0"],
    "assignment": [2],
    "busy_s": [0.1],
    "imbalance": 0.0,
    "lr": 0.1,
    "grad_norm": 0.5,
}


def _steps_with_an_fp16_skip():
    """Steps 0-2; step 1 was skipped for an inf gradient (fp16), as its record says with grad_norm inf."""
    return [
        {**_STEP, "step": 0},
        {**_STEP, "step": 1, "grad_norm": float("inf")},
        {**_STEP, "step": 2, "grad_norm": float("nan")},
        {**_STEP, "step": 3, "grad_norm": 0.25},
    ]


def test_a_skipped_fp16_step_is_a_marker_not_an_infinite_grad_norm(tmp_path):
    """Every tracker logs only finite values: a skipped step's grad_norm (inf/NaN) becomes train/skipped_step."""
    values = [trackers.step_values(record) for record in _steps_with_an_fp16_skip()]
    assert [value.get("train/grad_norm") for value in values] == [0.5, None, None, 0.25]
    assert [value.get("train/skipped_step") for value in values] == [None, 1.0, 1.0, None]
    assert all(math.isfinite(number) for value in values for number in value.values())
    names = ["csv"] + [name for name in ("tensorboard", "mlflow") if _installed(name)]
    created = trackers.create(names, str(tmp_path))
    for tracker in created:
        for record in _steps_with_an_fp16_skip():
            tracker.on_step(record)
        tracker.finish_tracking()
    rows = list(csv.DictReader(open(tmp_path / "csv" / "metrics.csv")))
    assert [(int(row["step"]), float(row["value"])) for row in rows if row["name"] == "train/grad_norm"] == [
        (0, 0.5),
        (3, 0.25),
    ]
    assert [int(row["step"]) for row in rows if row["name"] == "train/skipped_step"] == [1, 2]
    if "tensorboard" in names:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        accumulator = EventAccumulator(str(tmp_path / "tensorboard"))
        accumulator.Reload()
        assert [(e.step, e.value) for e in accumulator.Scalars("train/grad_norm")] == [(0, 0.5), (3, 0.25)]
        assert [e.step for e in accumulator.Scalars("train/skipped_step")] == [1, 2]
    if "mlflow" in names:
        tracker = created[names.index("mlflow")]
        with tracker._file_store_allowed():
            from mlflow.tracking import MlflowClient

            history = MlflowClient(tracking_uri=tracker.tracking_uri).get_metric_history(
                tracker.run_id, "train/grad_norm"
            )
        assert sorted((metric.step, metric.value) for metric in history) == [(0, 0.5), (3, 0.25)]


def test_the_csv_file_cannot_be_the_metrics_file_and_an_earlier_one_is_kept(tmp_path, capsys):
    """`--metrics run/metrics.csv` makes `run` the run directory: the CSV tracker writes run/csv/, not over it.
    A second run into the same run directory keeps the first run's CSV and says where its own goes."""
    metrics_file = tmp_path / "metrics.csv"
    metrics_file.write_text('{"kind": "step"}\n')  # the job's metrics file, by the user's choice of name
    first = trackers.CSVTracker(str(tmp_path))
    first.on_step(_STEP)
    first.finish_tracking()
    assert metrics_file.read_text() == '{"kind": "step"}\n'
    assert first.path == str(tmp_path / "csv" / "metrics.csv")
    before = open(first.path).read()
    second = trackers.CSVTracker(str(tmp_path))
    second.on_step({**_STEP, "step": 5})
    second.finish_tracking()
    assert second.path == str(tmp_path / "csv" / "metrics-2.csv")
    assert open(first.path).read() == before, "the earlier run's CSV is not overwritten"
    said = capsys.readouterr().err
    assert f"keeps {first.path} (an earlier run's) and writes {second.path}" in said, said
    third = trackers.CSVTracker(str(tmp_path))
    third.finish_tracking()
    assert third.path.endswith("metrics-3.csv")


@pytest.mark.skipif(not _installed("mlflow"), reason="the mlflow package is not installed (flexpar[mlflow])")
def test_mlflow_file_store_permission_does_not_leak_into_the_users_environment(tmp_path, monkeypatch):
    """MLFLOW_ALLOW_FILE_STORE is set around flexpar's own MLflow calls only; a value the user set stays."""
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    tracker = trackers.MLflowTracker(str(tmp_path), flush_s=0.0)
    tracker.on_step(_STEP)
    assert "MLFLOW_ALLOW_FILE_STORE" not in os.environ
    tracker.finish_tracking()
    assert "MLFLOW_ALLOW_FILE_STORE" not in os.environ
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=tracker.tracking_uri)
    assert client.get_run(tracker.run_id).info.status == "FINISHED"
    assert [metric.value for metric in client.get_metric_history(tracker.run_id, "train/loss")] == [2.0]
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "false")  # the user's own choice is theirs
    refused = trackers.MLflowTracker(str(tmp_path / "other"))
    with pytest.raises(Exception, match="MLFLOW_ALLOW_FILE_STORE"):
        refused.on_step(_STEP)
    assert os.environ["MLFLOW_ALLOW_FILE_STORE"] == "false"


def test_the_command_line_flags_reach_fit(tmp_path):
    """`flexpar run --eval-every N --tracker NAME --keep-checkpoints K`: the script's fit() gets them."""
    import json
    import textwrap

    from conftest import TESTS, flexpar_command

    script = tmp_path / "train.py"
    script.write_text(
        textwrap.dedent(f"""
        import json, sys
        sys.path.insert(0, {TESTS!r})
        import evaluation_pieces as ep
        if __name__ == "__main__":
            model, summary = ep.make_job(eval_batch=100).fit(steps=4)
            print("SUMMARY", json.dumps({{"eval": summary["eval"], "run_dir": summary["run_dir"]}}))
    """)
    )
    result = flexpar_command(
        "run",
        "--eval-every",
        "2",
        "--tracker",
        "csv",
        "--keep-checkpoints",
        "1",
        "--checkpoint-every",
        "1",
        "--checkpoint-dir",
        str(tmp_path / "ck"),
        "--no-display",
        "--metrics",
        str(tmp_path / "run" / "metrics.jsonl"),
        str(script),
        timeout_s=120,
        cwd=str(tmp_path),
    )
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout.split("SUMMARY", 1)[1])
    assert summary["eval"]["step"] == 4 and summary["eval"]["metrics"]["count"] == ep.EVAL_SIZE
    rows = list(csv.DictReader(open(os.path.join(summary["run_dir"], "csv", "metrics.csv"))))
    assert sorted({int(row["step"]) for row in rows if row["kind"] == "eval"}) == [2, 4]
    assert os.listdir(tmp_path / "ck") == ["step-00000004.pt"]
    assert "eval at step 2" in result.stderr, "the log line of an evaluation"
    refused = flexpar_command("run", "--tracker", "neptune", str(script), timeout_s=60, cwd=str(tmp_path))
    assert refused.returncode == 2 and "invalid choice: 'neptune'" in refused.stderr
