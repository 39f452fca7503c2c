"""A generation's process group and the collectives in it: a failure is a `PeerFailure`.

Every collective a device runs goes through `collective` (and an async one's
wait through `wait_for_collective`), so a peer that died or hung surfaces as
one exception the step loop recovers from. `fresh_group` forms a
generation's group; `GroupReaper` tears the old one down off the boundary's
critical path.
"""

from __future__ import annotations

import contextlib
import datetime
import queue
import threading
import time
from typing import Callable, Iterator

import torch.distributed as dist


class PeerFailure(Exception):
    """A collective failed or timed out: a peer died, hung or left unannounced."""


def collective(call):
    """Run `call` (a collective); a RuntimeError from it (gloo, NCCL) is a `PeerFailure`."""
    try:
        return call()
    except RuntimeError as error:  # gloo: connection reset / closed; NCCL: remote error
        raise PeerFailure(str(error)) from error


def wait_for_collective(work, peer_lost=lambda: None) -> None:
    """Wait for a collective; give up early when the coordinator reports a peer dead.

    A killed peer usually surfaces at once as a closed connection, but one that
    dies with data still in its send queue can leave the others waiting for the
    group's timeout. Polling costs at most half a millisecond of latency.
    """
    if work is None:
        return
    while not work.is_completed():
        lost = peer_lost()
        if lost:
            raise PeerFailure(f"peer {lost} is gone (reported by the coordinator)")
        time.sleep(0.0005)
    try:
        work.wait()
    except RuntimeError as error:  # also the process group's timeout for a hung peer
        raise PeerFailure(str(error)) from error


def wait_for_transfers(works, peer_lost=lambda: None) -> None:
    """Wait for point-to-point works (`isend`/`irecv`); give up early when a peer is reported dead.

    Unlike a collective's, a gloo send or receive work reports itself
    completed only inside its own `wait()` (torch 2.13: `is_completed()`
    stays False however long ago the bytes arrived), so
    `wait_for_collective`'s polling would wait forever. Here one thread
    waits for the works in order, blocked in C++ without the GIL, while the
    caller watches for a dead peer. A peer that dies makes the waits fail
    (closed connection) or, at worst, time out with the group; the thread
    then ends on its own, after the caller has moved on.
    """
    works = [work for work in works or () if work is not None]
    if not works:
        return
    finished = threading.Event()
    errors: list = []

    def wait_all() -> None:
        try:
            for work in works:
                work.wait()
        except RuntimeError as error:
            errors.append(error)
        finally:
            finished.set()

    threading.Thread(target=wait_all, name="flexpar-transfer-wait", daemon=True).start()
    while not finished.wait(0.002):  # returns as soon as the works are done
        lost = peer_lost()
        if lost:
            raise PeerFailure(f"peer {lost} is gone (reported by the coordinator)")
    if errors:
        raise PeerFailure(str(errors[0])) from errors[0]


class GroupReaper:
    """Retires process groups at boundaries; one long-lived thread tears them down later.

    Tearing a gloo group down waits for its transport loop to acknowledge
    each closed connection: 20, 30 and 30-45 ms for groups of 2, 3 and 4
    processes on the development machine, mostly blocked with the GIL
    released, but with milliseconds of CPU. A boundary needs neither (the
    next group has its own connections), so `retire` keeps the group's last
    references - the group and `works`, the work handles of the last step
    (`GradientSync.release_works`) - until the caller calls the returned
    `release`. A boundary releases once its members are level: on a host
    whose cores are shared, the teardown's CPU would otherwise stretch the
    boundary's own collectives (about 4 ms of a 10 ms scale-in on the
    development machine).

    `release` only queues the references for this reaper's thread, which
    exists from construction on: starting a thread at every release made
    the releasing member wait for the new thread to start, and then for the
    GIL while that thread began the teardown (up to 5 ms, Python's switch
    interval, in about one boundary in twenty on the development machine).
    An NCCL group is torn down in place: destroying a communicator while the
    next one initialises has not been tried on a GPU.
    """

    def __init__(self) -> None:
        self._retired: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._reap, name="flexpar-retire-group", daemon=True).start()

    def _reap(self) -> None:
        while True:
            references = self._retired.get()
            references.clear()  # the group's teardown runs here
            del references

    def retire(self, works: list) -> Callable[[], None]:
        """Leave the current process group (if any); its teardown waits for the returned release."""
        if not dist.is_initialized():
            return _nothing
        group = dist.group.WORLD
        gloo = dist.get_backend() == "gloo"
        try:
            dist.destroy_process_group()
        except Exception:  # a group broken by a dead peer may fail to tear down cleanly
            pass
        references = [group, works]
        del group, works
        if not gloo:
            references.clear()
            return _nothing
        return lambda: self._retired.put(references)


def _nothing() -> None:
    pass


@contextlib.contextmanager
def fresh_group(
    release_old_group: Callable[[], None], backend: str, store, rank: int, world_size: int, timeout_s: float
) -> Iterator[None]:
    """A new process group for the block; the old one (retired by `GroupReaper.retire`) released at its end.

    A boundary forms the new group, brings its members level inside the
    block, and only then lets the old group's teardown take CPU; the old
    group is released on an error too. A failure to form the group is a
    `PeerFailure` (a peer died or never came).
    """
    try:
        # A generation of one device has nothing to sum, and its steps call no collective
        # (they check the world size): no group, whose gloo transport thread would wake
        # 100 times a second on cores the device computes on.
        if world_size > 1:
            collective(
                lambda: dist.init_process_group(
                    backend,
                    store=store,
                    rank=rank,
                    world_size=world_size,
                    timeout=datetime.timedelta(seconds=timeout_s),
                )
            )
        yield
    finally:
        release_old_group()
