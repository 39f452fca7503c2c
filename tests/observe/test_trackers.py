"""Trackers: TensorBoard, MLflow and CSV files of a real job, read back with each library's own reader."""

import csv
import importlib.util
import math
import os

import evaluation_pieces as ep
import pytest

from flexpar import FitOptions
from flexpar.observe import trackers


def _installed(module):
    return importlib.util.find_spec(module) is not None


def test_unknown_and_missing_trackers_are_refused_naming_what_to_install(monkeypatch):
    with pytest.raises(ValueError, match="unknown tracker 'wandb': choose from tensorboard, mlflow, csv"):
        FitOptions(steps=1, trackers=["wandb"])
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mlflow" else real(name, *a))
    with pytest.raises(ValueError, match=r'the mlflow tracker needs the mlflow package.*pip install -e "\.\[mlflow\]"'):
        FitOptions(steps=1, trackers=["csv", "mlflow"])
    assert FitOptions(steps=1, trackers="csv").trackers == ("csv",)


def test_a_missing_tracker_stops_fit_before_any_worker_starts(train, monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(ValueError, match="tensorboard tracker needs"):
        train(ep.make_job(), steps=2, devices=2, trackers=["tensorboard"])


@pytest.fixture(scope="module")
def tracked_run(tmp_path_factory):
    """One real job (2 devices, a failure, evaluations) with every tracker that is installed."""
    names = ["csv"] + [name for name in ("tensorboard", "mlflow") if _installed(name)]
    folder = tmp_path_factory.mktemp("tracked")
    job = ep.make_job(virtual_workers=4, eval_batch=50)
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
    assert [step for step, _ in losses] == list(range(1, 9)), "x axis: optimizer steps done"
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
    assert [event.step for event in accumulator.Scalars("train/loss")] == list(range(1, 9))
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
    assert sorted(metric.step for metric in history) == list(range(1, 9))
    evals = sorted(client.get_metric_history(run.info.run_id, "eval/correct"), key=lambda metric: metric.step)
    assert [metric.step for metric in evals] == [4, 8]
    assert evals[-1].value == tracked_run["eval"]["metrics"]["correct"]
    assert client.get_metric_history(run.info.run_id, "event/failure/stall_s")


def test_trackers_are_callbacks_and_log_steps_done_on_the_x_axis(tmp_path):
    tracker = trackers.create(["csv"], str(tmp_path))[0]
    assert isinstance(tracker, trackers.Tracker)
    step = {**_STEP, "time": 1.0}
    tracker.on_step(step)
    tracker.finish_tracking()
    rows = list(csv.DictReader(open(tmp_path / "csv" / "metrics.csv")))
    assert {row["step"] for row in rows} == {"1"} and len(rows) == 8
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
        (1, 0.5),
        (4, 0.25),
    ]
    assert [int(row["step"]) for row in rows if row["name"] == "train/skipped_step"] == [2, 3]
    if "tensorboard" in names:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        accumulator = EventAccumulator(str(tmp_path / "tensorboard"))
        accumulator.Reload()
        assert [(e.step, e.value) for e in accumulator.Scalars("train/grad_norm")] == [(1, 0.5), (4, 0.25)]
        assert [e.step for e in accumulator.Scalars("train/skipped_step")] == [2, 3]
    if "mlflow" in names:
        tracker = created[names.index("mlflow")]
        with tracker._file_store_allowed():
            from mlflow.tracking import MlflowClient

            history = MlflowClient(tracking_uri=tracker.tracking_uri).get_metric_history(
                tracker.run_id, "train/grad_norm"
            )
        assert sorted((metric.step, metric.value) for metric in history) == [(1, 0.5), (4, 0.25)]


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
    refused = flexpar_command("run", "--tracker", "wandb", str(script), timeout_s=60, cwd=str(tmp_path))
    assert refused.returncode == 2 and "invalid choice: 'wandb'" in refused.stderr
