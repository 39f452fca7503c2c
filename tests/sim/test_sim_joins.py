"""The simulator's join model (flexpar/sim/joins.py): the way a join takes, its stall, a stream's steps and cost."""

from __future__ import annotations

import dataclasses

import pytest

from flexpar.core import join_choice
from flexpar.sim import (
    DeviceSpec,
    ElasticCosts,
    Event,
    JoinModel,
    ModelParameters,
    NetworkModel,
    Scenario,
    WorkloadModel,
    choose_join,
    join_inputs,
    parse_scenario,
    pg_formation_seconds,
    simulate,
)
from flexpar.sim.joins import planned_steps, simulate_stream
from flexpar.sim.report import joins_table

NETWORK = NetworkModel(alpha_s=0.0, bandwidth_bytes_per_s=1e9, broadcast_bandwidth_bytes_per_s=1e9)
WORKLOAD = WorkloadModel(gradient_bytes=0.0, state_bytes=2e9, optimizer_s=0.3)
ELASTIC = ElasticCosts(warmup_s=1.0, pg_formation_s=0.01, host_cores=2.0)


def parameters(**join) -> ModelParameters:
    return ModelParameters(network=NETWORK, workload=WORKLOAD, elastic=ELASTIC, join=JoinModel(**join))


def scenario(join_parameters: ModelParameters, steps: int = 60) -> Scenario:
    event = Event("join", ("new",), at_step=5, devices=(DeviceSpec("new", 0.1),))
    return Scenario(
        name="joins",
        steps=steps,
        virtual_workers=4,
        devices=(DeviceSpec("a", 0.1), DeviceSpec("b", 0.1)),
        events=(event,),
        parameters=join_parameters,
        policies=("flexpar",),
    )


def test_the_inputs_are_the_members_figures():
    inputs = join_inputs(("a", "b"), (2, 2), (0.1, 0.1), 3, parameters(joiner_shares_cores=True))
    assert inputs.step_s == pytest.approx(0.5) and inputs.compute_s == pytest.approx(0.2)
    assert inputs.link_bytes_per_s == 1e9 and inputs.senders == 2
    assert inputs.shared == join_choice.SharedCores("a", 2.0, 2)
    # The engine's choice plans 0.1 x 0.2 s of compute x 1 GB/s = 20 MB a sender; 2 GB over 2 senders: 50 rounds.
    assert inputs.stream_steps == planned_steps(2e9, 2, 0.2, parameters()) == 50


def test_a_blocking_join_costs_the_members_its_stall_only():
    result = simulate(scenario(parameters(mode="blocking")), "flexpar")
    (join,) = result.joins()
    assert join.way == "blocking" and "blocking transfer: predicted" in join.detail
    boundary = pg_formation_seconds(3, ELASTIC)  # 3 processes on 2 cores: 0.015 s
    assert join.stall_s == pytest.approx(boundary + 2.0)
    assert join.members_lost_s == pytest.approx(join.stall_s) and join.stream_steps == 0
    assert result.join_lost_s == pytest.approx(join.stall_s)


def test_a_streamed_join_runs_its_steps_slower_then_the_joiner_takes_vws():
    forced = simulate(scenario(parameters(mode="stream", joiner_shares_cores=True)), "flexpar")
    (join,) = [event for event in forced.events if event.kind == "join"]
    (stream,) = [event for event in forced.events if event.kind == "stream"]
    joined = parameters(mode="stream", joiner_shares_cores=True)
    choice = choose_join(("a", "b"), (2, 2), (0.1, 0.1), 3, joined)
    assert join.way == "stream" and join.stall_s == pytest.approx(pg_formation_seconds(3, ELASTIC))
    # The choice is made on the engine's estimate of the first plan (50 rounds); the stream runs as the
    # engine plans and re-sizes it: 20 MB slices cut at 12-byte elements plan 51 rounds; the listener's work
    # slows the members' steps by more than twice the 0.1 target in two steps in a row, so the slices are
    # halved at round 3, which does not help (the slowdown is the listener's), so they are doubled back at
    # round 6 once two steps carried the smaller slices: one more round (the re-plan packs the rest).
    course = simulate_stream(join_inputs(("a", "b"), (2, 2), (0.1, 0.1), 3, joined), joined)
    assert choice.stream.stream_steps == 50 and course.planned_rounds == 51 and course.rounds == 52
    assert course.sender_bytes[1:7] == (20_000_000, 20_000_000) + (10_000_000,) * 3 + (20_000_000,)
    assert stream.stream_steps == stream.step - join.step == 52
    assert stream.members_lost_s == pytest.approx(join.stall_s + course.lost_s(0.5))
    assert forced.joins() == (stream,)
    # The members' steps while it streams are the slower ones; after it, three devices share the VWs.
    slow = forced.segment_step_s[(forced.segment_committed > join.step) & (forced.segment_committed <= stream.step)]
    assert slow == pytest.approx(0.5 + course.lost_s(0.5) / 52)
    listener = join_choice.listener_slowdown(join_inputs(("a", "b"), (2, 2), (0.1, 0.1), 3, joined))
    assert min(course.member_step_s) >= 0.5 * listener > 0.5
    assert stream.first_vw_s == pytest.approx(join.stall_s + sum(course.member_step_s))
    assert forced.segment_devices[-1] == 3
    # Accounting still holds: the steps' time plus the stall is the run's time.
    assert forced.total_time_s == pytest.approx(forced.kept_step_seconds + forced.stall_s)


def test_auto_takes_blocking_on_a_shared_host_and_streams_on_its_own_cores():
    shared = simulate(scenario(parameters(joiner_shares_cores=True)), "flexpar").joins()[0]
    assert shared.way == "blocking" and shared.detail.endswith("(the joiner shares a's cores)")
    # Its own cores, a slow link: the blocking transfer would stop the members for 20 s.
    result = simulate(scenario(parameters(link_bytes_per_s=1e8)), "flexpar")
    (join,) = [event for event in result.events if event.kind == "join"]
    assert join.way == "stream" and "streamed: predicted" in join.detail
    slow_link = result.joins()[0]
    assert slow_link.members_lost_s < 20.0


def test_skipping_identical_steps_changes_no_join_figure():
    for join in (dict(mode="stream", joiner_shares_cores=True), dict(link_bytes_per_s=1e8)):
        fast = simulate(scenario(parameters(**join)), "flexpar")
        slow = simulate(scenario(parameters(**join)), "flexpar", skip_identical_steps=False)
        assert fast.total_time_s == pytest.approx(slow.total_time_s)
        assert [(e.kind, e.step, e.way, e.stream_steps) for e in fast.events] == [
            (e.kind, e.step, e.way, e.stream_steps) for e in slow.events
        ]
        for one, other in zip(fast.events, slow.events):
            assert (one.time_s, one.members_lost_s, one.first_vw_s) == pytest.approx(
                (other.time_s, other.members_lost_s, other.first_vw_s)
            )


def test_a_change_during_a_stream_breaks_it_off_and_the_listener_joins_again():
    base = scenario(parameters(mode="stream"))
    leave = Event("leave", ("b",), at_step=10)
    result = simulate(dataclasses.replace(base, events=base.events + (leave,)), "flexpar")
    kinds = [event.kind for event in result.events]
    assert kinds.count("stream") == 1 and kinds.count("join") == 2  # broken off, then streamed again from "a"
    assert "broken off" in next(event.detail for event in result.events if event.kind == "stream")
    # On its own cores the listener slows nobody; a's 40 MB slices (0.1 x its 0.4 s of compute at 1 GB/s)
    # cost 0.04 s of its 0.7 s step, between half and twice the 0.1 target: the first plan's 51 rounds
    # outlast the run's 50 steps left.
    assert result.completed and result.segment_devices[-1] == 1
    # A failure of the listener cancels it; the members run at full speed again.
    failure = Event("failure", ("new",), at_step=10)
    result = simulate(dataclasses.replace(base, events=base.events + (failure,)), "flexpar")
    assert any(event.kind == "cancelled" for event in result.events)
    assert result.completed and result.segment_devices[-1] == 2


def test_the_join_table_of_a_scenario_file():
    data = {
        "steps": 40,
        "virtual_workers": 4,
        "model": {"state_bytes": 1e9, "gradient_bytes": 0.0},
        "elastic": {"host_cores": 2, "warmup_s": 0.5},
        "join": {"mode": "stream", "link_bytes_per_s": 5e8, "joiner_shares_cores": True, "max_first_vw_s": 60},
        "devices": [{"seconds_per_vw": 0.1, "count": 2}],
        "events": [{"at_step": 3, "kind": "join", "ids": ["j"], "seconds_per_vw": 0.1}],
    }
    parsed = parse_scenario(data)
    assert parsed.parameters.join == JoinModel(
        mode="stream", link_bytes_per_s=5e8, joiner_shares_cores=True, max_first_vw_s=60.0
    )
    table = joins_table(simulate(parsed, "flexpar"))
    assert "members' lost" in table and "stream" in table
    for bad, message in (
        ({"mode": "fast"}, "scenario.join.mode"),
        ({"joiner_shares_cores": "yes"}, "scenario.join.joiner_shares_cores"),
        ({"speed": 1}, "scenario.join.speed: unknown field"),
        ({"tensors": [[10, 0]]}, "scenario.join.tensors"),
        ({"tensors": [10, 12]}, "scenario.join.tensors"),
        ({"listener_work": 0}, "scenario.join.listener_work"),
        ({"step_noise": -1}, "scenario.join.step_noise"),
    ):
        with pytest.raises(ValueError, match=message):
            parse_scenario({**data, "join": bad})
    with pytest.raises(ValueError, match="needs elastic.host_cores"):
        parse_scenario({**data, "elastic": {}, "join": {"joiner_shares_cores": True}})


def test_the_stream_follows_the_scenarios_tensors_listener_work_and_noise():
    data = {
        "steps": 80,
        "virtual_workers": 4,
        "model": {"state_bytes": 6e8, "gradient_bytes": 0.0, "optimizer_s": 0.3},
        "elastic": {"host_cores": 2, "warmup_s": 0.5},
        "join": {
            "mode": "stream",
            "joiner_shares_cores": True,
            "listener_work": 1.3,
            "baseline_ratio": 1.1,
            "step_noise": 0.1,
            "tensors": [[30_000_000, 12], [20_000_000, 12]],
        },
        "devices": [{"seconds_per_vw": 0.1, "count": 2}],
        "events": [{"at_step": 3, "kind": "join", "ids": ["j"], "seconds_per_vw": 0.1}],
    }
    parsed = parse_scenario(data)
    join = parsed.parameters.join
    assert (join.listener_work, join.baseline_ratio, join.step_noise) == (1.3, 1.1, 0.1)
    assert join.tensors == ((30_000_000, 12), (20_000_000, 12))
    events = simulate(parsed, "flexpar").events
    (join_event,) = [event for event in events if event.kind == "join"]
    (stream,) = [event for event in events if event.kind == "stream"]
    members = [device.device_id for device in parsed.devices]
    inputs = join_inputs(members, (2, 2), (0.1, 0.1), 3, parsed.parameters)
    course = simulate_stream(inputs, parsed.parameters, 0.1, parsed.seed * 1_000_003 + join_event.step)  # its draw
    assert stream.stream_steps == course.rounds
    assert stream.members_lost_s == pytest.approx(join_event.stall_s + course.lost_s(inputs.step_s))
    # The listener's work as the scenario says, not the engine's LISTENER_WORK: the members' steps are slower.
    engine_work = dataclasses.replace(
        parsed.parameters, join=dataclasses.replace(join, listener_work=0.95, step_noise=0.0)
    )
    quiet = dataclasses.replace(parsed.parameters, join=dataclasses.replace(join, step_noise=0.0))
    assert simulate_stream(inputs, quiet).lost_s(0.5) > simulate_stream(inputs, engine_work).lost_s(0.5)
