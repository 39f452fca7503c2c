"""How flexpar's worker processes start: forked from a fork server that has imported torch once.

The fork server's environment carries what every worker needs from its first
instruction on (glibc's allocator tunables, torch's C++ log level), set only
while the server starts, so the driver's own environment stays as it was; the
server holds SIGTERM off (blocked and ignored), and its children get it back
(flexpar.driver.forkserver_preload).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import threading
from typing import Optional


def worker_context(verbose: bool = False):
    """How worker processes start: a fork server that has imported torch once.

    Each worker is forked from that server (single-threaded, CUDA untouched),
    so it skips the seconds of `import torch` and still imports the user's
    script afresh, as spawn does. Where fork servers do not exist, spawn.
    """
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    context = multiprocessing.get_context("forkserver")
    # torch._dynamo is what torch.optim imports on first use: seconds, paid once here.
    context.set_forkserver_preload(
        [
            "flexpar.driver.forkserver_preload",
            "flexpar.worker.process",
            "torch.optim",
            "torch.distributed",
            "torch._dynamo",
        ]
    )
    from multiprocessing import forkserver

    # c10d logs each lost store connection as a warning with a C++ frame dump;
    # flexpar reports those events itself, in one line. Workers (children of the
    # fork server, which reads torch's setting when it imports torch) log c10d
    # errors only, unless the user set the level or asked for --verbose.
    settings = {"GLIBC_TUNABLES": worker_malloc_tunables(os.environ.get("GLIBC_TUNABLES"))}
    if not verbose and "TORCH_CPP_LOG_LEVEL" not in os.environ:
        settings["TORCH_CPP_LOG_LEVEL"] = "ERROR"
    # Only the fork server's environment (and so its children's) carries these: the
    # driver's own, and whatever else the user's code starts, stay as they were.
    previous = {name: os.environ.get(name) for name in settings}
    os.environ.update(settings)
    try:
        with _sigterm_held():
            forkserver.ensure_running()  # start it now: it imports while the driver checks the job
    finally:
        for name, value in previous.items():
            if value is None:
                del os.environ[name]
            else:
                os.environ[name] = value
    return context


def worker_malloc_tunables(user_tunables: Optional[str]) -> str:
    """GLIBC_TUNABLES for the fork server and the workers it forks: glibc's per-thread cache off.

    A VW's backward allocates each layer's gradient (16 MB for a 2048x2048
    layer) and frees it once added to `.grad`; torch asks for 64-byte aligned
    memory, and glibc's aligned allocation splits a few dozen bytes off either
    end of each such block. Its per-thread cache (tcache) keeps those crumbs
    as they are, so the small allocations of the next forward settle between
    the freed blocks, which then never merge again: the next gradient of the
    same size finds no hole to fit, and the heap grows. On the development
    machine a 16-VW step of benchmarks/overhead.py's MLP peaked 41-88 MB
    above a one-VW step, where the tensors alive at the peak differ by one
    layer's gradient, 16 MB (torch.profiler); without the cache, freed crumbs
    go to glibc's fast bins, which it merges before serving a large request,
    and the difference is those 16 MB. Keeps any tunable the user set,
    their own tcache_count included. The cache can only be turned off
    before the process starts; the rest of the workers' allocator settings
    are made in the process (flexpar/worker/process.py, keep_freed_memory).
    """
    if user_tunables and "glibc.malloc.tcache_count" in user_tunables:
        return user_tunables
    ours = "glibc.malloc.tcache_count=0"
    return f"{user_tunables}:{ours}" if user_tunables else ours


@contextlib.contextmanager
def _sigterm_held():
    """Start the fork server deaf to SIGTERM; a SIGTERM to this process meanwhile waits, it is not lost.

    A whole host's SIGTERM (SLURM's scancel, systemd, `kill -- -PGID`) also
    reaches the fork server; by default it would die, and with it the pipes
    through which the driver learns that its workers are alive: every worker
    would count as failed at once. The driver and the workers handle SIGTERM
    themselves (a clean stop, a planned leave); the fork server ends with the
    driver as it always does. So the server starts with SIGTERM blocked and
    ignored: this thread's mask, which the server inherits through fork and
    exec, blocks it, and the server ignores it as soon as it runs
    (flexpar.driver.forkserver_preload). Blocked, not only ignored: a SIGTERM
    sent to a child in the instant between its fork and its first instruction
    waits until the child unblocks it with its handler at the default again,
    where an ignored one would be lost and leave a worker its launcher could no
    longer stop. And a SIGTERM to this process while it starts the server
    reaches this process's own handler afterwards: this process has other
    threads (torch's, the store's), which do not block it, so the kernel hands
    it to one of them; a handler that only notes it stands in meanwhile, and
    the signal is raised again once the usual handler is back. (Ignoring it
    here instead, as this once did, lost it: a thread that does not block an
    ignored signal discards it.) If the user's code started the fork server
    before fit() did, it is that one, with the user's settings.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    from multiprocessing import resource_tracker

    # Python's resource tracker, which the fork server needs, unblocks SIGTERM once it has started
    # its own process: start it first, so that it does not undo the block below.
    resource_tracker.ensure_running()
    noted = []
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: noted.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
        if signal.SIGTERM not in blocked:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})  # one still pending reaches `previous`
        if noted:  # one taken by another thread meanwhile: to `previous` now, in this thread
            signal.raise_signal(signal.SIGTERM)
