"""The fault soak, small: random joins, leaves, kill -9, SIGSTOP and SIGTERM, each run equal to the
failure-free run with every sample used once (benchmarks/soak.py runs the full 100-fault version)."""

import os
import random
import sys

import pytest
from hypothesis import given, settings, strategies

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

import soak  # noqa: E402


@given(strategies.integers(min_value=0, max_value=2**32 - 1))
@settings(max_examples=200, deadline=None)
def test_drawn_runs_always_leave_a_device_standing(seed):
    plan = soak.draw_run(random.Random(seed), 0)
    assert 2 <= plan.size <= 5
    targets = [device for _, device, _, _ in plan.faults]
    assert len(targets) == len(set(targets)) <= plan.devices - 1, "signals hit distinct devices, one stays"
    assert all(device in {f"local-{i}" for i in range(plan.devices)} for device in targets)
    assert plan.devices + sum(1 for _, delta in plan.schedule if delta > 0) <= soak.VIRTUAL_WORKERS
    joins = leaves = 0
    for step, delta in sorted(plan.schedule):
        joins, leaves = joins + (delta > 0), leaves + (delta < 0)
        assert leaves <= joins, "a planned leave never takes a device the run started with"
    for step, _, phase, kind in plan.faults:
        assert soak.FIRST_STEP <= step <= soak.LAST_STEP < soak.STEPS
        assert phase in soak.SIGNAL_PHASES and kind in soak.SIGNAL_NAMES


@pytest.mark.timeout(400)
def test_a_small_soak_finds_no_hang_divergence_or_sample_error(tmp_path):
    # Seed 25 draws every kind (join, leave, kill, SIGSTOP, SIGTERM) and every phase in its first runs.
    report = soak.run_soak(faults=12, seed=25, folder=str(tmp_path), timeout_s=30.0, heartbeat_timeout_s=3.0,
                           progress=print)
    assert report["faults_injected"] >= 12 and report["hung_peers"] >= 1, "a SIGSTOP fired and was noticed"
    for key in ("hangs", "failed_runs", "divergent_runs", "samples_lost", "samples_repeated"):
        assert report[key] == 0, (key, [d for d in report["details"] if d["hang"] or d["failed"] or d["divergent"]])
