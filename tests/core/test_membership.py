"""The control plane's decisions, as pure data: decide(state, event) -> (state, actions)."""

import dataclasses

from flexpar.core import membership as ms


def _run(state, *events):
    actions = []
    for event in events:
        state, more = ms.decide(state, event)
        actions.extend(more)
    return state, actions


def _published(actions):
    return [a for a in actions if isinstance(a, ms.Publish)]


def _started(initial=2, maximum=4):
    state = ms.Membership(initial_devices=initial, max_devices=maximum, grace_s=5.0)
    state, actions = _run(state, ms.Start(initial))
    assert actions == [ms.SpawnLocal(tuple(f"local-{i}" for i in range(initial)))]
    state, actions = _run(state, *[ms.Ready(f"local-{i}") for i in range(initial)])
    assert _published(actions)[0].members == tuple(f"local-{i}" for i in range(initial))
    state, _ = _run(state, *[ms.Formed(f"local-{i}", 1) for i in range(initial)])
    return state


def test_generation_one_waits_for_all_initial_devices():
    state = ms.Membership(initial_devices=2, max_devices=2, grace_s=5.0)
    state, actions = _run(state, ms.Start(2), ms.Ready("local-1"))
    assert not _published(actions)
    state, actions = _run(state, ms.Ready("local-0"))
    assert _published(actions) == [ms.Publish(1, ("local-0", "local-1"), ("local-0", "local-1"), (), ())]


def test_join_appends_and_keeps_ranks():
    state = _started()
    state, actions = _run(state, ms.ScaleBy(1))
    assert actions[0] == ms.SpawnLocal(("local-2",)) and _answers(actions)[0].accepted
    state, actions = _run(state, ms.Ready("local-2"))
    assert _published(actions)[0].members == ("local-0", "local-1", "local-2")
    assert _published(actions)[0].joined == ("local-2",)


def test_one_generation_in_formation_at_a_time():
    state = _started()
    state, actions = _run(state, ms.ScaleBy(2), ms.Ready("local-2"))
    assert _published(actions)[0].generation == 2
    state, actions = _run(state, ms.Ready("local-3"))
    assert not _published(actions), "generation 2 has not formed yet"
    state, actions = _run(state, *[ms.Formed(d, 2) for d in ("local-0", "local-1", "local-2")])
    assert _published(actions)[0].members == ("local-0", "local-1", "local-2", "local-3")


def test_planned_leave_drops_the_newest_member():
    state = _started(initial=3)
    state, actions = _run(state, ms.ScaleBy(-1))
    assert _published(actions)[0].members == ("local-0", "local-1")
    assert _published(actions)[0].left == ("local-2",)


def test_a_scheduled_leave_publishes_its_generation_from_its_step():
    # Decided ahead of its step: the generation says where it starts; the members train on until then.
    state = _started(initial=3)
    state, actions = _run(state, ms.ScaleBy(-1, "schedule-0", at_step=7))
    (published,) = _published(actions)
    assert (published.members, published.left, published.from_step) == (("local-0", "local-1"), ("local-2",), 7)
    assert state.leaving_from is None


def test_an_unscheduled_leave_takes_effect_at_the_next_boundary():
    state = _started(initial=3)
    state, actions = _run(state, ms.ScaleBy(-1, "scale-1"))
    assert _published(actions)[0].from_step is None


def test_a_scheduled_leave_decided_while_a_join_forms_keeps_its_step():
    state = _started()
    state, actions = _run(state, ms.ScaleBy(1), ms.Ready("local-2"))
    assert _published(actions)[0].from_step is None  # the join: at the next boundary, as always
    state, actions = _run(state, ms.ScaleBy(-1, "schedule-1", at_step=9))
    assert not _published(actions) and state.leaving == ("local-2",) and state.leaving_from == 9
    state, actions = _run(state, *[ms.Formed(d, 2) for d in ("local-0", "local-1", "local-2")])
    assert [(p.left, p.from_step) for p in _published(actions)] == [(("local-2",), 9)]


def test_a_failure_publishes_at_once_whatever_a_scheduled_leave_waits_for():
    state = _started(initial=3)
    state, actions = _run(state, ms.ScaleBy(1), ms.Ready("local-3"))  # generation 2 forming: the leave waits
    state, _ = _run(state, ms.ScaleBy(-1, "schedule-0", at_step=12))
    state, actions = _run(
        state,
        ms.Exited("local-1", 1.0),
        *[ms.FailureReported(d, 2, 1.0) for d in ("local-0", "local-2", "local-3")],
    )
    (published,) = _published(actions)
    assert published.failed == ("local-1",) and published.from_step is None and state.leaving_from is None


def test_leave_cancels_devices_still_starting_first():
    state = _started()
    state, actions = _run(state, ms.ScaleBy(1), ms.ScaleBy(-1))
    assert ms.Evict("local-2", "the job was scaled down before it was admitted") in actions
    assert not _published(actions)


def test_at_least_one_device_stays():
    state = _started(initial=1)
    state, actions = _run(state, ms.ScaleBy(-1))
    assert any(isinstance(a, ms.Note) for a in actions) and not _published(actions)


def test_max_devices_refuses_joiners():
    state = _started(initial=2, maximum=2)
    state, actions = _run(state, ms.Announced("hostb-1"))
    assert isinstance(actions[0], ms.Refuse) and "--max-devices 2" in actions[0].reason


def test_refused_ready_is_not_admitted():
    state = _started()
    state, actions = _run(state, ms.Announced("hostb-1"), ms.Ready("hostb-1", problem="model differs"))
    assert actions == [ms.Refuse("hostb-1", "model differs")]


def test_failure_rebuilds_from_survivors_once_all_are_accounted():
    state = _started(initial=3)
    state, actions = _run(state, ms.FailureReported("local-0", 1, now=10.0))
    assert not _published(actions)
    state, actions = _run(state, ms.Exited("local-1", now=10.1), ms.FailureReported("local-2", 1, now=10.2))
    assert _published(actions) == [ms.Publish(2, ("local-0", "local-2"), (), (), ("local-1",))]


def test_silent_member_is_evicted_after_grace():
    state = _started(initial=3)
    state, _ = _run(state, ms.FailureReported("local-0", 1, now=10.0), ms.FailureReported("local-2", 1, now=10.0))
    state, actions = _run(state, ms.Tick(now=12.0))
    assert not _published(actions)
    state, actions = _run(state, ms.Tick(now=15.5))
    assert ms.Evict("local-1") in actions
    assert _published(actions)[0].members == ("local-0", "local-2")


def test_last_device_lost_stops_the_job():
    state = _started(initial=1)
    state, actions = _run(state, ms.Exited("local-0", now=1.0))
    assert any(isinstance(a, ms.StopJob) and "no worker is left" in a.reason for a in actions)


def test_stale_failure_reports_are_ignored():
    state = _started()
    state, actions = _run(state, ms.FailureReported("local-0", 7, now=1.0))
    assert actions == [] and state.failure_since is None


def _answers(actions):
    return [a for a in actions if isinstance(a, ms.Answer)]


def test_scale_is_answered_and_refused_whole_over_max_devices():
    state = _started(initial=2, maximum=3)
    state, actions = _run(state, ms.ScaleBy(2, "r1"))
    (answer,) = _answers(actions)
    assert not answer.accepted and "--max-devices 3" in answer.message and answer.request_id == "r1"
    assert not any(isinstance(a, ms.SpawnLocal) for a in actions), "nothing started for a refused request"
    state, actions = _run(state, ms.ScaleBy(1, "r2"))
    (answer,) = _answers(actions)
    assert answer.accepted and answer.devices == 3 and answer.started == ("local-2",)


def test_scale_over_local_capacity_needs_oversubscribe():
    state = _started(initial=2, maximum=8)
    state = dataclasses.replace(state, local_capacity=2)
    state, actions = _run(state, ms.ScaleBy(1, "r"))
    (answer,) = _answers(actions)
    assert not answer.accepted and "--oversubscribe" in answer.message
    # Remote devices do not take this host's cores.
    state, actions = _run(state, ms.Announced("hostb-1"))
    assert not any(isinstance(a, ms.Refuse) for a in actions)


def test_scale_down_past_one_device_is_refused_whole():
    state = _started(initial=2)
    state, actions = _run(state, ms.ScaleBy(-2, "r"))
    (answer,) = _answers(actions)
    assert not answer.accepted and "at most -1" in answer.message and not state.leaving
    state, actions = _run(state, ms.ScaleBy(-1, "s"))
    (answer,) = _answers(actions)
    assert answer.accepted and answer.leaving == ("local-1",) and answer.devices == 1


def test_preempted_member_leaves_as_planned():
    state = _started(initial=3)
    state, actions = _run(state, ms.LeaveRequested("local-1"))
    (published,) = _published(actions)
    assert published.members == ("local-0", "local-2") and published.left == ("local-1",)
    assert published.failed == ()


def test_preempted_device_still_starting_is_cancelled():
    state = _started(initial=2)
    state, _ = _run(state, ms.ScaleBy(1))
    state, actions = _run(state, ms.LeaveRequested("local-2"))
    assert any(isinstance(a, ms.Evict) and a.device_id == "local-2" for a in actions)
    assert "local-2" not in state.starting and not _published(actions)


def test_preempting_the_last_device_finishes_the_job():
    state = _started(initial=1)
    state, actions = _run(state, ms.LeaveRequested("local-0"))
    assert any(isinstance(a, ms.FinishJob) and "local-0" in a.reason for a in actions)
    assert not _published(actions)


def test_once_finishing_the_device_set_stays_and_only_failures_are_recovered():
    """A whole host's SIGTERM reaches the driver (a finish) and every device (leave requests):
    the stop wins, so the job ends with its devices instead of emptying itself."""
    state = _started(initial=3)
    state, actions = _run(state, ms.FinishRequested("the driver got SIGTERM"), ms.FinishRequested("again"))
    assert [a for a in actions if isinstance(a, ms.FinishJob)] == [ms.FinishJob("the driver got SIGTERM")]
    state, actions = _run(state, ms.LeaveRequested("local-1"), ms.LeaveRequested("local-0"))
    assert not _published(actions) and not state.leaving
    assert all(isinstance(a, ms.Note) and "stops at the next step boundary anyway" in a.message for a in actions)
    state, actions = _run(state, ms.ScaleBy(1, "r1"), ms.ScaleBy(-1, "r2"))
    assert [a.accepted for a in _answers(actions)] == [False, False] and not state.starting
    assert "stopping" in _answers(actions)[0].message
    # A member that dies meanwhile is still recovered from, so the others can stop together.
    state, actions = _run(
        state, ms.Exited("local-2", 1.0), ms.FailureReported("local-0", 1, 1.0), ms.FailureReported("local-1", 1, 1.0)
    )
    (published,) = _published(actions)
    assert published.members == ("local-0", "local-1") and published.failed == ("local-2",)


def test_a_quiet_finish_is_carried_quietly_and_scaling_by_nothing_changes_nothing():
    state = _started(initial=2)
    state, actions = _run(state, ms.ScaleBy(0, "r0"))
    (answer,) = _answers(actions)
    assert answer.accepted and answer.message == "already at 2 devices; nothing changes" and not state.starting
    state, actions = _run(state, ms.FinishRequested("SIGTERM", quiet=True))
    assert actions == [ms.FinishJob("SIGTERM", quiet=True)]


# Found by the state machine (tests/test_membership_properties.py), pinned as examples.


def test_a_survivor_that_dies_before_the_recovery_is_published_is_not_in_it():
    state = _started(initial=3, maximum=3)
    state, actions = _run(
        state,
        ms.FailureReported("local-1", 1, now=1.0),
        ms.Exited("local-2", now=1.1),
        ms.Exited("local-1", now=1.2),
        ms.FailureReported("local-0", 1, now=1.3),
    )
    (published,) = [a for a in actions if isinstance(a, ms.Publish)]
    assert published.members == ("local-0",) and published.failed == ("local-1", "local-2")


def test_a_device_refused_over_max_devices_stays_out_when_it_says_ready():
    state = _started(initial=1, maximum=1)
    state, actions = _run(state, ms.Announced("hostb-0"))
    assert isinstance(actions[0], ms.Refuse)
    state, actions = _run(state, ms.Ready("hostb-0"))
    assert actions == [] and state.waiting == () and state.device_count == 1


def test_a_stop_asked_before_the_first_generation_stops_at_once():
    """A whole host's SIGTERM during start-up: the devices may die of it before they can train."""
    state = ms.Membership(initial_devices=2, max_devices=2, grace_s=5.0)
    state, _ = _run(state, ms.Start(2), ms.Ready("local-0"))
    state, actions = _run(state, ms.FinishRequested("the driver got SIGTERM"))
    assert state.stopped and ms.StopJob(ms.STOPPED_BEFORE_START) in actions and not _published(actions)


def test_a_device_refused_at_its_warm_up_never_comes_back_over_the_hosts_capacity():
    """The sequence tests/core/test_membership_properties.py's machine found: local-2 is refused at its
    warm-up (another model), a scale +2 gives its place on this host to two new devices, and then an
    announcement under local-2's id arrives (late, or replayed). Admitting it again made this host's
    devices 5 with room for 4; a refused id is retired like a dead one."""
    state = ms.Membership(initial_devices=3, max_devices=5, grace_s=0.5, local_capacity=4)
    state, _ = _run(state, ms.Start(3), ms.Announced("hostb-0"), ms.ScaleBy(-1), ms.Announced("hostb-0"))
    state, actions = _run(state, ms.Ready("local-2", "its model differs from the job's"))
    assert actions == [ms.Refuse("local-2", "its model differs from the job's")] and "local-2" in state.dead
    state, actions = _run(state, ms.ScaleBy(2))
    assert [a for a in actions if isinstance(a, ms.SpawnLocal)] == [ms.SpawnLocal(("local-3", "local-4"))]
    state, actions = _run(state, ms.Announced("local-2"))
    assert actions == [] and "local-2" not in state.starting
    assert state.local_count == 4 <= state.local_capacity


def test_members_exiting_at_the_jobs_end_publish_no_generation_of_joiners():
    # Soak seed 253, run 27: two joiners were waiting when the job ended; the members' exits after their last
    # step counted as failures of all three, and the recovery published a generation of the joiners only,
    # whose levelling then reported the optimizer state lost.
    state = _started(initial=3, maximum=5)
    state, _ = _run(state, ms.ScaleBy(2), ms.Ready("local-4"))
    state, _ = _run(state, *[ms.Formed(d, 2) for d in ("local-0", "local-1", "local-2", "local-4")])
    state, actions = _run(state, ms.Ready("local-3"))
    assert _published(actions)[0].generation == 3  # a planned generation before the end is still published
    state, _ = _run(state, *[ms.Formed(d, 3) for d in ("local-0", "local-1", "local-2", "local-4", "local-3")])
    state, _ = _run(state, ms.ScaleBy(1))  # local-5 still on its way when the job ends
    state, actions = _run(
        state,
        *[ms.Finished(d) for d in ("local-1", "local-2", "local-3", "local-4")],
        *[ms.Exited(d, now=20.0) for d in ("local-1", "local-2", "local-3", "local-4")],
        ms.Ready("local-5"),
        ms.Finished("local-0", rank_0=True),
        ms.Exited("local-0", now=20.1),
        ms.Tick(now=100.0),
    )
    assert actions == [] and state.generation == 3 and state.failure_since is None
    assert state.result_from == "local-0" and state.rank_0_gone and not state.stopped


def test_a_joiner_ready_at_the_last_step_is_not_admitted_and_scaling_after_the_end_is_refused():
    state = _started()
    state, _ = _run(state, ms.ScaleBy(1), ms.Finished("local-0"))
    state, actions = _run(state, ms.Ready("local-2"), ms.ScaleBy(1, "late"))
    assert not _published(actions)
    assert [answer.accepted for answer in _answers(actions)] == [False]
    assert not state.rank_0_gone  # local-0 has not exited yet: the driver waits for "done"


def test_a_member_dying_after_another_finished_starts_no_recovery():
    state = _started(initial=3)
    state, actions = _run(
        state, ms.Finished("local-1"), ms.Exited("local-1", now=5.0), ms.Exited("local-0", now=5.0), ms.Tick(now=50.0)
    )
    assert actions == [] and state.generation == 1 and state.rank_0_gone  # the driver looks for "done" now


def test_rank_0_failing_the_last_all_reduce_after_another_finished_is_not_waited_for():
    """Rank 0's final all-reduce failed (it reports a failure, alive) after another member finished: no
    generation comes any more, so the driver stops waiting for it (issue 46 item 4)."""
    state = _started()
    state, actions = _run(state, ms.Finished("local-1"), ms.FailureReported("local-0", 1, now=5.0))
    assert actions == [] and state.generation == 1 and state.rank_0_gone  # the driver reads "finishing"


def test_finished_from_a_device_on_its_way_ends_nothing():
    state = _started()
    state, _ = _run(state, ms.ScaleBy(1), ms.Announced("hostb-1"))
    state, actions = _run(state, ms.Finished("local-2"), ms.Finished("hostb-1"))
    assert actions == [] and not state.ended


def test_rank_0_is_the_member_that_finished_as_rank_0():
    # A generation published during the last step, without local-0 (preempted), was never formed: the
    # members' rank 0 is still local-0, which hands the result over; local-1's exit says nothing of it.
    state = _started(initial=3)
    state, actions = _run(state, ms.LeaveRequested("local-0"))
    assert _published(actions)[0].members == ("local-1", "local-2")
    state, _ = _run(state, ms.Finished("local-1"), ms.Finished("local-0", rank_0=True), ms.Exited("local-1", now=3.0))
    assert not state.rank_0_gone
    state, _ = _run(state, ms.Exited("local-0", now=3.1))
    assert state.rank_0_gone
