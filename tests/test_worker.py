"""The worker's rules for a planned leaver: skip the last update, exit at the lowest priority.

The leave itself (parameters equal to the reference after every scale-in) is
covered by test_elastic.py; these pin the rule and the priority change.
"""

import subprocess
import sys
from types import SimpleNamespace

from flexpar.worker import Worker


def _device(device_id: str, rank: int):
    return SimpleNamespace(rank=rank, args=SimpleNamespace(device_id=device_id))


def test_a_leaver_that_is_not_rank_0_skips_its_last_update():
    upcoming = {"members": ["local-0", "local-1"]}
    assert Worker._skips_last_update(_device("local-2", rank=2), upcoming)


def test_rank_0_commits_even_when_it_leaves():
    # It publishes the step's record and writes checkpoints.
    assert not Worker._skips_last_update(_device("local-0", rank=0), {"members": ["local-1", "local-2"]})


def test_a_survivor_commits():
    assert not Worker._skips_last_update(_device("local-1", rank=1), {"members": ["local-0", "local-1"]})


def test_a_leaver_exits_at_the_lowest_cpu_priority():
    code = "import os; from flexpar.worker import _yield_cores; _yield_cores(); print(os.nice(0))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert result.stdout.strip() == "19"
