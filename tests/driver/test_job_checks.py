"""The driver's checkpoint-folder check (flexpar/driver/job_checks.py): the folder is taken with a lock
for the run, so two runs started together into one empty folder cannot both pass it."""

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from flexpar import FitOptions
from flexpar.driver.job_checks import LOCK_NAME, check_checkpoint_folder

HOLD = textwrap.dedent(
    """
    import sys, time
    from flexpar import FitOptions
    from flexpar.driver.job_checks import check_checkpoint_folder
    try:
        lock = check_checkpoint_folder(FitOptions(steps=1, checkpoint_dir=sys.argv[1]))
    except ValueError as error:
        print("refused:", error, flush=True)
        sys.exit(3)
    print("taken", flush=True)
    time.sleep(60)
    """
)


def test_two_fresh_runs_into_one_empty_folder_cannot_both_pass_the_check(tmp_path):
    folder = tmp_path / "ck"
    first = check_checkpoint_folder(FitOptions(steps=1, checkpoint_dir=str(folder)))
    assert first is not None and (folder / LOCK_NAME).exists()
    with pytest.raises(ValueError) as refused:
        check_checkpoint_folder(FitOptions(steps=1, checkpoint_dir=str(folder)))
    message = str(refused.value)
    assert message.startswith(f"checkpoint_dir {folder} is in use by another flexpar run (pid {os.getpid()} on host ")
    # A resume of a folder a live run writes is refused the same way.
    with pytest.raises(ValueError, match="is in use by another flexpar run"):
        check_checkpoint_folder(FitOptions(steps=1, checkpoint_dir=str(folder), resume=True))
    # With --metrics and no checkpoint_dir, the run directory is the folder taken.
    metrics = FitOptions(steps=1, metrics=str(tmp_path / "run" / "metrics.jsonl"))
    held = check_checkpoint_folder(metrics)
    with pytest.raises(ValueError, match=r"the run directory .*run .* is in use by another flexpar run"):
        check_checkpoint_folder(metrics)
    held.release()
    first.release()  # released when the run ends, its file removed: the next run takes the folder
    assert not (folder / LOCK_NAME).exists()
    check_checkpoint_folder(FitOptions(steps=1, checkpoint_dir=str(folder))).release()
    # A fresh run directory (neither option) is no other run's: nothing to take.
    assert check_checkpoint_folder(FitOptions(steps=1)) is None


@pytest.mark.slow  # two Python processes that import torch (main's conftest registers the marker)
def test_of_two_processes_started_together_one_takes_the_folder_and_its_lock_ends_with_it(tmp_path):
    folder = tmp_path / "ck"
    started = [
        subprocess.Popen([sys.executable, "-c", HOLD, str(folder)], stdout=subprocess.PIPE, text=True) for _ in range(2)
    ]
    try:
        lines = [process.stdout.readline() for process in started]
        assert sorted(line.split(":")[0].strip() for line in lines) == ["refused", "taken"], lines
        holder = started[[line.startswith("taken") for line in lines].index(True)]
        assert f"pid {holder.pid} on host" in "".join(lines)
        # Its holder killed outright: the kernel drops the lock, a restarted run takes the folder.
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)
        check_checkpoint_folder(FitOptions(steps=1, checkpoint_dir=str(folder), resume=True)).release()
    finally:
        for process in started:
            process.kill()
            process.wait(timeout=30)
            process.stdout.close()
