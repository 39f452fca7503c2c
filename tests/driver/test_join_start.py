"""SIGTERM at each stage of `flexpar join`'s start, and a wrong secret: no device of the joiner stays.

Kubernetes and SLURM scale down with SIGTERM, often while a joiner still starts. Whatever the
stage, every process the joiner started ends (or its device leaves at its first step boundary as
a planned leave), no device joins afterwards, and the job trains on unharmed. The stages are
pinned by the job's fault schedule (flexpar/worker/fault_injection.py START_PHASES), not by
sleeping: `flexpar join` fires "launch" and "launched" around starting its worker process, the
device the rest on its way in. One job serves every stage; each joiner's device gets its own id.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import uuid

import pieces
import pytest
import torch
from conftest import free_port, wait_for

import flexpar
from flexpar.comm.store import connect_client

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HOST = socket.gethostname()  # a joiner's devices are HOST-N, N from the job's counter

# (stage, signal): the joiner's own stages get SIGTERM alone (Kubernetes: the pod's first process,
# which must pass it on); the device's stages a whole group's (SLURM, systemd: every process at once).
STAGES = [
    ("launch", "term"),
    ("launched", "term"),
    ("announce", "term-group"),
    ("warmup", "term-group"),
    ("ready", "term-group"),
    ("admitted", "term-group"),
]


def _device(stage: str) -> str:
    """The id the joiner for `stage` gets: its number set aside (`_number`), whichever stages run."""
    return f"{HOST}-{_number(stage)}"


def _number(stage: str) -> int:
    return 100 * (1 + [name for name, _ in STAGES].index(stage)) + 1


class StopWhenAsked:
    """Ends the job cleanly (flexpar.STOP) once the test is done with it."""

    def __init__(self):
        self.asked = threading.Event()

    def on_step(self, record):
        return flexpar.STOP if self.asked.is_set() else None


class SharedJob:
    """One job, running fit() in a thread of this process, that every stage's joiner joins."""

    def __init__(self, directory):
        self.port, self.secret = free_port(), uuid.uuid4().hex
        self.address = f"127.0.0.1:{self.port}"
        self.metrics = directory / "metrics.jsonl"
        self.secret_file = directory / "secret"
        self.secret_file.write_text(self.secret)
        self.stopper = StopWhenAsked()
        # Slowish steps (0.6 s on one device): not too many of them while the joiners come and go, for
        # the plain loop that checks the result at the end.
        self.job = pieces.make_job(virtual_workers=3, delay_s=0.2)
        faults = ",".join(f"0:{_device(stage)}:{stage}:{name}" for stage, name in STAGES)
        self.result = self.error = None
        options = dict(
            steps=100_000,
            devices=1,
            max_devices=3,
            port=self.port,
            secret=self.secret,
            metrics=str(self.metrics),
            faults=faults,
            callbacks=[self.stopper],
            display=False,
            quiet=True,
            oversubscribe=True,
        )
        self.thread = threading.Thread(target=self._run, args=(options,), daemon=True)
        self.thread.start()
        wait_for(lambda: self.events("start") or not self.thread.is_alive(), "the job to start")

    def _run(self, options):
        try:
            self.result = self.job.fit(**options)
        except BaseException as error:  # reported by the test
            self.error = error

    def records(self):
        if not self.metrics.exists():
            return []
        return [json.loads(line) for line in self.metrics.read_text().splitlines()]

    def events(self, kind):
        return [r for r in self.records() if r["kind"] == "event" and r["event"] == kind]

    def finish(self, timeout_s=120):
        self.stopper.asked.set()
        self.thread.join(timeout_s)
        assert not self.thread.is_alive(), "the job did not stop"
        if self.error is not None:
            raise self.error
        return self.result


@pytest.fixture(scope="module")
def shared_job(tmp_path_factory):
    job = SharedJob(tmp_path_factory.mktemp("join-start"))
    yield job
    if job.thread.is_alive():
        job.stopper.asked.set()
        job.thread.join(120)


def _start_joiner(address, secret_file):
    """`flexpar join` in a session of its own: its process group is every process it starts."""
    script = os.path.join(TESTS, "pieces.py")
    return subprocess.Popen(
        [sys.executable, "-m", "flexpar", "join", address, "--script", script, "--secret-file", str(secret_file)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def _in_group(group: int) -> list:
    """Live (not zombie) processes in process group `group`: the joiner, its fork server, its workers."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as handle:
                fields = handle.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[2]) == group:
            found.append(int(entry))
    return found


def _wait_for_joiner(joiner, timeout_s=120):
    try:
        code = joiner.wait(timeout=timeout_s)
        return code, joiner.stderr.read()
    finally:
        if joiner.poll() is None:
            os.killpg(joiner.pid, signal.SIGKILL)
            joiner.wait()
        # Once the joiner has ended, its fork server ends as soon as it sees so: nothing else may be left.
        wait_for(lambda: not _in_group(joiner.pid), f"every process of the joiner (group {joiner.pid}) to end")


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads process groups from /proc")
@pytest.mark.timeout(300)
@pytest.mark.parametrize("stage, delivery", STAGES, ids=[stage for stage, _ in STAGES])
def test_sigterm_at_each_stage_of_a_joins_start_leaves_no_device(shared_job, stage, delivery):
    device = _device(stage)
    store = connect_client("127.0.0.1", shared_job.port, 10.0)
    # The joiner's device takes the next number of the job's counter: the one this stage's fault names.
    store.add("remote/counter", _number(stage) - 1 - store.add("remote/counter", 0))
    code, said = _wait_for_joiner(_start_joiner(shared_job.address, shared_job.secret_file))
    assert f"flexpar: fault: {device} gets SIGTERM at step 0 ({stage})" in said, said
    assert "Traceback" not in said, said
    if stage == "launch":  # no worker process existed yet: the command ends at once
        assert code == 143, said
        assert said.splitlines()[-1] == (
            "flexpar join: stopped by SIGTERM before this host's devices started; nothing joined"
        ), said
    else:
        assert code == 0, said
        assert said.splitlines()[-1].startswith(f"flexpar join: this host's devices have ended ({device} exit 0"), said

    # The job: no failure, and the device either never joined or left again as planned.
    def joined():
        return [e for e in shared_job.events("join") if device in e["devices"]]

    def left():
        return [e for e in shared_job.events("leave") if e["detail"] == f"left: {device}"]

    def failed():
        return [e for e in shared_job.events("failure") if device in e["detail"]]

    wait_for(lambda: not joined() or left() or failed(), f"{device}, which joined, to leave at a step boundary")
    assert not failed(), failed()
    if stage in ("launch", "launched", "announce", "warmup"):  # before it said it was ready: never let in
        assert not joined(), joined()
    assert shared_job.thread.is_alive(), shared_job.error


@pytest.mark.timeout(120)
def test_a_wrong_secret_is_refused_before_any_device_starts(shared_job, tmp_path):
    wrong = tmp_path / "wrong-secret"
    wrong.write_text("not-the-secret\n")
    store = connect_client("127.0.0.1", shared_job.port, 10.0)
    counted = store.add("remote/counter", 0)
    code, said = _wait_for_joiner(_start_joiner(shared_job.address, wrong))
    assert code == 3, said
    assert said.splitlines()[1:] == [
        f"flexpar join: wrong secret: the secret in {wrong} does not match the job at {shared_job.address}; give "
        "the job's own (a job on loopback keeps it in its run directory, file 'secret'); no device was started"
    ], said
    assert store.add("remote/counter", 0) == counted, "no device was numbered, so none was started"


@pytest.mark.timeout(300)
def test_the_job_ends_unharmed_with_the_right_parameters(shared_job):
    """After every stage's joiner came and went: the job stops cleanly, and its model is the plain loop's."""
    model, summary = shared_job.finish()
    assert not shared_job.events("failure")
    steps = [r["step"] for r in shared_job.records() if r["kind"] == "step"]
    assert steps == list(range(summary["steps"])), "every step commits once"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: one thread is 20 times faster on a busy machine than two
    try:
        expected = pieces.reference(shared_job.job, summary["steps"])
    finally:
        torch.set_num_threads(threads)
    pieces.assert_same_parameters(model, expected, atol=1e-6)


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads process groups from /proc")
@pytest.mark.timeout(120)
def test_sigterm_while_connecting_ends_the_join_at_once(tmp_path):
    """No job answers yet (a joiner started before its job, as under SLURM): nothing started, exit 143."""
    secret_file = tmp_path / "secret"
    secret_file.write_text("some-secret\n")
    joiner = _start_joiner(f"127.0.0.1:{free_port()}", secret_file)
    first = joiner.stderr.readline()
    assert first.startswith("flexpar join: connecting to the job at"), first
    joiner.send_signal(signal.SIGTERM)
    code, said = _wait_for_joiner(joiner)
    assert code == 143, said
    assert said.splitlines() == [
        "flexpar join: stopped by SIGTERM before this host's devices started; nothing joined"
    ], said


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as handle:
        return handle.read().rsplit(")", 1)[1].split()[0]


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads process states from /proc")
@pytest.mark.timeout(120)
def test_a_job_gone_before_the_device_connects_is_one_line(tmp_path):
    """The job's driver goes (SIGTERM to `flexpar run`, a scale-down of the whole job) while a joiner
    starts: its device says so in one line and ends at once, instead of a c10d traceback after 60 s.
    A stand-in job: the keys `flexpar join` reads, in a store this test closes while the joiner is
    held (SIGSTOP, from the fault schedule) just before it starts its device."""
    from flexpar.comm.protocol import secret_check
    from flexpar.comm.store import connect

    secret_file = tmp_path / "secret"
    secret_file.write_text("the-secret\n")
    port, device = free_port(), f"{HOST}-1"
    store = connect("127.0.0.1", port, 10.0, server=True)
    store.set("job/salt", "salt")
    store.set("job/secret_check", secret_check("the-secret", "salt"))
    store.set("job/script", "")
    store.set("job/settings", json.dumps({"backend": "gloo", "faults": [[0, device, "launch", "stop"]]}))
    joiner = _start_joiner(f"127.0.0.1:{port}", secret_file)
    try:
        wait_for(lambda: _state(joiner.pid) == "T", "the joiner to stop itself before it starts its device")
        del store  # the job's store closes: its driver is gone
        joiner.send_signal(signal.SIGCONT)
        code, said = _wait_for_joiner(joiner, timeout_s=60)
    finally:
        if joiner.poll() is None:
            os.killpg(joiner.pid, signal.SIGKILL)
    assert code == 4, said
    assert f"flexpar: device {device}: the job at 127.0.0.1:{port} is gone (nothing listens at" in said, said
    assert "Traceback" not in said and "c10d" not in said, said
    assert (
        said.splitlines()[-1]
        == f"flexpar join: this host's devices have ended ({device} exit 4; 0: left, withdrew or finished)"
    ), said
