"""deploy/slurm under a real SLURM: a one-node cluster started here runs the scripts as a user would.

slurmctld, slurmd and munged (Debian's `slurm-wlm` and `munge`) run as root from a temporary
directory: their own slurm.conf, state, spool and log folders, and a munge key and socket made for
the run; every daemon and job is stopped by pid at the end, also when a test fails. Two tasks on the
one node stand for two nodes (`--nodes=1 --ntasks-per-node=2`). One job goes through the five
cases, as few starts of torch as that takes: `sbatch flexpar.sbatch` starts it, the join command it
prints adds a device live, `scancel --signal=TERM` of that allocation is a planned leave,
`scontrol requeue` ends it with a final checkpoint that the requeued job resumes from, and `scancel`
stops the rerun with another. Each case is read from the job's own records: the device-set events
and step records of its metrics file, its checkpoints (equal to the plain loop's parameters), its
output file, and the scheduler's job states.

The script's loss sleeps per call for what the file `pace` holds, so the job is slow enough for
each action to land at a step boundary; no case depends on how fast this machine is.

Without SLURM installed the module is skipped (naming the packages), except under CI=true.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shlex
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pieces
import pytest
import torch
from conftest import TESTS, free_port

from flexpar.worker import checkpoints

ROOT = Path(__file__).resolve().parents[2]
SLURM = ROOT / "deploy" / "slurm"
PACKAGES = "slurm-wlm munge"
PROGRAMS = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "scancel", "squeue", "sinfo")
STEPS = 10000  # the script's; the job is stopped long before
PACE_S = 0.2  # sleep per loss call: a few steps a second, so each action lands at a known boundary
LONG_RUN_ATOL = 1e-6  # as in test_elastic: a hundred or more SGD-momentum steps in other summation orders
DEVICE_SET_EVENTS = ("start", "join", "leave", "failure", "stop")

pytestmark = pytest.mark.timeout(400)  # the first test of each job waits for all of it (the fixture)

CONFIGURATION = """\
ClusterName=flexpartest
SlurmctldHost={node}(127.0.0.1)
SlurmctldPort={controller_port}
SlurmdPort={node_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={munge_socket}
StateSaveLocation={folder}/state
SlurmdSpoolDir={folder}/spool
SlurmctldPidFile={folder}/slurmctld.pid
SlurmdPidFile={folder}/slurmd.pid
SlurmctldLogFile={folder}/log/slurmctld.log
SlurmdLogFile={folder}/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
# 16 CPUs on a 2-core host, so that the scripts' own --cpus-per-task=8 fits a join allocation.
SlurmdParameters=config_overrides
MpiDefault=none
ReturnToService=2
KillWait=30
SchedulerParameters=sched_interval=1
NodeName={node} NodeAddr=127.0.0.1 CPUs=16 State=UNKNOWN
PartitionName=test Nodes={node} Default=YES MaxTime=INFINITE State=UP
"""

TRAIN = """
import os, sys, time
sys.path.insert(0, {tests!r})
import dataclasses
import torch
import pieces

PACE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "pace")


class PacedLoss(pieces.Loss):
    \"\"\"pieces.Loss, sleeping per call for the seconds the file `pace` holds.\"\"\"

    def __call__(self, model, batch):
        with open(PACE) as handle:
            time.sleep(float(handle.read()))
        inputs, labels = batch
        return torch.nn.functional.cross_entropy(model(inputs), labels)


if __name__ == "__main__":
    job = dataclasses.replace(pieces.make_job(), loss=PacedLoss())
    model, summary = job.fit(steps={steps}, devices=1)
    torch.save(model.state_dict(), "final.pt")
"""


def missing_slurm():
    """Why the cluster cannot start here, or None."""
    search = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/usr/local/sbin"])
    missing = [name for name in PROGRAMS if shutil.which(name, path=search) is None]
    if missing:
        return f"SLURM is not installed ({', '.join(missing)} missing): apt-get install -y {PACKAGES}"
    if os.geteuid() != 0:
        return "the test cluster's daemons run as root (SlurmUser=root): run the tests as root"
    return None


class OneNodeCluster:
    """slurmctld, slurmd and munged of this run, in `folder`; `stop` ends them and every job by pid."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.node = socket.gethostname().split(".")[0]
        self.configuration = folder / "slurm.conf"
        self.daemons: list = []  # (name, Popen)

    def environment(self, **variables) -> dict:
        """What a user's shell on this cluster has: SLURM_CONF, and this checkout's python first."""
        search = os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", ""), "/usr/sbin"])
        base = {key: value for key, value in os.environ.items() if not key.startswith(("FLEXPAR_", "SLURM_"))}
        base.update(SLURM_CONF=str(self.configuration), PATH=search, PYTHONPATH=str(ROOT))
        base.update({key: str(value) for key, value in variables.items()})
        return base

    def start(self) -> None:
        munge = self.folder / "munge"
        munge.mkdir(mode=0o700)
        key = munge / "munge.key"
        key.write_bytes(secrets.token_bytes(1024))
        key.chmod(0o400)
        munge_socket = munge / "socket"
        for name in ("state", "spool", "log"):
            (self.folder / name).mkdir()
        self.configuration.write_text(
            CONFIGURATION.format(
                node=self.node,
                controller_port=free_port(),
                node_port=free_port(),
                munge_socket=munge_socket,
                folder=self.folder,
            )
        )
        self._start(
            "munged",
            f"--socket={munge_socket}",
            f"--key-file={key}",
            f"--log-file={munge / 'munged.log'}",
            f"--pid-file={munge / 'munged.pid'}",
            f"--seed-file={munge / 'munged.seed'}",
            "--foreground",
            "--force",
        )
        self.wait(munge_socket.exists, "munged's socket")
        self._start("slurmctld", "-D", "-i", "-f", str(self.configuration))
        self._start("slurmd", "-D", "-f", str(self.configuration))
        self.wait(lambda: self.run("sinfo", "-h", "-o", "%t", check=False).stdout.strip() == "idle", "an idle node")

    def _start(self, name: str, *arguments: str) -> None:
        output = open(self.folder / "log" / f"{name}.out", "w")
        process = subprocess.Popen(
            [shutil.which(name, path=self.environment()["PATH"]), *arguments],
            env=self.environment(),
            stdout=output,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.daemons.append((name, process))

    def wait(self, predicate, what: str, timeout_s: float = 120.0, output: Path = None) -> None:
        """Poll until `predicate()`; fails naming `what` (with `output`'s tail) or a daemon that died."""
        deadline = time.monotonic() + timeout_s
        while not predicate():
            dead = [name for name, process in self.daemons if process.poll() is not None]
            if dead or time.monotonic() > deadline:
                tail = output.read_text()[-3000:] if output is not None and output.exists() else ""
                logs = "".join(
                    f"\n--- {path.name}\n{path.read_text()[-1500:]}" for path in sorted(self.folder.glob("log/*"))
                )
                problem = f"{', '.join(dead)} ended" if dead else "timed out"
                raise AssertionError(f"{problem} waiting for {what}\n{tail}{logs}")
            time.sleep(0.2)

    def run(self, *command: str, check: bool = True, cwd: Path = None, environment: dict = None):
        result = subprocess.run(
            command, env=environment or self.environment(), cwd=cwd, capture_output=True, text=True, timeout=60
        )
        if check:
            assert result.returncode == 0, f"{shlex.join(command)}: {result.stderr}"
        return result

    def job(self, job_id: str) -> dict:
        """The job's fields as `scontrol show job` gives them (JobState, ExitCode, Restarts...)."""
        text = self.run("scontrol", "-o", "show", "job", job_id).stdout
        return dict(re.findall(r"(\w+)=(\S*)", text))

    def stop(self) -> None:
        """Every job cancelled, then the daemons, then any process of this cluster still alive, by pid."""
        try:
            listed = self.run("squeue", "-h", "-o", "%i", check=False).stdout.split()
            for job_id in listed:
                self.run("scancel", "--signal=KILL", "--full", job_id, check=False)
            deadline = time.monotonic() + 30
            while listed and time.monotonic() < deadline:
                time.sleep(0.5)
                listed = self.run("squeue", "-h", "-o", "%i", check=False).stdout.split()
        finally:
            for _, process in reversed(self.daemons):
                process.send_signal(signal.SIGTERM)
                try:
                    process.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait(timeout=15)
            for pid in self._leftovers():
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

    def _leftovers(self) -> list:
        """Processes started under this cluster (slurmstepd, a job's): SLURM_CONF names its file."""
        marker = f"SLURM_CONF={self.configuration}".encode()
        found = []
        for entry in os.listdir("/proc"):
            if entry.isdigit() and int(entry) != os.getpid():
                try:
                    with open(f"/proc/{entry}/environ", "rb") as handle:
                        if marker in handle.read().split(b"\0"):
                            found.append(int(entry))
                except OSError:
                    continue
        return found


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    reason = missing_slurm()
    if reason is not None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI runs the SLURM tests: {reason}")
        pytest.skip(reason)
    started = OneNodeCluster(tmp_path_factory.mktemp("slurm"))
    try:
        started.start()
        yield started
    finally:
        started.stop()


# ------------------------------------------------------------ jobs


class SubmittedJob:
    """A flexpar.sbatch job: its folder (the submission directory), output file and metrics file."""

    def __init__(self, cluster: OneNodeCluster, folder: Path, job_id: str, environment: dict):
        self.cluster, self.folder, self.id, self.environment = cluster, folder, job_id, environment
        self.output = folder / f"flexpar-{job_id}.out"
        self.checkpoints = folder / "checkpoints" / job_id  # flexpar.sbatch's default
        self.metrics = self.checkpoints / "metrics.jsonl"  # task.sh's default with checkpoints

    def records(self) -> list:
        if not self.metrics.exists():
            return []
        lines = self.metrics.read_text().split("\n")[:-1]  # a line being written is not whole yet
        return [json.loads(line) for line in lines if line]

    def events(self, *kinds) -> list:
        return [r for r in self.records() if r["kind"] == "event" and r["event"] in kinds]

    def steps(self) -> list:
        return [r["step"] for r in self.records() if r["kind"] == "step"]

    def state(self) -> str:
        return self.cluster.job(self.id)["JobState"]

    def wait(self, predicate, what: str) -> None:
        self.cluster.wait(predicate, f"job {self.id}: {what}", output=self.output)


def submit(cluster: OneNodeCluster, folder: Path, *options: str) -> SubmittedJob:
    """`sbatch [OPTIONS] deploy/slurm/flexpar.sbatch train.py` from `folder`, two tasks on the node."""
    (folder / "train.py").write_text(TRAIN.format(tests=TESTS, steps=STEPS))
    (folder / "pace").write_text(str(PACE_S))
    environment = cluster.environment(
        HOME=folder / "home", FLEXPAR_PORT=free_port(), FLEXPAR_MAX_DEVICES=4, FLEXPAR_CHECKPOINT_EVERY=1000
    )
    two_tasks = ("--nodes=1", "--ntasks-per-node=2", "--cpus-per-task=1")
    command = ("sbatch", *two_tasks, *options, str(SLURM / "flexpar.sbatch"), "train.py")
    submitted = cluster.run(*command, cwd=folder, environment=environment).stdout
    assert re.fullmatch(r"Submitted batch job \d+\n", submitted), submitted
    return SubmittedJob(cluster, folder, submitted.split()[-1], environment)


@pytest.fixture(scope="module")
def slurm_job(cluster, tmp_path_factory):
    """The five cases on one job (its tasks start once per run: torch's import is most of the cost):
    started; grown by the printed command; the join allocation preempted; requeued, and resumed from
    its checkpoint; cancelled. Returns (job, the join allocation's id)."""
    job = submit(cluster, tmp_path_factory.mktemp("job"), "--requeue")
    job.wait(lambda: job.events("join"), "its second task to join")
    printed = next(line for line in job.output.read_text().splitlines() if "join.sbatch" in line)
    grown = cluster.run(*shlex.split(printed), cwd=job.folder, environment=job.environment).stdout
    join_id = grown.split()[-1]
    job.wait(lambda: len(job.events("join")) == 2, "the join allocation's device to join")
    cluster.run("scancel", "--signal=TERM", join_id)
    job.wait(lambda: job.events("leave"), "the preempted device to leave")
    job.wait(lambda: cluster.job(join_id)["JobState"] not in ("RUNNING", "COMPLETING"), "the join allocation to end")
    cluster.run("scontrol", "requeue", job.id)
    job.wait(lambda: job.events("stop"), "the final checkpoint before the requeue")
    job.wait(lambda: job.state() == "PENDING", "SLURM to requeue it")
    # SLURM holds a requeued job for about two minutes (its BeginTime); the test starts it now.
    cluster.run("scontrol", "update", f"JobId={job.id}", "StartTime=now")
    job.wait(lambda: len(job.events("join")) == 3, "the rerun's second task to join")
    cluster.run("scancel", job.id)
    job.wait(lambda: len(job.events("stop")) == 2, "the cancelled job's final checkpoint")
    job.wait(lambda: job.state() == "CANCELLED", "SLURM to end the cancelled job")
    return job, join_id


def device_set_events(job: SubmittedJob) -> list:
    return [record["event"] for record in job.events(*DEVICE_SET_EVENTS)]


@contextlib.contextmanager
def one_thread():
    """The plain loop on one thread: with torch's default thread count on two busy cores the tiny
    model's reference takes ten times longer (the result is the same)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def assert_checkpoint_is_the_plain_loops(path: str, steps: int) -> None:
    model = pieces.make_model()
    model.load_state_dict(checkpoints.read_checkpoint(path, torch.device("cpu"))["model"])
    with one_thread():
        expected = pieces.reference(pieces.make_job(), steps)
    pieces.assert_same_parameters(model, expected, atol=LONG_RUN_ATOL)


# ------------------------------------------------------------ the cases


def test_sbatch_starts_the_job_and_its_second_task_joins_it(slurm_job, cluster):
    job, _ = slurm_job
    start, first_join = job.events(*DEVICE_SET_EVENTS)[:2]
    assert (start["event"], start["step"], start["devices"]) == ("start", 0, ["local-0"])
    assert first_join["event"] == "join" and len(first_join["devices"]) == 2
    (second_task,) = set(first_join["devices"]) - {"local-0"}
    assert second_task.startswith(f"{cluster.node}-"), "the other task joins from its node"
    port = job.environment["FLEXPAR_PORT"]
    assert f"flexpar: the job listens on {cluster.node}:{port}; add nodes with:" in job.output.read_text()
    secret = job.folder / "home" / ".flexpar" / f"secret-{job.id}"
    assert re.fullmatch(r"[0-9a-f]{32}\n", secret.read_text())
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600 and stat.S_IMODE(secret.parent.stat().st_mode) == 0o700


def test_the_printed_join_command_adds_a_device_that_joins_live(slurm_job):
    job, _ = slurm_job
    first, second = job.events("join")[:2]
    (grown,) = set(second["devices"]) - set(first["devices"])
    assert len(second["devices"]) == 3 and second["step"] > first["step"]
    (leave,) = job.events("leave")
    during = [r for r in job.records() if r["kind"] == "step" and second["step"] <= r["step"] < leave["step"]]
    assert during and all(grown in r["devices"] for r in during), "it trains with the job"


def test_scancel_signal_term_of_the_join_allocation_is_a_planned_leave(slurm_job, cluster):
    job, join_id = slurm_job
    first, second = job.events("join")[:2]
    (grown,) = set(second["devices"]) - set(first["devices"])
    (leave,) = job.events("leave")
    assert leave["detail"] == f"left: {grown}" and grown not in leave["devices"]
    assert not job.events("failure"), "a preempted device leaves; nothing fails"
    fields = cluster.job(join_id)
    assert (fields["JobState"], fields["ExitCode"]) == ("COMPLETED", "0:0")


def test_scontrol_requeue_checkpoints_and_the_requeued_job_resumes_from_it(slurm_job, cluster):
    job, _ = slurm_job
    stop, restart = job.events("stop")[0], job.events("start")[1]
    assert "the driver got SIGTERM" in stop["detail"]
    saved = checkpoints.checkpoint_path(str(job.checkpoints), stop["step"])
    assert stop["detail"].endswith(f"checkpoint {saved}") and os.path.exists(saved)
    assert restart["step"] == stop["step"] and restart["devices"] == ["local-0"]
    assert device_set_events(job) == ["start", "join", "join", "leave", "stop", "start", "join", "stop"]
    last = job.events("stop")[1]["step"]
    assert job.steps() == list(range(last)), "every step is committed once, numbered on across the requeue"
    assert cluster.job(job.id)["Restarts"] == "1"
    output = job.output.read_text()
    assert output.count("flexpar: the job listens on") == 2, "the rerun appends to the job's output file"
    assert f"resuming from step {stop['step']} ({saved})" in output
    assert_checkpoint_is_the_plain_loops(saved, stop["step"])


def test_scancel_stops_the_job_with_a_checkpoint(slurm_job, cluster):
    job, _ = slurm_job
    stop = job.events("stop")[1]
    assert "the driver got SIGTERM" in stop["detail"] and not job.events("failure")
    saved = checkpoints.checkpoint_path(str(job.checkpoints), stop["step"])
    assert stop["detail"].endswith(f"checkpoint {saved}")
    assert cluster.job(job.id)["JobState"] == "CANCELLED"
    assert f"stopped by SIGTERM after step {stop['step']}; checkpoint {saved}; resume with:" in job.output.read_text()
    assert_checkpoint_is_the_plain_loops(saved, stop["step"])
