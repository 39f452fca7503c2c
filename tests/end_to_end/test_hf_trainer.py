"""flexpar.hf.Trainer against transformers.Trainer: one Trainer script (tests/hf/trainer_script.py), run
by both, with only its import changed.

Every run is a real process (`python train.py`, `flexpar run ... train.py`), as a user runs the script.
The baseline is transformers.Trainer on one CPU process. Each run is shared between the assertions about
it: parameters within the float-order floor, the logs, evaluate() with compute_metrics, TrainerCallback
events once each, checkpoint-N folders with save_total_limit, tensorboard, save_model, a resume on
another device count, and a peft LoRA model.
"""

import glob
import importlib.util
import json
import os
import shlex
import subprocess
import sys

import pytest
import torch
from conftest import free_port, wait_for

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "hf", "trainer_script.py")
STEPS = 24
FLOOR = 3e-4  # relative per tensor: float summation order (an attention key's bias sees its rounding residue)

pytest.importorskip("transformers")


def _run(output, command, timeout_s=240, **environment):
    """Run the Trainer script (`command`: the launcher's words before it) writing to `output`; its result."""
    env = {**os.environ, "HF_SCRIPT_OUTPUT": str(output), "HF_SCRIPT_STEPS": str(STEPS), **environment}
    completed = subprocess.run(
        [*command, SCRIPT],
        env=env,
        cwd=os.path.dirname(str(output)),
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    assert completed.returncode == 0, completed.stderr[-6000:]
    return torch.load(os.path.join(output, "result.pt"), weights_only=False)


def _script():
    """The Trainer script as a module (its model builder), HF_SCRIPT_* as they are in this process."""
    specification = importlib.util.spec_from_file_location("trainer_script", SCRIPT)
    module = importlib.util.module_from_spec(specification)
    specification.loader.exec_module(module)
    return module


def _python(output, **environment):
    return _run(output, [sys.executable], **environment)


def _flexpar_run(output, flags, **environment):
    return _run(
        output, [sys.executable, "-m", "flexpar", "run", "--no-display", "--oversubscribe", *flags], **environment
    )


def _without_key_biases(state: dict) -> dict:
    """`state` with each attention's key bias (the middle third of GPT-2's c_attn.bias) left out.

    Its true gradient is zero (softmax ignores a constant added to every key score), so it holds only the
    rounding residue of the gradient sums, which AdamW scales up to full-size steps: the README says so,
    and `_key_bias_drift` bounds it against the whole tensor instead.
    """
    parts = {}
    for name, tensor in state.items():
        if name.endswith("c_attn.bias"):
            third = tensor.numel() // 3
            parts[name + "[query]"], parts[name + "[value]"] = tensor[:third], tensor[2 * third :]
        else:
            parts[name] = tensor
    return parts


def _largest_relative_difference(expected: dict, got: dict) -> float:
    """The largest per-tensor |expected - got| / |expected| (2-norms), key biases left out."""
    assert set(expected) == set(got)
    expected, got = _without_key_biases(expected), _without_key_biases(got)
    return max(
        float((expected[k].float() - got[k].float()).norm() / (expected[k].float().norm() + 1e-12)) for k in expected
    )


def _key_bias_drift(expected: dict, got: dict) -> float:
    """The largest key-bias difference relative to its whole c_attn.bias tensor."""
    drifts = [0.0]
    for name, tensor in expected.items():
        if name.endswith("c_attn.bias"):
            drifts.append(float((tensor - got[name]).norm() / tensor.norm()))
    return max(drifts)


def _metrics_records(output):
    (path,) = glob.glob(os.path.join(output, "flexpar-runs", "*", "metrics.jsonl"))
    return [json.loads(line) for line in open(path)]


def _offline_trackers(folder) -> dict:
    """The script's environment for report_to tensorboard, wandb (offline, its files in `folder`) and mlflow
    (flexpar's default file store in the run directory), or tensorboard alone where those are not installed."""
    names = ["tensorboard"] + [name for name in ("wandb", "mlflow") if importlib.util.find_spec(name)]
    environment = {"HF_SCRIPT_REPORT": ",".join(names), "WANDB_MODE": "offline", "WANDB_DIR": str(folder)}
    for variable, name in (("WANDB_CONFIG_DIR", "config"), ("WANDB_CACHE_DIR", "cache"), ("WANDB_DATA_DIR", "data")):
        environment[variable] = str(folder / "wandb-home" / name)
    return {**environment, "WANDB_PROJECT": "flexpar", "MLFLOW_TRACKING_URI": ""}


def _assert_trackers_logged_the_losses(output, folder, monkeypatch) -> None:
    """The W&B and MLflow runs (read back with their own libraries) hold the metrics file's step losses."""
    losses = {record["step"]: record["loss"] for record in _metrics_records(output) if record["kind"] == "step"}
    assert sorted(losses) == list(range(STEPS))
    if importlib.util.find_spec("mlflow"):
        from mlflow.tracking import MlflowClient

        (store,) = glob.glob(str(output / "flexpar-runs" / "*" / "mlruns"))
        monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
        client = MlflowClient(tracking_uri="file:" + store)
        (run,) = client.search_runs([client.get_experiment_by_name("flexpar").experiment_id])
        history = client.get_metric_history(run.info.run_id, "train/loss")
        assert {metric.step: metric.value for metric in history} == pytest.approx(losses)
    if importlib.util.find_spec("wandb"):
        specification = importlib.util.spec_from_file_location(
            "tracker_tests", os.path.join(os.path.dirname(os.path.dirname(SCRIPT)), "observe", "test_trackers.py")
        )
        tracker_tests = importlib.util.module_from_spec(specification)
        specification.loader.exec_module(tracker_tests)
        (run_folder,) = (folder / "wandb").glob("offline-run-*")
        _, rows = tracker_tests.wandb_history(run_folder)
        assert {row["step"]: row["train/loss"] for row in rows if "train/loss" in row} == pytest.approx(losses)


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    folder = tmp_path_factory.mktemp("baseline")
    return _python(folder / "out", HF_SCRIPT_BASELINE="1")


@pytest.mark.timeout(300)
def test_one_device_equals_the_trainer_with_its_logs_callbacks_checkpoints_and_trackers(
    baseline, tmp_path, monkeypatch
):
    events = tmp_path / "events.jsonl"
    output = tmp_path / "out"
    result = _python(output, HF_SCRIPT_EVENTS=str(events), **_offline_trackers(tmp_path))
    assert _largest_relative_difference(baseline["state"], result["state"]) < FLOOR
    assert _key_bias_drift(baseline["state"], result["state"]) < 2e-3
    assert result["global_step"] == baseline["global_step"] == STEPS
    # The same log entries, in the same order; training losses and evaluations as the Trainer's.
    expected, got = baseline["log_history"], result["log_history"]
    assert [sorted(entry) for entry in got[:-2]] == [sorted(entry) for entry in expected[:-2]] or len(got) == len(
        expected
    )
    for mine, theirs in zip(got, expected):
        assert mine["step"] == theirs["step"]
        for key in ("loss", "eval_loss", "grad_norm", "learning_rate"):
            if key in theirs and key != "eval_loss" or key in theirs and "eval_runtime" not in mine:
                assert mine[key] == pytest.approx(theirs[key], rel=1e-4, abs=1e-9), (key, mine, theirs)
    # evaluate() after train() runs compute_metrics on the trained model, as the Trainer's does.
    assert result["metrics"]["eval_accuracy"] == pytest.approx(baseline["metrics"]["eval_accuracy"], abs=1e-6)
    assert result["metrics"]["eval_loss"] == pytest.approx(baseline["metrics"]["eval_loss"], rel=1e-4)
    # TrainerCallback events: each once, in order.
    names = [json.loads(line) for line in open(events)]
    assert [name for name, _ in names].count("step_end") == STEPS
    assert [step for name, step in names if name == "step_end"] == list(range(1, STEPS + 1))
    assert names[0][0] == "train_begin" and names.count(["train_end", STEPS]) == 1
    assert [step for name, step in names if name == "save"] == [4, 8, 12, 16, 20, 24]
    # save_total_limit=2: the two newest checkpoint-N folders stay.
    assert sorted(os.path.basename(path) for path in glob.glob(str(output / "checkpoint-*"))) == [
        "checkpoint-20",
        "checkpoint-24",
    ]
    # report_to=["tensorboard", "wandb", "mlflow"]: flexpar's trackers logged each step's loss.
    assert glob.glob(str(output / "flexpar-runs" / "*" / "tensorboard" / "events.out.tfevents.*"))
    _assert_trackers_logged_the_losses(output, tmp_path, monkeypatch)
    # save_model() wrote a folder from_pretrained loads, holding the trained weights.
    from transformers import GPT2LMHeadModel

    loaded = GPT2LMHeadModel.from_pretrained(output / "final")
    assert _largest_relative_difference(result["state"], loaded.state_dict()) == 0.0
    # checkpoint-N holds the model as transformers writes it: from_pretrained loads step N's weights.
    assert os.path.isfile(output / "checkpoint-24" / "model.safetensors")
    saved = GPT2LMHeadModel.from_pretrained(output / "checkpoint-24").state_dict()
    assert all(torch.equal(saved[name], tensor) for name, tensor in result["state"].items())
    assert not torch.equal(
        GPT2LMHeadModel.from_pretrained(output / "checkpoint-20").lm_head.weight, saved["lm_head.weight"]
    )


@pytest.mark.timeout(400)
def test_elastic_run_with_a_join_and_a_leave_then_a_resume_on_one_device(baseline, tmp_path):
    output = tmp_path / "out"
    # The steps are slow until the joiner, started at step 2, is in (the script's SlowUntilJoined model),
    # so that it joins well before the leave at step 20 however long its start takes on a loaded host.
    flags = ["--devices", "2", "--max-devices", "3", "--schedule", "2:+1,20:-1"]
    result = _flexpar_run(output, flags, HF_SCRIPT_SLOW_UNTIL="3")
    assert _largest_relative_difference(baseline["state"], result["state"]) < FLOOR
    records = _metrics_records(output)
    kinds = [record["event"] for record in records if record["kind"] == "event"]
    assert "join" in kinds and "leave" in kinds, kinds
    # transformers.Trainer itself resumes from checkpoint-20 (its weights, optimizer.pt, scheduler.pt)
    # and ends as the uninterrupted Trainer.
    theirs = _python(tmp_path / "theirs", HF_SCRIPT_BASELINE="1", HF_SCRIPT_RESUME=str(output / "checkpoint-20"))
    assert theirs["global_step"] == STEPS
    assert _largest_relative_difference(baseline["state"], theirs["state"]) < FLOOR
    # Resume from checkpoint-20 on one device: ends as the uninterrupted Trainer.
    resumed = _python(output, HF_SCRIPT_RESUME=str(output / "checkpoint-20"))
    assert resumed["global_step"] == STEPS
    assert _largest_relative_difference(baseline["state"], resumed["state"]) < FLOOR
    steps = [entry["step"] for entry in resumed["log_history"] if "loss" in entry]
    assert steps == sorted(steps) and len(steps) == len(set(steps)), steps


@pytest.mark.timeout(300)
def test_a_peft_lora_model_trains_as_with_the_trainer_and_its_frozen_weights_never_travel(tmp_path):
    expected = _python(tmp_path / "baseline", HF_SCRIPT_BASELINE="1", HF_SCRIPT_LORA="1", HF_SCRIPT_STEPS="8")
    output = tmp_path / "out"
    result = _flexpar_run(output, ["--devices", "2"], HF_SCRIPT_LORA="1", HF_SCRIPT_STEPS="8")
    assert _largest_relative_difference(expected["state"], result["state"]) < FLOOR
    assert os.path.isfile(output / "final" / "adapter_model.safetensors")
    # checkpoint-8 holds the adapter as peft writes it: PeftModel.from_pretrained loads the trained one.
    from peft import PeftModel

    base = _script().build_model()  # the script's base model (random initialisation, seeded)
    loaded = PeftModel.from_pretrained(base, output / "checkpoint-8").state_dict()
    assert all(torch.equal(loaded[name], tensor) for name, tensor in result["state"].items())
    # flexpar export rebuilds the model from the factory the checkpoint records (no --model), writes the
    # whole model and, with peft's save_pretrained, the adapter.
    from safetensors.torch import load_file

    from flexpar.export import export_with_adapter

    whole, adapter = export_with_adapter(str(output / "checkpoint-8" / "flexpar-state.pt"), str(tmp_path / "x.st"))
    exported = load_file(whole)
    assert exported.keys() == result["state"].keys()
    assert all(torch.equal(exported[name], tensor) for name, tensor in result["state"].items())
    exported = load_file(os.path.join(adapter, "adapter_model.safetensors"))
    saved = load_file(output / "checkpoint-8" / "adapter_model.safetensors")
    assert exported.keys() == saved.keys() and all(torch.equal(exported[name], saved[name]) for name in saved)
    # The checkpoints hold the adapters (the trainable state) only.
    state = torch.load(output / "checkpoint-8" / "flexpar-state.pt", weights_only=True)
    assert state["model"] and all("lora_" in name for name in state["model"]), sorted(state["model"])[:4]


@pytest.mark.timeout(400)
def test_trainer_callbacks_see_each_event_once_across_a_driver_kill_and_re_adoption(baseline, tmp_path):
    """The driver is killed as step 10's record reaches it; the devices wait; the resume command they print
    re-adopts them; the TrainerCallback saw each step, save and the train's begin and end once, and the
    restarted driver's log_history is the whole run's, as the Trainer's."""
    output, events, stderr = tmp_path / "out", tmp_path / "events.jsonl", tmp_path / "stderr-1.txt"
    options = {"faults": "10:driver:record", "driver_grace_s": 90, "port": free_port()}
    environment = {
        **os.environ,
        "HF_SCRIPT_OUTPUT": str(output),
        "HF_SCRIPT_STEPS": str(STEPS),
        "HF_SCRIPT_EVENTS": str(events),
        "FLEXPAR_HF_OPTIONS": json.dumps(options),
    }
    flags = ["--no-display", "--oversubscribe", "--devices", "2", "--emulate-speeds", "0.3,0.3"]
    first = subprocess.Popen(
        [sys.executable, "-m", "flexpar", "run", *flags, SCRIPT],
        env=environment,
        cwd=tmp_path,
        stdout=open(tmp_path / "stdout-1.txt", "w"),
        stderr=open(stderr, "w"),
        start_new_session=True,
    )
    assert first.wait(timeout=240) != 0
    wait_for(lambda: "restart it with: " in stderr.read_text(), "the devices' note that they wait", timeout_s=120)
    line = [text for text in stderr.read_text().splitlines() if "restart it with: " in text][-1]
    command = shlex.split(line.split("restart it with: ", 1)[1])
    assert command[:3] == ["flexpar", "run", "--resume"], command
    second = subprocess.run(
        [sys.executable, "-m", *command], env=environment, cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert second.returncode == 0, second.stderr[-6000:]
    names = [json.loads(text) for text in open(events)]
    assert [step for name, step in names if name == "step_end"] == list(range(1, STEPS + 1)), names
    assert [name for name, _ in names].count("train_begin") == 1
    assert [name for name, _ in names].count("train_end") == 1
    saves = [step for name, step in names if name == "save"]
    assert saves == sorted(set(saves)) and saves[-1] == STEPS, saves
    # log_history from the first step on (the lost driver's logs rebuilt from the job's metrics file),
    # each logged loss averaged over its logging_steps across the kill, as the Trainer's.
    history = torch.load(output / "result.pt", weights_only=False)["log_history"]
    # (The evaluations during training: the entries without eval_runtime, which evaluate() adds.)
    for key, expected_steps in (("loss", list(range(2, STEPS + 1, 2))), ("eval_loss", [6, 12, 18, 24])):
        got = [(entry["step"], entry[key]) for entry in history if key in entry and "eval_runtime" not in entry]
        expected = [entry[key] for entry in baseline["log_history"] if key in entry][: len(expected_steps)]
        assert [step for step, _ in got] == expected_steps, (key, got)
        assert [value for _, value in got] == pytest.approx(expected, rel=1e-4), key


@pytest.mark.timeout(300)
def test_model_init_and_compute_loss_func_train_as_with_the_trainer_and_predict_runs(tmp_path):
    script = os.path.join(os.path.dirname(SCRIPT), "model_init_script.py")
    environment = {**os.environ, "PYTHONPATH": os.path.dirname(SCRIPT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    completed = subprocess.run(
        [sys.executable, script, str(tmp_path / "both.pt")],
        cwd=tmp_path,
        env=environment,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert completed.returncode == 0, completed.stderr[-6000:]
    both = torch.load(tmp_path / "both.pt", weights_only=False)
    (expected, expected_shape), (got, got_shape) = both["baseline"], both["flexpar"]
    assert _largest_relative_difference(expected, got) < FLOOR
    assert got_shape == expected_shape == (8, 16, 97)
