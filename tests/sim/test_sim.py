"""Tests of the cluster simulator (flexpar.sim): cost model, engine, policies, scenarios, CLI."""

from __future__ import annotations

import dataclasses
import json
import re
import statistics
import textwrap

import numpy as np
import pytest

from flexpar.core import balance
from flexpar.sim import (
    DeviceSpec,
    ElasticCosts,
    Event,
    JoinModel,
    ModelParameters,
    NetworkModel,
    RestartCosts,
    Scenario,
    WorkloadModel,
    broadcast_seconds,
    calibrate,
    failed_step_lost_seconds,
    failure_stall_seconds,
    host_contention,
    load_scenario,
    parse_scenario,
    pg_formation_seconds,
    predict_elastic_stalls,
    predict_step_seconds,
    ring_all_reduce_seconds,
    scalability,
    shipped_scenarios,
    simulate,
    simulate_all,
    simulate_command,
    step_seconds,
    uniform_assignment,
)
from flexpar.sim.policies import BalanceSettings
from flexpar.sim.results import weighted_median
from flexpar.sim.scalability import failure_trace, scaled_devices, scaled_scenario

# A small cost model whose figures are easy to check by hand.
NETWORK = NetworkModel(
    alpha_s=1e-3, bandwidth_bytes_per_s=1e6, broadcast_bandwidth_bytes_per_s=2e6, bucket_bytes=1e6, overlap_fraction=0.0
)
WORKLOAD = WorkloadModel(gradient_bytes=2e6, state_bytes=4e6, optimizer_s=0.01, samples_per_vw=4)
ELASTIC = ElasticCosts(warmup_s=5.0, pg_formation_s=0.2, pg_formation_per_device_s=0.0, detection_s=0.5)
RESTART = RestartCosts(
    process_start_s=1.0,
    import_s=2.0,
    rebuild_s=3.0,
    checkpoint_save_s=0.5,
    checkpoint_load_s=0.25,
    checkpoint_every_steps=10,
)
PARAMETERS = ModelParameters(network=NETWORK, workload=WORKLOAD, elastic=ELASTIC, restart=RESTART)


def make_scenario(seconds_per_vw, virtual_workers, steps=20, events=(), noise=0.0, parameters=PARAMETERS, **overrides):
    devices = tuple(DeviceSpec(f"d{index}", seconds) for index, seconds in enumerate(seconds_per_vw))
    return Scenario(
        name="test",
        steps=steps,
        virtual_workers=virtual_workers,
        devices=devices,
        events=tuple(events),
        noise=noise,
        parameters=parameters,
        **overrides,
    )


def write_toml(tmp_path, text, name="scenario.toml"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


MINIMAL_TOML = """
    name = "minimal"
    steps = 10
    virtual_workers = 8
    [model]
    reference_seconds_per_vw = 0.1
    [device_types]
    slow = { speed = 1.0 }
    [[devices]]
    type = "slow"
    count = 2
    [[devices]]
    speed = 2.0
    id_prefix = "fast"
    [[devices]]
    seconds_per_vw = 0.02
    id_prefix = "measured"
"""


# ---------------------------------------------------------------- cost model


def test_ring_all_reduce_matches_the_alpha_beta_formula_by_hand():
    # 4 devices, 2 MB in 1 MB buckets: 2 buckets x 2 x 3 hops x 1 ms + 2 x 3/4 x 2 MB / 1 MB/s.
    assert ring_all_reduce_seconds(4, 2e6, NETWORK) == pytest.approx(2 * 2 * 3 * 1e-3 + 1.5 * 2.0)
    assert ring_all_reduce_seconds(1, 2e6, NETWORK) == 0.0


def test_broadcast_pays_tree_depth_latency_and_the_bytes_once():
    # 5 members: depth ceil(log2 5) = 3; 4 MB at 2 MB/s.
    assert broadcast_seconds(5, 4e6, NETWORK) == pytest.approx(3 * 1e-3 + 2.0)
    assert broadcast_seconds(1, 4e6, NETWORK) == 0.0


def test_overlap_hides_communication_only_up_to_the_last_backward():
    overlapping = dataclasses.replace(
        PARAMETERS, network=dataclasses.replace(NETWORK, overlap_fraction=1.0, backward_fraction=0.5)
    )
    all_reduce = ring_all_reduce_seconds(2, 2e6, NETWORK)
    # Last VW 1 s, of which 0.5 s backward: at most 0.5 s of the all-reduce hides.
    assert step_seconds((2, 2), (1.0, 1.0), overlapping) == pytest.approx(2.0 + all_reduce - 0.5 + 0.01)
    assert step_seconds((2, 2), (1.0, 1.0), PARAMETERS) == pytest.approx(2.0 + all_reduce + 0.01)


def test_uniform_assignment_gives_the_remainder_to_the_first_ranks():
    assert uniform_assignment(3, 10) == (4, 3, 3)
    assert uniform_assignment(4, 8) == (2, 2, 2, 2)
    with pytest.raises(ValueError, match="fewer than the 3 devices"):
        uniform_assignment(3, 2)


def test_configuration_rejects_bad_numbers_with_the_field_and_value():
    with pytest.raises(ValueError, match=r"network.overlap_fraction: expected a number in \[0, 1\], got 1.5"):
        NetworkModel(overlap_fraction=1.5)
    with pytest.raises(ValueError, match="elastic.detection_s: expected a finite number >= 0, got -1"):
        ElasticCosts(detection_s=-1)


# ---------------------------------------------------------------- engine


@pytest.mark.parametrize("policy", ["flexpar", "uniform", "restart"])
def test_one_device_without_events_reproduces_the_closed_form_step_time(policy):
    parameters = dataclasses.replace(PARAMETERS, restart=dataclasses.replace(RESTART, checkpoint_every_steps=10_000))
    scenario = make_scenario([0.3], virtual_workers=8, steps=50, parameters=parameters)
    result = simulate(scenario, policy)
    # One device: no all-reduce; a step is 8 VWs one after another plus the optimizer.
    closed_form = 8 * 0.3 + 0.01
    assert result.completed
    assert result.step_time_median_s == pytest.approx(closed_form, rel=1e-12)
    assert result.total_time_s == pytest.approx(50 * closed_form, rel=1e-12)
    assert result.stall_s == 0.0
    assert result.samples_per_s == pytest.approx(8 * 4 / closed_form)


def test_equal_devices_reproduce_the_closed_form_with_the_all_reduce():
    scenario = make_scenario([0.2] * 4, virtual_workers=8, steps=30)
    expected = 2 * 0.2 + (2 * 2 * 3 * 1e-3 + 1.5 * 2.0) + 0.01
    for result in simulate_all(dataclasses.replace(scenario, policies=("flexpar", "uniform"))):
        assert result.total_time_s == pytest.approx(30 * expected, rel=1e-12)


def test_total_time_is_kept_step_time_plus_stall_under_churn():
    scenario = load_scenario("spot_churn")
    scenario = dataclasses.replace(scenario, steps=1500, noise=0.0)
    for result in simulate_all(scenario):
        assert result.kept_step_seconds + result.stall_s == pytest.approx(result.total_time_s, rel=1e-9)


def test_skipping_identical_steps_changes_no_figure():
    scenario = dataclasses.replace(load_scenario("spot_churn"), steps=800, noise=0.0)
    for policy in scenario.policies:
        skipped = simulate(scenario, policy)
        stepped = simulate(scenario, policy, skip_identical_steps=False)
        assert skipped.segment_steps.size < stepped.segment_steps.size  # it did skip
        assert skipped.total_time_s == pytest.approx(stepped.total_time_s, rel=1e-9)
        assert skipped.stall_s == pytest.approx(stepped.stall_s, rel=1e-9, abs=1e-9)
        assert skipped.completed_steps == stepped.completed_steps


def test_same_seed_same_result_and_noise_changes_it():
    scenario = make_scenario([0.1, 0.2, 0.05], virtual_workers=12, steps=40, noise=0.05)
    first, second = simulate(scenario, "flexpar"), simulate(scenario, "flexpar")
    assert first.total_time_s == second.total_time_s
    other = simulate(dataclasses.replace(scenario, seed=7), "flexpar")
    assert other.total_time_s != first.total_time_s


def test_weighted_median_equals_the_median_of_the_expanded_values():
    values = np.array([3.0, 1.0, 2.0, 5.0])
    weights = np.array([1, 2, 1, 2])
    expanded = [value for value, weight in zip(values, weights) for _ in range(weight)]
    assert weighted_median(values, weights) == statistics.median(expanded)
    assert weighted_median(values[:3], np.array([1, 1, 1])) == 2.0


# ---------------------------------------------------------------- the real balancer


def test_balanced_policy_calls_the_real_balance_functions(monkeypatch):
    calls = {"next_assignment": 0, "observe": 0}
    real_next, real_observe = balance.next_assignment, balance.observe

    def counting_next(*arguments, **keywords):
        calls["next_assignment"] += 1
        return real_next(*arguments, **keywords)

    def counting_observe(*arguments, **keywords):
        calls["observe"] += 1
        return real_observe(*arguments, **keywords)

    monkeypatch.setattr(balance, "next_assignment", counting_next)
    monkeypatch.setattr(balance, "observe", counting_observe)
    seconds = [0.1, 0.05, 0.025]
    scenario = make_scenario(seconds, virtual_workers=14, steps=10, noise=0.01)
    result = simulate(scenario, "flexpar")
    assert calls == {"next_assignment": 10, "observe": 10}
    # Settled on the real optimum of the true speeds: counts (2, 4, 8) -> max busy 0.2 s.
    expected = step_seconds(balance.optimal_assignment(seconds, 14), seconds, PARAMETERS)
    assert result.segment_step_s[-1] == pytest.approx(expected, rel=0.05)


def test_the_simulated_step_follows_whatever_the_balancer_returns(monkeypatch):
    # If the simulator had its own copy of the balancer, this patch would not matter.
    monkeypatch.setattr(balance, "next_assignment", lambda state, device_ids, virtual_workers, hysteresis: (10, 1, 1))
    scenario = make_scenario([0.1, 0.1, 0.1], virtual_workers=12, steps=5)
    result = simulate(scenario, "flexpar")
    assert result.step_time_median_s == pytest.approx(step_seconds((10, 1, 1), [0.1] * 3, PARAMETERS))


def test_balanced_beats_uniform_on_a_mixed_cluster_and_ties_on_equal_devices():
    mixed = make_scenario([0.4, 0.1, 0.1, 0.05], virtual_workers=32, steps=30)
    flexpar, uniform = simulate(mixed, "flexpar"), simulate(mixed, "uniform")
    assert flexpar.samples_per_s > 1.5 * uniform.samples_per_s
    assert flexpar.imbalance_median < uniform.imbalance_median
    equal = make_scenario([0.1] * 4, virtual_workers=32, steps=30)
    assert simulate(equal, "flexpar").total_time_s == pytest.approx(simulate(equal, "uniform").total_time_s)


def test_balance_interval_observes_less_often(monkeypatch):
    calls = []
    real_observe = balance.observe
    monkeypatch.setattr(balance, "observe", lambda *a, **k: calls.append(1) or real_observe(*a, **k))
    scenario = make_scenario(
        [0.1, 0.05], virtual_workers=6, steps=12, noise=0.02, balance=BalanceSettings(interval_steps=4)
    )
    assert simulate(scenario, "flexpar").completed
    assert len(calls) == 3


# ---------------------------------------------------------------- elastic events


def stall_of(result, kind):
    return sum(event.stall_s for event in result.events if event.kind == kind)


def test_in_place_join_waits_for_warm_up_then_stalls_for_group_and_broadcast():
    join = Event("join", ("new",), at_s=1.0, devices=(DeviceSpec("new", 0.2),))
    blocking = dataclasses.replace(PARAMETERS, join=JoinModel(mode="blocking"))
    scenario = make_scenario([0.2, 0.2], virtual_workers=6, steps=40, events=[join], parameters=blocking)
    result = simulate(scenario, "flexpar")
    (event,) = [event for event in result.events if event.kind == "join"]
    assert event.time_s >= 1.0 + ELASTIC.warmup_s  # warm-up off the critical path
    assert event.stall_s == pytest.approx(0.2 + broadcast_seconds(3, 4e6, NETWORK))
    restart = simulate(scenario, "restart")
    (event,) = [event for event in restart.events if event.kind == "join"]
    assert 1.0 <= event.time_s < 1.0 + ELASTIC.warmup_s
    assert event.stall_s == pytest.approx(1.0 + 2.0 + 3.0 + 0.5 + 0.25 + 0.2)


def test_in_place_leave_costs_one_group_formation():
    scenario = make_scenario([0.2] * 3, virtual_workers=6, steps=20, events=[Event("leave", ("d2",), at_step=5)])
    result = simulate(scenario, "flexpar")
    assert stall_of(result, "leave") == pytest.approx(ELASTIC.pg_formation_s)
    assert result.stall_s == pytest.approx(ELASTIC.pg_formation_s)
    assert result.segment_devices[-1] == 2


def test_failure_costs_in_flight_step_detection_and_group_or_a_rollback():
    # Failure in the all-reduce of step 15; the restart policy checkpoints every 10 steps.
    scenario = make_scenario([0.2] * 3, virtual_workers=6, steps=20, events=[Event("failure", ("d1",), at_step=15)])
    step_three = step_seconds((2, 2, 2), [0.2] * 3, PARAMETERS)
    flexpar = simulate(scenario, "flexpar")
    assert stall_of(flexpar, "failure") == pytest.approx(step_three + 0.5 + 0.2)
    assert flexpar.lost_work_s == 0.0
    restart = simulate(scenario, "restart")
    assert stall_of(restart, "failure") == pytest.approx(step_three + 0.5 + (1.0 + 2.0 + 3.0 + 0.25 + 0.2))
    # Steps 10 to 14 since the checkpoint after step 10 are redone.
    assert restart.lost_work_s == pytest.approx(5 * step_three)
    assert restart.completed


def test_a_failure_early_in_a_step_costs_flexpar_the_survivors_compute_and_restart_only_up_to_it():
    # 3 devices x 2 VWs x 0.2 s: each survivor computes 0.4 s before the all-reduce.
    quick = dataclasses.replace(
        PARAMETERS, elastic=dataclasses.replace(ELASTIC, detection_s=0.1, recovery_notice_s=0.03)
    )
    step_three = step_seconds((2, 2, 2), [0.2] * 3, quick)
    failure = Event("failure", ("d1",), at_s=3 * step_three + 0.05)  # 0.05 s into step 3
    scenario = make_scenario([0.2] * 3, virtual_workers=6, steps=20, events=[failure], parameters=quick)
    flexpar = simulate(scenario, "flexpar")
    assert stall_of(flexpar, "failure") == pytest.approx(0.4 + 0.03 + 0.2)
    restart = simulate(scenario, "restart")
    assert stall_of(restart, "failure") == pytest.approx(0.05 + 0.1 + (1.0 + 2.0 + 3.0 + 0.25 + 0.2))
    # Dying just before the all-reduce: the detection outlasts the survivors' compute.
    late = make_scenario(
        [0.2] * 3,
        virtual_workers=6,
        steps=20,
        parameters=quick,
        events=[Event("failure", ("d1",), at_s=3 * step_three + 0.38)],
    )
    assert stall_of(simulate(late, "flexpar"), "failure") == pytest.approx(0.38 + 0.1 + 0.03 + 0.2)


def test_joins_beyond_one_device_per_vw_are_refused():
    join = Event("join", ("x", "y"), at_step=2, devices=(DeviceSpec("x", 0.1), DeviceSpec("y", 0.1)))
    scenario = make_scenario(
        [0.1, 0.1],
        virtual_workers=3,
        steps=10,
        events=[join],
        parameters=dataclasses.replace(PARAMETERS, elastic=dataclasses.replace(ELASTIC, warmup_s=0)),
    )
    result = simulate(scenario, "flexpar")
    assert result.count("join") == 1 and result.count("refused") == 1
    assert result.segment_devices.max() == 3


def test_losing_every_device_loses_in_memory_state_but_restart_resumes():
    join = Event("join", ("z",), at_s=30.0, devices=(DeviceSpec("z", 0.1),))
    scenario = make_scenario([0.1], virtual_workers=4, steps=100, events=[Event("failure", ("d0",), at_step=50), join])
    flexpar = simulate(scenario, "flexpar")
    assert not flexpar.completed and flexpar.count("lost") == 1
    restart = simulate(scenario, "restart")
    assert restart.completed and restart.count("idle") == 1


def test_slowdown_is_rebalanced_by_flexpar_only():
    slowdown = Event("slowdown", ("d0",), at_step=10, factor=3.0)
    scenario = make_scenario([0.1] * 4, virtual_workers=16, steps=40, events=[slowdown])
    flexpar, uniform = simulate(scenario, "flexpar"), simulate(scenario, "uniform")
    # Uniform: 4 VWs x 0.3 s on the slow device; flexpar moves VWs off it.
    assert uniform.segment_step_s[-1] == pytest.approx(step_seconds((4, 4, 4, 4), [0.3, 0.1, 0.1, 0.1], PARAMETERS))
    assert flexpar.segment_step_s[-1] < uniform.segment_step_s[-1]


# ---------------------------------------------------------------- scenarios


def test_shipped_scenarios_parse():
    shipped = shipped_scenarios()
    assert {"mixed_cluster", "spot_churn"} <= set(shipped)
    mixed = load_scenario("mixed_cluster")
    assert len(mixed.devices) == 24 and {device.kind for device in mixed.devices} == {"V100", "A100", "H100"}
    speeds = {device.kind: 0.06 / device.seconds_per_vw for device in mixed.devices}
    assert speeds == pytest.approx({"V100": 1.0, "A100": 2.5, "H100": 5.0})
    churn = load_scenario(str(shipped["spot_churn"]))
    kinds = {event.kind for event in churn.events}
    assert kinds == {"join", "leave", "failure"}
    assert max(event.at_s for event in churn.events) > 4 * 3600  # hours of churn


def test_device_entries_take_a_type_a_speed_or_measured_seconds(tmp_path):
    scenario = load_scenario(str(write_toml(tmp_path, MINIMAL_TOML)))
    assert [(device.device_id, device.seconds_per_vw) for device in scenario.devices] == [
        ("slow-0", 0.1),
        ("slow-1", 0.1),
        ("fast-0", 0.05),
        ("measured-0", 0.02),
    ]
    assert scenario.policies == ("flexpar", "uniform", "restart")
    assert scenario.global_batch == 8 * 32


@pytest.mark.parametrize(
    "replace_from, replace_to, message",
    [
        ("seconds_per_vw = 0.02", "speed = -1", "scenario.devices[2].speed: expected a positive number, got -1"),
        ("steps = 10", 'steps = "ten"', "scenario.steps: expected an integer >= 1, got 'ten'"),
        ("steps = 10", "steps = 10\nstepz = 3", "scenario.stepz: unknown field"),
        ("virtual_workers = 8", "virtual_workers = 2", "scenario.virtual_workers: expected an integer >= 4"),
        ("[model]", "[model]\ngradient_bytes = -5", "scenario.model.gradient_bytes: expected a number >= 0, got -5"),
        (
            "[model]",
            "[network]\noverlap_fraction = 2\n[model]",
            "scenario.network.overlap_fraction: expected a number in [0, 1], got 2",
        ),
        ('type = "slow"', 'type = "fast"', "scenario.devices[0].type: expected one of the device_types ['slow']"),
        ('type = "slow"', 'type = "slow"\nspeed = 3', "scenario.devices[0]: expected exactly one of type"),
        ("count = 2", "count = 0", "scenario.devices[0].count: expected an integer >= 1, got 0"),
        ('name = "minimal"', 'name = "minimal"\npolicies = ["ddp"]', "scenario.policies[0]: expected one of"),
        ("reference_seconds_per_vw = 0.1\n", "", "scenario.device_types.slow.speed: a relative speed needs"),
        (
            "[model]",
            "[elastic]\nhost_cores = 0\n[model]",
            "scenario.elastic.host_cores: expected a positive number, got 0",
        ),
    ],
)
def test_bad_scenario_files_name_the_field(tmp_path, replace_from, replace_to, message):
    source = textwrap.dedent(MINIMAL_TOML)
    assert replace_from in source  # the test itself must break the file
    broken = source.replace(replace_from, replace_to, 1)
    with pytest.raises(ValueError, match=re.escape(message)):
        load_scenario(str(write_toml(tmp_path, broken)))


@pytest.mark.parametrize(
    "event, message",
    [
        ('at_s = 5\nkind = "explode"\nids = ["slow-0"]', r"scenario.events\[0\].kind: expected one of"),
        ('kind = "leave"\nids = ["slow-0"]', r"scenario.events\[0\]: expected exactly one of at_s"),
        ('at_s = 5\nat_step = 3\nkind = "leave"\nids = ["slow-0"]', r"scenario.events\[0\]: expected exactly one"),
        (
            'at_s = 5\nkind = "leave"\nids = ["nobody"]',
            r"scenario.events\[0\].ids\[0\]: expected an initial or joining",
        ),
        (
            'at_s = 5\nkind = "join"\nids = ["slow-1"]\ntype = "slow"',
            r"scenario.events\[0\].ids\[0\]: device id 'slow-1'",
        ),
        ('at_s = -1\nkind = "leave"\nids = ["slow-0"]', r"scenario.events\[0\].at_s: expected a number >= 0, got -1"),
        ('at_step = 2\nkind = "slowdown"\nids = ["slow-0"]', r"scenario.events\[0\].factor: required field"),
        ('at_step = 2\nkind = "leave"\nids = []', r"scenario.events\[0\].ids: expected a non-empty list"),
    ],
)
def test_bad_events_name_the_field(tmp_path, event, message):
    text = textwrap.dedent(MINIMAL_TOML) + "[[events]]\n" + event + "\n"
    with pytest.raises(ValueError, match=message):
        load_scenario(str(write_toml(tmp_path, text)))


def test_invalid_toml_and_missing_files_are_value_errors(tmp_path):
    with pytest.raises(ValueError, match="not valid TOML"):
        load_scenario(str(write_toml(tmp_path, "steps = = 3")))
    with pytest.raises(ValueError, match="does not exist"):
        load_scenario(str(tmp_path / "absent.toml"))
    with pytest.raises(ValueError, match="scenario.steps: required field is missing"):
        parse_scenario({"virtual_workers": 2, "devices": [{"seconds_per_vw": 1.0}]})


# ---------------------------------------------------------------- command line


def test_simulate_command_prints_the_table_and_writes_plot_and_json(tmp_path, capsys):
    path = write_toml(tmp_path, MINIMAL_TOML)
    plot_path, json_path = tmp_path / "plot.png", tmp_path / "out.json"
    assert simulate_command(str(path), plot_path=str(plot_path), json_path=str(json_path)) == 0
    printed = capsys.readouterr().out
    for label in (
        "flexpar (balanced, in-place)",
        "uniform split (DDP)",
        "checkpoint-restart (torchrun)",
        "samples/s",
        "time to N steps",
        "stall",
        "imbalance (median)",
    ):
        assert label in printed
    assert plot_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    data = json.loads(json_path.read_text())
    assert set(data["policies"]) == {"flexpar", "uniform", "restart"}
    assert data["policies"]["flexpar"]["completed_steps"] == 10


def test_flexpar_simulate_takes_its_own_flags_and_prints_its_help(tmp_path, capsys):
    from flexpar.cli import main as flexpar_main

    with pytest.raises(SystemExit) as stopped:
        flexpar_main(["simulate", "--help"])
    assert stopped.value.code == 0
    printed = capsys.readouterr().out
    assert "usage: flexpar simulate" in printed and "--scalability" in printed and "mixed_cluster" in printed
    json_path = tmp_path / "out.json"
    path = write_toml(tmp_path, MINIMAL_TOML)
    assert flexpar_main(["simulate", str(path), "--no-plot", "--json", str(json_path)]) == 0
    assert json.loads(json_path.read_text())["policies"]["flexpar"]["completed_steps"] == 10


def test_simulate_command_reports_a_bad_file_and_exits_2(tmp_path, capsys):
    path = write_toml(tmp_path, MINIMAL_TOML.replace("count = 2", "count = -2"))
    assert simulate_command(str(path), plot_path=str(tmp_path / "p.png")) == 2
    assert "scenario.devices[0].count: expected an integer >= 1, got -2" in capsys.readouterr().err
    assert not (tmp_path / "p.png").exists()


def test_scalability_sweep_command(tmp_path, capsys):
    text = textwrap.dedent(MINIMAL_TOML) + "[scalability]\ndevice_counts = [8, 16]\nsteps = 50\n"
    path = write_toml(tmp_path, text)
    json_path = tmp_path / "sweep.json"
    assert (
        simulate_command(str(path), plot_path=str(tmp_path / "s.png"), json_path=str(json_path), scalability_sweep=True)
        == 0
    )
    assert "flexpar samples/s" in capsys.readouterr().out
    assert (tmp_path / "s.png").exists()
    assert json.loads(json_path.read_text())["device_counts"] == [8, 16]


# ---------------------------------------------------------------- scalability


def test_scaled_devices_keep_the_mix_by_largest_remainder():
    devices = (DeviceSpec("a-0", 0.1, "A"), DeviceSpec("b-0", 0.2, "B"), DeviceSpec("c-0", 0.3, "C"))
    kinds = [device.kind for device in scaled_devices(devices, 10)]
    assert (kinds.count("A"), kinds.count("B"), kinds.count("C")) == (4, 3, 3)
    assert len({device.device_id for device in scaled_devices(devices, 1024)}) == 1024


def test_scalability_covers_8_to_1024_devices_for_the_three_policies():
    scenario = load_scenario("mixed_cluster")
    spec = dataclasses.replace(scenario.scalability, steps=200, failures_per_device_hour=0.0)
    sweep = scalability(scenario, spec=spec)
    assert sweep.device_counts == (8, 16, 32, 64, 128, 256, 512, 1024)
    for policy in ("flexpar", "uniform", "restart"):
        throughput = sweep.samples_per_s(policy)
        assert all(result.completed for result in sweep.results[policy])
        assert throughput[-1] > throughput[0]
    # On this mix the balancer wins at every size.
    assert all(f > u for f, u in zip(sweep.samples_per_s("flexpar"), sweep.samples_per_s("uniform")))


def test_failure_trace_is_seeded_and_replaces_each_failed_device():
    devices = tuple(DeviceSpec(f"d-{index}", 0.1, "d") for index in range(16))
    trace = failure_trace(devices, failures_per_device_hour=1.0, replacement_s=60.0, horizon_s=3600.0, seed=3)
    assert trace == failure_trace(devices, 1.0, 60.0, 3600.0, seed=3)
    failures = [event for event in trace if event.kind == "failure"]
    joins = [event for event in trace if event.kind == "join"]
    assert len(failures) == len(joins) > 0
    assert all(join.at_s == pytest.approx(failure.at_s + 60.0) for failure, join in zip(failures, joins))
    point = scaled_scenario(load_scenario("mixed_cluster"), 64)
    assert point.virtual_workers == 4 * 64 and len(point.devices) == 64


# ---------------------------------------------------------------- calibration


def test_calibration_recovers_the_parameters_that_produced_the_measurements():
    devices = 3
    measured = {
        "seconds_per_vw": {"local-0": 0.1, "local-1": 0.05, "local-2": 0.05},
        "virtual_workers": 12,
        "gradient_bytes": 2e6,
        "state_bytes": 4e6,
        "alpha_s": 1e-3,
        "bucket_bytes": 1e6,
        "all_reduce_s": ring_all_reduce_seconds(devices, 2e6, NETWORK),
        "scale_in_stall_s": 0.2,
        "scale_out_stall_s": 0.2 + broadcast_seconds(devices + 1, 4e6, NETWORK),
        "failure_resume_s": 0.5 + 0.2,
        "optimizer_s": 0.01,
    }
    calibration = calibrate(measured)
    parameters = calibration.parameters
    assert parameters.network.bandwidth_bytes_per_s == pytest.approx(1e6)
    assert parameters.network.broadcast_bandwidth_bytes_per_s == pytest.approx(2e6)
    assert parameters.elastic.pg_formation_s == pytest.approx(0.2)
    assert parameters.elastic.detection_s == pytest.approx(0.5)
    assert calibration.sources["network.bandwidth_bytes_per_s"] == "all_reduce_s"
    stalls = predict_elastic_stalls(calibration, devices)
    assert stalls["scale_in_stall_s"] == pytest.approx(measured["scale_in_stall_s"])
    assert stalls["scale_out_stall_s"] == pytest.approx(measured["scale_out_stall_s"])
    seconds = list(measured["seconds_per_vw"].values())
    expected_step = step_seconds(balance.optimal_assignment(seconds, 12), seconds, PARAMETERS)
    assert predict_step_seconds(calibration) == pytest.approx(expected_step)


def test_calibration_fits_the_optimizer_from_a_step_time_and_rejects_bad_figures():
    measured = {"seconds_per_vw": [0.1, 0.1], "virtual_workers": 4, "gradient_bytes": 0.0, "step_time_s": 0.25}
    calibration = calibrate(measured)
    assert calibration.parameters.workload.optimizer_s == pytest.approx(0.05)
    assert calibration.sources["model.optimizer_s"] == "step_time_s residual"
    with pytest.raises(ValueError, match=r"measured\['seconds_per_vw'\]\['device-1'\]: expected a positive number"):
        calibrate({"seconds_per_vw": [0.1, -1]})
    with pytest.raises(ValueError, match=r"measured\['broadcast_s'\]: expected a finite number"):
        calibrate({"broadcast_s": "fast"})


# ------------------------------------------------------------- shared hosts, failures


def test_host_contention_is_processor_sharing_of_the_cores():
    assert host_contention(8, None) == 1.0  # each device has its own cores
    assert host_contention(2, 2.0) == 1.0
    assert host_contention(3, 2.0) == pytest.approx(1.5)
    assert host_contention(4, 2.0) == pytest.approx(2.0)
    with pytest.raises(ValueError, match="elastic.host_cores: expected a finite positive number, got 0"):
        ElasticCosts(host_cores=0)


def test_group_formation_stretches_with_the_busy_processes_on_shared_cores():
    shared = ElasticCosts(pg_formation_s=0.002, pg_formation_per_device_s=0.001, host_cores=2.0)
    assert pg_formation_seconds(2, shared) == pytest.approx(0.004)
    assert pg_formation_seconds(3, shared) == pytest.approx(0.005 * 1.5)
    assert 0.004 * host_contention(3, shared.host_cores) == pytest.approx(0.004 * 1.5)
    own = dataclasses.replace(shared, host_cores=None)
    assert 0.004 * host_contention(3, own.host_cores) == pytest.approx(0.004)


def test_failure_stall_is_the_later_of_the_compute_and_the_detection_then_notice_and_a_group():
    costs = ElasticCosts(pg_formation_s=0.01, detection_s=0.05, recovery_notice_s=0.02)
    # A peer dying while the others wait in the collective: detection.
    assert failure_stall_seconds(2, costs) == pytest.approx(0.05 + 0.02 + 0.01)
    # Dying early in a long step: the survivors' compute hides the detection.
    assert failure_stall_seconds(2, costs, lost_compute_s=0.3, death_at_s=0.1) == pytest.approx(0.3 + 0.02 + 0.01)
    # Dying near its end: the detection runs past the survivors' compute.
    assert failure_stall_seconds(2, costs, lost_compute_s=0.3, death_at_s=0.28) == pytest.approx(0.33 + 0.02 + 0.01)


def test_lost_compute_runs_faster_after_the_death_only_on_shared_cores():
    own = ElasticCosts()
    assert failed_step_lost_seconds(0.6, 3, own, death_fraction=0.25) == pytest.approx(0.6)
    shared = ElasticCosts(host_cores=2.0)
    # A quarter at 3 processes on 2 cores, the rest at 2: 1.5x faster.
    assert failed_step_lost_seconds(0.6, 3, shared, death_fraction=0.25) == pytest.approx(0.6 * (0.25 + 0.75 / 1.5))
    assert failed_step_lost_seconds(0.6, 3, shared, death_fraction=1.0) == pytest.approx(0.6)


def test_predicted_elastic_stalls_count_the_survivors_and_the_recovery_notice():
    costs = ElasticCosts(pg_formation_s=0.004, detection_s=0.03, recovery_notice_s=0.02, host_cores=2.0)
    calibration = calibrate(
        {"pg_formation_s": 0.004, "detection_s": 0.03, "recovery_notice_s": 0.02, "host_cores": 2.0}
    )
    assert calibration.parameters.elastic == dataclasses.replace(
        ElasticCosts(),
        **{name: getattr(costs, name) for name in ("pg_formation_s", "detection_s", "recovery_notice_s", "host_cores")},
    )
    stalls = predict_elastic_stalls(calibration, devices_before=3)
    # 2 survivors on 2 cores: the leaver skips its last update and exits at the lowest priority.
    assert stalls["scale_in_stall_s"] == pytest.approx(0.004)
    assert stalls["failure_resume_s"] == pytest.approx(0.03 + 0.02 + 0.004)
