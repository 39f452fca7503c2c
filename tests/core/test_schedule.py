"""What became of each scheduled device change: on time, late, refused or never applied."""

import json

import pieces

from flexpar.core import membership as ms
from flexpar.core.schedule import ON_TIME_STEPS, ScheduleTracker
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


def test_a_change_within_the_boundary_slack_is_on_time():
    tracker = ScheduleTracker(parse_schedule("10:-1"))
    (request,) = tracker.due(10)
    tracker.answered(request[0], ms.Answer(request[0], True, "", 1, leaving=("local-1",)))
    leave = {"kind": "event", "event": "leave", "step": 10 + ON_TIME_STEPS, "devices": ["local-0"]}
    assert tracker.observed(["local-0", "local-1"], leave) == []
    assert tracker.summary()[0]["status"] == "on time"


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
    (leave,) = tracker.due(80)
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
