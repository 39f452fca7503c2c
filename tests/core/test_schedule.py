"""What became of each scheduled device change: on time, late, refused or never applied."""

import json

import pieces
import pytest

from flexpar.core import membership as ms
from flexpar.core.schedule import LEAVE_LEAD_STEPS, NO_HOLD, ON_TIME_STEPS, ScheduleTracker, fire_points
from flexpar.options import parse_schedule


def _event(step, devices):
    return {"kind": "event", "event": "join", "step": step, "devices": list(devices)}


def test_a_late_join_is_reported_with_the_step_it_applied():
    tracker = ScheduleTracker(parse_schedule("30:+1"))
    assert tracker.due(29) == []
    (request,) = tracker.due(30)
    assert tracker.answered(request[0], ms.Answer(request[0], True, "", 3, started=("local-2",))) == []
    (report,) = tracker.observed(["local-0", "local-1"], _event(154, ["local-0", "local-1", "local-2"]))
    assert report == "scheduled +1 for step 30 applied at step 154, 124 steps late (the new device was warming up)"
    assert tracker.summary() == [{"step": 30, "delta": 1, "status": "late", "applied_step": 154, "detail": report}]


def test_a_join_within_the_boundary_slack_is_on_time():
    tracker = ScheduleTracker(parse_schedule("10:+1"))
    (request,) = tracker.due(10)
    tracker.answered(request[0], ms.Answer(request[0], True, "", 3, started=("local-2",)))
    join = _event(10 + ON_TIME_STEPS, ["local-0", "local-1", "local-2"])
    assert tracker.observed(["local-0", "local-1"], join) == []
    assert tracker.summary()[0]["status"] == "on time"


def _leave(step, devices):
    return {"kind": "event", "event": "leave", "step": step, "devices": list(devices)}


def test_a_leave_fires_ahead_of_its_step_and_is_on_time_only_at_it():
    tracker = ScheduleTracker(parse_schedule("10:-1"))
    assert tracker.due(10 - LEAVE_LEAD_STEPS - 1) == []
    (request,) = tracker.due(10 - LEAVE_LEAD_STEPS)
    assert request == ("schedule-0", -1, 10)  # the step its generation starts at
    tracker.answered(request[0], ms.Answer(request[0], True, "", 1, leaving=("local-1",)))
    assert tracker.observed(["local-0", "local-1"], _leave(10, ["local-0"])) == []
    assert tracker.summary()[0]["status"] == "on time"


def test_a_leave_one_step_late_or_early_is_reported():
    late, early = ScheduleTracker(parse_schedule("10:-1")), ScheduleTracker(parse_schedule("10:-1"))
    for tracker, step in ((late, 11), (early, 7)):
        (request,) = tracker.due(8)
        tracker.answered(request[0], ms.Answer(request[0], True, "", 1, leaving=("local-1",)))
        (report,) = tracker.observed(["local-0", "local-1"], _leave(step, ["local-0"]))
        assert report == tracker.summary()[0]["detail"]
    assert "applied at step 11, 1 steps late (another change" in late.summary()[0]["detail"]
    assert "applied at step 7, 3 steps early (a failure" in early.summary()[0]["detail"]
    assert [late.summary()[0]["status"], early.summary()[0]["status"]] == ["late", "early"]


def test_entries_fire_in_order_and_a_leave_behind_a_join_at_its_step_is_not_held():
    # A leave may cancel an earlier join's device: it never fires before it.
    changes = parse_schedule("3:+1,4:-1,5:+1,5:-1,20:-1")
    assert fire_points(changes) == [3, 3, 5, 5, 18]
    tracker = ScheduleTracker(changes)
    assert tracker.hold(()) == 4  # 5:-1 fires at its step: it cannot be exact, and nobody waits for it
    assert [entry[1] for entry in tracker.due(3)] == [1]  # a join puts a device on its way: asked again
    assert [entry[1:] for entry in tracker.due(3, on_their_way=True)] == [(-1, 4)]  # the step before its own
    assert tracker.hold(()) == 20


def test_a_leave_waits_for_a_device_on_its_way_until_the_step_before_its_own():
    # A leave cancels devices on their way first; one that joins before the leave's step is not
    # cancelled 2 steps ahead, but the leave is still decided in time to be exact.
    tracker = ScheduleTracker(parse_schedule("2:+1,6:-1,9:+1,12:-1"))
    (join,) = tracker.due(2)
    assert tracker.due(4, on_their_way=True) == [] and tracker.hold(()) == 6
    assert tracker.due(5, on_their_way=True) == [("schedule-1", -1, 6)]
    (join,) = tracker.due(9)
    assert tracker.due(10, on_their_way=False) == [("schedule-3", -1, 12)]  # it joined: decided ahead


def test_a_leave_that_cannot_be_exact_is_reported_late_with_why():
    # 5:-1 fires behind the join at its step, once step 5 has committed: its boundary is past, so its
    # generation moves at the next one, and the report says so (the lateness a live leave would have).
    tracker = ScheduleTracker(parse_schedule("5:+1,5:-1"))
    (join,) = tracker.due(5)
    tracker.answered(join[0], ms.Answer(join[0], True, "", 3, started=("local-2",)))
    (leave,) = tracker.due(5, on_their_way=True)
    assert leave == ("schedule-1", -1, 5) and not tracker.outcomes[1].exact
    tracker.answered(leave[0], ms.Answer(leave[0], True, "", 3, leaving=("local-1",)))
    assert tracker.hold(("local-1",)) == NO_HOLD  # nobody waits for a leave that cannot be exact
    (report,) = tracker.observed(["local-0", "local-1"], _leave(6, ["local-0"]))
    assert report == (
        "scheduled -1 for step 5 applied at step 6, 1 steps late (an earlier entry at its step fired first, "
        "so it could not be decided ahead of its step)"
    )
    assert tracker.summary()[1]["status"] == "late"


def test_the_hold_stays_until_the_leave_is_published():
    tracker = ScheduleTracker(parse_schedule("6:-1,9:-1"), total_steps=9)
    assert tracker.hold(()) == 6
    (request,) = tracker.due(4)
    tracker.answered(request[0], ms.Answer(request[0], True, "", 2, leaving=("local-2",)))
    assert tracker.hold(("local-2",)) == 6  # decided, not published: the coordinator's `leaving` holds it
    assert tracker.hold(()) == NO_HOLD  # published; 9:-1 is the job's end: it never fires, nobody waits
    assert tracker.due(8) == []
    assert tracker.ended(9)[-1] == "scheduled -1 for step 9 never applied: the job ended at step 9 first"


def test_a_restarted_driver_decides_again_the_leaves_its_predecessor_published_ahead():
    # Its predecessor wrote steps up to 6 and decided 8:-1 and 9:-1 ahead (gone with it); the re-adopted
    # devices train on from step 8. 7:+1 it fired; 8:-1 may have applied (the devices crossed step 8's
    # boundary, or stopped there): decided once step 8 has committed, unless its leave event came first.
    changes = parse_schedule("5:-1,7:+1,8:-1,9:-1,12:+1")
    tracker = ScheduleTracker(changes, after_step=7, resumed_at=8)
    assert [(o["step"], o["delta"]) for o in tracker.summary()] == [(8, -1), (9, -1), (12, 1)]
    assert tracker.due(8) == [] and tracker.hold(()) == 9  # 8:-1 cannot be exact any more
    assert tracker.due(9) == [("schedule-0", -1, 8), ("schedule-1", -1, 9)]

    tracker = ScheduleTracker(changes, after_step=7, resumed_at=8)
    tracker.applied_before({"kind": "event", "event": "leave", "step": 8, "devices": ["local-0"]})
    assert tracker.due(9) == [("schedule-1", -1, 9)]
    assert tracker.summary()[0]["status"] == "on time"


def test_a_leave_at_the_re_adopted_step_with_a_member_not_back_counts_as_applied():
    # The members crossed step 8's boundary: the leaver left, the others found no driver to form with.
    tracker = ScheduleTracker(parse_schedule("8:-1"), after_step=7, resumed_at=8, not_back=("local-2",))
    assert tracker.due(9) == [] and tracker.hold(()) == NO_HOLD
    (detail,) = tracker.taken_as_done()
    assert detail == (
        "scheduled -1 for step 8 applied at step 8, taken as done: local-2 did not come back to the restarted driver"
    )
    assert tracker.summary()[0]["status"] == "on time"
    # The driver writes the leave event nobody wrote (flexpar/driver/driver_loop.py, _report_left_unseen).
    assert [outcome.left_unseen for outcome in tracker.outcomes] == [("local-2",)]


def test_an_unsure_leave_decided_again_late_says_why():
    tracker = ScheduleTracker(parse_schedule("8:-1"), after_step=7, resumed_at=8)
    (request,) = tracker.due(9)
    tracker.answered(request[0], ms.Answer(request[0], True, "", 1, leaving=("local-1",)))
    (report,) = tracker.observed(["local-0", "local-1"], _leave(10, ["local-0"]))
    assert report.endswith(
        "2 steps late (the driver was restarted at its step, and its predecessor's decision did not outlive it)"
    )


def test_refused_and_never_applied_changes_are_reported():
    tracker = ScheduleTracker(parse_schedule("5:+1,8:+2,50:-1"))
    (first,) = tracker.due(5)
    tracker.answered(first[0], ms.Answer(first[0], True, "", 2, started=("local-1",)))
    (second,) = tracker.due(8)
    (refused,) = tracker.answered(second[0], ms.Answer(second[0], False, "over --max-devices 2", 2))
    assert refused == "scheduled +2 for step 8 was refused: over --max-devices 2"
    reports = tracker.ended(20)
    assert reports == [
        "scheduled +1 for step 5 never applied: the job ended at step 20 while its device was still warming up",
        "scheduled -1 for step 50 never applied: the job ended at step 20 first",
    ]
    assert [o["status"] for o in tracker.summary()] == ["not applied", "refused", "not applied"]


def test_a_leave_that_cancels_a_warming_joiner_says_so():
    tracker = ScheduleTracker(parse_schedule("30:+1,80:-1"))
    (join,) = tracker.due(30)
    tracker.answered(join[0], ms.Answer(join[0], True, "", 3, started=("local-2",)))
    (leave,) = tracker.due(80 - LEAVE_LEAD_STEPS)
    (report,) = tracker.answered(leave[0], ms.Answer(leave[0], True, "", 2, cancelled=("local-2",)))
    assert "scheduled +1 for step 30 never applied: local-2 was still warming up" in report
    assert [o["status"] for o in tracker.summary()] == ["not applied", "on time"]


def test_a_late_scheduled_join_reaches_the_log_the_metrics_file_and_the_summary(train, metrics_file, caplog):
    job = pieces.make_job(delay_s=0.02, model=pieces.make_model_slowly)
    model, summary = train(job, steps=150, devices=1, schedule="3:+1", quiet=False, display=False)
    (outcome,) = summary["schedule"]
    # The joiner takes 1.5 s to build its model while steps of ~80 ms go on: it cannot apply
    # within ON_TIME_STEPS of its step, so it is late, and applies well before step 150.
    assert outcome["status"] == "late", outcome
    joins = [e for e in summary["events"] if e["event"] == "join"]
    assert [outcome["applied_step"]] == [e["step"] for e in joins] and outcome["applied_step"] > 3 + ON_TIME_STEPS
    assert f"applied at step {outcome['applied_step']}" in outcome["detail"]
    records = [json.loads(line) for line in open(metrics_file)]
    reported = [r for r in records if r["kind"] == "event" and r["event"] == "schedule"]
    assert [r["detail"] for r in reported] == [outcome["detail"]]
    assert outcome["detail"] in [e["detail"] for e in summary["events"]]
    assert outcome["detail"] in caplog.text
    pieces.assert_same_parameters(model, pieces.reference(job, 150), atol=1e-6)


@pytest.mark.parametrize(
    "devices, schedule, steps, leaves",
    [(2, "5:-1", 8, (5,)), (4, "3:-1,4:-1,8:-1", 10, (3, 4, 8))],
    ids=["one leave", "three leaves, two on adjacent steps"],
)
def test_scheduled_leaves_take_effect_exactly_at_their_steps(train, metrics_file, devices, schedule, steps, leaves):
    # Steps of a few milliseconds: the driver sees each step's record some steps after it committed,
    # which made a leave land at step 8 or 9 (5:-1), 1-4 steps late. Each leaver's last step is the one
    # before its leave's; the generation without it trains from the leave's step on, and nothing is
    # reported: each leave event's step is its scheduled step, and each entry is on time, 0 steps late.
    job = pieces.make_job()
    model, summary = train(job, steps=steps, devices=devices, schedule=schedule)
    assert summary["schedule"] == [
        {
            "step": step,
            "delta": -1,
            "status": "on time",
            "applied_step": step,
            "detail": f"scheduled -1 for step {step} applied at step {step}",
        }
        for step in leaves
    ]
    records = [json.loads(line) for line in open(metrics_file)]
    devices_by_step = {r["step"]: r["devices"] for r in records if r["kind"] == "step"}
    expected = [devices - sum(1 for leave in leaves if leave <= step) for step in range(steps)]
    assert [len(devices_by_step[step]) for step in range(steps)] == expected
    events = [(r["event"], r["step"]) for r in records if r["kind"] == "event" and r["event"] != "rebalance"]
    assert events == [("start", 0)] + [("leave", step) for step in leaves]
    pieces.assert_same_parameters(model, pieces.reference(job, steps), atol=1e-6)
