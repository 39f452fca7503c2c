"""Load balancing end to end: devices of unequal (emulated) speed get the optimal split.

Three worker processes run at relative speeds 1, 0.5 and 0.25 (the worker
stretches each VW's compute to 1/speed of it). One job runs for the whole
module; its step records and result are checked three ways: the balancer
reaches the min-max optimal assignment for those speeds within a few steps,
it stays there (no oscillation), and the parameters are still the
single-process reference's.
"""

import json
import multiprocessing

import pieces
import pytest

from flexpar.core.balance import optimal_assignment

SPEEDS = (1.0, 0.5, 0.25)
VIRTUAL_WORKERS = 8
STEPS = 20
WITHIN_STEPS = 10

# Each VW sleeps DELAY_S inside the loss, so a VW's "compute" is dominated by a
# fixed, core-free wait: three processes on two cores then measure the speed
# ratios the emulation sets, not CPU contention.
DELAY_S = 0.03


@pytest.fixture(scope="module")
def balanced_run(tmp_path_factory):
    """(job, model, step records) of one job at SPEEDS; fails if a worker is left running."""
    metrics = tmp_path_factory.mktemp("balance") / "metrics.jsonl"
    job = pieces.make_job(virtual_workers=VIRTUAL_WORKERS, global_batch=48, delay_s=DELAY_S)
    # The same settings as the `train` fixture of conftest.py (module scope needs its own).
    model, _ = job.fit(
        steps=STEPS,
        devices=len(SPEEDS),
        emulate_speeds=list(SPEEDS),
        metrics=str(metrics),
        display=False,
        quiet=True,
        oversubscribe=True,
        timeout_s=10.0,
    )
    leftovers = [child for child in multiprocessing.active_children() if child.name.startswith("flexpar-")]
    for child in leftovers:
        child.kill()
    assert not leftovers, f"worker processes left running: {[child.name for child in leftovers]}"
    records = [record for record in map(json.loads, open(metrics)) if record["kind"] == "step"]
    return job, model, records


def _speed_of(device_id):
    """Emulated speed of a local device: `local-i` runs at SPEEDS[i]."""
    return SPEEDS[int(device_id.rsplit("-", 1)[1])]


def _expected_assignment(record):
    """The optimum for the known relative speeds, in the record's rank order.

    Ranks follow the order in which the devices became ready, not their
    names, so the expectation is built per record from its `devices`.
    """
    optimum = optimal_assignment([1.0 / _speed_of(device) for device in record["devices"]], VIRTUAL_WORKERS)
    # V = 8 over speeds 1 : 0.5 : 0.25 has a unique optimum (5, 2, 1 VWs for
    # the devices of speed 1, 0.5, 0.25), predicted 5 time units; the next best
    # splits cost 6 units. That 20% margin is far above the balancer's 5%
    # hysteresis, so the checks are about convergence and stability, not about
    # a tie-break between equally good splits.
    by_speed = {_speed_of(device): count for device, count in zip(record["devices"], optimum)}
    assert by_speed == {1.0: 5, 0.5: 2, 0.25: 1}
    return list(optimum)


def _assignments(records):
    return [dict(zip(record["devices"], record["assignment"])) for record in records]


def _is_optimal(record):
    return record["assignment"] == _expected_assignment(record)


def _first_optimal_step(records):
    return next((index for index, record in enumerate(records) if _is_optimal(record)), None)


def test_every_step_commits_on_the_three_devices(balanced_run):
    _, _, records = balanced_run
    assert [record["step"] for record in records] == list(range(STEPS))
    assert all(sorted(record["devices"]) == ["local-0", "local-1", "local-2"] for record in records)
    assert all(sum(record["assignment"]) == VIRTUAL_WORKERS for record in records)


def test_optimal_assignment_is_reached_within_ten_steps(balanced_run):
    _, _, records = balanced_run
    first = _first_optimal_step(records)
    assert first is not None and first <= WITHIN_STEPS, (
        f"optimal assignment (5, 2, 1 VWs at speeds 1, 0.5, 0.25) not reached within {WITHIN_STEPS} steps: "
        f"{_assignments(records)}"
    )


def test_assignment_stays_optimal_once_reached(balanced_run):
    _, _, records = balanced_run
    first = _first_optimal_step(records)
    assert first is not None, f"never optimal: {_assignments(records)}"
    departures = [record["step"] for record in records[first:] if not _is_optimal(record)]
    # On failure, show what the balancer saw: each step's devices, assignment and busy seconds.
    trace = [
        (record["step"], record["devices"], record["assignment"], [round(busy, 3) for busy in record["busy_s"]])
        for record in records
    ]
    assert not departures, (
        f"the assignment left the optimum (first reached at step {first}) at steps {departures}; "
        f"(step, devices, assignment, busy_s): {trace}"
    )


def test_parameters_equal_the_reference(balanced_run):
    job, model, _ = balanced_run
    pieces.assert_same_parameters(model, pieces.reference(job, STEPS), rtol=1e-5)


def test_two_equal_devices_rebalance_rarely(train):
    """Quiet rebalancing: the split follows speeds, not noise. Two equal devices used to flip it every
    1-3 steps (1,462 rebalances in 5,000 steps); the noise-aware threshold keeps it to a handful.
    The summary counts rebalances instead of listing them."""
    # VWs of ~2 ms, as real ones are at least: with VWs of 0.3 ms (no delay) a 0.3 ms hiccup of this
    # shared VM is a 2x slowdown that lasts two steps, a real (if short) change of speed, followed
    # and undone (0-8 such pairs in 300 steps, before and after balancing to the whole-VW ceiling).
    job = pieces.make_job(virtual_workers=16, global_batch=64, delay_s=0.002)
    model, summary = train(job, steps=300, devices=2)
    # ~90 in 300 steps before the noise-aware threshold; a handful now.
    assert summary["rebalances"] <= 8, summary["rebalances"]
    assert all(event["event"] != "rebalance" for event in summary["events"])
    print(f"rebalances in 300 steps on two equal devices: {summary['rebalances']}")
