"""Trackers: TensorBoard, MLflow and CSV files of a real job, read back with each library's own reader."""

import csv
import importlib.util
import os

import pytest

import evaluation_pieces as ep
from flexpar import FitOptions, trackers


def _installed(module):
    return importlib.util.find_spec(module) is not None


def test_unknown_and_missing_trackers_are_refused_naming_what_to_install(monkeypatch):
    with pytest.raises(ValueError, match="unknown tracker 'wandb': choose from tensorboard, mlflow, csv"):
        FitOptions(steps=1, trackers=["wandb"])
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mlflow" else real(name, *a))
    with pytest.raises(ValueError, match=r"the mlflow tracker needs the mlflow package.*flexpar\[mlflow\]"):
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
    model, summary = job.fit(steps=8, devices=2, eval_every=4, trackers=names, faults="5:local-1:forward",
                             metrics=str(folder / "metrics.jsonl"), display=False, quiet=True,
                             oversubscribe=True, timeout_s=10.0)
    return summary


def test_csv_parses(tracked_run):
    with open(os.path.join(tracked_run["run_dir"], "metrics.csv"), newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert list(rows[0]) == ["time", "kind", "step", "name", "value", "detail"]
    losses = [(int(row["step"]), float(row["value"])) for row in rows if row["name"] == "train/loss"]
    assert [step for step, _ in losses] == list(range(1, 9)), "x axis: optimizer steps done"
    evals = {(int(row["step"]), row["name"]): float(row["value"]) for row in rows if row["kind"] == "eval"}
    assert evals[(8, "eval/count")] == ep.EVAL_SIZE
    assert evals[(8, "eval/loss_mean")] == pytest.approx(evals[(8, "eval/loss_sum")] / ep.EVAL_SIZE)
    assert evals[(8, "eval/loss_sum")] == pytest.approx(tracked_run["eval"]["metrics"]["loss_sum"])
    assert {row["name"] for row in rows if row["kind"] == "event"} >= {"event/start/stall_s", "event/failure/stall_s"}


@pytest.mark.skipif(not _installed("tensorboard"), reason="the tensorboard package is not installed (flexpar[tensorboard])")
def test_tensorboard_files_read_back_with_tensorboards_reader(tracked_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(os.path.join(tracked_run["run_dir"], "tensorboard"))
    accumulator.Reload()
    tags = accumulator.Tags()["scalars"]
    assert {"train/loss", "train/lr", "eval/loss_sum", "eval/correct_mean", "event/failure/stall_s"} <= set(tags)
    assert [event.step for event in accumulator.Scalars("train/loss")] == list(range(1, 9))
    evals = accumulator.Scalars("eval/loss_sum")
    assert [event.step for event in evals] == [4, 8]
    assert evals[-1].value == pytest.approx(tracked_run["eval"]["metrics"]["loss_sum"], rel=1e-6)
    assert "events/text_summary" in accumulator.Tags()["tensors"]  # each event as text


@pytest.mark.skipif(not _installed("mlflow"), reason="the mlflow package is not installed (flexpar[mlflow])")
def test_mlflow_run_reads_back_through_mlflows_api(tracked_run):
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
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
    step = {"kind": "step", "step": 0, "time": 1.0, "elapsed_s": 0.0, "loss": 2.0, "samples_per_s": 10.0,
            "step_time_s": 0.1, "generation": 1, "devices": ["local-0"], "assignment": [2], "busy_s": [0.1],
            "imbalance": 0.0, "lr": 0.1, "grad_norm": 0.5}
    tracker.on_step(step)
    tracker.finish_tracking()
    rows = list(csv.DictReader(open(tmp_path / "metrics.csv")))
    assert {row["step"] for row in rows} == {"1"} and len(rows) == 7


def test_the_command_line_flags_reach_fit(tmp_path):
    """`flexpar run --eval-every N --tracker NAME --keep-checkpoints K`: the script's fit() gets them."""
    import json
    import textwrap

    from conftest import TESTS, flexpar_command

    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(f"""
        import json, sys
        sys.path.insert(0, {TESTS!r})
        import evaluation_pieces as ep
        if __name__ == "__main__":
            model, summary = ep.make_job(eval_batch=100).fit(steps=4)
            print("SUMMARY", json.dumps({{"eval": summary["eval"], "run_dir": summary["run_dir"]}}))
    """))
    result = flexpar_command("run", "--eval-every", "2", "--tracker", "csv", "--keep-checkpoints", "1",
                             "--checkpoint-every", "1", "--checkpoint-dir", str(tmp_path / "ck"),
                             "--no-display", "--metrics", str(tmp_path / "run" / "metrics.jsonl"), str(script),
                             timeout_s=120, cwd=str(tmp_path))
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout.split("SUMMARY", 1)[1])
    assert summary["eval"]["step"] == 4 and summary["eval"]["metrics"]["count"] == ep.EVAL_SIZE
    rows = list(csv.DictReader(open(os.path.join(summary["run_dir"], "metrics.csv"))))
    assert sorted({int(row["step"]) for row in rows if row["kind"] == "eval"}) == [2, 4]
    assert os.listdir(tmp_path / "ck") == ["step-00000004.pt"]
    assert "eval at step 2" in result.stderr, "the log line of an evaluation"
    refused = flexpar_command("run", "--tracker", "wandb", str(script), timeout_s=60, cwd=str(tmp_path))
    assert refused.returncode == 2 and "invalid choice: 'wandb'" in refused.stderr
