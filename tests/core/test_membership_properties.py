"""membership.decide under random event sequences: the module's rules hold after every event.

A hypothesis state machine feeds `decide` what the coordinator could hand it
(flexpar/driver/coordinator.py turns store messages, process exits and the clock into
events): devices announcing, warming up (or refused), forming, reporting a
failure, exiting; scale requests, preemption notices, a finish request, and
time passing, including stale generations and devices nobody knows. After
every event it checks the rules of flexpar/core/membership/decide.py's module doc:

- generations are published one at a time, each the previous + 1;
- a generation's members are unique and never more than --max-devices, and
  the devices counted against it (members and those on their way) neither;
  this host's devices stay within local_capacity;
- a new generation follows a formed one, or a failure (at most one in
  formation); a planned one keeps the members' order and appends joiners,
  and none is published once the job is finishing;
- a device that died (exited, evicted, cancelled) or was refused never comes back under the
  same id: not waiting, not starting, not in a later generation, even if it
  announces itself again;
- a scale request is answered once, carried out whole or refused whole, and
  at least one device always stays;
- once stopped, nothing happens any more.

A drawn start may be a restarted driver's (`--resume`): it opens an adoption
window with the reports of devices that outlived the old driver (members of
its newest generation, some gone; a device of an older generation; joiners),
and the same rules hold around it: nothing forms while it is open; the
re-adopted generation numbers above every generation any device saw, holds
only reporting members of the newest one (in their old rank order) and warm
joiners, never a device of an older generation.
"""

import dataclasses

from hypothesis import settings, strategies
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from flexpar.core import adoption
from flexpar.core import membership as ms

LOCALS = tuple(f"local-{i}" for i in range(10))
REMOTES = ("hostb-0", "hostb-1", "hostc-0")
PROBLEMS = strategies.sampled_from(("", "", "its model differs from the job's"))


def _starts_a_failure(state: ms.Membership, event) -> bool:
    """Whether `event` makes the current generation a failed one (decide recovers in the same call)."""
    if isinstance(event, ms.Exited):
        return event.device_id in state.members and event.device_id not in state.leaving
    if isinstance(event, ms.FailureReported):
        return event.generation == state.generation and event.device_id in state.members
    return False


@strategies.composite
def reports_of_a_lost_driver(draw, max_devices: int, local_capacity):
    """What the devices that outlived a driver report: members of its newest generation (each at its
    last committed step, or the one before after a split commit; some never report), one device of an
    older generation, joiners. As many as the old driver may have run (max_devices, local_capacity)."""
    generation = draw(strategies.integers(1, 6))
    ids = list(draw(strategies.permutations(LOCALS[:4] + REMOTES)))
    locals_left = local_capacity if local_capacity is not None else len(ids)
    chosen = []
    for device in ids:
        if len(chosen) < max_devices and (not device.startswith("local-") or locals_left > 0):
            chosen.append(device)
            locals_left -= device.startswith("local-")
    members = tuple(chosen[: draw(strategies.integers(1, len(chosen)))])
    others = chosen[len(members) :]
    step = draw(strategies.integers(1, 40))
    reports = [
        adoption.DeviceReport(device, generation, members, generation, step - draw(strategies.integers(0, 1)), True)
        for device in members
        if draw(strategies.booleans())
    ]
    for position, device in enumerate(others):
        if position == 0 and generation > 1 and draw(strategies.booleans()):  # left out while it was away
            reports.append(adoption.DeviceReport(device, generation - 1, (device,), generation - 1, step - 3, True))
        else:  # a joiner of the old driver, warm or not
            reports.append(adoption.DeviceReport(device, 0, (), generation, -1, draw(strategies.booleans())))
    return tuple(draw(strategies.permutations(reports)))


class MembershipRules(RuleBasedStateMachine):
    @initialize(
        initial=strategies.integers(1, 3),
        room=strategies.integers(0, 3),
        capacity=strategies.none() | strategies.integers(0, 4),
        grace=strategies.sampled_from((0.5, 5.0)),
        restarted=strategies.booleans(),
        data=strategies.data(),
    )
    def start(self, initial, room, capacity, grace, restarted, data):
        self.now = 0.0
        self.state = ms.Membership(
            initial_devices=initial,
            max_devices=initial + room,
            grace_s=grace,
            local_capacity=None if capacity is None else initial + capacity,
        )
        self.refused: set = set()
        if not restarted:
            self.apply(ms.Start(initial))
            return
        # A driver restarted with --resume: the window opens with what the waiting devices report.
        reports = data.draw(reports_of_a_lost_driver(self.state.max_devices, self.state.local_capacity))
        window = adoption.Adoption(deadline=2.0, checkpoint_step=5, checkpoint_path="step-00000005.pt")
        self.state = dataclasses.replace(self.state, adoption=window)
        for report in reports:
            self.apply(ms.Reported(report, self.now))

    # ------------------------------------------------------------ events

    def apply(self, event):
        before = self.state
        self.state, actions = ms.decide(before, event)
        self.refused |= {a.device_id for a in actions if isinstance(a, ms.Refuse)}
        _check(before, event, self.state, actions)
        return actions

    def _later(self, seconds):
        self.now += seconds
        return self.now

    def _spawned(self):
        """Local ids this job has started (the coordinator names them; nobody else uses them)."""
        return LOCALS[: self.state.next_local]

    @rule(data=strategies.data())
    def announce(self, data):  # a remote joiner; a local device (again); a dead one again
        self.apply(ms.Announced(data.draw(strategies.sampled_from(REMOTES + self._spawned()))))

    @precondition(lambda self: self.state.starting)
    @rule(data=strategies.data(), problem=PROBLEMS)
    def warm_up(self, data, problem):
        self.apply(ms.Ready(data.draw(strategies.sampled_from(self.state.starting)), problem))

    @precondition(lambda self: self.refused)
    @rule(data=strategies.data())
    def ready_after_being_refused(self, data):
        # A device may finish its warm-up before it reads the refusal of its announcement.
        self.apply(ms.Ready(data.draw(strategies.sampled_from(sorted(self.refused)))))

    @precondition(lambda self: self.state.members)
    @rule()
    def every_member_forms(self):
        for device in self.state.members:
            self.apply(ms.Formed(device, self.state.generation))

    @precondition(lambda self: self.state.members)
    @rule(data=strategies.data(), stale=strategies.booleans())
    def one_member_forms(self, data, stale):
        device = data.draw(strategies.sampled_from(self.state.members))
        self.apply(ms.Formed(device, self.state.generation - 1 if stale else self.state.generation))

    @precondition(lambda self: self.state.members)
    @rule(data=strategies.data(), stale=strategies.booleans(), seconds=strategies.floats(0, 2))
    def a_member_reports_a_failure(self, data, stale, seconds):
        device = data.draw(strategies.sampled_from(self.state.members))
        generation = self.state.generation - 1 if stale else self.state.generation
        self.apply(ms.FailureReported(device, generation, self._later(seconds)))

    @rule(data=strategies.data(), seconds=strategies.floats(0, 2))
    def a_device_exits(self, data, seconds):
        known = self.state.members + self.state.waiting + self.state.starting
        device = data.draw(strategies.sampled_from(known or REMOTES))
        self.apply(ms.Exited(device, self._later(seconds)))

    @rule(data=strategies.data(), seconds=strategies.floats(0, 2))
    def any_device_exits(self, data, seconds):  # dead already, or never admitted
        self.apply(ms.Exited(data.draw(strategies.sampled_from(REMOTES + self._spawned())), self._later(seconds)))

    @rule(delta=strategies.integers(-4, 4), request=strategies.sampled_from(("", "r1", "schedule-0")))
    def scale(self, delta, request):
        self.apply(ms.ScaleBy(delta, request))

    @rule(data=strategies.data())
    def preemption_notice(self, data):
        known = self.state.members + self.state.waiting + self.state.starting
        self.apply(ms.LeaveRequested(data.draw(strategies.sampled_from(known or REMOTES))))

    @rule(quiet=strategies.booleans())
    def finish(self, quiet):
        self.apply(ms.FinishRequested("SIGTERM to the driver", quiet=quiet))

    @rule(seconds=strategies.floats(0, 8))
    def time_passes(self, seconds):
        self.apply(ms.Tick(self._later(seconds)))

    # ------------------------------------------------------------ always

    @invariant()
    def the_state_keeps_its_bounds(self):
        state = self.state
        assert len(set(state.members)) == len(state.members)
        on_their_way = state.waiting + state.starting
        assert len(set(on_their_way)) == len(on_their_way) and not set(on_their_way) & set(state.members)
        assert not set(on_their_way) & state.dead, "a dead device never comes back under its id"
        assert len(state.members) <= state.max_devices
        assert state.device_count <= state.max_devices, (state.device_count, state)
        if state.local_capacity is not None:
            assert state.local_count <= state.local_capacity
        assert set(state.leaving) <= set(state.members) and set(state.survivors) <= set(state.members)


def _check(before: ms.Membership, event, after: ms.Membership, actions: tuple) -> None:
    if before.stopped:
        assert after == before and actions == ()
        return
    assert before.dead <= after.dead, "death is for good"
    published = [a for a in actions if isinstance(a, ms.Publish)]
    assert len(published) <= 1
    if before.adoption is not None:
        assert not published or after.adoption is None, "nothing forms while the adoption window is open"
        for generation in published:
            if any(isinstance(action, ms.NothingToAdopt) for action in actions):  # a start from the checkpoint
                assert generation.adopted is None and generation.generation == after.generation == 1
            else:
                _check_adoption(before, generation, after)
    else:
        assert after.generation == before.generation + len(published)
    for generation in published if before.adoption is None else ():
        members = generation.members
        assert generation.generation == before.generation + 1 and members == after.members
        assert members and len(set(members)) == len(members) <= before.max_devices
        assert set(generation.joined) <= set(members)
        assert not (set(generation.left) | set(generation.failed)) & set(members)
        assert not set(members) & after.dead, f"dead devices in generation {generation}"
        assert set(generation.joined) <= set(before.waiting) | {getattr(event, "device_id", None)}
        recovery = before.failure_since is not None or _starts_a_failure(before, event)
        if before.generation >= 1 and not recovery:
            formed = before.formed | (
                {event.device_id} if isinstance(event, ms.Formed) and event.generation == before.generation else set()
            )
            assert set(before.members) <= formed, "at most one generation in formation"
            assert not before.finishing, "no planned change once the job is finishing"
            kept = tuple(m for m in before.members if m not in generation.left)
            assert members[: len(kept)] == kept, "planned changes keep the members' order, joiners last"
    answers = [a for a in actions if isinstance(a, ms.Answer)]
    if isinstance(event, ms.ScaleBy):
        assert [a.request_id for a in answers] == [event.request_id], "answered once"
        (answer,) = answers
        if answer.accepted:
            assert answer.devices == after.device_count == before.device_count + event.delta
            if event.delta < 0:
                assert after.device_count >= 1, "at least one device stays"
        else:
            assert (after.members, after.waiting, after.starting, after.leaving) == (
                before.members,
                before.waiting,
                before.starting,
                before.leaving,
            ), "refused whole"
    else:
        assert not answers


def _check_adoption(before: ms.Membership, generation, after: ms.Membership) -> None:
    """The generation that closes a restarted driver's adoption window."""
    assert generation.adopted is not None
    window = before.adoption
    reports = window.by_device()
    seen = max(max(r.seen, r.generation) for r in window.reports)
    assert generation.generation > seen, "fencing: above every generation any device saw"
    newest = max(r.generation for r in window.reports)
    old_members = next(r.members for r in window.reports if r.generation == newest)
    back = [d for d in generation.members if d in reports and reports[d].generation > 0]
    assert generation.members[: len(back)] == tuple(d for d in old_members if d in back), "in their old rank order"
    assert all(reports[d].generation == newest for d in back), "no device of an older generation"
    # Joiners: the old driver's warm ones, then devices that warmed up while the window was open.
    assert all(reports[d].generation == 0 and reports[d].warm for d in generation.joined if d in reports)
    assert all(d in before.waiting for d in generation.joined if d not in reports)
    assert set(generation.members) == set(back) | set(generation.joined)
    assert generation.adopted.step == max(reports[d].committed for d in back), "the newest committed step"
    assert not set(generation.members) & after.dead and after.generation == generation.generation


TestMembershipRules = MembershipRules.TestCase
TestMembershipRules.settings = settings(max_examples=300, stateful_step_count=40, deadline=None)


# What the state machine found is pinned as examples in tests/test_membership.py.
