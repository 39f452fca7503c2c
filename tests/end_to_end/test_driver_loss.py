"""Losing the driver (issue 30): the devices wait, and a driver restarted with --resume re-adopts them.

One process test checks several things at once (the suite's time budget): the driver killed during a
forward, during a sync and during a join's state transfer, each time restarted with the resume command
the devices printed; the result equals the uninterrupted run; no worker restarted; the joiner that was
receiving the state stays a joiner and joins; the metrics file continues.
"""

import json
import re
import shlex

import pieces
import pytest
import torch
from conftest import flexpar_command, free_port, wait_for

LONG_RUN_ATOL = 1e-6  # as in test_elastic: SGD-momentum steps in another summation order
STEPS = 26

# The job kills its own driver three times: in the state transfer to the device scheduled to join at
# step 3 (fired by the sender, at that join's boundary), in step 12's forward and in step 18's sync
# (fired by rank 0). The leave scheduled at step 13 is due just after the second kill: the restarted
# driver follows it (its dead predecessor never saw step 13 commit), and the joiner leaves.
RE_ADOPTED_JOB = """
import os, sys, torch
if __name__ == "__main__":
    port = int(os.environ["TEST_PORT"])
    model, summary = pieces.make_job(delay_s=0.02).fit(
        steps={steps},
        devices=2,
        max_devices=3,
        port=port,
        schedule="3:+1,13:-1",
        faults="3:driver:transfer,12:driver:forward,18:driver:sync",
        driver_grace_s=60,
    )
    torch.save(model.state_dict(), "final.pt")
    print("resumed by", summary.get("resumed_by"), "from", summary["resumed_from"])
"""
KILLS = 3
DEVICES = ("local-0", "local-1")
JOINER = "local-2"


def _records(path):
    return [json.loads(line) for line in open(path)] if path.exists() else []


def _waiting_notes(drivers):
    """What the devices said when they lost a driver (each device writes to the output of the driver that
    started it)."""
    lines = [line for driver in drivers for line in driver.output()[1].splitlines()]
    return [line for line in lines if "Waiting up to" in line and "restart it with: " in line]


@pytest.mark.timeout(300)
def test_a_killed_driver_restarted_with_resume_re_adopts_the_devices(tmp_path, command_line_job, monkeypatch):
    """Three kill -9s of the driver (during a forward, a sync, a join's state transfer), each followed by
    the resume command the devices printed: the result equals the uninterrupted run, no worker
    restarted, the joiner joins, no checkpoint read, the metrics file continues; during the first gap
    `flexpar status` says who waits."""
    metrics = tmp_path / "m.jsonl"
    port = free_port()
    monkeypatch.setenv("TEST_PORT", str(port))
    flags = ["--oversubscribe", "--no-display", "--timeout", "20", "--metrics", str(metrics)]
    first = command_line_job(flags, RE_ADOPTED_JOB.format(steps=STEPS)).wait_for_banner()
    drivers = [first]
    notes = 0
    for kill in range(KILLS):
        wait_for(lambda: drivers[-1].process.poll() is not None, f"the driver's death {kill + 1}")
        # Every device holding a committed step says once that it waits (the joiner, once it does).
        wait_for(
            lambda seen=notes: len(_waiting_notes(drivers)) >= seen + 2, f"the devices to say they wait ({kill + 1})"
        )
        notes = len(_waiting_notes(drivers))
        if kill == 1:  # killed in step 12's forward: the step in flight still commits (13 steps)
            status = flexpar_command("status", f"127.0.0.1:{port}", timeout_s=60)
            assert status.returncode == 1 and "no driver; " in status.stdout and "waiting since" in status.stdout
            assert "local-0 (step 13), local-1 (step 13)" in status.stdout, status.stdout
            printed = _waiting_notes(drivers)[-1].split("restart it with: ", 1)[1]
            assert status.stdout.rstrip().endswith(f"re-adopt them: {printed}"), status.stdout
        command = shlex.split(_waiting_notes(drivers)[-1].split("restart it with: ", 1)[1])
        assert command[:3] == ["flexpar", "run", "--resume"], command
        drivers.append(command_line_job([], "", arguments=command[1:], outputs=f"driver-{kill + 2}"))
    assert drivers[-1].wait(timeout_s=180) == 0, drivers[-1].output()[1]
    out, err = drivers[-1].output()
    assert "resumed by adoption" in out and "no checkpoint read" in out, out
    assert not any("resuming from step" in driver.output()[0] for driver in drivers)
    said = "".join(driver.output()[1] for driver in drivers)
    assert said.count("fault: driver gets SIGKILL") == KILLS, said
    assert re.search(r"fault: driver gets SIGKILL at step \d+ \(transfer\)", said), said

    records = _records(metrics)
    steps = [r["step"] for r in records if r["kind"] == "step"]
    assert sorted(set(steps)) == list(range(STEPS)), steps
    events = [r for r in records if r["kind"] == "event"]
    adopted = [event for event in events if event["event"] == "adopt"]
    assert len(adopted) == KILLS, events
    assert all(event["steps_lost"] <= 1 and event["no_driver_s"] >= 0 for event in adopted)
    generations = [event["generation"] for event in events]
    assert generations == sorted(generations), "every driver numbers its generations above the last one seen"
    # No worker restarted: the same two devices trained every step; the joiner, which was receiving the
    # state when the driver died, joined (it stayed a joiner), then left as scheduled; no other device came.
    devices = [tuple(r["devices"]) for r in sorted(records, key=lambda r: r["time"]) if r["kind"] == "step"]
    joined = devices.index(DEVICES + (JOINER,))
    left = joined + devices[joined:].index(DEVICES)
    assert set(devices[:joined]) == set(devices[left:]) == {DEVICES}, devices
    assert set(devices[joined:left]) == {DEVICES + (JOINER,)}, devices
    assert [event["event"] for event in events if event["event"] in ("join", "leave")] == ["join", "leave"], events
    for device in DEVICES:  # each member was re-adopted by every restarted driver
        assert said.count(f"device {device}: re-adopted by the restarted driver") == KILLS, said

    model = pieces.make_model()
    model.load_state_dict(torch.load(tmp_path / "final.pt", weights_only=True))
    pieces.assert_same_parameters(model, pieces.reference(pieces.make_job(), STEPS), atol=LONG_RUN_ATOL)
