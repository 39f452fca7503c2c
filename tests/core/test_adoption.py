"""Re-adopting devices that outlived their driver: the window's decision (flexpar/core/adoption.py) and how
membership.decide carries it out (publish, fencing, joiners, replacements, fallback, decline)."""

import dataclasses

from hypothesis import given, settings
from hypothesis import strategies as st
from test_membership import _published, _run  # the same helpers as the membership's own tests

from flexpar.core import adoption as ad
from flexpar.core import membership as ms

IDS = tuple(f"local-{i}" for i in range(5)) + ("hostb-1", "hostb-2")


@st.composite
def scenarios(draw):
    """A job's history compressed: the newest generation G with its members (all at step s or
    s - 1 after a split commit), a few older-generation devices, joiners; some members died."""
    generation = draw(st.integers(1, 9))
    members = tuple(draw(st.lists(st.sampled_from(IDS), min_size=1, max_size=4, unique=True)))
    others = [d for d in IDS if d not in members]
    stale = draw(st.lists(st.sampled_from(others), max_size=2, unique=True)) if others else []
    joiners = [d for d in others if d not in stale][: draw(st.integers(0, 2))]
    step = draw(st.integers(0, 50))
    reports = []
    for device in members:
        if draw(st.booleans()) or device == members[-1] and not reports:  # some died with the driver
            committed = step - draw(st.integers(0, 1)) if step else 0
            reports.append(
                ad.DeviceReport(
                    device,
                    generation,
                    members,
                    generation + draw(st.integers(0, 1)),
                    committed,
                    True,
                    draw(st.floats(0, 10)),
                    draw(st.booleans()),
                )
            )
    for device in stale:
        old = draw(st.integers(1, generation)) if generation > 1 else 1
        reports.append(
            ad.DeviceReport(
                device,
                old - (1 if old == generation else 0) or 0,
                (device,),
                old,
                draw(st.integers(0, step)),
                True,
                1.0,
            )
        )
    for device in joiners:
        reports.append(ad.DeviceReport(device, 0, (), generation, -1, draw(st.booleans()), 2.0))
    order = draw(st.permutations(reports))
    return generation, members, order


@given(scenarios())
@settings(max_examples=300, deadline=None)
def test_adoption_rules(scenario):
    generation, members, reports = scenario
    window = ad.Adoption(deadline=5.0)
    for report in reports:
        window = ad.add_report(window, report)
    result = ad.outcome(window)
    current = [r for r in reports if r.generation == generation and r.device_id in members]
    # Adopted: exactly the reporting members of the newest generation, in their old rank order.
    assert result.members == tuple(d for d in members if d in {r.device_id for r in current})
    assert set(result.not_back) == set(members) - set(result.members)
    # Fencing: nobody of an older generation is adopted; every one of them is refused.
    stale = {r.device_id for r in reports if 0 < r.generation < generation}
    assert stale == set(result.stale) and not stale & set(result.members)
    # Joiners stay joiners.
    assert set(result.warm_joiners) | set(result.cold_joiners) == {r.device_id for r in reports if r.generation == 0}
    # The counter continues above every generation any device saw.
    assert result.next_generation > max(max(r.seen, r.generation) for r in reports)
    # Nothing committed is lost: the adopted hold the latest committed step of any member.
    assert result.step == max(r.committed for r in current)
    assert result.steps_lost in (0, 1)
    assert result.lost_at == min(r.lost_at for r in current)


def test_the_window_closes_when_every_member_reported_or_at_its_deadline():
    members = ("local-0", "local-1")
    window = ad.add_report(ad.Adoption(deadline=2.0), ad.DeviceReport("local-1", 3, members, 3, 7))
    assert not ad.closeable(window, frozenset(), now=1.0)
    assert ad.closeable(window, frozenset(), now=2.0)  # local-0 died with the driver: adopt local-1 alone
    assert ad.closeable(ad.add_report(window, ad.DeviceReport("local-0", 3, members, 3, 7)), frozenset(), now=0.1)
    assert ad.closeable(window, frozenset({"local-0"}), now=0.1)


def test_a_device_seen_waiting_on_this_host_is_waited_for_past_the_deadline():
    """A live device whose reconnect is slow (a loaded host) is not replaced by a fresh one."""
    members = ("local-0", "local-1")
    window = ad.add_report(ad.Adoption(deadline=2.0), ad.DeviceReport("local-1", 3, members, 3, 7))
    window = ad.seen_waiting(window, ["local-0", "local-1"])
    assert not ad.closeable(window, frozenset(), now=2.0 + ad.LATE_WINDOW_S - 0.1)
    assert ad.closeable(window, frozenset(), now=2.0 + ad.LATE_WINDOW_S)  # ... but not for ever
    assert ad.closeable(window, frozenset({"local-0"}), now=2.5)  # it died
    assert ad.closeable(ad.seen_waiting(window, ["local-1"]), frozenset(), now=2.5)  # its process ended
    assert not ad.closeable(window, frozenset(), now=1.0)  # before the deadline, as always
    back = ad.add_report(window, ad.DeviceReport("local-0", 3, members, 3, 7))
    assert ad.closeable(back, frozenset(), now=0.5)
    # Nobody reported yet, both seen waiting: the window waits rather than resume from a checkpoint.
    silent = ad.seen_waiting(ad.Adoption(deadline=2.0), ["local-0"])
    assert not ad.closeable(silent, frozenset(), now=3.0)


def test_a_member_still_finishing_its_step_holds_the_window_open_past_its_deadline():
    members = ("local-0", "local-1")
    window = ad.Adoption(deadline=2.0)
    window = ad.add_report(window, ad.DeviceReport("local-0", 3, members, 3, 7))
    window = ad.add_report(window, ad.DeviceReport("local-1", 3, members, 3, 7, final=False))
    assert not ad.closeable(window, frozenset(), now=30.0)
    assert ad.closeable(window, frozenset({"local-1"}), now=30.0)  # ... unless it died meanwhile
    final = ad.add_report(window, ad.DeviceReport("local-1", 3, members, 3, 8))
    assert ad.outcome(final).step == 8
    # A late notice never replaces a final report.
    assert ad.add_report(final, ad.DeviceReport("local-1", 3, members, 3, 7, final=False)) == final


def test_no_report_means_nothing_to_adopt():
    result = ad.outcome(ad.Adoption(deadline=2.0))
    assert result.members == () and result.from_generation == 0 and result.next_generation == 1


def test_late_reports():
    late = ad.DeviceReport("local-2", 4, ("local-0", "local-1", "local-2"), 4, 9)
    assert ad.late_report_verdict(late, adopted_from=4, known=False) is None
    assert "older" in ad.late_report_verdict(dataclasses.replace(late, generation=3), adopted_from=4, known=False)
    assert "checkpoint" in ad.late_report_verdict(late, adopted_from=0, known=False)
    assert ad.late_report_verdict(ad.DeviceReport("hostb-1"), adopted_from=4, known=False) is None
    assert "already" in ad.late_report_verdict(late, adopted_from=4, known=True)


def test_a_fingerprint_mismatch_names_the_setting_and_both_values():
    ours = {"total_steps": 80, "global_batch": 32}
    assert ad.fingerprint_problem(ours, dict(ours)) == ""
    problem = ad.fingerprint_problem(ours, {"total_steps": 60, "global_batch": 32})
    assert "total_steps is 60 there and 80 here" in problem and "resume command" in problem


# ------------------------------------------------------------ carried out by membership.decide

MEMBERS = ("local-0", "local-1", "hostb-1")


def _window(initial=2, maximum=4, checkpoint_step=-1):
    state = ms.Membership(initial_devices=initial, max_devices=maximum, grace_s=5.0)
    return dataclasses.replace(
        state,
        adoption=ad.Adoption(deadline=2.0, checkpoint_step=checkpoint_step, checkpoint_path="/ckpt/step-00000030.pt"),
    )


def _report(device, generation=6, members=MEMBERS, seen=6, committed=41, **fields):
    return ms.Reported(ad.DeviceReport(device, generation, members, seen, committed, True, 100.0, **fields), 0.5)


def test_the_window_re_adopts_the_newest_generation_above_every_number_seen():
    state, actions = _run(_window(), _report("local-0", seen=7), _report("hostb-1", committed=40))
    assert not actions, "the window is open until local-1 reports or the deadline"
    state, actions = _run(state, _report("local-1", abandoned=True), ms.Tick(0.6))
    (publish,) = [a for a in actions if isinstance(a, ms.Publish)]
    assert publish.generation == 8 and publish.members == MEMBERS and publish.failed == ()
    assert publish.adopted == ad.Adopted(6, 41, 100.0, 1, ()) and publish.restore == ""
    assert state.adopted_from == 6 and state.adoption is None
    assert not [a for a in actions if isinstance(a, ms.SpawnLocal)], "both local devices came back"


def test_a_member_that_died_with_the_driver_is_replaced_by_a_fresh_local_device():
    state, actions = _run(_window(initial=2), _report("local-1"), _report("hostb-1"), ms.Tick(1.0))
    assert not [a for a in actions if isinstance(a, ms.Publish)]
    state, actions = _run(state, ms.Tick(2.0))
    (publish,) = [a for a in actions if isinstance(a, ms.Publish)]
    assert publish.members == ("local-1", "hostb-1") and publish.failed == ("local-0",)
    assert publish.adopted.not_back == ("local-0",)
    # The host had two devices; one came back: one fresh one, numbered above every id seen, joins later.
    assert [a for a in actions if isinstance(a, ms.SpawnLocal)] == [ms.SpawnLocal(("local-2",))]
    state, actions = _run(state, *[ms.Formed(d, 7) for d in publish.members], ms.Ready("local-2"))
    assert [a for a in actions if isinstance(a, ms.Publish)][0].joined == ("local-2",)


def test_a_device_of_an_older_generation_is_refused_in_the_window_and_after_it():
    stale = _report("local-3", generation=4, members=("local-0", "local-1", "local-3"), seen=5, committed=30)
    state, actions = _run(_window(), stale, *[_report(d) for d in MEMBERS], ms.Tick(0.6))
    refusals = [a for a in actions if isinstance(a, ms.Refuse)]
    assert [r.device_id for r in refusals] == ["local-3"] and "older" in refusals[0].reason
    assert "local-3" not in [a for a in actions if isinstance(a, ms.Publish)][0].members
    late = _report("local-4", generation=5, members=("local-4",), seen=5)
    state, actions = _run(state, late)
    assert actions == [ms.Refuse("local-4", actions[0].reason)] and "generation 5, older" in actions[0].reason


def test_joiners_stay_joiners_and_a_late_member_joins_like_one():
    warm = ms.Reported(ad.DeviceReport("hostc-2", warm=True, seen=6), 0.5)
    cold = ms.Reported(ad.DeviceReport("hostc-3", seen=6), 0.5)
    state, actions = _run(_window(initial=1, maximum=5), *[_report(d) for d in MEMBERS[:2]], warm, cold, ms.Tick(2.0))
    (publish,) = [a for a in actions if isinstance(a, ms.Publish)]
    assert publish.members == ("local-0", "local-1", "hostc-2") and publish.joined == ("hostc-2",)
    assert state.starting == ("hostc-3",)
    state, actions = _run(state, _report("hostb-1"))
    assert not actions and "hostb-1" in state.waiting


def test_a_member_holding_no_committed_step_comes_back_as_a_joiner():
    """A joiner still listening to a streamed join (flexpar/worker/streaming.py) is a member of the newest
    generation that holds no committed step: it is re-adopted as a joiner (levelled at the boundary), and
    alone it is nothing to adopt."""
    listener = _report("hostb-1", committed=-1)
    state, actions = _run(_window(), *[_report(d) for d in MEMBERS[:2]], listener, ms.Tick(0.6))
    (publish,) = [a for a in actions if isinstance(a, ms.Publish)]
    assert publish.members == MEMBERS and publish.joined == ("hostb-1",) and publish.failed == ()
    assert publish.adopted == ad.Adopted(6, 41, 100.0, 0, ())
    state, actions = _run(_window(checkpoint_step=30), listener, ms.Tick(2.5))
    assert [type(a) for a in actions] == [ms.Refuse, ms.NothingToAdopt, ms.SpawnLocal], actions
    assert "join it again" in actions[0].reason and actions[1].checkpoint == "/ckpt/step-00000030.pt"


def test_no_member_back_means_the_checkpoint_fresh_devices_and_every_reporter_refused():
    joiner = ms.Reported(ad.DeviceReport("hostc-2", warm=True, seen=3), 0.1)
    old_member = ms.Reported(ad.DeviceReport("local-3", 0, (), 3), 0.1)  # a joiner of the old driver, cold
    state, actions = _run(_window(checkpoint_step=30), joiner, old_member, ms.Tick(2.5))
    assert [type(a) for a in actions] == [ms.Refuse, ms.Refuse, ms.NothingToAdopt, ms.SpawnLocal]
    assert all("join it again" in a.reason for a in actions[:2]) and {"hostc-2", "local-3"} <= state.dead
    assert actions[2].checkpoint == "/ckpt/step-00000030.pt"
    # Fresh devices number above every id the reports named; once warm, generation 1 forms as in any start.
    assert actions[3] == ms.SpawnLocal(("local-4", "local-5")) and state.adoption is None
    state, actions = _run(state, ms.Ready("local-4"), ms.Ready("local-5"))
    assert _published(actions)[0].generation == 1 and _published(actions)[0].members == ("local-4", "local-5")


def test_no_report_at_all_resumes_from_the_checkpoint():
    state, actions = _run(_window(), ms.Tick(1.0))
    assert actions == [], "the window stays open until its deadline"
    state, actions = _run(state, ms.Tick(2.0))
    assert actions == [
        ms.NothingToAdopt("no device of the job's newest generation reported", "/ckpt/step-00000030.pt"),
        ms.SpawnLocal(("local-0", "local-1")),
    ]


def test_a_newer_checkpoint_is_read_by_the_new_rank_0():
    state, actions = _run(_window(checkpoint_step=45), *[_report(d) for d in MEMBERS], ms.Tick(0.6))
    assert [a for a in actions if isinstance(a, ms.Publish)][0].restore == "/ckpt/step-00000030.pt"


def test_a_report_of_another_job_makes_the_restarted_driver_decline_and_tells_the_devices_nothing():
    state, actions = _run(_window(), ms.Reported(ad.DeviceReport("local-0"), 0.1, "total_steps is 60 there"))
    assert actions == [ms.Decline(actions[0].reason)] and "total_steps" in actions[0].reason and state.stopped
