"""Losing the driver (issue 30): the devices wait, and a driver restarted with --resume re-adopts them.

One process test checks several things at once (the suite's time budget): the driver killed during a
forward and during a sync, each time restarted with the resume command the devices printed; the
result equals the uninterrupted run; no worker restarted; the metrics file continues.
"""

import json
import os
import re
import shlex
import socket
import time

import pieces
import pytest
import torch

LONG_RUN_ATOL = 1e-6  # as in test_elastic: SGD-momentum steps in another summation order
STEPS = 24

# The job kills its own driver twice (faults fired by rank 0): in step 5's forward, in step 12's sync.
RE_ADOPTED_JOB = """
import os, sys, torch
if __name__ == "__main__":
    port = int(os.environ["TEST_PORT"])
    model, summary = pieces.make_job(delay_s=0.02).fit(
        steps={steps}, devices=2, port=port, faults="5:driver:forward,12:driver:sync", driver_grace_s=60
    )
    torch.save(model.state_dict(), "final.pt")
    print("resumed by", summary.get("resumed_by"), "from", summary["resumed_from"])
"""


def _records(path):
    return [json.loads(line) for line in open(path)] if path.exists() else []


def _free_port():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _wait_for(predicate, what, timeout_s=90.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def _waiting_notes(text):
    return [line for line in text.splitlines() if "Waiting up to" in line and "restart it with: " in line]


@pytest.mark.timeout(300)
def test_a_killed_driver_restarted_with_resume_re_adopts_the_devices(tmp_path, command_line_job, monkeypatch):
    metrics = tmp_path / "m.jsonl"
    monkeypatch.setenv("TEST_PORT", str(_free_port()))
    flags = ["--oversubscribe", "--no-display", "--timeout", "20", "--metrics", str(metrics)]
    first = command_line_job(flags, RE_ADOPTED_JOB.format(steps=STEPS)).wait_for_banner()
    drivers = [first]
    for kill in range(2):
        _wait_for(lambda: drivers[-1].process.poll() is not None, f"the driver's death {kill + 1}")
        notes = []
        _wait_for(
            lambda: len(notes.__setitem__(slice(None), _waiting_notes(first.output()[1])) or notes) >= 2 * (kill + 1),
            "both devices to say they wait",
        )
        command = shlex.split(notes[-1].split("restart it with: ", 1)[1])
        assert command[:3] == ["flexpar", "run", "--resume"], command
        drivers.append(command_line_job([], "", arguments=command[1:], outputs=f"driver-{kill + 2}"))
    assert drivers[-1].wait(timeout_s=180) == 0, drivers[-1].output()[1]
    out, err = drivers[-1].output()
    assert "resumed by adoption" in out, out
    assert "resuming from step" not in out

    records = _records(metrics)
    steps = [r["step"] for r in records if r["kind"] == "step"]
    assert sorted(set(steps)) == list(range(STEPS)), steps
    adopted = [r for r in records if r["kind"] == "event" and r["event"] == "adopt"]
    assert len(adopted) == 2, [r for r in records if r["kind"] == "event"]
    assert all(event["steps_lost"] <= 1 and event["no_driver_s"] >= 0 for event in adopted)
    generations = [r["generation"] for r in records if r["kind"] == "event"]
    assert generations == sorted(generations), "every driver numbers its generations above the last one seen"
    # No worker restarted: the same two device ids trained from the first step to the last.
    assert {tuple(r["devices"]) for r in records if r["kind"] == "step"} == {("local-0", "local-1")}
    assert len(re.findall(r"re-adopted by the restarted driver", first.output()[1])) == 4

    model = pieces.make_model()
    model.load_state_dict(torch.load(tmp_path / "final.pt", weights_only=True))
    pieces.assert_same_parameters(model, pieces.reference(pieces.make_job(), STEPS), atol=LONG_RUN_ATOL)
