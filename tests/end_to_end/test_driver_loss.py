"""Losing the driver: the devices wait, and a driver restarted with --resume re-adopts them.

One process test checks several things at once (the suite's time budget): the driver killed at each
phase (a join's state transfer, a step's record on its way, a forward, a sync, a backward, a checkpoint;
a sharded job's update), each time restarted with the resume command the devices printed; the result
equals the uninterrupted run; no worker restarted; the joiner that was receiving the state stays a
joiner and joins; the metrics file continues with every step, evaluation, ledger entry and callback
call exactly once (each record delivered once).
"""

import json
import os
import re
import shlex

import evaluation_pieces
import pieces
import pytest
import torch
from conftest import flexpar_command, free_port, wait_for

from flexpar.core import ledger

LONG_RUN_ATOL = 1e-6  # as in test_elastic: SGD-momentum steps in another summation order
STEPS = 40
EVAL_EVERY = 4

# The driver's callback: one line per call, in a file every restarted driver appends to (each record's
# callbacks run once across the job's drivers: each record delivered once).
CALLS = """
import flexpar


class Calls(flexpar.Callback):
    def on_step(self, record):
        open("calls.txt", "a").write(f"on_step {record['step']}\\n")

    def on_eval(self, record):
        open("calls.txt", "a").write(f"on_eval {record['step']}\\n")
"""

# The job kills its own driver five times: in the state transfer to the device scheduled to join at
# step 3 (fired by the sender, at that join's boundary); in step 12's forward, step 18's sync and step
# 24's checkpoint (fired by rank 0); and as step 30's record reaches it, before it writes it (the
# driver's own fault: the devices committed step 30 and go on training for as long as the loss takes
# them to notice; nobody wrote step 30's record). The faults are 6 steps apart, and 10 steps are left
# after the last: the devices commit at most the step in flight and the next one once the driver's process
# ended (DeviceLink.driver_gone_now), so no fault falls due while they have not noticed the last loss
# (on a loaded host they once trained four steps on, and a fault due meanwhile hit the dead driver).
# The leave scheduled at step 13 is decided two steps ahead, by the driver killed in step 12: its
# generation does not outlive it, and the restarted driver decides it again (unless the joiner left
# at step 13's boundary before the devices noticed the loss), and the joiner leaves. Evaluations every 4 steps:
# those at 12 and 24 were delivered by a driver that died before the devices forgot them.
RE_ADOPTED_JOB = """
import evaluation_pieces
if __name__ == "__main__":
    import os, sys, torch
    port = int(os.environ["TEST_PORT"])
    model, summary = evaluation_pieces.make_job(delay_s=0.02).fit(
        steps={steps},
        devices=2,
        max_devices=3,
        port=port,
        schedule="3:+1,13:-1",
        faults="3:driver:transfer,12:driver:forward,18:driver:sync,24:driver:checkpoint,30:driver:record",
        driver_grace_s=60,
        checkpoint_dir="ckpt",
        checkpoint_every=12,
        eval_every={eval_every},
        sample_ledger=True,
        callbacks=[Calls()],
    )
    torch.save(model.state_dict(), "final.pt")
    print("resumed by", summary.get("resumed_by"), "from", summary["resumed_from"])
"""
KILLS = 5
DEVICES = ("local-0", "local-1")
JOINER = "local-2"


def _records(path):
    return [json.loads(line) for line in open(path)] if path.exists() else []


def _waiting_notes(drivers):
    """What the devices said when they lost a driver (each device writes to the output of the driver that
    started it)."""
    lines = [line for driver in drivers for line in driver.output()[1].splitlines()]
    return [line for line in lines if "Waiting up to" in line and "restart it with: " in line]


def _restart_until_done(tmp_path, command_line_job, script: str, kills: int, during_gap=None) -> tuple:
    """Run `script`, restart its driver with the resume command the devices printed after each of its
    deaths (`during_gap(death, port, drivers)` runs while no driver is there) until one ends the job; returns
    (the drivers, the metrics records, every driver's stderr). `kills`: the driver faults scheduled."""
    metrics = tmp_path / "m.jsonl"
    port = int(os.environ["TEST_PORT"])
    flags = ["--oversubscribe", "--no-display", "--timeout", "20", "--metrics", str(metrics)]
    drivers = [command_line_job(flags, script).wait_for_banner()]
    notes = 0
    while True:
        death = len(drivers) - 1
        wait_for(lambda: drivers[-1].process.poll() is not None, f"the driver's end {death + 1}")
        if drivers[-1].process.returncode == 0:
            break
        assert death < kills, drivers[-1].output()[1]
        # Every device holding a committed step says once that it waits (the joiner, once it does).
        wait_for(
            lambda seen=notes: len(_waiting_notes(drivers)) >= seen + 2, f"the devices to say they wait ({death + 1})"
        )
        notes = len(_waiting_notes(drivers))
        if during_gap is not None:
            during_gap(death, port, drivers)
        command = shlex.split(_waiting_notes(drivers)[-1].split("restart it with: ", 1)[1])
        assert command[:3] == ["flexpar", "run", "--resume"], command
        drivers.append(command_line_job([], "", arguments=command[1:], outputs=f"driver-{death + 2}"))
    said = "".join(driver.output()[1] for driver in drivers)
    # Each fault fired once, at a live driver, and each firing killed one driver: the devices noticed each
    # loss within a step, long before the next fault fell due.
    deaths = len(drivers) - 1
    assert said.count("fault: driver gets SIGKILL") == deaths, said
    assert deaths == kills, said
    return drivers, _records(metrics), said


def _assert_each_record_once(tmp_path, records, said, steps: int, job) -> None:
    """Each record delivered once across driver kills: every committed step has one step record, one
    ledger entry and one on_step call, in order; every evaluation one record and one on_eval call; the
    devices' terminals show no C++ frame dump while they wait; the parameters are the plain loop's."""
    assert [r["step"] for r in records if r["kind"] == "step"] == list(range(steps))
    evaluated = sorted({*range(EVAL_EVERY, steps, EVAL_EVERY), steps})
    assert [r["step"] for r in records if r["kind"] == "eval"] == evaluated
    calls = (tmp_path / "calls.txt").read_text().split()
    assert [int(step) for hook, step in zip(calls[::2], calls[1::2]) if hook == "on_step"] == list(range(steps))
    assert [int(step) for hook, step in zip(calls[::2], calls[1::2]) if hook == "on_eval"] == evaluated
    lines = sorted(tmp_path.rglob("ledger.jsonl"))
    entries = [json.loads(line)["step"] for path in lines for line in open(path)]
    assert entries == list(range(steps)), entries
    audit = ledger.audit(
        {
            step: indices
            for path in sorted(tmp_path.rglob("ledger.jsonl"))
            for step, indices in ledger.read(path).items()
        },
        job.seed,
        len(job.dataset),
        job.global_batch,
        steps,
    )
    assert audit.clean, audit
    assert "frame #" not in said and "socket.cpp" not in said, said
    model = pieces.make_model()
    model.load_state_dict(torch.load(tmp_path / "final.pt", weights_only=True))
    pieces.assert_same_parameters(model, pieces.reference(job, steps), atol=LONG_RUN_ATOL)


@pytest.mark.timeout(400)
def test_a_killed_driver_restarted_with_resume_re_adopts_the_devices(tmp_path, command_line_job, monkeypatch):
    """Five kill -9s of the driver (a join's state transfer, a forward, a sync, a checkpoint, as a step's
    record reaches it), each followed by the resume command the devices printed: each
    record once; the result equals the uninterrupted run, no worker restarted, the joiner joins, no
    checkpoint read, the metrics file continues; during the second gap `flexpar status` says who waits."""
    monkeypatch.setenv("TEST_PORT", str(free_port()))

    def status_during(kill, port, drivers):
        if kill != 1:  # killed in step 12's forward: the devices hold step 12, or 13 if the step in flight
            return  # committed (later still where a loaded host's devices noticed the loss a step late)
        pattern = r"local-0 \(step (\d+)\), local-1 \(step (\d+)\)"
        status = ""
        for _ in range(20):  # a device says it waits a moment before `status` can list it
            status = flexpar_command("status", f"127.0.0.1:{port}", timeout_s=60).stdout
            if re.search(pattern, status):
                break
        assert "no driver; " in status and "waiting since" in status, status
        held = re.search(pattern, status)
        assert held and held.group(1) == held.group(2) and int(held.group(1)) >= 12, status
        printed = _waiting_notes(drivers)[-1].split("restart it with: ", 1)[1]
        assert status.rstrip().endswith(f"re-adopt them: {printed}"), status  # the command the devices printed

    script = CALLS + RE_ADOPTED_JOB.format(steps=STEPS, eval_every=EVAL_EVERY)
    drivers, records, said = _restart_until_done(tmp_path, command_line_job, script, KILLS, status_during)
    out, err = drivers[-1].output()
    assert "resumed by adoption" in out and "no checkpoint read" in out, out
    assert not any("resuming from step" in driver.output()[0] for driver in drivers)
    for phase in ("transfer", "forward", "sync", "checkpoint", "record"):
        assert re.search(rf"fault: driver gets SIGKILL at step \d+ \({phase}\)", said), said
    _assert_each_record_once(tmp_path, records, said, STEPS, evaluation_pieces.make_job())

    events = [r for r in records if r["kind"] == "event"]
    adopted = [event for event in events if event["event"] == "adopt"]
    assert len(adopted) == len(drivers) - 1, events  # every restarted driver re-adopted the devices
    assert all(event["steps_lost"] <= 1 and event["no_driver_s"] >= 0 for event in adopted)
    generations = [event["generation"] for event in events]
    assert generations == sorted(generations), "every driver numbers its generations above the last one seen"
    # No worker restarted: the same two devices trained every step; the joiner, which was receiving the
    # state when the driver died, joined (it stayed a joiner), then left as scheduled; no other device came.
    devices = [tuple(r["devices"]) for r in records if r["kind"] == "step"]
    joined = devices.index(DEVICES + (JOINER,))
    left = joined + devices[joined:].index(DEVICES)
    assert set(devices[:joined]) == set(devices[left:]) == {DEVICES}, devices
    assert set(devices[joined:left]) == {DEVICES + (JOINER,)}, devices
    # Where the devices noticed the loss before the joiner's streamed join ended (it holds no committed step
    # yet), the joiner is re-adopted as a joiner: it joins again at that adoption (flexpar/core/adoption.py).
    joins = [event for event in events if event["event"] == "join"]
    assert all(event["step"] in {adoption["step"] for adoption in adopted} for event in joins[1:]), events
    assert all(event["detail"].startswith(f"joined: {JOINER}") for event in joins), events
    # The leave at step 13 falls on the step where the second driver kill stopped the devices. Where they had
    # crossed that boundary (its generation published ahead of the step), the joiner left while no driver was
    # there to record it: the restarted driver takes the -1 as done (core/schedule.py, ScheduleTracker), says
    # so in a schedule note and writes the leave event itself. One leave event, either way.
    taken = [
        event
        for event in events
        if event["event"] == "schedule" and f"taken as done: {JOINER} did not come back" in event["detail"]
    ]
    assert len(taken) <= 1, events
    assert [event["event"] for event in events if event["event"] in ("join", "leave")] == ["join"] * len(joins) + [
        "leave"
    ], events
    leave = next(event for event in events if event["event"] == "leave")
    assert leave["detail"].startswith(f"left: {JOINER}"), leave
    assert ("while no driver was there" in leave["detail"]) == bool(taken), (leave, taken)
    for device in DEVICES:  # each member was re-adopted by every restarted driver
        assert said.count(f"device {device}: re-adopted by the restarted driver") == len(drivers) - 1, said


SHARDED_STEPS = 24
# A sharded job under `flexpar run` whose driver the test kills ({job}: make_job's extra arguments, {fit}: fit's).
SHARDED_JOB = """
import evaluation_pieces
if __name__ == "__main__":
    import os, torch
    model, summary = evaluation_pieces.make_job(delay_s=0.02, shard_optimizer=True{job}).fit(
        steps={steps},
        port=int(os.environ["TEST_PORT"]),
        driver_grace_s=60,
        eval_every={eval_every},
        sample_ledger=True,
        callbacks=[Calls()],
        {fit}
    )
    torch.save(model.state_dict(), "final.pt")
"""


@pytest.mark.timeout(300)
def test_a_sharded_job_records_each_step_once_across_driver_kills(tmp_path, command_line_job, monkeypatch):
    """Each record delivered once, with sharded optimizer state: three driver kills (in an update, a
    backward, as a record arrives): every step recorded once, in order, ledger complete, each evaluation
    once, the plain loop's parameters."""
    monkeypatch.setenv("TEST_PORT", str(free_port()))
    # The driver dies in step 4's parameter update (after every member applied its chunks), in step 9's
    # backward and as step 14's record reaches it (10 steps before the end, as above).
    fit = 'devices=2, faults="4:driver:update,9:driver:backward,14:driver:record",'
    script = CALLS + SHARDED_JOB.format(job="", fit=fit, steps=SHARDED_STEPS, eval_every=EVAL_EVERY)
    _, records, said = _restart_until_done(tmp_path, command_line_job, script, 3)
    for phase in ("update", "backward", "record"):
        assert re.search(rf"fault: driver gets SIGKILL at step \d+ \({phase}\)", said), said
    job = evaluation_pieces.make_job(shard_optimizer=True)
    _assert_each_record_once(tmp_path, records, said, SHARDED_STEPS, job)


@pytest.mark.timeout(300)
def test_a_driver_killed_during_a_sharded_stream_re_adopts_the_joiner_as_a_joiner(
    tmp_path, command_line_job, monkeypatch
):
    """Sharded optimizer state: the driver dies as rank 0 posts a round of the joiner's chunks. The
    listener holds no committed state: the restarted driver re-adopts the members and the joiner as a
    joiner, its join streams again, and every record, ledger entry and parameter is the plain loop's."""
    monkeypatch.setenv("TEST_PORT", str(free_port()))
    fit = 'devices=2, max_devices=3, schedule="1:+1", join_stream_mb=0.0002, join_mode="stream", '
    fit += 'faults="1:driver:stream",'
    job = ", shard_redundancy=2"
    # More steps than the other sharded job: the stream starts over at the adoption, and in one full-suite
    # run (three test processes on two cores) it had not ended by step 24, the job's last (no stream event).
    steps = SHARDED_STEPS + 16
    script = CALLS + SHARDED_JOB.format(job=job, fit=fit, steps=steps, eval_every=EVAL_EVERY)
    _, records, said = _restart_until_done(tmp_path, command_line_job, script, 1)
    assert re.search(r"fault: driver gets SIGKILL at step \d+ \(stream\)", said), said
    _assert_each_record_once(tmp_path, records, said, steps, evaluation_pieces.make_job(shard_optimizer=True))
    events = {r["event"]: r for r in records if r["kind"] == "event"}
    first, *again = [r for r in records if r["kind"] == "event" and r["event"] == "join"]
    planned = r"streaming to 1 listener: \d+ bytes of optimizer state, planned in (\d+) steps"
    rounds = int(re.search(planned, first["detail"])[1])
    # The stream in flight was dropped with its generation; the re-adopted generation streamed it all again,
    # the listener coming back as a joiner (a join event at the adoption's step).
    assert [r["step"] for r in again] == [events["adopt"]["step"]] and "streaming to 1 listener" in again[0]["detail"]
    assert events["stream"]["step"] >= events["adopt"]["step"] + rounds > first["step"] + rounds - 1, events


# Both devices' follower threads stop running at step 3 (a test's "starve" fault: as a loaded host's
# scheduler may leave them, for 10 s or until the device itself notes the driver's loss), and rank 0 kills
# the driver in step 6's backward. With no grace, each device then writes the last committed step and exits.
# Steps of about 100 ms (50 ms of sleep per VW, 2 VWs a device): the bound counts from the moment the driver's
# connections closed, which the kernel does only after tearing down the killed process's memory; with 20 ms
# steps that teardown spanned a whole step on the loaded 2-core machine (9 steps committed, twice in five
# runs of the file beside tests/driver), which measured the host, not the devices' check.
STARVED_JOB = """
import dataclasses
if __name__ == "__main__":
    job = dataclasses.replace(pieces.make_job(virtual_workers=4), loss=pieces.Loss(0.05))
    job.fit(steps=60, devices=2, driver_grace_s=0, faults="{faults}")
"""


@pytest.mark.timeout(200)
def test_devices_whose_follower_thread_is_starved_stop_within_a_step_of_the_drivers_death(tmp_path, command_line_job):
    """A driver killed in step 6 while the devices' follower threads get no CPU: the step loop looks at the
    driver itself (DeviceLink.driver_gone_now), so the members commit the step in flight and at most one
    more, 7 or 8 steps in all (on main they trained on until the follower ran again, 10 s later)."""
    faults = "3:local-0:forward:starve,3:local-1:forward:starve,6:driver:backward"
    flags = ["--oversubscribe", "--no-display", "--timeout", "10", "--metrics", str(tmp_path / "m.jsonl")]
    job = command_line_job(flags, STARVED_JOB.format(faults=faults)).wait_for_banner()
    wait_for(lambda: job.process.poll() is not None, "the driver's death")

    def notes():
        return [line for line in job.output()[1].splitlines() if "the last committed step, " in line]

    wait_for(lambda: len(notes()) == 2, "both devices to say where their last committed step is", timeout_s=30)
    said = job.output()[1]
    assert said.count("starves its follower thread at step 3 (forward)") == 2, said
    assert "fault: driver gets SIGKILL at step 6 (backward)" in said, said
    committed = {int(re.search(r"the last committed step, (\d+),", note)[1]) for note in notes()}
    assert len(committed) == 1 and committed.pop() in (7, 8), notes()
