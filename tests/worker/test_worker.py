"""The worker's rules for a planned leaver: skip the last update, exit at the lowest priority.

The leave itself (parameters equal to the reference after every scale-in) is
covered by test_elastic.py; these pin the rule and the priority change.
"""

import subprocess
import sys
from types import SimpleNamespace

from flexpar.worker.step_loop import StepLoop


def _device(device_id: str, rank: int, shards=None):
    return SimpleNamespace(
        membership=SimpleNamespace(rank=rank), args=SimpleNamespace(device_id=device_id), shards=shards
    )


def test_a_leaver_that_is_not_rank_0_skips_its_last_update():
    upcoming = {"members": ["local-0", "local-1"]}
    assert StepLoop._skips_last_update(_device("local-2", rank=2), upcoming)


def test_a_sharded_leaver_commits_its_last_update():
    # It holds parts of the optimizer state that it hands over at the boundary.
    upcoming = {"members": ["local-0", "local-1"]}
    assert not StepLoop._skips_last_update(_device("local-2", rank=2, shards=object()), upcoming)


def test_rank_0_commits_even_when_it_leaves():
    # It publishes the step's record and writes checkpoints.
    assert not StepLoop._skips_last_update(_device("local-0", rank=0), {"members": ["local-1", "local-2"]})


def test_a_survivor_commits():
    assert not StepLoop._skips_last_update(_device("local-1", rank=1), {"members": ["local-0", "local-1"]})


def test_a_leaver_exits_at_the_lowest_cpu_priority():
    code = "import os; from flexpar.worker.host import yield_cores; yield_cores(); print(os.nice(0))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert result.stdout.strip() == "19"


CHURN = """
import resource, sys, torch
from flexpar.worker.process import keep_freed_memory
applied = keep_freed_memory()

def churn():  # three 16 MB buffers allocated, written and freed: a backward's weight gradients
    for tensor in [torch.empty(4 << 20) for _ in range(3)]:
        tensor.fill_(1.0)

churn()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    churn()
print(applied, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def test_a_worker_keeps_the_memory_a_step_frees_for_the_next():
    """After keep_freed_memory (what every worker process runs first), memory that is freed and
    allocated again is reused, not faulted in afresh: 20 more rounds of three 16 MB buffers take
    fewer page faults than one round's pages (12,288). With glibc's defaults the same rounds took
    16,000-245,000 here (its thresholds move with what was freed before)."""
    if not sys.platform.startswith("linux"):
        import pytest

        pytest.skip("glibc's mallopt and page-fault counts: Linux only")
    run = subprocess.run([sys.executable, "-c", CHURN], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    applied, faults = run.stdout.split()
    if applied != "True":
        import pytest

        pytest.skip("not glibc: keep_freed_memory changes nothing")
    assert int(faults) < 3 * 4096, f"{faults} page faults: freed buffers were returned to the OS"
