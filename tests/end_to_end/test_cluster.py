"""Running where clusters run: preemption (SIGTERM) as a planned leave, a joiner found through the
environment, and a job that survives the loss of its driver as a checkpoint it can resume from."""

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time

import pieces
import pytest
import torch
from conftest import flexpar_command, wait_for

LONG_RUN_ATOL = 1e-6  # as in test_elastic: 60+ SGD-momentum steps in another summation order


def _records(path):
    return [json.loads(line) for line in open(path)]


def test_sigterm_to_a_busy_worker_is_a_planned_leave(train, metrics_file):
    job = pieces.make_job(virtual_workers=6, delay_s=0.01)
    model, summary = train(job, steps=20, devices=3, faults="7:local-1:backward:term")
    records = _records(metrics_file)
    events = [r for r in records if r["kind"] == "event" and r["event"] in ("leave", "failure")]
    assert [e["event"] for e in events] == ["leave"], "a preempted device leaves; it does not fail"
    assert events[0]["detail"] == "left: local-1"
    steps = [r["step"] for r in records if r["kind"] == "step"]
    assert steps == list(range(20)), "every step commits once"
    assert {len(r["devices"]) for r in records if r["kind"] == "step" and r["step"] > 10} == {2}
    pieces.assert_same_parameters(model, pieces.reference(job, 20))
    print(f"preemption leave stall: {events[0]['stall_s'] * 1000:.1f} ms")
    # Not a timing goal (benchmarks/elastic.py measures leaves): a leave that had gone through the
    # failure path would have waited for the dead device to be noticed (heartbeat_timeout_s, 5 s).
    assert events[0]["stall_s"] < 5.0


def test_sigterm_to_the_last_device_stops_the_job_cleanly(train, tmp_path):
    job = pieces.make_job(delay_s=0.02)
    checkpoints = tmp_path / "checkpoints"
    model, summary = train(
        job, steps=30, devices=1, faults="5:local-0:forward:term", checkpoint_every=100, checkpoint_dir=str(checkpoints)
    )
    assert "its last device, local-0, got SIGTERM" in summary["stopped"]
    final = summary["steps"]
    assert 5 <= final < 30 and os.path.exists(summary["checkpoint"])
    assert summary["checkpoint"].endswith(f"step-{final:08d}.pt")
    pieces.assert_same_parameters(model, pieces.reference(job, final))


# ------------------------------------------------------------ a joiner from the environment

JOB = """
if __name__ == "__main__":
    pieces.make_job(virtual_workers=6, delay_s=0.03).fit(steps=100000, devices=1)
"""


def _events(metrics, kind):
    return [r for r in _records(metrics) if r["kind"] == "event" and r["event"] == kind] if metrics.exists() else []


@pytest.mark.parametrize("delivery", ["to flexpar join", "to every process"])
def test_joiner_from_the_environment_and_sigterm_to_flexpar_join(tmp_path, command_line_job, delivery):
    """Kubernetes sends SIGTERM to a pod's first process (`flexpar join`, which passes it on);
    SLURM's scancel and systemd send it to every process of the host's share of the job at once
    (here: the process group). Either way the joiner leaves as planned, and the job, sent the
    same whole-host SIGTERM, stops cleanly with a checkpoint instead of losing its devices."""
    metrics = tmp_path / "m.jsonl"
    job = command_line_job(["--max-devices", "2", "--no-display", "--metrics", str(metrics)], JOB).wait_for_banner()
    environment = {**os.environ, "FLEXPAR_ADDRESS": job.address, "FLEXPAR_SECRET_FILE": job.secret_file}
    environment.pop("FLEXPAR_SECRET", None)
    # Nothing but the environment: the address, the secret, and (same host) the job's own script path.
    joiner = subprocess.Popen(
        [sys.executable, "-m", "flexpar", "join"],
        env=environment,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        wait_for(lambda: _events(metrics, "join"), "the joiner to join")
        (joined,) = _events(metrics, "join")
        remote = [d for d in joined["devices"] if not d.startswith("local-")]
        assert len(remote) == 1
        if delivery == "to flexpar join":
            joiner.send_signal(signal.SIGTERM)  # what Kubernetes sends a pod it deletes
        else:
            os.killpg(joiner.pid, signal.SIGTERM)  # the joiner, its fork server and its worker
        assert joiner.wait(timeout=60) == 0, joiner.stderr.read()
        said = joiner.stderr.read()
        assert f"flexpar join: started 1 cpu device ({remote[0]})" in said, said
        assert f"flexpar join: this host's devices have ended ({remote[0]} exit 0;" in said, said
        wait_for(lambda: _events(metrics, "leave"), "the joiner to leave")
        (left,) = _events(metrics, "leave")
        assert left["detail"] == f"left: {remote[0]}" and not _events(metrics, "failure")
    finally:
        if joiner.poll() is None:
            os.killpg(joiner.pid, signal.SIGKILL)
    if delivery == "to flexpar join":
        job.process.send_signal(signal.SIGTERM)
        assert job.wait(timeout_s=60) == 143
        return
    os.killpg(job.process.pid, signal.SIGTERM)  # the driver, its fork server and its device
    assert job.wait(timeout_s=60) == 143, job.output()
    stdout, stderr = job.output()
    (stop,) = _events(metrics, "stop")
    assert "the driver got SIGTERM" in stop["detail"] and not _events(metrics, "failure"), stderr
    assert "stopped by SIGTERM after step" in stderr and "failed" not in stderr, stderr


# ------------------------------------------------------------ the driver dies

SAVING_JOB = """
import torch
if __name__ == "__main__":
    model, summary = pieces.make_job(delay_s=0.02).fit(steps=60, devices=2)
    torch.save(model.state_dict(), "final.pt")
    print("resumed from", summary["resumed_from"])
"""


def _descendants(pid):
    """Every process below `pid` (workers are children of the fork server, a child of the driver)."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as handle:
                    fields = handle.read().rsplit(")", 1)[1].split()
                parents.setdefault(int(fields[1]), []).append(int(entry))
            except OSError:
                continue
    found, frontier = [], [pid]
    while frontier:
        children = parents.get(frontier.pop(), [])
        found.extend(children)
        frontier.extend(children)
    return found


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.timeout(400)
def test_kill_9_of_the_driver_leaves_a_checkpoint_that_resumes(tmp_path, command_line_job):
    """With no driver restarted within the devices' grace (1 s here), the present behaviour: the
    survivors' checkpoint, the resume command, a full restart from it."""
    metrics = tmp_path / "m.jsonl"
    timeout_s = 10
    flags = ["--oversubscribe", "--no-display", "--timeout", str(timeout_s), "--metrics", str(metrics)]
    flags += ["--driver-grace", "1"]
    job = command_line_job(flags, SAVING_JOB).wait_for_banner()
    wait_for(lambda: metrics.exists() and sum(r["kind"] == "step" for r in _records(metrics)) >= 10, "ten steps")
    workers = _descendants(job.process.pid)
    assert workers
    os.kill(job.process.pid, signal.SIGKILL)
    killed = time.monotonic()
    wait_for(lambda: not any(_alive(pid) for pid in workers), "the workers to exit", timeout_s=timeout_s + 10)
    print(f"workers exited {time.monotonic() - killed:.2f} s after the driver's death")
    _, err = job.output()
    run_dir = str(tmp_path)
    waited = [line for line in err.splitlines() if "Waiting up to 1 s for a driver at" in line]
    assert len(waited) == 2, err
    notes = [line for line in err.splitlines() if "none came back" in line and "Resume with: " in line]
    assert len(notes) == 2 and all(f"flexpar run --resume --checkpoint-dir {run_dir}" in n for n in notes), err
    printed = {note.split("Resume with: ", 1)[1] for note in notes}
    assert len(printed) == 1, "every device prints the same command"
    checkpoints = sorted(name for name in os.listdir(run_dir) if name.startswith("step-"))
    assert len(checkpoints) == 1
    saved_step = int(checkpoints[0][5:13])
    committed = [r["step"] for r in _records(metrics) if r["kind"] == "step"]
    assert saved_step >= max(committed) + 1, "the checkpoint holds the last committed step"
    assert all(str(saved_step) in note for note in notes)
    assert not (tmp_path / "final.pt").exists()

    # The printed command, as a user would paste it: the job's own flags and the two that resume it.
    command = shlex.split(printed.pop())
    assert command[:2] == ["flexpar", "run"] and command[-1] == str(job.script)
    # Pinned where the job made them up: its port and its secret file (a restarted driver is this job's).
    port = job.address.rsplit(":", 1)[1]
    pins = ["--port", port, "--secret-file", os.path.join(run_dir, "secret")]
    assert command[2:] == ["--resume", "--checkpoint-dir", run_dir, *pins, *flags, str(job.script)]
    resumed = flexpar_command(*command[1:], timeout_s=300, cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    assert f"resuming from step {saved_step}" in resumed.stdout
    model = pieces.make_model()
    model.load_state_dict(torch.load(tmp_path / "final.pt", weights_only=True))
    pieces.assert_same_parameters(model, pieces.reference(pieces.make_job(), 60), atol=LONG_RUN_ATOL)


# Records each worker's pid under its device id (pid-local-N in the job's folder), so a test can kill
# one device together with the driver, as the death of the driver's host does.
PID_RECORDING_JOB = """
import dataclasses, multiprocessing, os, torch


class PidRecordingLoss(pieces.Loss):
    def __call__(self, model, batch):
        name = multiprocessing.current_process().name.replace("flexpar-", "pid-")
        if name.startswith("pid-") and not os.path.exists(name):
            with open(name + ".tmp", "w") as handle:
                handle.write(str(os.getpid()))
            os.replace(name + ".tmp", name)
        return super().__call__(model, batch)


if __name__ == "__main__":
    job = dataclasses.replace(pieces.make_job(virtual_workers=6), loss=PidRecordingLoss(0.02))
    model, summary = job.fit(steps=60, devices=3)
    torch.save(model.state_dict(), "final.pt")
"""


@pytest.mark.timeout(400)
def test_the_driver_and_rank_0_killed_together_leave_the_survivors_checkpoint(tmp_path, command_line_job):
    """The driver's host dies with local-0 (rank 0) on it: the survivors' step fails as well, no one can
    ask who is left, and each survivor writes the step it committed; the resume equals the whole run."""
    metrics = tmp_path / "m.jsonl"
    timeout_s = 10
    flags = ["--oversubscribe", "--no-display", "--timeout", str(timeout_s), "--metrics", str(metrics)]
    flags += ["--driver-grace", "0"]  # the present behaviour: exit at once
    job = command_line_job(flags, PID_RECORDING_JOB).wait_for_banner()
    wait_for(
        lambda: (
            metrics.exists()
            and sum(r["kind"] == "step" for r in _records(metrics)) >= 10
            and all((tmp_path / f"pid-local-{index}").exists() for index in range(3))
        ),
        "ten steps",
    )
    workers = _descendants(job.process.pid)
    rank_0 = int((tmp_path / "pid-local-0").read_text())
    assert rank_0 in workers
    os.kill(job.process.pid, signal.SIGKILL)
    os.kill(rank_0, signal.SIGKILL)
    wait_for(lambda: not any(_alive(pid) for pid in workers), "the workers to exit", timeout_s=timeout_s + 10)
    _, err = job.output()
    notes = [line for line in err.splitlines() if "the job's driver is gone" in line]
    assert sorted(note.split(":")[1].strip() for note in notes) == ["device local-1", "device local-2"], err
    assert not any("written by" in note for note in notes), "each survivor wrote its own, none names local-0"
    said = [re.search(r"the last committed step, (\d+), is in (\S+)\. Resume with", note) for note in notes]
    assert all(said), notes
    for match in said:
        assert os.path.exists(match.group(2)) and match.group(2).endswith(f"step-{int(match.group(1)):08d}.pt")
    saved_step = max(int(match.group(1)) for match in said)
    committed = [r["step"] for r in _records(metrics) if r["kind"] == "step"]
    assert saved_step >= max(committed) + 1, "the checkpoint holds the last committed step"

    command = shlex.split(notes[0].split("Resume with: ", 1)[1])
    resumed = flexpar_command(*command[1:], timeout_s=300, cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    assert f"resuming from step {saved_step}" in resumed.stdout
    model = pieces.make_model()
    model.load_state_dict(torch.load(tmp_path / "final.pt", weights_only=True))
    pieces.assert_same_parameters(model, pieces.reference(pieces.make_job(virtual_workers=6), 60), atol=LONG_RUN_ATOL)


# ------------------------------------------------------------ hung peers and faults at boundaries


@pytest.mark.timeout(150)
def test_a_hung_peer_is_noticed_by_its_silence_not_the_collective_timeout(train, metrics_file):
    """SIGSTOP a device mid-step: its heartbeat stops, the coordinator counts it failed and kills it,
    and the others go on. The collective timeout (600 s here) is never waited out: the test's own
    limit is far below it."""
    job = pieces.make_job(virtual_workers=6, delay_s=0.01)
    model, summary = train(
        job, steps=20, devices=3, faults="7:local-2:backward:stop", timeout_s=600.0, heartbeat_timeout_s=2.0
    )
    records = _records(metrics_file)
    failures = [r for r in records if r["kind"] == "event" and r["event"] == "failure"]
    assert [f["detail"] for f in failures] == ["failed: local-2"]
    assert [r["step"] for r in records if r["kind"] == "step"] == list(range(20))
    pieces.assert_same_parameters(model, pieces.reference(job, 20))
    print(f"hung peer: failure stall {failures[0]['stall_s']:.2f} s (heartbeat timeout 2 s)")


@pytest.mark.timeout(150)
@pytest.mark.parametrize("fault", ["0:local-1:formation", "0:local-0:formation", "4:local-0:checkpoint"])
def test_a_death_during_group_formation_or_a_checkpoint_costs_no_timeout(train, metrics_file, tmp_path, fault):
    """A device killed as a generation's group forms (the first, here) or as it writes a checkpoint:
    the others learn it from the coordinator's death notice, not from a 600 s timeout."""
    job = pieces.make_job(virtual_workers=6)
    model, summary = train(
        job,
        steps=12,
        devices=3,
        faults=fault,
        timeout_s=600.0,
        checkpoint_every=4,
        checkpoint_dir=str(tmp_path / "checkpoints"),
    )
    records = _records(metrics_file)
    assert [r["step"] for r in records if r["kind"] == "step"] == list(range(12))
    assert {len(r["devices"]) for r in records if r["kind"] == "step"} <= {2, 3}
    assert summary["generations"] >= 2
    pieces.assert_same_parameters(model, pieces.reference(job, 12))


def test_a_device_that_cannot_leave_within_the_grace_period_fails_over(train, metrics_file):
    """SIGTERM early in a long step with a grace period shorter than the step: the device kills itself
    and the others recover as from a failure; the result is unchanged."""
    job = pieces.make_job(virtual_workers=6, delay_s=0.25)
    model, summary = train(job, steps=6, devices=3, faults="2:local-1:forward:term", preemption_grace_s=0.2)
    events = [r for r in _records(metrics_file) if r["kind"] == "event" and r["event"] in ("leave", "failure")]
    assert [(e["event"], e["detail"]) for e in events] in (
        [("failure", "failed: local-1")],  # it died before the coordinator let it go
        [("failure", "failed: local-1 (while leaving)")],  # ... or after: the others still lost the step
    )
    pieces.assert_same_parameters(model, pieces.reference(job, 6))


def test_a_second_sigterm_to_a_leaving_device_stops_it_at_once(train, metrics_file):
    """SIGTERM at a step's first forward, then another at the same step's gradient sum, over
    SAME_NOTICE_S later (two VWs of 1.5 s): the device kills itself there instead of waiting for the
    boundary, the others recover as from a failure, and the result is unchanged."""
    job = pieces.make_job(virtual_workers=6, delay_s=1.5)
    model, summary = train(job, steps=4, devices=3, faults="1:local-1:forward:term,1:local-1:sync:term")
    events = [r for r in _records(metrics_file) if r["kind"] == "event" and r["event"] in ("leave", "failure")]
    assert [(e["event"], e["detail"]) for e in events] in (
        [("failure", "failed: local-1")],
        [("failure", "failed: local-1 (while leaving)")],
    )
    pieces.assert_same_parameters(model, pieces.reference(job, 4))


SLOW_START_JOB = """
if __name__ == "__main__":
    pieces.make_job(model=pieces.make_model_slowly).fit(steps=1000, devices=2)
"""


def test_a_whole_hosts_sigterm_during_start_up_stops_in_one_line(tmp_path, command_line_job):
    """The devices are still building their model (1.5 s) when SLURM or systemd signals them all."""
    job = command_line_job(
        ["--oversubscribe", "--no-display", "--metrics", str(tmp_path / "m.jsonl")], SLOW_START_JOB
    ).wait_for_banner()
    os.killpg(job.process.pid, signal.SIGTERM)
    assert job.wait(timeout_s=60) == 143
    _, err = job.output()
    assert "flexpar: stopped by SIGTERM before training started" in err, err
    assert "__main__" not in err and "Traceback" not in err, err
