"""deploy/: the files that run a flexpar job on a cluster, checked without one.

Kubernetes (deploy/kubernetes): every manifest is validated against the Kubernetes OpenAPI
schemas that the `kubernetes-validate` package bundles (offline, strict: an unknown or misspelt
field is an error), for the oldest and the newest Kubernetes version checked here. A schema
cannot see how the pieces fit together, so the tests also check that: the driver's Service selects
the driver's pod (only) and reaches its port; joiners run `flexpar join` with no address argument
and FLEXPAR_ADDRESS naming that Service and port; the driver runs `flexpar run` with all of
flexpar's flags before the script (its shell wrapper is run with a fake `flexpar` that records
its argv, with and without a checkpoint to resume from); the Secret is mounted where
--secret-file points; pods outlive flexpar's preemption grace after SIGTERM. Command lines are
parsed with flexpar's own argument parser, so a renamed flag breaks these tests.

SLURM (deploy/slurm): `bash -n` on every script, then the per-task wrapper and the sbatch
scripts run with fake `flexpar`, `scontrol` and `srun` on PATH.
"""

from __future__ import annotations

import os
import re
import shlex
import socket
import stat
import subprocess
import threading
import time
from pathlib import Path

import pytest
from conftest import free_port

try:
    import yaml
except ImportError:  # pyyaml comes with the `test` extra; the SLURM tests do not need it
    yaml = None

needs_yaml = pytest.mark.skipif(yaml is None, reason="pyyaml is not installed (pip install -e '.[test]')")

ROOT = Path(__file__).resolve().parent.parent
KUBERNETES = ROOT / "deploy" / "kubernetes"
SLURM = ROOT / "deploy" / "slurm"
DEFAULT_PREEMPTION_GRACE_S = 30.0  # flexpar's --preemption-grace default
OLDEST_KUBERNETES = "1.29"


# ------------------------------------------------------------ helpers


def manifest_files() -> list:
    return sorted(path for path in KUBERNETES.glob("*.yaml") if path.name != "kustomization.yaml")


def load_manifests() -> dict:
    """{(kind, name): document} over every manifest."""
    documents = {}
    for path in manifest_files():
        for document in yaml.safe_load_all(path.read_text()):
            if document:
                documents[(document["kind"], document["metadata"]["name"])] = document
    return documents


def one(kind: str) -> dict:
    found = [document for (k, _), document in load_manifests().items() if k == kind]
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


def pod_spec(workload: dict) -> dict:
    return workload["spec"]["template"]["spec"]


def only_container(workload: dict) -> dict:
    containers = pod_spec(workload)["containers"]
    assert len(containers) == 1
    return containers[0]


def environment(container: dict) -> dict:
    return {variable["name"]: variable.get("value") for variable in container.get("env", [])}


def flexpar_parser():
    from flexpar.cli import build_parser

    return build_parser()


def flags_of(subcommand: str) -> dict:
    """{flag: whether it takes a value} for `flexpar SUBCOMMAND`, from flexpar's own parser."""
    parser = flexpar_parser()
    subparsers = next(action for action in parser._actions if action.choices and subcommand in action.choices)
    return {
        flag: action.nargs != 0 for action in subparsers.choices[subcommand]._actions for flag in action.option_strings
    }


def check_run_command(argv: list, script: str) -> object:
    """argv is `run FLAGS... SCRIPT [SCRIPT ARGS]` with every flexpar flag before the script."""
    assert argv[0] == "run", argv
    arguments = flexpar_parser().parse_args(argv)
    assert arguments.script == script, argv
    flags, position = flags_of("run"), 1
    while argv[position] != script:
        flag = argv[position].split("=")[0]
        assert flag in flags, f"{argv[position]} before the script is not a flexpar flag: {argv}"
        position += 2 if flags[flag] and "=" not in argv[position] else 1
    after = {token.split("=")[0] for token in argv[position + 1 :]}
    assert not after & (set(flags) - {"-h", "--help"}), f"a flexpar flag after the script: {argv}"
    return arguments


FAKE_FLEXPAR = """#!/bin/bash
# Records its arguments (NUL-separated) and the address variable, per SLURM task.
record="$FAKE_RECORD_DIR/flexpar.${SLURM_PROCID:-x}"
printf '%s\\0' "$@" >"$record.argv"
printf '%s' "${FLEXPAR_ADDRESS-<unset>}" >"$record.address"
exit "${FAKE_FLEXPAR_EXIT:-0}"
"""

FAKE_SCANCEL = """#!/bin/bash
# Records its arguments (NUL-separated).
printf '%s\\0' "$@" >"$FAKE_RECORD_DIR/scancel.argv"
"""

FAKE_SCONTROL = """#!/bin/bash
# `scontrol show hostnames LIST`: the nodes of FAKE_NODES, one a line; `scontrol show job ID`: the
# line that names the submitted script (FAKE_SUBMITTED) and its arguments, as SLURM 22.05 prints it.
if [ "$1" = show ] && [ "$2" = hostnames ]; then
    printf '%s\\n' $FAKE_NODES
    exit 0
fi
if [ "$1" = show ] && [ "$2" = job ] && [ -n "${FAKE_SUBMITTED:-}" ]; then
    printf '   WorkDir=%s\\n   Command=%s train.py\\n' "$PWD" "$FAKE_SUBMITTED"
    exit 0
fi
echo "fake scontrol: unexpected $*" >&2
exit 1
"""

FAKE_SRUN = """#!/bin/bash
# Records srun's options, then runs the command once per task (SLURM_NTASKS), one after another.
options=()
while [ "$#" -gt 0 ] && [ "${1#-}" != "$1" ]; do
    options+=("$1")
    shift
done
printf '%s\\0' "${options[@]}" >"$FAKE_RECORD_DIR/srun.options"
for ((task = 0; task < ${SLURM_NTASKS:-1}; task++)); do
    SLURM_PROCID=$task "$@" || exit $?
done
"""


class FakeCluster:
    """A PATH with fake `flexpar`, `scontrol`, `srun` and `scancel`, and what they recorded."""

    def __init__(self, tmp_path: Path, nodes=("node01", "node02")):
        self.tmp_path = tmp_path
        self.bin = tmp_path / "bin"
        self.records = tmp_path / "records"
        self.bin.mkdir(parents=True)
        self.records.mkdir()
        fakes = (("flexpar", FAKE_FLEXPAR), ("scontrol", FAKE_SCONTROL), ("srun", FAKE_SRUN), ("scancel", FAKE_SCANCEL))
        for name, text in fakes:
            path = self.bin / name
            path.write_text(text)
            path.chmod(0o755)
        self.nodes = list(nodes)

    def environment(self, **variables) -> dict:
        # Nothing from the developer's own environment that these scripts or flexpar read.
        base = {
            key: value
            for key, value in os.environ.items()
            if not key.startswith(("FLEXPAR_", "SLURM_", "MASTER_", "PET_"))
        }
        base.update(
            PATH=f"{self.bin}{os.pathsep}{os.environ['PATH']}",
            FAKE_RECORD_DIR=str(self.records),
            FAKE_NODES=" ".join(self.nodes),
            HOME=str(self.tmp_path / "home"),
            SLURM_JOB_NODELIST="node[01-02]",
            FLEXPAR_JOIN_WAIT="0",
        )
        base.update({key: str(value) for key, value in variables.items()})
        return base

    def run(self, command: list, **variables) -> subprocess.CompletedProcess:
        return subprocess.run(
            command, env=self.environment(**variables), cwd=self.tmp_path, capture_output=True, text=True, timeout=60
        )

    def argv(self, task="x") -> list:
        data = (self.records / f"flexpar.{task}.argv").read_bytes()
        return data.decode().split("\0")[:-1]

    def address(self, task="x") -> str:
        return (self.records / f"flexpar.{task}.address").read_text()

    def called(self, task="x") -> bool:
        return (self.records / f"flexpar.{task}.argv").exists()


def flag_value(argv: list, flag: str):
    return argv[argv.index(flag) + 1] if flag in argv else None


# ------------------------------------------------------------ Kubernetes: schema


def schema_versions() -> list:
    validator = pytest.importorskip("kubernetes_validate")
    return sorted({OLDEST_KUBERNETES, validator.latest_version().rsplit(".", 1)[0]})


@needs_yaml
@pytest.mark.parametrize("path", manifest_files(), ids=lambda path: path.name)
def test_manifests_match_the_kubernetes_schema(path):
    validator = pytest.importorskip("kubernetes_validate")
    documents = [document for document in yaml.safe_load_all(path.read_text()) if document]
    assert documents
    for version in schema_versions():
        for document in documents:
            validator.validate(document, version, strict=True)  # raises ValidationError


@needs_yaml
def test_the_validator_rejects_what_kubernetes_would():
    """The schema check is live: a misspelt field and a wrongly typed one are refused."""
    validator = pytest.importorskip("kubernetes_validate")
    joiners = one("Deployment")
    misspelt = yaml.safe_load(yaml.safe_dump(joiners))
    pod_spec(misspelt)["terminationGracePeriod"] = 60
    wrong_type = yaml.safe_load(yaml.safe_dump(joiners))
    wrong_type["spec"]["replicas"] = "two"
    for broken in (misspelt, wrong_type):
        with pytest.raises(validator.ValidationError):
            validator.validate(broken, validator.latest_version(), strict=True)


@needs_yaml
def test_kustomization_lists_the_manifests_but_not_the_example_secret():
    kustomization = yaml.safe_load((KUBERNETES / "kustomization.yaml").read_text())
    assert kustomization["kind"] == "Kustomization"
    listed = set(kustomization["resources"])
    assert all((KUBERNETES / name).exists() for name in listed)
    # Applying the placeholder would overwrite a real secret made with kubectl create secret.
    assert listed == {path.name for path in manifest_files()} - {"secret.example.yaml"}
    assert one("Secret")["metadata"]["name"] == "flexpar-secret"


# ------------------------------------------------------------ Kubernetes: how the pieces fit


@needs_yaml
def test_the_service_reaches_the_driver_pod_and_only_it():
    service, driver, joiners = one("Service"), one("Job"), one("Deployment")
    selector = service["spec"]["selector"]
    driver_labels = driver["spec"]["template"]["metadata"]["labels"]
    joiner_labels = joiners["spec"]["template"]["metadata"]["labels"]
    assert selector.items() <= driver_labels.items()
    assert not selector.items() <= joiner_labels.items()
    assert joiners["spec"]["selector"]["matchLabels"].items() <= joiner_labels.items()
    # The Service's port leads to the driver container's port, which `flexpar run --port` listens on.
    (port,) = service["spec"]["ports"]
    container_ports = {entry.get("name"): entry["containerPort"] for entry in only_container(driver)["ports"]}
    target = port["targetPort"]
    target = container_ports[target] if isinstance(target, str) else target
    assert target in container_ports.values()
    assert str(target) == flag_value(driver_command(tmp=None), "--port")


@needs_yaml
def test_joiners_run_flexpar_join_with_the_address_from_the_environment():
    joiners, service = one("Deployment"), one("Service")
    container = only_container(joiners)
    command = container["command"] + container.get("args", [])
    assert command[:2] == ["flexpar", "join"]
    arguments = flexpar_parser().parse_args(command[1:])
    assert arguments.address is None, "the address comes from FLEXPAR_ADDRESS, not the command line"
    assert arguments.devices >= 1
    assert arguments.script and os.path.isabs(arguments.script)
    variables = environment(container)
    assert variables["FLEXPAR_ADDRESS"] == f"{service['metadata']['name']}:{service['spec']['ports'][0]['port']}"
    # Injected Service variables (a Service named `master` gives MASTER_PORT=tcp://...) are off.
    assert pod_spec(joiners)["enableServiceLinks"] is False
    assert pod_spec(one("Job"))["enableServiceLinks"] is False


DRIVER_CHECKPOINTS = "/ckpt"  # the driver's --checkpoint-dir in driver.yaml


def driver_command(tmp=None, checkpoint_dir=None, **variables) -> list:
    """The argv after `flexpar` that the driver container runs.

    With `tmp`, its shell wrapper really runs, with a fake flexpar, `checkpoint_dir` in place of
    /ckpt and `variables` in its environment; without, the `exec flexpar run ...` line is read
    statically (nothing to resume)."""
    if tmp is None:
        line = re.search(r"exec (flexpar run .*)", driver_script().replace("\\\n", " "), re.S).group(1)
        return shlex.split(line.replace("$resume", ""))[1:]
    return driver_run(tmp, checkpoint_dir, **variables)[0]


def driver_script() -> str:
    container = only_container(one("Job"))
    command = container["command"] + container.get("args", [])
    assert command[:2] == ["/bin/sh", "-c"] and len(command) == 3, command
    return command[2]


def driver_run(tmp, checkpoint_dir, **variables) -> tuple:
    """(argv, stderr) of the driver container's shell wrapper run with a fake flexpar (see driver_command)."""
    script = driver_script()
    assert script.count(DRIVER_CHECKPOINTS) == 2  # where it looks for checkpoints, where it writes them
    cluster = FakeCluster(tmp)
    result = cluster.run(["sh", "-c", script.replace(DRIVER_CHECKPOINTS, str(checkpoint_dir))], **variables)
    assert result.returncode == 0, result.stderr
    return cluster.argv(), result.stderr


@needs_yaml
def test_the_driver_runs_flexpar_run_with_its_flags_before_the_script(tmp_path):
    job = one("Job")
    container = only_container(job)
    static = check_run_command(driver_command(), "train.py")
    assert (Path(container["workingDir"]) / "train.py").as_posix() == "/app/train.py"
    assert static.host == "0.0.0.0", "the driver must listen beyond loopback"
    assert static.devices >= 1 and static.max_devices > static.devices
    mounts = {mount["mountPath"] for mount in container["volumeMounts"]}
    assert static.checkpoint_dir == DRIVER_CHECKPOINTS and DRIVER_CHECKPOINTS in mounts and static.checkpoint_every
    assert job["spec"]["template"]["spec"]["restartPolicy"] in ("Never", "OnFailure")
    assert "backoffLimit" in job["spec"]
    # Run, in a fresh pod (no checkpoint yet): the same command, nothing to resume.
    empty = tmp_path / "ckpt"
    empty.mkdir()
    argv = driver_command(tmp_path / "run", checkpoint_dir=empty)
    running = check_run_command(argv, "train.py")
    assert not running.resume
    assert argv == [str(empty) if token == DRIVER_CHECKPOINTS else token for token in driver_command()]


@needs_yaml
def test_a_restarted_driver_resumes_from_its_checkpoints_and_a_new_job_does_not_resume_anothers(tmp_path):
    """The Job's uid (FLEXPAR_JOB_ID, from the label Kubernetes puts on the Job's pods) is recorded with
    the checkpoints: a restart of the same Job resumes, a new Job into a reused volume does not (and so
    `flexpar run` refuses it, as it refuses any fresh run into a folder with another run's checkpoints)."""
    (variable,) = [v for v in only_container(one("Job"))["env"] if v["name"] == "FLEXPAR_JOB_ID"]
    assert variable["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.labels['batch.kubernetes.io/controller-uid']"
    checkpoints = tmp_path / "ckpt"
    checkpoints.mkdir()
    argv, _ = driver_run(tmp_path / "first", checkpoints, FLEXPAR_JOB_ID="uid-a")
    assert not check_run_command(argv, "train.py").resume
    (checkpoints / "step-100.pt").write_bytes(b"")
    argv, _ = driver_run(tmp_path / "restart", checkpoints, FLEXPAR_JOB_ID="uid-a")
    arguments = check_run_command(argv, "train.py")
    assert arguments.resume and arguments.checkpoint_dir == str(checkpoints)
    for new_job in ({"FLEXPAR_JOB_ID": "uid-b"}, {}):
        argv, stderr = driver_run(tmp_path / f"new{len(new_job)}", checkpoints, **new_job)
        assert not check_run_command(argv, "train.py").resume
        assert "holds the checkpoints of kubernetes uid-a, not of this Job" in stderr
    assert (checkpoints / ".flexpar-job").read_text() == "kubernetes uid-a\n"  # a refused job records nothing
    # Continuing another Job's run on purpose: FLEXPAR_RESUME=1; the folder is then this Job's.
    argv, _ = driver_run(tmp_path / "taken", checkpoints, FLEXPAR_JOB_ID="uid-b", FLEXPAR_RESUME=1)
    assert check_run_command(argv, "train.py").resume
    assert (checkpoints / ".flexpar-job").read_text() == "kubernetes uid-b\n"


@needs_yaml
def test_the_secret_is_mounted_where_secret_file_points():
    secret = one("Secret")
    assert set(secret.get("stringData", secret.get("data", {}))) == {"secret"}
    joiners = one("Deployment")
    joiner_command = only_container(joiners)["command"]
    for workload, argv in ((one("Job"), driver_command(tmp=None)), (joiners, joiner_command)):
        container = only_container(workload)
        path = Path(flag_value(argv, "--secret-file"))
        volumes = {volume["name"]: volume for volume in pod_spec(workload)["volumes"]}
        (mount,) = [mount for mount in container["volumeMounts"] if mount["mountPath"] == str(path.parent)]
        assert mount.get("readOnly") is True
        source = volumes[mount["name"]]["secret"]
        assert source["secretName"] == secret["metadata"]["name"]
        assert {"key": "secret", "path": path.name} in source["items"]


@needs_yaml
def test_pods_outlive_the_preemption_grace_after_sigterm():
    """Kubernetes sends SIGKILL terminationGracePeriodSeconds after SIGTERM: a joiner needs
    longer than flexpar's preemption grace to leave at a step boundary, the driver to stop and
    write its final checkpoint."""
    joiners = one("Deployment")
    command = only_container(joiners)["command"]
    grace = float(flag_value(command, "--preemption-grace") or DEFAULT_PREEMPTION_GRACE_S)
    assert pod_spec(joiners)["terminationGracePeriodSeconds"] > grace
    driver_grace = float(flag_value(driver_command(tmp=None), "--preemption-grace") or DEFAULT_PREEMPTION_GRACE_S)
    assert pod_spec(one("Job"))["terminationGracePeriodSeconds"] > driver_grace


@needs_yaml
def test_pods_name_the_gloo_interface_and_their_cpus():
    for workload in (one("Job"), one("Deployment")):
        container = only_container(workload)
        assert environment(container)["GLOO_SOCKET_IFNAME"] == "eth0"
        resources = container["resources"]
        assert resources["requests"]["cpu"] and resources["limits"]["cpu"]
        assert "ghcr.io/your-org/" in container["image"]  # a placeholder, said to be one


# ------------------------------------------------------------ SLURM


SLURM_SCRIPTS = sorted(SLURM.iterdir())


@pytest.mark.parametrize("path", SLURM_SCRIPTS, ids=lambda path: path.name)
def test_slurm_scripts_parse_and_are_executable(path):
    result = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    assert path.stat().st_mode & stat.S_IXUSR


def test_task_0_runs_the_job_and_the_other_tasks_join_it(tmp_path):
    cluster = FakeCluster(tmp_path)
    secret = tmp_path / "secret"
    common = dict(FLEXPAR_SECRET_FILE=secret, FLEXPAR_PORT=29555, FLEXPAR_MAX_DEVICES=8, FLEXPAR_DEVICES_PER_TASK=2)
    for task in (0, 1):
        result = cluster.run([str(SLURM / "task.sh"), "train.py", "--lr", "0.1"], SLURM_PROCID=task, **common)
        assert result.returncode == 0, result.stderr

    run = cluster.argv(0)
    arguments = check_run_command(run, "train.py")
    assert run[run.index("train.py") :] == ["train.py", "--lr", "0.1"]
    assert arguments.script_arguments == ["--lr", "0.1"]
    assert (arguments.host, arguments.port, arguments.devices, arguments.max_devices) == ("0.0.0.0", 29555, 2, 8)
    assert arguments.secret_file == str(secret)

    join = cluster.argv(1)
    assert join[0] == "join"
    parsed = flexpar_parser().parse_args(join)
    assert parsed.address is None, "the address comes from FLEXPAR_ADDRESS"
    assert (parsed.devices, parsed.secret_file, parsed.script) == (2, str(secret), "train.py")
    assert cluster.address(1) == "node01:29555"  # the allocation's first node


def test_task_0_resumes_when_the_checkpoint_directory_has_this_jobs_checkpoint(tmp_path):
    cluster = FakeCluster(tmp_path)
    checkpoints = tmp_path / "checkpoints"
    checkpoints.mkdir()
    common = dict(SLURM_PROCID=0, SLURM_JOB_ID=4242, FLEXPAR_SECRET_FILE=tmp_path / "secret")
    common.update(FLEXPAR_CHECKPOINT_DIR=checkpoints)
    assert cluster.run([str(SLURM / "task.sh"), "train.py"], **common).returncode == 0
    fresh = check_run_command(cluster.argv(0), "train.py")
    assert fresh.checkpoint_dir == str(checkpoints) and fresh.checkpoint_every and not fresh.resume
    # The metrics file next to the checkpoints: a requeued job continues it (steps numbered on).
    assert fresh.metrics == str(checkpoints / "metrics.jsonl")
    (checkpoints / "step-200.pt").write_bytes(b"")
    assert cluster.run([str(SLURM / "task.sh"), "train.py"], **common).returncode == 0
    assert check_run_command(cluster.argv(0), "train.py").resume


def test_a_new_job_into_a_folder_with_another_jobs_checkpoints_does_not_resume_them(tmp_path):
    """Task 0 records SLURM's job id with the checkpoints: a requeue (same SLURM_JOB_ID) resumes, a new
    job sent into the reused folder runs without --resume (so `flexpar run` refuses it, naming the way on)."""
    cluster = FakeCluster(tmp_path)
    checkpoints = tmp_path / "checkpoints"
    common = dict(SLURM_PROCID=0, FLEXPAR_SECRET_FILE=tmp_path / "secret", FLEXPAR_CHECKPOINT_DIR=checkpoints)
    assert cluster.run([str(SLURM / "task.sh"), "train.py"], SLURM_JOB_ID=4242, **common).returncode == 0
    assert (checkpoints / ".flexpar-job").read_text() == "slurm 4242\n"
    (checkpoints / "step-200.pt").write_bytes(b"")
    for other in ({"SLURM_JOB_ID": 5000}, {}):  # another job; no job id at all
        result = cluster.run([str(SLURM / "task.sh"), "train.py"], **other, **common)
        assert result.returncode == 0, result.stderr
        assert not check_run_command(cluster.argv(0), "train.py").resume
        assert f"{checkpoints} holds the checkpoints of slurm 4242, not of this job" in result.stderr
        assert "FLEXPAR_RESUME=1" in result.stderr
    assert (checkpoints / ".flexpar-job").read_text() == "slurm 4242\n"
    (checkpoints / ".flexpar-job").unlink()  # a folder from before identities were recorded: not taken either
    result = cluster.run([str(SLURM / "task.sh"), "train.py"], SLURM_JOB_ID=4242, **common)
    assert not check_run_command(cluster.argv(0), "train.py").resume
    assert "a job that recorded no identity" in result.stderr
    # On purpose: FLEXPAR_RESUME=1 continues that run, and the folder is this job's from then on.
    result = cluster.run([str(SLURM / "task.sh"), "train.py"], SLURM_JOB_ID=5000, FLEXPAR_RESUME=1, **common)
    assert result.returncode == 0, result.stderr
    assert check_run_command(cluster.argv(0), "train.py").resume
    assert cluster.run([str(SLURM / "task.sh"), "train.py"], SLURM_JOB_ID=5000, **common).returncode == 0
    assert check_run_command(cluster.argv(0), "train.py").resume


@pytest.mark.parametrize("exit_code", [0, 1, 143])
def test_when_task_0_ends_the_steps_other_tasks_get_sigterm(tmp_path, exit_code):
    """Else a task still waiting for the job's port (its script failed at once, or the job finished
    first) would hold the allocation for FLEXPAR_JOIN_WAIT seconds; task 0's exit code stays the task's."""
    cluster = FakeCluster(tmp_path)
    variables = dict(SLURM_PROCID=0, SLURM_NTASKS=2, SLURM_JOB_ID=4242, SLURM_STEP_ID=0, FAKE_FLEXPAR_EXIT=exit_code)
    result = cluster.run([str(SLURM / "task.sh"), "train.py"], FLEXPAR_SECRET_FILE=tmp_path / "secret", **variables)
    assert result.returncode == exit_code, result.stderr
    assert cluster.called(0)
    scancel = (cluster.records / "scancel.argv").read_bytes().decode().split("\0")[:-1]
    assert scancel == ["--quiet", "--signal=TERM", "4242.0"]
    # A job of one task has no one to tell.
    (cluster.records / "scancel.argv").unlink()
    variables["SLURM_NTASKS"] = 1
    result = cluster.run([str(SLURM / "task.sh"), "train.py"], FLEXPAR_SECRET_FILE=tmp_path / "secret", **variables)
    assert result.returncode == exit_code, result.stderr
    assert not (cluster.records / "scancel.argv").exists()


def test_a_joining_task_waits_for_the_jobs_port(tmp_path):
    cluster = FakeCluster(tmp_path, nodes=("127.0.0.1", "127.0.0.2"))
    port = free_port()
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)

    def listen_later():
        time.sleep(1.5)
        listener.bind(("127.0.0.1", port))
        listener.listen()

    thread = threading.Thread(target=listen_later)
    thread.start()
    try:
        started = time.monotonic()
        result = cluster.run(
            [str(SLURM / "task.sh"), "train.py"],
            SLURM_PROCID=1,
            FLEXPAR_PORT=port,
            FLEXPAR_SECRET_FILE=tmp_path / "secret",
            FLEXPAR_JOIN_WAIT=30,
        )
        waited = time.monotonic() - started
    finally:
        thread.join()
        listener.close()
    assert result.returncode == 0, result.stderr
    assert cluster.argv(1)[0] == "join" and cluster.address(1) == f"127.0.0.1:{port}"
    assert 1.0 < waited < 20


def test_flexpar_sbatch_makes_a_secret_runs_the_tasks_and_prints_the_join_command(tmp_path):
    cluster = FakeCluster(tmp_path)
    slurm = dict(SLURM_JOB_ID=4242, SLURM_NTASKS=2, SLURM_CPUS_PER_TASK=8, SLURM_SUBMIT_DIR=tmp_path)
    result = cluster.run(["bash", str(SLURM / "flexpar.sbatch"), "train.py", "--lr", "3e-4"], **slurm)
    assert result.returncode == 0, result.stderr

    secret = tmp_path / "home" / ".flexpar" / "secret-4242"
    assert re.fullmatch(r"[0-9a-f]{32}\n?", secret.read_text())
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600 and stat.S_IMODE(secret.parent.stat().st_mode) == 0o700
    srun_options = (cluster.records / "srun.options").read_bytes().decode().split("\0")[:-1]
    assert "--kill-on-bad-exit=0" in srun_options and "--cpus-per-task=8" in srun_options

    run = check_run_command(cluster.argv(0), "train.py")
    assert run.script_arguments == ["--lr", "3e-4"]
    assert run.secret_file == str(secret) and run.port == 24242  # 20000 + job id % 10000
    assert run.checkpoint_dir == str(tmp_path / "checkpoints" / "4242")
    assert cluster.argv(1)[0] == "join" and cluster.address(1) == "node01:24242"
    assert flag_value(cluster.argv(1), "--secret-file") == str(secret)

    # The printed command adds nodes: join.sbatch with those variables joins every task.
    printed = next(line for line in result.stdout.splitlines() if "join.sbatch" in line).split()
    assert printed[:2] == ["sbatch", f"--export=ALL,FLEXPAR_ADDRESS=node01:24242,FLEXPAR_SECRET_FILE={secret}"]
    exported = dict(item.split("=", 1) for item in printed[1].split("=", 1)[1].split(",")[1:])
    for record in cluster.records.glob("flexpar.*"):
        record.unlink()
    later = cluster.run(
        ["bash", printed[2], *printed[3:]], SLURM_JOB_ID=4243, SLURM_NTASKS=2, SLURM_SUBMIT_DIR=tmp_path, **exported
    )
    assert later.returncode == 0, later.stderr
    for task in (0, 1):
        argv = cluster.argv(task)
        assert argv[0] == "join" and flexpar_parser().parse_args(argv).address is None
        assert flag_value(argv, "--secret-file") == str(secret) and flag_value(argv, "--script") == "train.py"
        assert cluster.address(task) == "node01:24242"


@pytest.mark.parametrize("name", ["flexpar.sbatch", "join.sbatch"])
def test_a_copy_in_slurmds_spool_finds_task_sh_next_to_the_submitted_script(tmp_path, name):
    """sbatch runs a copy of the script from slurmd's spool directory, not the file it was given: task.sh
    is found next to the submitted file (scontrol's Command=), wherever the job was submitted from."""
    cluster = FakeCluster(tmp_path)
    spool = tmp_path / "spool" / "job04242"
    spool.mkdir(parents=True)
    copy = spool / "slurm_script"
    copy.write_text((SLURM / name).read_text())
    submitted_from = tmp_path / "elsewhere"  # no deploy/slurm below it
    submitted_from.mkdir()
    variables = dict(SLURM_JOB_ID=4242, SLURM_NTASKS=1, SLURM_SUBMIT_DIR=submitted_from)
    variables.update(FAKE_SUBMITTED=SLURM / name, FLEXPAR_ADDRESS="node01:24242", FLEXPAR_SECRET_FILE=tmp_path / "s")
    result = cluster.run(["bash", str(copy), "train.py"], **variables)
    assert result.returncode == 0, result.stderr
    assert cluster.called(0)
    if name == "flexpar.sbatch":
        assert f"{SLURM}/join.sbatch train.py" in result.stdout, "the printed command names the real file"
    # Nothing to go by: one line naming the fix, and no task starts.
    (cluster.records / "flexpar.0.argv").unlink()
    variables.pop("FAKE_SUBMITTED")
    result = cluster.run(["bash", str(copy), "train.py"], **variables)
    assert result.returncode == 2 and "FLEXPAR_SLURM_DIR" in result.stderr and not cluster.called(0)


def test_join_sbatch_needs_the_jobs_address(tmp_path):
    cluster = FakeCluster(tmp_path)
    result = cluster.run(
        ["bash", str(SLURM / "join.sbatch"), "train.py"],
        SLURM_NTASKS=1,
        SLURM_SUBMIT_DIR=tmp_path,
        FLEXPAR_SECRET_FILE=tmp_path / "secret",
    )
    assert result.returncode != 0 and "FLEXPAR_ADDRESS" in result.stderr
    assert not cluster.called(0)


# ------------------------------------------------------------ the documentation


def test_the_cluster_page_names_files_that_exist():
    text = (ROOT / "docs" / "cluster.md").read_text()
    assert "## A coordinator that outlives the driver" in text
    named = set(re.findall(r"deploy/(?:kubernetes|slurm)(?:/[\w.-]*\w)?", text))
    assert {"deploy/kubernetes", "deploy/slurm/flexpar.sbatch", "deploy/slurm/join.sbatch"} <= named
    missing = [name for name in named if not (ROOT / name).exists()]
    assert not missing, missing
