"""The session-end check finds the suite's leftover processes (orphans too) and nobody else's."""

import os
import signal
import subprocess
import sys
import time

import processes
import pytest
from processes import Process

ME, OURS, THEIRS = 100, "100-ours", "200-theirs"


def test_the_suites_leftovers_are_found_and_nobody_elses():
    table = {
        1: Process(0, "/sbin/init", "init"),
        ME: Process(1, "python -m pytest tests", "python", None),
        101: Process(ME, "python -c from multiprocessing.forkserver import main; main(...)", "python", OURS),
        102: Process(101, "python -c from multiprocessing.forkserver import main; main(...)", "python", OURS),
        103: Process(1, "python benchmarks/soak_job.py spec.json", "python", OURS),
        104: Process(103, "python -c from multiprocessing.forkserver import main; main(...)", "python", OURS),
        105: Process(1, "python -m flexpar run train.py", "python", OURS),
        106: Process(ME, "python -c from multiprocessing.resource_tracker import main; main(7)", "python", OURS),
        107: Process(ME, "python -m flexpar status", "python", None),  # its own environment
        108: Process(ME, "python .../torch/_inductor/compile_worker/__main__.py", "python", OURS),
        109: Process(108, "python .../torch/_inductor/compile_worker/__main__.py", "python", OURS),
        # Other people's: another session's orphaned driver, a run with no marker, an unreadable one.
        201: Process(1, "python benchmarks/soak_job.py spec.json", "python", THEIRS),
        202: Process(201, "python -c from multiprocessing.forkserver import main; main(...)", "python", THEIRS),
        203: Process(1, "python -m flexpar run train.py", "python", None),
        204: Process(203, "pt_data_worker", "pt_data_worker", None),
    }
    found = [pid for pid, _, _ in processes.strays(table, ME, OURS)]
    # 101 is this process's fork server and 106 its resource tracker (they end with it), 108-109
    # torch's compile pool; 102 is a worker the fork server forked, 103-105 an orphaned soak driver
    # and `python -m flexpar` with its workers, 107 a child started with an environment of its own.
    assert found == [102, 103, 104, 105, 107]


def _orphan(environment):
    """A sleeping grandchild whose parent has exited (re-parented away from this process); its pid."""
    code = (
        "import subprocess, sys; child = subprocess.Popen([sys.executable, '-c', 'import time; "
        "time.sleep(120)'], start_new_session=True, stdin=subprocess.DEVNULL, "
        "stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL); print(child.pid)"
    )
    return int(
        subprocess.run(
            [sys.executable, "-c", code], env=environment, capture_output=True, text=True, check=True, timeout=60
        ).stdout
    )


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc")
def test_a_real_orphan_is_found_by_its_marker_and_a_strangers_is_not():
    session = os.environ[processes.SESSION_VARIABLE]
    stranger_environment = {key: value for key, value in os.environ.items() if key != processes.SESSION_VARIABLE}
    ours = _orphan(dict(os.environ))
    theirs = _orphan({**stranger_environment, processes.SESSION_VARIABLE: "another-session"})
    unmarked = _orphan(stranger_environment)
    try:
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline:  # the middle process has exited; wait for re-parenting
            table = processes.table()
            if all(pid in table and table[pid].parent != os.getpid() for pid in (ours, theirs, unmarked)):
                break
            time.sleep(0.1)
        found = {pid for pid, _, _ in processes.strays(table, os.getpid(), session)}
        assert ours in found
        assert theirs not in found and unmarked not in found
    finally:
        for pid in (ours, theirs, unmarked):  # the three this test started
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
