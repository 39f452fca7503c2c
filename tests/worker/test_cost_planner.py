"""Balancing by cost end to end: Job(sample_cost=...), the driver's checks, the planner, real processes.

The promise is unchanged by it: the parameters equal the single-process
reference, over a join too, and every sample of every step runs exactly once
(the sample ledger counts what the workers really loaded), while the per-step
VW sets follow the costs: not contiguous ranges, not equal counts.
"""

import json
import math

import cost_pieces
import pieces
import pytest

import flexpar
from flexpar.core import batching, cost_balance, ledger
from flexpar.errors import UserCodeError
from flexpar.worker.cost_planner import CostPlanner

# A join needs its joiner started and warm before the job ends (test_elastic.py).
JOIN_HEADROOM_S = 6.0
LONG_RUN_ATOL = 1e-6  # test_elastic.py: summation order over ~100 SGD-momentum steps


def _records(path, kind="step"):
    return [record for record in map(json.loads, open(path)) if record["kind"] == kind]


def _contiguous(members):
    return list(members) == list(range(members[0], members[0] + len(members)))


def _check_step_records(records, job):
    """Every step's sets partition the VWs, agree with `assignment`, and `cost` is what they cost."""
    planner = CostPlanner(job)
    for record in records:
        sets = record["virtual_worker_sets"]
        assert sorted(member for members in sets for member in members) == list(range(job.virtual_workers))
        assert [len(members) for members in sets] == record["assignment"]
        costs = planner.raw_costs(record["step"])
        assert record["cost"] == [math.fsum(costs[member] for member in members) for members in sets]


# ------------------------------------------------------------------ the pieces, without processes


def test_the_planner_sees_the_samples_batching_gives_every_step():
    job = cost_pieces.make_cost_job(virtual_workers=4)
    planner = CostPlanner(job)
    table = job.sample_cost.costs
    for step in (0, 1, 9, 10, 11, 25):  # 480 samples / 48: epochs of 10 steps
        expected = [
            math.fsum(
                table[index]
                for index in batching.virtual_worker_indices(
                    job.seed, step, virtual_worker, len(job.dataset), job.global_batch, job.virtual_workers
                )
            )
            for virtual_worker in range(job.virtual_workers)
        ]
        assert list(planner.raw_costs(step)) == expected


def test_the_planner_plans_by_cost_and_the_same_way_twice():
    job = cost_pieces.make_cost_job(virtual_workers=8)
    planner, other = CostPlanner(job), CostPlanner(job)
    members = ("local-0", "local-1")
    for step in range(6):
        plan = planner.assignment(step, members)
        assert plan == other.assignment(step, members)
        scaled = [cost / planner.scale() for cost in planner.raw_costs(step)]
        assert plan == cost_balance.cost_assignment(scaled, [1.0, 1.0])


def test_a_sample_cost_that_is_not_a_function_is_refused():
    with pytest.raises(TypeError, match="sample_cost= must be a function"):
        pieces.make_job(sample_cost=[1, 2, 3])


@pytest.mark.parametrize(
    "value,message", [(math.nan, "returned nan"), (-2.0, "returned -2.0"), ("long", "returned 'long' \\(str\\)")]
)
def test_the_driver_refuses_a_bad_cost_before_any_worker_starts(train, value, message):
    job = pieces.make_job(virtual_workers=4)
    index = batching.virtual_worker_indices(job.seed, 0, 0, len(job.dataset), job.global_batch, 4)[0]
    job = cost_pieces.make_cost_job(virtual_workers=4, sample_cost=cost_pieces.BadCostAt(index, value))
    with pytest.raises(UserCodeError, match=rf"sample_cost\({index}\) {message}.*token count of sample {index}"):
        train(job, steps=2, devices=2)


def test_a_bad_cost_found_later_stops_the_job_naming_the_index_and_step(train):
    job = pieces.make_job(virtual_workers=4)
    checked = set(batching.virtual_worker_indices(job.seed, 0, 0, len(job.dataset), job.global_batch, 4))
    later = next(
        index
        for index in batching.global_batch_indices(job.seed, 1, len(job.dataset), 48).tolist()
        if index not in checked and index != len(job.dataset) - 1
    )
    job = cost_pieces.make_cost_job(virtual_workers=4, sample_cost=cost_pieces.BadCostAt(later, math.inf))
    with pytest.raises(flexpar.TrainingError, match=rf"sample_cost\({later}\) returned inf.* at step 1"):
        train(job, steps=4, devices=2)


# ------------------------------------------------------------------ real processes


@pytest.mark.timeout(300)
def test_parameters_equal_the_reference_through_a_join(train, metrics_file):
    # local-1 at a quarter speed: the planned rates (set after a device's third step) differ from
    # the start's equal ones before the join at step 6 or later, so a joiner that did not
    # receive them would plan other sets than its peers (the ledger and the parameters show it).
    job = cost_pieces.make_cost_job(virtual_workers=6, delay_s=0.001)
    step_s = 4 * 27 * job.loss.delay_s  # about 4 VWs on the fast device, 8 samples of mean cost 26.7 / 8
    steps = 6 + math.ceil(JOIN_HEADROOM_S / step_s)
    model, summary = train(
        job, steps=steps, devices=2, max_devices=3, schedule="6:+1", sample_ledger=True, emulate_speeds=[1.0, 0.25]
    )
    records = _records(metrics_file)
    assert [record["step"] for record in records] == list(range(steps))
    assert {len(record["devices"]) for record in records} == {2, 3}, "the join took effect"
    before_join = [record for record in records if len(record["devices"]) == 2]
    # About 4:1, in whole VWs of cost 8 to 64 out of about 213. Moving off the equal split gains over
    # 50% of the predicted step time, beyond the noise threshold's cap: taken however noisy the host.
    fast, slow = before_join[-1]["cost"]
    assert fast > 1.5 * slow, f"planned by the speeds: {before_join[-1]}"
    _check_step_records(records, job)
    assert ledger.audit(
        ledger.read(summary["sample_ledger"]), job.seed, len(job.dataset), job.global_batch, steps
    ).clean, "every sample of every step ran exactly once"
    pieces.assert_same_parameters(model, pieces.reference(job, steps), atol=LONG_RUN_ATOL)


@pytest.mark.timeout(300)
def test_two_devices_run_uneven_non_contiguous_sets_and_match_the_reference(train, metrics_file):
    # num_workers=1: DataLoader workers prefetch along the plan of the steps ahead.
    job = cost_pieces.make_cost_job(virtual_workers=8, delay_s=0.0005, num_workers=1)
    steps = 20
    model, summary = train(job, steps=steps, devices=2, sample_ledger=True)
    records = _records(metrics_file)
    _check_step_records(records, job)
    sets = [record["virtual_worker_sets"] for record in records]
    assert any(not _contiguous(members) for step_sets in sets for members in step_sets), sets
    assert any(len(set(record["assignment"])) > 1 for record in records), [r["assignment"] for r in records]
    rebalances = [event for event in _records(metrics_file, "event") if event["event"] == "rebalance"]
    assert len(rebalances) <= steps // 4, f"cost mode must not announce a rebalance per step: {rebalances}"
    assert ledger.audit(
        ledger.read(summary["sample_ledger"]), job.seed, len(job.dataset), job.global_batch, steps
    ).clean
    pieces.assert_same_parameters(model, pieces.reference(job, steps))
