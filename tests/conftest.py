"""Shared fixtures: every multi-process test goes through `train`, which runs a real
job (worker processes over gloo) with a time limit and always cleans up: fit()
kills its workers when it returns or raises, and the fixture checks none is left."""

import multiprocessing
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time

import processes
import pytest

# ------------------------------------------------------------ the edit loop's tier

# Modules whose every test starts processes (a job, a `flexpar` command, a real cluster): slow.
_SLOW_FOLDERS = ("end_to_end",)
_SLOW_MODULES = (
    "test_cli.py",
    "test_recipes.py",
    "test_join.py",
    "test_join_start.py",
    "test_fork_server.py",
    "test_examples.py",
    "test_tiny_lm_variable.py",
    "test_trackers.py",
    "test_worker.py",
    "test_job.py",
    "test_user_errors.py",
    "test_sparse_sync.py",
    "test_collectives.py",
)
# Fixtures that start training processes: a test that takes one is slow wherever it is.
_SLOW_FIXTURES = ("train", "command_line_job")


def pytest_collection_modifyitems(config, items):
    """Mark `slow` what starts training processes (by folder, module or fixture), so that
    `pytest -m "not slow"` is a tier of a few minutes for an edit loop; CI runs everything."""
    for item in items:
        path = item.path
        if (
            path.parent.name in _SLOW_FOLDERS
            or path.name in _SLOW_MODULES
            or any(name in _SLOW_FIXTURES for name in getattr(item, "fixturenames", ()))
        ):
            item.add_marker(pytest.mark.slow)


@pytest.fixture
def train(tmp_path):
    """train(job, steps=..., devices=..., **options) -> (model, summary), metrics in tmp_path."""

    def run(job, **options):
        options.setdefault("metrics", str(tmp_path / "metrics.jsonl"))
        options.setdefault("display", False)
        options.setdefault("quiet", True)
        options.setdefault("oversubscribe", True)
        options.setdefault("timeout_s", 10.0)
        return job.fit(**options)

    yield run
    leftovers = [child for child in multiprocessing.active_children() if child.name.startswith("flexpar-")]
    for child in leftovers:
        child.kill()
    assert not leftovers, f"worker processes left running: {[c.name for c in leftovers]}"


@pytest.fixture
def metrics_file(tmp_path):
    return tmp_path / "metrics.jsonl"


TESTS = os.path.dirname(os.path.abspath(__file__))


def _sigint_as_default() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class CommandLineJob:
    """A `flexpar run` in its own process group; its banner gives the address and the secret file.

    `arguments`: a whole command line after `flexpar` instead (a job's resume command, restarting
    its driver); `outputs`: the name its stdout/stderr files take (stdout-NAME.txt), one per driver.
    """

    def __init__(self, tmp_path, flags, script_body, name="train.py", arguments=None, outputs=""):
        self.script = tmp_path / name
        if arguments is None:
            self.script.write_text(
                textwrap.dedent(f"""
                import sys
                sys.path.insert(0, {TESTS!r})
                import pieces
            """)
                + textwrap.dedent(script_body)
            )
            arguments = ["run", *flags, str(self.script)]
        suffix = f"-{outputs}" if outputs else ""
        self.stdout_path, self.stderr_path = tmp_path / f"stdout{suffix}.txt", tmp_path / f"stderr{suffix}.txt"
        self.process = subprocess.Popen(
            [sys.executable, "-m", "flexpar", *arguments],
            stdout=open(self.stdout_path, "w"),
            stderr=open(self.stderr_path, "w"),
            cwd=tmp_path,
            start_new_session=True,
            # Ctrl-C as a terminal sends it, whoever started the suite: a shell's background job (`cmd &`)
            # starts with SIGINT ignored, and a Python started so keeps it ignored, so the job would never
            # see the tests' SIGINT.
            preexec_fn=_sigint_as_default,
        )
        self.address = self.secret_file = None

    def wait_for_banner(self, timeout_s=60.0):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            match = re.search(r"job at (\S+?);.*secret( in (\S+)|: the one you gave)", self.stdout_path.read_text())
            if match:
                self.address = match.group(1)
                self.secret_file = os.path.join(self.stdout_path.parent, match.group(3)) if match.group(3) else None
                return self
            assert self.process.poll() is None, self.stderr_path.read_text()
            time.sleep(0.1)
        raise AssertionError("no banner within the time limit:\n" + self.stderr_path.read_text())

    def wait(self, timeout_s=120.0):
        """The driver's exit code; past the time limit, a failure that shows its stderr, with every one of
        its threads' stacks (`flexpar run` prints them on SIGUSR1), so that a hang says where it waits."""
        try:
            return self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            try:
                os.kill(self.process.pid, signal.SIGUSR1)
                time.sleep(1.0)
            except ProcessLookupError:
                pass
            raise AssertionError(
                f"the job did not end within {timeout_s} s; its stderr, then its threads' stacks:\n"
                + self.stderr_path.read_text()[-20000:]
            ) from None

    def output(self):
        return self.stdout_path.read_text(), self.stderr_path.read_text()

    def kill_all(self):
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait(timeout=30)


def free_port() -> int:
    """A TCP port free on the loopback now (a job's coordinator binds it next)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def wait_for(predicate, what, timeout_s=90.0, poll_s=0.05):
    """Poll `predicate` until it holds; AssertionError naming `what` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(poll_s)
    raise AssertionError(f"timed out waiting for {what}")


def flexpar_command(*arguments, timeout_s=60.0, environment=None, cwd=None):
    """Run `python -m flexpar ARGUMENTS` to its end."""
    return subprocess.run(
        [sys.executable, "-m", "flexpar", *arguments],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env=environment,
        cwd=cwd,
    )


@pytest.fixture
def command_line_job(tmp_path):
    """command_line_job(flags, script_body) -> CommandLineJob; every process it started is killed after.

    `arguments=[...]` runs that command line after `flexpar` instead (a job's resume command)."""
    jobs = []

    def start(flags, script_body, name="train.py", arguments=None, outputs=""):
        job = CommandLineJob(tmp_path, list(flags), script_body, name, arguments, outputs)
        jobs.append(job)
        return job

    yield start
    for job in jobs:
        job.kill_all()


# ------------------------------------------------------------ no process outlives the suite

# Set at import, before any test starts a process: the suite's processes carry it
# (tests/processes.py), whoever their parent is by the end.
_SESSION = processes.mark_this_session()


@pytest.fixture(scope="session", autouse=True)
def no_process_outlives_the_suite():
    if not os.path.isdir("/proc"):
        yield
        return
    yield
    deadline = time.monotonic() + 15.0
    strays = processes.strays(processes.table(), os.getpid(), _SESSION)
    while strays and time.monotonic() < deadline:
        time.sleep(0.5)
        strays = processes.strays(processes.table(), os.getpid(), _SESSION)
    for pid, _, _ in strays:  # the suite's own processes only (processes.strays)
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert not strays, f"processes left running after the test session: {strays}"
