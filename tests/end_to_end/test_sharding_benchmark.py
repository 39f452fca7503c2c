"""The pieces of benchmarks/sharding.py: its figures from records (pure) and its watch over a fit that hangs.

No flexpar job runs here (the benchmark's --quick form does that); the watch
runs a few-line Python process.
"""

import os
import sys

import pytest
import torch

sys.path.insert(
    0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "benchmarks")
)

import sharding  # noqa: E402
import sharding_figures  # noqa: E402


def _step(step, devices=("local-0", "local-1"), optimizer_bytes=(0, 0), step_time_s=1.0):
    return {
        "kind": "step",
        "step": step,
        "devices": list(devices),
        "optimizer_bytes": list(optimizer_bytes),
        "step_time_s": step_time_s,
    }


def _event(event, step, stall_s=0.5, **extra):
    return {"kind": "event", "event": event, "step": step, "stall_s": stall_s, "detail": f"{event} detail", **extra}


def test_a_failure_costs_the_steps_recorded_before_it_that_run_again():
    clean = [_event("start", 0), *map(_step, range(6)), _event("failure", 6, stall_s=0.8), _step(6)]
    assert sharding_figures.failure_figures(clean) == {
        "failure_lost_steps": 0,
        "failure_resume_s": 0.8,
        "failure_detail": "failure detail",
    }
    # Steps 5 and 6 were recorded, then the failure sent the job back to step 5: two steps lost.
    redone = [*map(_step, range(7)), _event("failure", 5), _step(7)]
    assert sharding_figures.failure_figures(redone)["failure_lost_steps"] == 2
    assert sharding_figures.failure_figures(clean[:-2])["failure_lost_steps"] is None


def test_join_optimizer_bytes_step_times_and_device_counts_from_records():
    records = [
        _event("start", 0, stall_s=0.0, state_bytes_sent=0),
        _step(0, optimizer_bytes=(0, 0), step_time_s=5.0),
        _step(1, optimizer_bytes=(300, 200), step_time_s=1.0),
        _event("join", 2, stall_s=0.4, state_bytes_sent=1000),
        _step(2, devices=("local-0", "local-1", "local-2"), optimizer_bytes=(100, 250, 100), step_time_s=3.0),
        _step(3, optimizer_bytes=(300, 200), step_time_s=2.0),
    ]
    assert sharding_figures.join_figures(records) == {"join_stall_s": 0.4, "join_bytes": 1000}
    assert sharding_figures.join_figures(records[:3]) == {"join_stall_s": None, "join_bytes": None}
    assert sharding_figures.largest_optimizer_bytes(records) == 300
    assert sharding_figures.largest_optimizer_bytes(records[:2]) is None  # no state yet
    assert sharding_figures.steady_step_s(records, skip=1) == 2.0
    assert sharding_figures.steady_step_s(records, skip=4) is None
    assert sharding_figures.device_counts(records) == [2, 3, 2]
    assert sharding_figures.steps_recorded_once(records, 4)
    assert not sharding_figures.steps_recorded_once(records + [_step(3)], 4)


def test_max_relative_error_is_the_worst_tensor_relative_to_its_own_scale():
    reference = {"a": torch.tensor([2.0, -4.0]), "b": torch.tensor([0.5, 0.5]), "zeros": torch.zeros(2)}
    same = {name: value.clone() for name, value in reference.items()}
    assert sharding_figures.max_relative_error(same, reference) == 0.0
    off = {**same, "b": torch.tensor([0.5, 0.55])}
    assert sharding_figures.max_relative_error(off, reference) == pytest.approx(0.1)
    assert sharding_figures.worst_tensor(off, reference) == "b 1.0e-01"
    assert sharding_figures.elements_beyond(off, reference) == 1
    assert sharding_figures.elements_beyond(same, reference) == 0
    off_zero = {**same, "zeros": torch.tensor([0.0, 1e-3])}
    assert sharding_figures.max_relative_error(off_zero, reference) == pytest.approx(1e-3)


def _round(optimizer_bytes, peak, step_s):
    return {"optimizer_bytes": optimizer_bytes, "peak_rss_bytes": peak, "step_s": step_s}


def test_figures_are_ratios_of_the_sides_medians_and_a_missing_input_leaves_a_reason():
    rounds = {
        "unsharded": [_round(400, 1000, 1.0), _round(400, 1200, 1.2), _round(400, 1100, 3.0)],
        "r2": [_round(200, 900, 1.1), _round(200, 900, 1.3), _round(200, 900, 1.0)],
        "r1": [_round(100, 800, 1.0), _round(100, 800, 1.0), _round(100, 800, 1.0)],
    }
    elastic = {
        "unsharded": {"join_stall_s": 0.5, "join_bytes": 300, "failure_resume_s": 0.6},
        "sharded": {"join_stall_s": 0.4, "join_bytes": 270, "failure_lost_steps": 0, "failure_resume_s": 0.2},
        "kill_update": {"failure_lost_steps": 1, "failure_resume_s": 0.3},
    }
    unmeasured = {"max_rel_err": "the sharded fit hung"}
    result = sharding_figures.figures(rounds, elastic, unmeasured)
    assert result["optimizer_bytes_ratio"] == result["optimizer_bytes_ratio_r2"] == 0.5
    assert result["optimizer_bytes_ratio_r1"] == 0.25
    assert result["peak_rss_ratio"] == pytest.approx(800 / 1100)
    assert result["step_time_ratio"] == pytest.approx(1.2 / 1.1)
    assert result["join_stall_ratio"] == pytest.approx(0.8) and result["join_bytes_ratio"] == pytest.approx(0.9)
    assert result["failure_lost_steps"] == 1, "the larger of the two kills'"
    assert result["failure_resume_s"] == 0.3 and result["failure_resume_s_backward"] == 0.2
    assert result["failure_resume_s_backward_unsharded"] == 0.6
    assert result["max_rel_err"] is None
    assert result["unmeasured"] == {"max_rel_err": "the sharded fit hung"}
    assert result["goals"]["optimizer_bytes_ratio_r1"] == "<= 0.3: met"
    assert result["goals"]["step_time_ratio"] == ">= 0.9: met"
    assert result["goals"]["max_rel_err"] == "<= 1e-05: not measured"
    assert result["goals"]["failure_lost_steps"] == "<= 0: missed"
    # Without the elastic fits, every figure they give is None, each with a reason.
    result = sharding_figures.figures({**rounds, "r1": [_round(None, 800, 1.0)]}, {}, {})
    assert result["optimizer_bytes_ratio_r1"] is None and "optimizer_bytes_ratio_r1" in result["unmeasured"]
    assert result["goals"]["peak_rss_ratio"] == "<= 0.85: met"
    for key in ("join_stall_ratio", "join_bytes_ratio", "failure_lost_steps", "failure_resume_s", "max_rel_err"):
        assert result[key] is None and key in result["unmeasured"]


def test_the_watch_tells_a_hung_fit_from_a_failed_and_a_finished_one(tmp_path):
    metrics = str(tmp_path / "metrics.jsonl")

    def watch(code: str, idle_s: float = 0.5, bound_s: float = 30.0) -> str:
        with open(tmp_path / "stderr.txt", "w") as stderr:
            return sharding.run_watched([sys.executable, "-c", code], metrics, idle_s, bound_s, stderr, poll_s=0.1)

    write = f"open({metrics!r}, 'a').write('{{}}\\n'); "
    assert watch(write + "import time; time.sleep(60)") == "hung"
    assert watch(write + "raise SystemExit(3)") == "failed (exit 3)"
    # Records every 0.2 s for 1.2 s: longer than idle_s in all, never idle that long.
    slow = f"import time; [time.sleep(0.2) or open({metrics!r}, 'a').write('x') for _ in range(6)]"
    assert watch(write + slow) == "finished"
    os.remove(metrics)
    # Nothing written yet (a fit still starting) is not a hang; the bound still ends it.
    assert watch("import time; time.sleep(60)", idle_s=0.5, bound_s=1.0) == "past the bound"
