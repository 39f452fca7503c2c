"""retire_group: leaving a process group at a boundary without waiting for its teardown.

These run a one-member gloo group inside the test process: the point is where
the last references are dropped, which does not need peers.
"""

import threading

import torch
import torch.distributed as dist

from flexpar import state as training_state
from flexpar.sync import retire_group


class _DropWitness:
    """Records the thread that releases it: there the group's teardown runs too."""

    def __init__(self, released: list, done: threading.Event):
        self.released, self.done = released, done

    def __del__(self):
        self.released.append(threading.current_thread().name)
        self.done.set()


def _form(name: str) -> None:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1, group_name=name)


def test_last_references_are_dropped_off_the_calling_thread():
    _form("retire-test-1")
    work = dist.all_reduce(torch.ones(4), async_op=True)
    work.wait()
    released, done = [], threading.Event()
    retire_group([work, _DropWitness(released, done)])
    del work
    assert not dist.is_initialized()
    assert done.wait(timeout=10)
    assert released == ["flexpar-retire-group"]
    # The next group forms and works while (or after) the old one is torn down.
    _form("retire-test-2")
    total = torch.ones(3)
    dist.all_reduce(total)
    assert total.tolist() == [1.0, 1.0, 1.0]
    retire_group([])
    assert not dist.is_initialized()


def test_retire_without_a_group_does_nothing():
    assert not dist.is_initialized()
    retire_group([])
    assert not dist.is_initialized()


def test_latest_commit_of_one_member_is_its_own():
    assert training_state.latest_commit(1234.5, 1, "cpu") == 1234.5
