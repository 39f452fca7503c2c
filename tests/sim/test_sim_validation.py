"""Tests of the pure parts of benchmarks/sim_validation.py (no processes, no benchmarks run)."""

from __future__ import annotations

import math
import os
import sys

import numpy as np
import pytest

sys.path.insert(
    0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "benchmarks")
)

import validation
import validation.join_rows

from flexpar.core import join_choice
from flexpar.sim import calibrate


def test_error_of_is_relative_and_undefined_without_a_measurement():
    assert validation.error_of(1.1, 1.0) == pytest.approx(0.1)
    assert validation.error_of(0.9, 1.0) == pytest.approx(0.1)
    assert validation.error_of(None, 1.0) is None
    assert validation.error_of(1.0, None) is None
    assert validation.error_of(0.5, 0.0) is None
    assert validation.error_of(math.inf, 1.0) is None


def test_verdict_counts_only_counted_rows_and_needs_every_one_defined():
    rows = [
        validation.Comparison("a", 1.05, 1.0, True, "m"),
        validation.Comparison("b", 2.0, 1.0, False, "diagnostic"),
    ]
    summary = validation.verdict(rows)
    assert summary["max_relative_error"] == pytest.approx(0.05)
    assert summary["max_relative_error_all_rows"] == pytest.approx(1.0)
    assert summary["goal_met"] is True
    rows.append(validation.Comparison("c", None, 1.0, True, "missing input"))
    summary = validation.verdict(rows)
    assert summary["goal_met"] is False
    assert summary["rows_without_error"] == ["c"]
    rows.append(validation.Comparison("d", 1.3, 1.0, True, "m"))
    assert validation.verdict(rows)["rows_over_goal"] == ["d"]


def test_noise_sigma_recovers_a_lognormal_sigma():
    generator = np.random.default_rng(0)
    deviations = {f"d{index}": list(generator.normal(0.0, 0.1, 2000)) for index in range(4)}
    assert validation.noise_sigma(deviations) == pytest.approx(0.1, rel=0.08)
    assert validation.noise_sigma({"short": [0.1, 0.2]}) == 0.0


def test_independent_deviations_drop_what_all_devices_share():
    # Every device slowed by the same factor in a step: no independent noise at all.
    factors = [1.0, 1.5, 0.8, 1.2]
    steps = [{"a": 0.1 * factor, "b": 0.3 * factor, "c": 0.2 * factor} for factor in factors]
    deviations = validation.independent_log_deviations(steps)
    assert all(abs(value) < 1e-12 for values in deviations.values() for value in values)
    # One device alone slower in one step: only it deviates (by the log of the ratio, less the median share).
    steps = [{"a": 0.1, "b": 0.3, "c": 0.2} for _ in range(5)]
    steps[2] = {"a": 0.2, "b": 0.3, "c": 0.2}
    deviations = validation.independent_log_deviations(steps)
    assert deviations["a"][2] == pytest.approx(math.log(2.0))
    assert deviations["b"][2] == pytest.approx(0.0)


def test_per_vw_samples_takes_the_window_and_divides_by_the_count():
    records = [
        {"step": step, "devices": ["local-1", "local-0"], "assignment": [2, 4], "busy_s": [0.2, 0.8]}
        for step in range(6)
    ]
    samples = validation.per_vw_samples(records, 2, 5)
    assert len(samples) == 3
    assert samples[0] == {"local-1": pytest.approx(0.1), "local-0": pytest.approx(0.2)}


def test_transfer_path_is_a_fresh_receivers_receive_and_restore():
    parts = {
        "capture_s": 0.01,
        "send_s": 0.2,
        "receive_s": 0.25,
        "restore_s": 0.05,
        "fresh_receive_s": 0.31,
        "fresh_restore_s": 0.02,
    }
    assert validation.transfer_path_seconds(parts) == pytest.approx(0.33)
    # Older elastic.py JSONs have no fresh receivers: the long-lived receiver stands in.
    assert validation.transfer_path_seconds({**parts, "fresh_receive_s": None}) == pytest.approx(0.3)
    assert validation.transfer_path_seconds({"send_s": 1.0}) is None
    assert validation.transfer_path_seconds({}) is None


def _step(step, generation, devices, busy):
    return {
        "kind": "step",
        "step": step,
        "generation": generation,
        "devices": devices,
        "assignment": [2] * len(devices),
        "busy_s": busy,
    }


def test_failed_step_inputs_are_the_slowest_survivors_busy_and_the_victims_vws():
    records = [
        _step(0, 1, ["a", "b"], [0.9, 0.9]),
        _step(1, 2, ["a", "b", "c"], [5.0, 5.0, 5.0]),  # first step of the set: left out
        _step(2, 2, ["a", "b", "c"], [0.4, 0.6, 9.0]),  # c is the one that fails: not a survivor
        _step(3, 2, ["a", "b", "c"], [0.5, 0.3, 9.0]),
        {"kind": "event", "event": "failure", "step": 4, "devices": ["a", "b"]},
        _step(4, 3, ["a", "b"], [0.9, 0.9]),
    ]
    [inputs] = validation.failed_steps_inputs(records)
    assert inputs["survivor_busy_s"] == pytest.approx(0.55)
    assert inputs["victim_vws"] == 2 and inputs["devices_before"] == 3
    assert validation.failed_steps_inputs([r for r in records if r["kind"] == "step"]) == []
    # A second failure, of a later set: its own generation's steps.
    records += [_step(5, 3, ["a", "b"], [0.7, 0.8]), {"kind": "event", "event": "failure", "step": 6, "devices": ["b"]}]
    first, second = validation.failed_steps_inputs(records)
    assert first == inputs
    assert second["survivor_busy_s"] == pytest.approx(0.8) and second["devices_before"] == 2


def test_fault_death_fraction_places_the_fault_in_the_victims_first_vw():
    assert validation.fault_death_fraction("forward", 2, 2 / 3) == 0.0
    assert validation.fault_death_fraction("backward", 2, 2 / 3) == pytest.approx(1 / 6)
    assert validation.fault_death_fraction("sync", 2, 2 / 3) == 1.0
    with pytest.raises(ValueError, match="fault phase 'transfer'"):
        validation.fault_death_fraction("transfer", 2, 2 / 3)


def test_predicted_failure_stall_charges_the_survivors_vws_at_the_contention_after_the_death():
    inputs = [
        {"survivor_busy_s": 0.3, "victim_vws": 2, "devices_before": 3},
        {"survivor_busy_s": 0.6, "victim_vws": 2, "devices_before": 3},
        {"survivor_busy_s": 0.4, "victim_vws": 2, "devices_before": 3},
    ]
    parameters = calibrate(
        {"host_cores": 2.0, "recovery_notice_s": 0.02, "detection_s": 0.03, "pg_formation_s": 0.004}
    ).parameters
    stall, lost = validation.predict_failure_stall(inputs, parameters)
    # elastic.py kills in backward: 1/6 of the way in at 3 busy processes, the rest at 2 (1.5x faster).
    assert lost == pytest.approx(0.4 * (1 / 6 + (5 / 6) / 1.5))
    assert stall == pytest.approx(lost + 0.02 + 0.004)


def test_recovery_notice_is_half_of_each_poll_on_the_path(monkeypatch):
    # The driver is woken by the reports (no poll of its own on the path); each device polls twice.
    monkeypatch.setattr(validation.control, "DEVICE_POLL_S", 0.03)
    assert validation.recovery_notice_seconds() == pytest.approx(0.5 * (2 * 0.03))


def test_ddp_slowest_seconds_per_vw_is_the_median_over_rounds():
    balance = {
        "virtual_workers": 8,
        "devices": 2,
        "rounds": [{"uniform_busy_s": [0.4, 0.8]}, {"uniform_busy_s": [0.4, 1.2]}, {}],
    }
    assert validation.ddp_slowest_seconds_per_vw(balance) == pytest.approx(0.25)


def test_predict_balance_noise_free_matches_the_closed_form():
    balance = {
        "virtual_workers": 6,
        "devices": 2,
        "config": {"speeds": [1.0, 1.0], "changed_device": 0, "changed_speed": 0.5},
    }
    table = [0.1, 0.2]
    calibration = calibrate(
        {
            "seconds_per_vw": table,
            "devices": 2,
            "virtual_workers": 6,
            "gradient_bytes": 1e6,
            "all_reduce_s": 0.01,
            "optimizer_s": 0.005,
        }
    )
    predicted = validation.predict_balance(balance, table, calibration, noise=0.0)
    # Balanced: 4 x 0.1 vs 2 x 0.2 -> 0.4; uniform 3 + 3 -> 0.6; local-0 at 0.2 -> 3 + 3 -> 0.6.
    assert predicted["flexpar_step_s"] == pytest.approx(0.4 + 0.01 + 0.005, rel=1e-6)
    assert predicted["uniform_step_s"] == pytest.approx(0.6 + 0.01 + 0.005, rel=1e-6)
    assert predicted["settled_step_s"] == pytest.approx(0.6 + 0.01 + 0.005, rel=1e-6)


def test_boundary_seconds_takes_the_last_arrivals_time_per_repeat_then_the_median():
    # Two members, three repeats of a 2-process boundary: per repeat the least
    # member time (the one that arrived last), then the median over repeats.
    per_rank = [{2: [0.010, 0.004, 0.020], 3: [0.030]}, {2: [0.003, 0.009, 0.005], 3: [0.012]}, {3: [0.020]}]
    assert validation.boundary_seconds(per_rank) == {2: 0.004, 3: 0.012}


def test_boundary_calibration_fits_base_and_per_device_from_sizes_2_and_3():
    fitted = validation.boundary_calibration(
        {"process_group_formation_s": 0.5}, {"boundary_s_by_size": {2: 0.004, 3: 0.006}}, cores=8
    )
    assert fitted["pg_formation_per_device_s"] == pytest.approx(0.002)
    assert fitted["pg_formation_s"] == pytest.approx(0.0)
    calibration = calibrate({**fitted, "devices": 2})
    from flexpar.sim.model import pg_formation_seconds

    assert pg_formation_seconds(2, calibration.parameters.elastic) == pytest.approx(0.004)
    assert pg_formation_seconds(3, calibration.parameters.elastic) == pytest.approx(0.006)
    # A negative intercept is not a cost: a line through the origin, least squares.
    origin = validation.boundary_calibration({}, {"boundary_s_by_size": {2: 0.002, 3: 0.005}}, cores=8)
    assert origin["pg_formation_s"] == 0.0
    assert origin["pg_formation_per_device_s"] == pytest.approx((2 * 0.002 + 3 * 0.005) / 13)
    # A boundary that takes less with more members is not a negative cost per member: flat, the mean.
    flat = validation.boundary_calibration({}, {"boundary_s_by_size": {2: 0.0048, 3: 0.0042}}, cores=8)
    assert flat["pg_formation_per_device_s"] == 0.0
    assert flat["pg_formation_s"] == pytest.approx(0.0045)
    # Without the probe's sizes, elastic.py's fresh-group figure stands in.
    assert validation.boundary_calibration({"process_group_formation_s": 0.5}, {}, cores=8) == {
        "pg_formation_s": 0.5,
        "host_cores": 8,
    }


def test_boundary_calibration_takes_the_host_contention_out_before_the_fit():
    # On 2 cores a 3-process boundary runs 1.5x stretched: 0.0075 s is 0.005 s of work.
    fitted = validation.boundary_calibration({}, {"boundary_s_by_size": {2: 0.004, 3: 0.0075}}, cores=2)
    assert fitted["pg_formation_per_device_s"] == pytest.approx(0.001)
    assert fitted["pg_formation_s"] == pytest.approx(0.002)
    elastic = calibrate(fitted).parameters.elastic
    from flexpar.sim.model import host_contention, pg_formation_seconds

    assert pg_formation_seconds(3, elastic) == pytest.approx(0.0075)
    assert pg_formation_seconds(2, elastic) * host_contention(3, elastic.host_cores) == pytest.approx(
        0.006
    )  # with a third process busy


def test_probes_combine_into_the_median_of_each_timing_and_boundary_size():
    probes = [
        {
            "all_reduce_s": 0.01,
            "optimizer_s": 0.002,
            "detection_s": 0.03,
            "parameter_count": 5,
            "world": 4,
            "boundary_s_by_size": {"2": 0.003, "3": 0.006},
        },
        {
            "all_reduce_s": 0.03,
            "optimizer_s": 0.001,
            "detection_s": None,
            "parameter_count": 5,
            "world": 4,
            "boundary_s_by_size": {"2": 0.005, "3": 0.009},
        },
        {
            "all_reduce_s": 0.02,
            "optimizer_s": 0.004,
            "detection_s": 0.05,
            "parameter_count": 5,
            "world": 4,
            "boundary_s_by_size": {"2": 0.004},
        },
    ]
    combined = validation.combine_probes(probes)
    assert combined["all_reduce_s"] == 0.02 and combined["optimizer_s"] == 0.002
    assert combined["detection_s"] == pytest.approx(0.04)  # the runs that saw a detection
    assert combined["boundary_s_by_size"] == {2: 0.004, 3: pytest.approx(0.0075)}
    assert combined["runs"] == 3 and combined["parameter_count"] == 5


def test_median_interval_holds_the_median_and_narrows_with_more_changes():
    few = [2.2, 2.4, 2.6, 5.0, 11.0, 2.3]
    low, high = validation.median_interval(few)
    assert low <= float(np.median(few)) <= high
    assert low >= min(few) and high <= max(few)
    many_low, many_high = validation.median_interval(few * 8)
    assert many_high - many_low < high - low
    assert validation.median_interval(few) == (low, high), "deterministic for a seed"
    assert validation.median_interval([1.0, 2.0]) is None


def test_a_miss_inside_the_measured_interval_is_said_so():
    inside = validation.Comparison("elastic: x", 3.0, 2.4, True, "m", measured_interval=(2.2, 3.5))
    outside = validation.Comparison("elastic: x", 5.0, 2.4, True, "m", measured_interval=(2.2, 3.5))
    assert "lies inside" in validation._against_interval(inside)
    assert "lies outside" in validation._against_interval(outside)
    assert validation._against_interval(validation.Comparison("balance: x", 1.0, 2.0, True, "m")) == ""


def test_errors_are_in_units_of_the_floor_below_it():
    assert validation.error_of(0.154, 0.025, validation.FLOOR_S) == pytest.approx(0.516)  # issue 49's scale-out
    assert validation.error_of(1.1, 1.0, validation.FLOOR_S) == pytest.approx(0.1)
    row = validation.Comparison("steps", 18, 20, True, "m", floor=0.0)
    assert row.relative_error == pytest.approx(0.1)
    lost = validation.Comparison("lost", 1.2, 1.0, True, "m", floor=0.0, goal=0.25)
    summary = validation.verdict([row, lost])
    assert summary["goal_met"] is True and summary["max_relative_error"] == pytest.approx(0.1)
    assert validation.verdict([validation.Comparison("lost", 1.3, 1.0, True, "m", floor=0.0, goal=0.25)])[
        "rows_over_goal"
    ] == ["lost"]


def test_join_rows_simulate_join_streams_job():
    from flexpar.sim import ElasticCosts, ModelParameters, NetworkModel

    figures = {
        "sizes_gb": ["0.1"],
        "state_bytes": {"0.1": 81451708},
        "step_before_s": {"0.1": 0.09},
        "compute_before_s": {"0.1": 0.0227},
        "compute_at_join_s": {"0.1": 0.0227},
        "boundary_stall_s": {"0.1": 0.019},
        "stream_steps": {"0.1": 19.0},
        "members_lost_s": {"stream": {"0.1": 0.6}, "blocking": {"0.1": 0.06}},
        "time_to_contribute_s": {"stream": {"0.1": 2.4}, "blocking": {"0.1": 0.06}},
        "member_slowdown": {"0.1": 1.34},
        "blocking_stall_s": {"0.1": 0.06},
    }
    calibrated = ModelParameters(
        network=NetworkModel(broadcast_bandwidth_bytes_per_s=2e9),
        elastic=ElasticCosts(pg_formation_s=0.0025, host_cores=2.0),
    )
    rows, predicted = validation.compare_joins(figures, calibrated)
    stream = predicted["0.1"]["stream"]
    # join_stream.py's 8 tensors (13 bytes an element as the engine counts them) in 2.27 MB slices: 19
    # rounds planned; the engine's re-sizing halves the slices at round 3 and doubles them back at round 6
    # (the listener's work, not the slices, slows the members): two more here.
    assert len(validation.join_rows.streamed_tensors(figures, "0.1")) == 8
    assert stream["way"] == "stream" and stream["stream_steps"] == 21
    assert stream["listener_work"] == join_choice.LISTENER_WORK  # one size: nothing else calibrates it
    assert stream["boundary_stall_s"] == pytest.approx(0.0025 * 1.5)
    assert 1.45 < stream["member_slowdown"] < 1.55  # 1 + 1.3 x 0.73 / 2, and the slices
    assert predicted["0.1"]["blocking"]["way"] == "blocking"
    assert [row.counted for row in rows] == [True, True, True, False, False, False]
    assert validation.compare_joins(None, calibrated) == ([], {})


def two_sizes(slowdown_at_half: float, **extra) -> dict:
    figures = {
        "sizes_gb": ["0.1", "0.5"],
        "state_bytes": {"0.1": 81451708, "0.5": 406673124},
        "step_before_s": {"0.1": 0.1, "0.5": 0.64},
        "compute_before_s": {"0.1": 0.027, "0.5": 0.28},
        "stream_steps": {"0.1": 26.0, "0.5": 9.0},
        "member_slowdown": {"0.1": 1.5, "0.5": slowdown_at_half},
        "boundary_stall_s": {"0.1": 0.03, "0.5": 0.03},
        "members_lost_s": {"stream": {"0.1": 1.3, "0.5": 2.3}, "blocking": {"0.1": 0.08, "0.5": 0.3}},
        "time_to_contribute_s": {"stream": {"0.1": 3.9, "0.5": 8.0}, "blocking": {"0.1": 0.08, "0.5": 0.3}},
        "blocking_stall_s": {"0.1": 0.08, "0.5": 0.3},
    }
    figures.update(extra)
    return figures


def join_parameters():
    from flexpar.sim import ElasticCosts, ModelParameters, NetworkModel

    return ModelParameters(
        network=NetworkModel(broadcast_bandwidth_bytes_per_s=1.28e9),
        elastic=ElasticCosts(pg_formation_s=0.0025, host_cores=2.0),
    )


def test_each_size_takes_its_listener_work_from_the_other_sizes():
    from validation.join_rows import join_scenario, listener_work_calibration, members_inputs

    calibrated = join_parameters()
    # The 0.5 GB slowdown made by the model with a work of 1.3 (the slices' share on top): the 0.1 GB
    # prediction takes 1.3, whatever the 0.1 GB measurement says, and the other way round.
    inputs = members_inputs(join_scenario(two_sizes(1.0), "0.5", calibrated, "stream"))
    slices = inputs.state_bytes / (2 * 9.0) / inputs.link_bytes_per_s / inputs.step_s
    slowdown = join_choice.listener_slowdown(inputs, 1.3) + slices
    calibration = listener_work_calibration(two_sizes(slowdown), calibrated)
    assert calibration["0.1"]["listener_work"] == pytest.approx(1.3)
    assert calibration["0.1"]["from_sizes"] == ["0.5"]
    assert calibration["0.5"]["listener_work"] == pytest.approx(calibration["0.1"]["measured_here"])
    # A slowdown within the idle cores says nothing: the other size falls back to the engine's figure.
    assert listener_work_calibration(two_sizes(0.9), calibrated)["0.1"]["listener_work"] == join_choice.LISTENER_WORK


def test_a_recorded_spread_and_baseline_feed_the_simulated_re_sizing():
    calibrated = join_parameters()
    quiet = validation.predict_join(two_sizes(1.4), "0.1", calibrated, "stream", 1.3)
    noisy = two_sizes(1.4, step_spread={"0.1": 0.2}, baseline_ratio={"0.1": 1.0})
    spread = validation.predict_join(noisy, "0.1", calibrated, "stream", 1.3)
    runs = [
        validation.join_rows._simulated_join(noisy, "0.1", calibrated, "stream", 1.3, seed)
        for seed in range(validation.join_rows.SEEDS)
    ]
    assert spread["stream_steps"] == sorted(run["stream_steps"] for run in runs)[len(runs) // 2]
    # join_stream.py's figure is the median of its rounds: so is each simulated benchmark run's.
    two = validation.predict_join({**noisy, "rounds": 2}, "0.1", calibrated, "stream", 1.3)
    pairs = [
        sum(
            validation.join_rows._simulated_join(noisy, "0.1", calibrated, "stream", 1.3, seed)["stream_steps"]
            for seed in (2 * index, 2 * index + 1)
        )
        / 2
        for index in range(validation.join_rows.SEEDS)
    ]
    assert two["stream_steps"] == sorted(pairs)[len(pairs) // 2]
    assert len({run["stream_steps"] for run in runs}) > 1  # the rule reacts to the noise
    assert (
        quiet["stream_steps"]
        == validation.join_rows._simulated_join(two_sizes(1.4), "0.1", calibrated, "stream", 1.3, 0)["stream_steps"]
    )
    # A baseline the joiner's start-up slowed by half: the listening steps look faster than before, and
    # the rule doubles the slices: a shorter stream than the undisturbed one.
    slowed = validation.predict_join(two_sizes(1.4, baseline_ratio={"0.1": 1.5}), "0.1", calibrated, "stream", 1.3)
    assert slowed["stream_steps"] < quiet["stream_steps"]
