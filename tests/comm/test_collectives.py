"""GroupReaper and fresh_group: replacing the process group at a boundary, the old one's teardown released
later; take_stock.

These run a one-member gloo group inside the test process: the point is where
the last references are dropped, which does not need peers.
"""

import contextlib
import threading

import pytest
import torch
import torch.distributed as dist

from flexpar.comm import state_transfer as training_state
from flexpar.comm.collectives import GroupReaper, PeerFailure, fresh_group, wait_for_transfers


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
    reaper = GroupReaper()
    release = reaper.retire([work, _DropWitness(released, done)])
    del work
    assert not dist.is_initialized()
    # Kept until the boundary says so: nothing else holds the witness.
    assert released == []
    release()
    assert done.wait(timeout=10)
    assert released == ["flexpar-retire-group"]
    # The next group forms and works while (or after) the old one is torn down.
    _form("retire-test-2")
    total = torch.ones(3)
    dist.all_reduce(total)
    assert total.tolist() == [1.0, 1.0, 1.0]
    reaper.retire([])()
    assert not dist.is_initialized()


def test_retire_without_a_group_does_nothing():
    assert not dist.is_initialized()
    GroupReaper().retire([])()
    assert not dist.is_initialized()


@pytest.mark.parametrize("block_fails", [False, True])
def test_fresh_group_releases_the_old_one_when_its_block_ends(block_fails):
    _form(f"fresh-old-{block_fails}")
    released, done = [], threading.Event()
    with pytest.raises(ZeroDivisionError) if block_fails else contextlib.nullcontext():
        reaper = GroupReaper()
        with fresh_group(reaper.retire([_DropWitness(released, done)]), "gloo", dist.HashStore(), 0, 1, timeout_s=10):
            # One member has nothing to sum: no group (its gloo thread would wake 100 times a second).
            assert not dist.is_initialized()
            assert released == []  # the old group waits for the block's end
            if block_fails:
                1 / 0  # noqa: B018  (the block fails on purpose)
    assert done.wait(timeout=10) and released == ["flexpar-retire-group"]
    assert not dist.is_initialized()
    reaper.retire([])()


def test_fresh_group_that_cannot_form_is_a_peer_failure():
    _form("fresh-old-failing")
    released, done = [], threading.Event()
    with pytest.raises(PeerFailure):
        # A second member that never comes: the rendezvous times out.
        with fresh_group(
            GroupReaper().retire([_DropWitness(released, done)]), "gloo", dist.HashStore(), 0, 2, timeout_s=1
        ):
            pass
    assert done.wait(timeout=10)  # the old group is released on the failure too
    assert not dist.is_initialized()


def _with_no_stream(slots: list) -> list:
    """take_stock's first three groups of slots, with the streamed join's three (none reported)."""
    return list(slots) + [0.0] * len(slots)


def test_stock_of_one_member_is_its_own():
    stock = training_state.take_stock(7, 1234.5, 0, 1, "cpu")
    assert stock == training_state.Stock(source=0, receivers=(), latest_step=7, last_commit_wall=1234.5)


def test_stock_of_a_joiner_alone_keeps_its_wall():
    # A joiner (no commit) does not count towards the last commit; alone, its own time stands.
    stock = training_state.take_stock(-1, 99.0, 0, 1, "cpu")
    assert stock.latest_step == -1 and stock.last_commit_wall == 99.0


def test_stock_source_is_the_lowest_rank_with_the_latest_step():
    # Ranks 0 and 2 committed step 5, rank 1 only step 4 (a failure mid-sync), rank 3 joins.
    slots = [6.0, 5.0, 6.0, 0.0] + [100.0, 90.0, 101.5, 0.0] + [0.0] * 4
    stock = training_state.stock_of(_with_no_stream(slots), own_wall=50.0)
    assert stock == training_state.Stock(
        source=0, receivers=(1, 3), latest_step=5, last_commit_wall=101.5, joiners=(3,)
    )


def test_stock_of_members_level_has_no_receivers():
    stock = training_state.stock_of(_with_no_stream([3.0, 3.0, 10.0, 12.0, 0.0, 0.0]), own_wall=0.0)
    assert stock.receivers == () and stock.source == 0 and stock.last_commit_wall == 12.0


def test_stock_before_the_first_step_names_the_members_whose_start_differs_from_the_source():
    # Ranks 0-2 hold the untrained model (step 0); rank 2's factory built other values; rank 3 joins
    # (it receives the source's state anyway and reports no digest).
    slots = [1.0, 1.0, 1.0, 0.0] + [5.0, 5.0, 5.0, 0.0] + [7.0, 7.0, 9.0, 0.0]
    stock = training_state.stock_of(_with_no_stream(slots), own_wall=0.0)
    assert stock.source == 0 and stock.receivers == (3,) and stock.differing == (2,)
    # A deterministic factory: every start the same, nothing to send.
    assert training_state.stock_of(_with_no_stream([1.0, 1.0] + [5.0, 5.0] + [7.0, 7.0]), own_wall=0.0).differing == ()
    # After the first step nobody reports: nothing to compare.
    assert training_state.stock_of(_with_no_stream([2.0, 2.0, 5.0, 5.0, 0.0, 0.0]), own_wall=0.0).differing == ()


# ------------------------------------------------------------ the statistics' sum across two devices

# Per device: a total token count above 2**24 that float32 cannot hold (2**24 + 1), and fractional
# ones. One device's float64 sum is what every device set must reproduce.
_STATS = ([2.0**24 + 1, 0.1, 5.0], [2.0, 0.2, 7.0])


def _sum_stats(rank: int, port: int, folder: str) -> None:
    """One of two gloo processes: finish() a step of a float32 model with and without `exact_stats`."""
    import os

    from torch import nn

    from flexpar.comm.gradient_sync import GradientSync

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    model = nn.Linear(3, 2)
    sync = GradientSync(model, "cpu")
    sync.start_generation(2)
    results = {}
    for exact in (False, True):
        sync.exact_stats = exact
        sync.reset()
        model.zero_grad(set_to_none=True)
        model(torch.ones(1, 3) * (rank + 1)).sum().backward()
        results[exact] = sync.finish(torch.tensor(_STATS[rank], dtype=torch.float64)).tolist()
        results[f"grad {exact}"] = model.weight.grad.tolist()
    torch.save(results, os.path.join(folder, f"{rank}.pt"))
    dist.destroy_process_group()


def test_exact_statistics_are_summed_in_float64_across_devices(tmp_path):
    """`exact_stats` (token-weighted losses): the summed counts are the float64 sums, bit for bit.
    Without it the statistics ride in the float32 bucket, which rounds them (why counts need it)."""
    import socket

    import torch.multiprocessing as torch_multiprocessing

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    torch_multiprocessing.spawn(_sum_stats, args=(port, str(tmp_path)), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"{rank}.pt") for rank in range(2)]
    expected = [a + b for a, b in zip(*_STATS)]
    assert ranks[0][True] == ranks[1][True] == expected
    assert ranks[0][False] != expected, "float32 rounds 2**24 + 3 and 0.1 + 0.2"
    assert ranks[0][False][2] == 12.0, "small whole numbers (VW counts, flags) are exact either way"
    # The gradients are summed alike on both paths: only where the statistics travel changed.
    assert ranks[0]["grad True"] == ranks[0]["grad False"] == ranks[1]["grad True"] == [[3.0] * 3] * 2


class _PointToPointWork:
    """Like a gloo send/receive work: completed only once `wait()` returned, never before."""

    def __init__(self, finished: threading.Event, error: str = ""):
        self.finished, self.error, self.waited = finished, error, False

    def is_completed(self):
        return self.waited

    def wait(self):
        self.finished.wait()
        if self.error:
            raise RuntimeError(self.error)
        self.waited = True
        return True


def test_wait_for_transfers_returns_when_the_works_finish():
    finished = threading.Event()
    works = [_PointToPointWork(finished), _PointToPointWork(finished)]
    threading.Timer(0.05, finished.set).start()
    wait_for_transfers(works, peer_lost=lambda: None)
    assert all(work.waited for work in works)


def test_wait_for_transfers_gives_up_when_a_peer_is_reported_dead():
    finished = threading.Event()
    calls = []

    def peer_lost():
        calls.append(1)
        return "local-2" if len(calls) > 3 else None

    with pytest.raises(PeerFailure, match="local-2 is gone"):
        wait_for_transfers([_PointToPointWork(finished)], peer_lost)
    finished.set()  # lets the waiting thread end


def test_wait_for_transfers_turns_a_transport_error_into_a_peer_failure():
    finished = threading.Event()
    finished.set()
    with pytest.raises(PeerFailure, match="Connection closed by peer"):
        wait_for_transfers([_PointToPointWork(finished, error="Connection closed by peer")])
