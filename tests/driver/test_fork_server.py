"""How worker processes start (flexpar/driver/fork_server.py `worker_context`): glibc's tunables for their memory,
and SIGTERM, which the fork server holds off and its children get back.

The equivalence of the training itself is covered by test_equivalence.py and
test_elastic.py; these pin the allocator settings every worker inherits from
the fork server, and what they are for.
"""

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from flexpar.driver.fork_server import _sigterm_held, worker_context, worker_malloc_tunables

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc and /proc: Linux only")

# A 16-VW step of benchmarks/overhead.py's MLP after one-VW steps, in one process as keep_freed_memory leaves it;
# prints how far the peak resident memory rose (MiB).
ACCUMULATION = """
import torch
from torch import nn
from flexpar.worker.process import keep_freed_memory

keep_freed_memory()
torch.set_num_threads(1)
torch.manual_seed(0)


def peak_mib():
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmHWM")) / 1024


model = nn.Sequential(nn.Linear(1024, 2048), nn.ReLU(), nn.Linear(2048, 2048), nn.ReLU(),
                      nn.Linear(2048, 2048), nn.ReLU(), nn.Linear(2048, 10))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
inputs, labels = torch.randn(4, 1024), torch.randint(0, 10, (4,))


def step(virtual_workers):
    for _ in range(virtual_workers):
        (nn.functional.cross_entropy(model(inputs), labels) / virtual_workers).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


for _ in range(2):
    step(1)
one = peak_mib()
for _ in range(4):
    step(16)
print(peak_mib() - one)
"""


def test_the_workers_tunables_turn_the_per_thread_cache_off():
    assert worker_malloc_tunables(None) == "glibc.malloc.tcache_count=0"
    assert worker_malloc_tunables("") == "glibc.malloc.tcache_count=0"


def test_the_users_own_tunables_are_kept():
    assert worker_malloc_tunables("glibc.malloc.arena_max=2") == "glibc.malloc.arena_max=2:glibc.malloc.tcache_count=0"
    # Their own choice of the cache wins.
    assert worker_malloc_tunables("glibc.malloc.tcache_count=7") == "glibc.malloc.tcache_count=7"


@linux_only
def test_a_worker_inherits_the_tunables_and_the_driver_keeps_its_environment():
    before = os.environ.get("GLIBC_TUNABLES")
    context = worker_context()
    assert os.environ.get("GLIBC_TUNABLES") == before
    child = context.Process(target=time.sleep, args=(30,))
    child.start()
    try:
        with open(f"/proc/{child.pid}/environ", "rb") as environ:
            variables = dict(entry.split(b"=", 1) for entry in environ.read().split(b"\0") if b"=" in entry)
    finally:
        child.kill()
        child.join(timeout=30)
    assert b"glibc.malloc.tcache_count=0" in variables.get(b"GLIBC_TUNABLES", b"")


@linux_only
def test_with_the_workers_tunables_more_vws_cost_one_gradients_memory():
    """Accumulating 16 VWs instead of 1 keeps one more layer gradient alive at the peak, 16 MiB (the
    2048x2048 layer's, as torch.profiler shows); with the workers' tunables the peak rises by that.
    With glibc's defaults here it rose by 64 MiB: the freed gradients' holes were pinned by crumbs."""
    environment = {**os.environ, "GLIBC_TUNABLES": worker_malloc_tunables(os.environ.get("GLIBC_TUNABLES"))}
    run = subprocess.run(
        [sys.executable, "-c", ACCUMULATION], capture_output=True, text=True, timeout=120, env=environment
    )
    assert run.returncode == 0, run.stderr
    risen_mib = float(run.stdout.split()[-1])
    assert risen_mib <= 16 + 4, f"the peak rose by {risen_mib:.1f} MiB for one 16 MiB gradient"


def _signal_masks(pid: int) -> dict:
    """{"SigBlk": mask, "SigIgn": mask} of process `pid` (bit N-1 for signal N), from /proc."""
    with open(f"/proc/{pid}/status") as status:
        fields = dict(line.split(":", 1) for line in status if ":" in line)
    return {name: int(fields[name].strip(), 16) for name in ("SigBlk", "SigIgn")}


SIGTERM_BIT = 1 << (signal.SIGTERM - 1)


def _say_running_then_sleep(running) -> None:
    running.set()
    time.sleep(30)


def test_a_sigterm_while_the_fork_server_starts_waits_for_its_handler():
    """SIGTERM to a driver or joiner in the instant it starts its fork server is delivered afterwards,
    to its own handler (a scale-down at that moment must not be lost: the joiner would start its devices)."""
    received = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: received.append(signum))
    # A driver has other threads (torch's, the store's) that do not block SIGTERM: the kernel hands a
    # SIGTERM to the process to one of them. One such thread here, as in a driver.
    other_thread_stop = threading.Event()
    other_thread = threading.Thread(target=other_thread_stop.wait, daemon=True)
    other_thread.start()
    try:
        with _sigterm_held():
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.2)  # time for the kernel to deliver it (to the other thread)
            held = list(received)
        assert held == [] and received == [signal.SIGTERM]
    finally:
        signal.signal(signal.SIGTERM, previous)
        other_thread_stop.set()


@linux_only
def test_the_fork_server_holds_sigterm_off_and_its_children_get_it_back():
    """The fork server blocks and ignores SIGTERM (a whole host's must not take it down); a worker starts
    with neither, so a SIGTERM its launcher passes on the instant it learns the pid ends it."""
    from multiprocessing import forkserver

    context = worker_context()
    running = context.Event()
    child = context.Process(target=_say_running_then_sleep, args=(running,))
    child.start()
    try:
        assert running.wait(timeout=60), "the child did not start"
        # Read once a child runs: the server ignores SIGTERM from its preload on (blocked from its start).
        server = _signal_masks(forkserver._forkserver._forkserver_pid)
        assert server["SigBlk"] & SIGTERM_BIT and server["SigIgn"] & SIGTERM_BIT, server
        masks = _signal_masks(child.pid)
        child.terminate()  # SIGTERM
        child.join(timeout=30)
    finally:
        if child.is_alive():
            child.kill()
    assert not masks["SigBlk"] & SIGTERM_BIT and not masks["SigIgn"] & SIGTERM_BIT, masks
    assert child.exitcode == -signal.SIGTERM
