"""The fault soak, small: random joins, leaves, kill -9, SIGSTOP and SIGTERM at every phase, each run equal
to the failure-free run with every sample used once and every evaluation whole (benchmarks/soak.py runs
the full 100-fault version); its draw (soak_plan.py) and its count of what fired (soak_tally.py)."""

import os
import random
import sys

import pytest
from hypothesis import Phase, given, settings, strategies

sys.path.insert(
    0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "benchmarks")
)

import soak  # noqa: E402
import soak_checks  # noqa: E402
import soak_plan  # noqa: E402
import soak_tally  # noqa: E402
from soak_plan import RunPlan  # noqa: E402

_REFERENCES: dict = {}  # the failure-free run, computed once for the runs below (soak.run_one)


def _check_plan(plan):
    assert 2 <= plan.size <= 5
    targets = [device for _, device, _, _ in plan.faults]
    assert len(targets) == len(set(targets)) <= plan.devices - 1, "signals hit distinct devices, one stays"
    assert all(device in {f"local-{i}" for i in range(plan.devices)} for device in targets)
    assert plan.devices + plan.joins <= soak_plan.VIRTUAL_WORKERS
    joins = leaves = 0
    for _step, delta in sorted(plan.schedule):
        joins, leaves = joins + (delta > 0), leaves + (delta < 0)
        assert leaves <= joins, "a planned leave never takes a device the run started with"
    for step, _, phase, kind in plan.faults:
        assert soak_plan.FIRST_STEP <= step <= soak_plan.LAST_STEP < soak_plan.STEPS
        assert phase in soak_plan.SIGNAL_PHASES and kind in soak_plan.SIGNAL_NAMES


def _check_fireable(plan):
    """Every drawn signal is where it can fire (soak_plan's module doc)."""
    assert [fault[0] for fault in plan.faults] == sorted(fault[0] for fault in plan.faults)
    rank_zero = [fault for fault in plan.faults if fault[2] in soak_plan.RANK_ZERO_PHASES]
    assert len(rank_zero) <= 1
    for position, (step, device, phase, _) in enumerate(plan.faults):
        if phase in soak_plan.RANK_ZERO_PHASES:
            taken = {fault[1] for fault in plan.faults[:position]}
            assert device == next(f"local-{i}" for i in range(plan.devices) if f"local-{i}" not in taken)
        if phase == "transfer":
            assert any(at >= step for at, delta in plan.schedule if delta > 0), "a join to send the state to"
        if phase == "formation":
            triggers = [at for at, _ in plan.schedule] + [
                other[0] for other in plan.faults if other[1] != device and other[2] != "formation"
            ]
            assert any(at >= step for at in triggers), "a change after it forms a new generation"
        if phase == "eval":
            assert step in soak_plan.EVALUATION_STEPS


@given(strategies.integers(min_value=0, max_value=2**32 - 1))
@settings(max_examples=300, deadline=None)
def test_drawn_runs_leave_a_device_standing_and_place_each_fault_where_it_can_fire(seed):
    plan = soak_plan.draw_run(random.Random(seed), 0)
    _check_plan(plan)
    _check_fireable(plan)


@given(strategies.integers(min_value=0, max_value=2**32 - 1))
@settings(max_examples=30, deadline=None)
def test_a_soaks_deck_deals_every_phase_early(seed):
    plans = soak_plan.plans(seed)
    dealt = []
    while len(dealt) < 3 * len(soak_plan.SIGNAL_PHASES):
        plan = next(plans)
        _check_fireable(plan)
        dealt += [phase for _, _, phase, _ in plan.faults]
    # The deck deals every phase within its first seven cards, save a checkpoint or transfer card
    # held back while a run already has one, which comes in a later run, ahead of the next deck.
    assert set(dealt) == set(soak_plan.SIGNAL_PHASES)


@given(strategies.integers(min_value=0, max_value=2**32 - 1))
@settings(max_examples=30, deadline=None)
def test_every_fourth_run_also_kills_its_driver_where_that_can_fire(seed):
    runs = soak_plan.plans(seed)
    for index in range(2 * soak_plan.DRIVER_EVERY):
        plan = next(runs)
        _check_fireable(plan)
        if index % soak_plan.DRIVER_EVERY != soak_plan.DRIVER_EVERY - 1:
            assert plan.driver_fault is None
            continue
        step, phase = plan.driver_fault
        assert soak_plan.FIRST_STEP <= step <= soak_plan.LAST_STEP and phase in soak_plan.DRIVER_PHASES
        if phase == "transfer":
            assert any(at >= step for at, delta in plan.schedule if delta > 0), "a join to send the state to"
        assert f"{step}:driver:{phase}" in plan.fault_text().split(",")


def test_a_driver_fault_is_tallied_as_the_driver_kind():
    plan = RunPlan(0, 2, [], [], driver_fault=(7, "sync"))
    line = "flexpar: fault: driver gets SIGKILL at step 7 (sync) at 100.000000 (pid 12, from local-0)\n"
    fired = soak_tally.tally(plan, line, [], []).fired
    assert [(f.kind, f.phase, f.step) for f in fired] == [("driver", "sync", 7)]
    assert soak_tally.tally(plan, "", [], []).not_fired == [("driver", "sync", 7, "driver")]


def test_the_driver_overrun_counts_the_steps_committed_past_the_driver_faults_step():
    fired = [{"kind": "kill", "step": 3}, {"kind": "driver", "step": 7}]
    events = [{"event": "join", "step": 2}, {"event": "adopt", "step": 9}]
    assert soak_checks.driver_overrun(fired, events) == 1  # step 7 in flight, step 8 past it
    assert soak_checks.driver_overrun(fired, events[:1]) is None and soak_checks.driver_overrun([], events) is None


def test_a_restart_command_is_read_from_whole_lines_only(tmp_path):
    output = tmp_path / "stderr.txt"
    note = soak.WAITING_NOTE
    output.write_text(f"x: waits; {note}flexpar run --resume a.py\nnoise\ny: waits; {note}flexpar run --resu")
    assert soak.harness.commands_said(str(output), note) == ["flexpar run --resume a.py"]


def test_the_phase_deck_keeps_an_excluded_phase_for_later():
    deck = soak_plan.PhaseDeck(random.Random(1))
    first = [deck() for _ in soak_plan.SIGNAL_PHASES]
    assert sorted(first) == sorted(soak_plan.SIGNAL_PHASES)
    second = [deck(excluded=("checkpoint", "transfer")) for _ in range(5)]
    assert "checkpoint" not in second and "transfer" not in second
    assert sorted(deck() for _ in range(2)) == ["checkpoint", "transfer"]


# ------------------------------------------------------------ what fired


def _line(device, signal, step, phase, at):
    return f"flexpar: fault: {device} gets {signal} at step {step} ({phase}) at {at:.6f}\n"


def test_the_tally_counts_what_fired_by_kind_and_phase_and_what_did_not():
    plan = RunPlan(
        0,
        3,
        [(5, +1), (9, +1), (20, -1)],
        [(4, "local-1", "forward", "kill"), (4, "local-2", "formation", "kill"), (12, "local-0", "checkpoint", "term")],
    )
    stderr = (
        "noise\n"
        + _line("local-1", "SIGKILL", 4, "forward", 100.0)
        + _line("local-2", "SIGKILL", 4, "formation", 100.5)
    )  # rank 0's checkpoint fault never fired
    outcomes = [
        {"step": 5, "delta": 1, "status": "on time", "detail": ""},
        {"step": 9, "delta": 1, "status": "not applied", "detail": "the job ended first"},
        {"step": 20, "delta": -1, "status": "late", "detail": ""},
    ]
    records = [
        {"kind": "step", "step": 3, "time": 99.0},
        {"kind": "event", "event": "failure", "time": 101.0},
        {"kind": "step", "step": 4, "time": 101.2},
    ]
    tally = soak_tally.tally(plan, stderr, outcomes, records)
    assert [(f.kind, f.phase, f.step) for f in tally.fired] == [
        ("kill", "forward", 4),
        ("kill", "formation", 4),
        ("join", "schedule", 5),
        ("leave", "schedule", 20),
    ]
    assert tally.not_fired == [("term", "checkpoint", 12, "local-0"), ("join", "schedule", 9, "")]
    assert (tally.simultaneous, tally.signal_with_change, tally.during_recovery) == (1, 0, 1)
    counts = soak_tally.counts([tally, tally])
    assert counts["fired_by_kind"] == {"kill": 4, "stop": 0, "term": 0, "join": 2, "leave": 2, "driver": 0}
    assert counts["fired_by_phase"]["forward"] == counts["fired_by_phase"]["formation"] == 2
    assert counts["not_fired"] == 4 and counts["not_fired_by_phase"]["checkpoint"] == 2
    assert counts["during_recovery"] == 2 and counts["simultaneous"] == 2


def test_recovery_ends_at_the_next_generation_or_step_whichever_shows_first():
    plan = RunPlan(0, 3, [(12, +1)], [(4, "local-1", "sync", "stop"), (10, "local-2", "forward", "term")])
    stopped, later = _line("local-1", "SIGSTOP", 4, "sync", 100.0), _line("local-2", "SIGTERM", 10, "forward", 104.0)
    after_the_failure = [{"kind": "event", "event": "failure", "time": 103.0}]
    assert soak_tally.tally(plan, stopped + later, [], after_the_failure).during_recovery == 0
    # The failure event was lost with its rank 0; the next committed step still ends the recovery.
    assert (
        soak_tally.tally(plan, stopped + later, [], [{"kind": "step", "step": 4, "time": 103.5}]).during_recovery == 0
    )
    assert (
        soak_tally.tally(plan, stopped + later, [], [{"kind": "step", "step": 4, "time": 104.5}]).during_recovery == 1
    )
    # A SIGTERM is a planned leave, not a failure: nothing recovers from it. A join at the
    # signal's step is a signal with a change.
    term_first = _line("local-2", "SIGTERM", 12, "forward", 100.0) + _line("local-1", "SIGSTOP", 12, "sync", 100.1)
    tally = soak_tally.tally(plan, term_first, [{"step": 12, "delta": 1, "status": "on time", "detail": ""}], [])
    assert (tally.during_recovery, tally.simultaneous, tally.signal_with_change) == (0, 1, 1)


def test_a_sharded_soak_deals_the_update_phase_and_allows_a_lost_state_stop_only_after_two_failures_at_once():
    plans = soak_plan.plans(5, soak_plan.SHARDED_PHASES)
    dealt = set()
    while len(dealt) < len(soak_plan.SHARDED_PHASES):
        plan = next(plans)
        _check_fireable(plan)
        dealt |= {phase for _, _, phase, _ in plan.faults}
    assert dealt == set(soak_plan.SHARDED_PHASES)
    named = (
        "flexpar: optimizer state lost: elements 0-63 of 0.weight had no copy left on the devices still running "
        "(local-1, local-2 failed together; shard_redundancy=default (2)); the latest checkpoint is "
        "/tmp/c/step-00000010.pt; resume with: flexpar run --resume train.py\n"
    )
    assert soak_checks.lost_state_stop_allowed("noise\n" + named, simultaneous=1, during_recovery=0)
    assert soak_checks.lost_state_stop_allowed(named, simultaneous=0, during_recovery=1)
    assert not soak_checks.lost_state_stop_allowed(named, simultaneous=0, during_recovery=0), "one loses nothing"
    nameless = named.replace("the latest checkpoint is /tmp/c/step-00000010.pt; resume with: flexpar run --resume", "")
    assert not soak_checks.lost_state_stop_allowed(nameless, simultaneous=1, during_recovery=0)
    assert not soak_checks.lost_state_stop_allowed("Traceback: a hang\n", simultaneous=1, during_recovery=1)


def test_a_run_that_ends_before_its_last_step_is_a_failure():
    assert soak.ending_problem({"steps": soak_plan.STEPS, "stopped": ""}) == ""
    assert soak.ending_problem({"steps": 20, "stopped": ""}) == f"ended after 20 of {soak_plan.STEPS} steps"
    assert "ended after 11" in soak.ending_problem({"steps": 11, "stopped": "its last device got SIGTERM"})
    assert soak.ending_problem({"steps": soak_plan.STEPS, "stopped": "a callback"}) == "stopped: a callback"


@pytest.mark.timeout(240)
def test_a_real_run_cut_short_counts_as_failed_not_as_a_shorter_match(tmp_path):
    # One device, preempted: the job finishes cleanly after the step in flight, far short of STEPS.
    plan = RunPlan(0, 1, [], [(8, "local-0", "forward", "term")])
    result = soak.run_one(plan, str(tmp_path), timeout_s=10.0, heartbeat_timeout_s=3.0, references=_REFERENCES)
    assert not result.hang and result.steps < soak_plan.STEPS
    assert result.failed.startswith(f"ended after {result.steps} of {soak_plan.STEPS} steps"), result.failed
    assert result.bad


@pytest.mark.timeout(240)
def test_a_sharded_run_through_a_join_a_leave_and_a_kill_after_the_update_is_the_failure_free_run(tmp_path):
    # soak.py --shard's check on one run: the optimizer state sharded (3 devices, each part on 2),
    # a device killed after its own update of its part and before its broadcast of it.
    plan = RunPlan(0, 3, [(4, +1), (14, -1)], [(18, "local-1", "update", "kill")])
    result = soak.run_one(
        plan, str(tmp_path), timeout_s=10.0, heartbeat_timeout_s=3.0, references=_REFERENCES, shard=True
    )
    assert not result.bad and not result.lost_state_stop, soak.describe(plan, result)
    assert result.steps == soak_plan.STEPS
    assert ("kill", "update", 18) in [(f["kind"], f["phase"], f["step"]) for f in result.fired], result.fired


@pytest.mark.timeout(240)
def test_a_streaming_run_through_a_join_a_leave_and_a_kill_is_the_failure_free_run(tmp_path):
    # The soak's streaming draw on one run: 6 shards, one per VW; the ledger names stream items.
    assert [plan.streaming for plan, _ in zip(soak_plan.plans(9), range(6))] == [False, True, False] * 2
    assert not any(plan.streaming for plan, _ in zip(soak_plan.plans(9, streaming=False), range(6)))
    plan = RunPlan(0, 2, [(4, +1), (14, -1)], [(18, "local-1", "forward", "kill")], streaming=True)
    result = soak.run_one(plan, str(tmp_path), timeout_s=10.0, heartbeat_timeout_s=3.0, references=_REFERENCES)
    assert not result.bad, soak.describe(plan, result)
    assert result.steps == soak_plan.STEPS
    assert ("kill", "forward", 18) in [(f["kind"], f["phase"], f["step"]) for f in result.fired], result.fired


# ------------------------------------------------------------ the soak itself


@pytest.mark.timeout(400)
def test_a_small_soak_fires_every_kind_and_phase_and_finds_no_error(tmp_path):
    # Seed 9's first four runs draw every kind and phase, a kill with a formation fault in its
    # recovery, two signals at one step, and a signal at a join's step (soak_plan.plans).
    report = soak.run_soak(
        faults=12,
        seed=9,
        folder=str(tmp_path),
        timeout_s=30.0,
        heartbeat_timeout_s=3.0,
        progress=print,
        references=_REFERENCES,
    )
    problems = [
        d
        for d in report["details"]
        if d["hang"] or d["failed"] or d["divergent"] or d["eval_missing"] or d["eval_divergent"]
    ]
    for key in soak.PROBLEMS:
        assert report[key] == 0, (key, problems)
    assert report["faults_injected"] >= 12 and report["hung_peers"] >= 1, "a SIGSTOP fired and was noticed"
    missed = [(d["index"], d["not_fired"]) for d in report["details"] if d["not_fired"]]
    assert all(report["fired_by_kind"].values()), (report["fired_by_kind"], missed)
    assert all(report["fired_by_phase"].values()), (report["fired_by_phase"], missed)
    assert report["simultaneous"] >= 1, report
    # The devices stop within a step of their driver's death (DeviceLink.driver_gone_now), so a fault drawn
    # a few steps after a driver fault hits the restarted driver, not the dead one (steps here: ~0.1 s).
    assert report["driver_overrun_max"] is not None and report["driver_overrun_max"] <= 1, report
    # A formation kill drawn into another kill's recovery fires at the recovery's group formation,
    # so it is in that recovery by construction. The tally's time-based `during_recovery` also
    # depends on whether the failure event was written before that formation (machine load), so
    # the test asserts on the plan: such a fault was drawn, and it fired.
    plans = soak_plan.plans(9)
    drawn = [next(plans) for _ in report["details"]]
    in_recovery = [
        (plan.index, ("kill", "formation", step, device))
        for plan in drawn
        for step, device, phase, kind in plan.faults
        if (phase, kind) == ("formation", "kill")
        and any(
            at == step and other_kind == "kill" and other_phase != "formation"
            for at, _, other_phase, other_kind in plan.faults
        )
    ]
    assert in_recovery, "seed 9 draws a formation kill into a kill's recovery"
    not_fired = {(d["index"], tuple(fault)) for d in report["details"] for fault in d["not_fired"]}
    assert not any(fault in not_fired for fault in in_recovery), (in_recovery, missed)


@pytest.mark.timeout(240)
@given(strategies.randoms(use_true_random=False))
@settings(max_examples=2, deadline=None, derandomize=True, database=None, phases=[Phase.explicit, Phase.generate])
def test_hypothesis_drawn_plans_train_to_the_failure_free_result(tmp_path_factory, rng):
    # Two plans drawn by hypothesis (derandomized: the same two on every machine), each trained for
    # real; no shrinking, each example is a whole run (about 10 s).
    plan = soak_plan.draw_run(rng, 0)
    _check_fireable(plan)
    result = soak.run_one(
        plan, str(tmp_path_factory.mktemp("drawn")), timeout_s=10.0, heartbeat_timeout_s=3.0, references=_REFERENCES
    )
    assert not result.bad, soak.describe(plan, result)
    assert result.steps == soak_plan.STEPS
