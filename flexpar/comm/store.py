"""Connecting to the job's store: the TCPStore the driver hosts, and clients that fail in one line.

Every process of a job talks to the others outside the training collectives
through this store (flexpar/comm/protocol.py lists its keys). The driver
listens (`connect(..., server=True)`), on loopback unless told otherwise;
workers and the command line connect as clients (`connect_client`: an
`Unreachable` error in one line instead of c10d's dumps or a hang).
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import errno
import functools
import os
import queue
import socket
import threading
import time
from typing import Optional

import torch
import torch.distributed as dist


class Unreachable(Exception):
    """No job answers at an address; the message says where and why, in one line.

    `exit_at_once`: a connection attempt was abandoned on a thread that is
    still inside C++ code: a command line must end with os._exit.
    """

    exit_at_once = False


def connect(host: str, port: int, timeout_s: float, server: bool = False) -> dist.TCPStore:
    """A TCPStore client (or the server, for the driver).

    The server listens on `host` only (loopback by default): TCPStore itself
    binds every interface, so the driver binds the listening socket to the
    asked address and hands it to TCPStore (its `master_listen_fd`), which
    serves its own protocol on it.
    """
    listen_fd = None
    if server:
        try:
            listener = socket.create_server((host, port), backlog=1024)
        except OSError as error:
            if error.errno == errno.EADDRINUSE and port and _a_job_answers(host, port):
                raise ValueError(
                    f"a flexpar job is already running at {host}:{port} (its driver answers); a second driver "
                    "there is refused. To continue a job whose driver died, run its resume command once that "
                    "driver is gone"
                ) from None
            raise ValueError(
                f"cannot listen on {host}:{port} ({error.strerror}); choose another --port "
                "(0 picks a free one) or --host"
            ) from None
        port = listener.getsockname()[1]
        listen_fd = listener.detach()  # TCPStore owns the descriptor from here on
    return dist.TCPStore(
        host,
        port,
        is_master=server,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=timeout_s),
        master_listen_fd=listen_fd,
    )


def _a_job_answers(host: str, port: int) -> bool:
    """Whether a flexpar job's store answers at host:port (where a second driver finds the port taken).

    A dead driver's port is free at once (its sockets linger in TIME-WAIT,
    which SO_REUSEADDR, set by socket.create_server, binds over), so a port in
    use means a live listener: a job's store, or another program.
    """
    reach = "127.0.0.1" if host in ("0.0.0.0", "") else ("::1" if host == "::" else host)
    try:
        return connect_client(reach, port, 2.0).check(["job/version"])
    except (Unreachable, RuntimeError):
        return False


# A device that lost its driver connects to a restarted one (`reconnect`): a plain TCP connection
# first, refused in 1-2 ms while nothing listens (a TCPStore constructor alone retries for about
# twice its timeout, logging C++ errors); then the store's handshake, bounded by HANDSHAKE_S (a
# server that dies during it would hold the constructor for its whole timeout; a live one answers
# in milliseconds); then the job's timeout for every call.
HANDSHAKE_S = 2.0


def reconnect(host: str, port: int, timeout_s: float, handshake_s: float = HANDSHAKE_S) -> dist.TCPStore:
    """A store client, or RuntimeError at once when nothing (or nothing that answers) listens at host:port.

    A device's first connection passes `handshake_s=timeout_s`: its driver is up (or gone), not restarting.
    """
    try:
        socket.create_connection((host, port), timeout=min(1.0, timeout_s)).close()
    except OSError as error:
        raise RuntimeError(f"nothing listens at {host}:{port} ({error.strerror or error})") from None
    # Something accepts connections there that may not answer yet (a driver between its listen and its
    # store, or one dying): c10d logs each timed-out handshake with a C++ frame dump, which a waiting
    # device does not show (it says in its own line what it waits for).
    with native_log_quieted():
        store = connect(host, port, min(handshake_s, timeout_s))
    store.set_timeout(datetime.timedelta(seconds=timeout_s))
    return store


@contextlib.contextmanager
def native_log_quieted():
    """For the duration, c10's C++ log (c10d's errors, each with its frame dump) says nothing in this process.

    c10d logs each failed handshake of a store client straight to file descriptor 2, from C++. It is
    quieted at its source, c10's log level (the variable that TORCH_CPP_LOG_LEVEL sets when torch is
    imported, and that every native log call reads), raised to FATAL while any thread of the process
    asks, and put back when the last one is done. Descriptor 2 itself is never touched: every line of
    flexpar's, the user's, or another thread's goes out at once, as written. (Pointing descriptor 2 at a
    pipe for the call, as this once did, held every other thread's lines until the call ended, which
    could be after the process did: a device's last lines were lost when it exited while its follower
    thread was still inside a handshake. It also dropped their blank lines.)

    Where torch's native library does not expose its level (not one of torch's own builds), nothing is
    quieted: c10d's lines are shown, and nothing else is hidden.
    """
    level = _c10_log_level()
    if level is None:
        yield
        return
    _QUIETING.enter(level)
    try:
        yield
    finally:
        _QUIETING.leave(level)


class _Quieting:
    """c10's level is the process's: the threads that quiet it at once (a device's follower and main
    thread both reconnecting) count themselves here, so that the first raises it and the last puts back
    the level it found."""

    FATAL = 3  # c10's levels: 0 INFO, 1 WARNING, 2 ERROR, 3 FATAL

    def __init__(self):
        self._lock = threading.Lock()
        self._threads = 0
        self._found = 0

    def enter(self, level: ctypes.c_int32) -> None:
        with self._lock:
            if self._threads == 0:
                self._found = level.value
                level.value = max(level.value, self.FATAL)
            self._threads += 1

    def leave(self, level: ctypes.c_int32) -> None:
        with self._lock:
            self._threads -= 1
            if self._threads == 0:
                level.value = self._found


_QUIETING = _Quieting()


@functools.cache
def _c10_log_level() -> Optional[ctypes.c_int32]:
    """c10's log level (`FLAGS_caffe2_log_level` in torch's libc10), or None where it is not found."""
    folder = os.path.join(os.path.dirname(torch.__file__), "lib")
    for name in ("libc10.so", "libc10.dylib", "c10.dll"):
        path = os.path.join(folder, name)
        if os.path.exists(path):
            try:  # the library torch has loaded already: the same one, not a copy
                return ctypes.c_int32.in_dll(ctypes.CDLL(path), "FLAGS_caffe2_log_level")
            except (OSError, ValueError):
                return None
    return None


def connect_client(host: str, port: int, timeout_s: float, wait_for_job: bool = False) -> dist.TCPStore:
    """A store client for a command-line tool: Unreachable (one line) instead of c10d's dumps or a hang.

    Answers within about `timeout_s` whatever listens at the address:
    - nothing (a closed port, a dead job): at once, unless `wait_for_job`
      (`flexpar join` started beside its job, as under SLURM), which keeps
      trying until `timeout_s` (a plain connection attempt every 0.5 s);
    - a program that is not a flexpar job (an HTTP server, a silent
      listener): TCPStore's handshake waits for an answer that never comes,
      without a timeout of its own, so the connection is made on a daemon
      thread that is abandoned at the deadline.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            _probe(host, port, timeout_s)
            break
        except Unreachable:
            if not wait_for_job or time.monotonic() + 0.5 > deadline:
                raise
            time.sleep(0.5)
    # Something listens: a job answers its handshake in milliseconds.
    handshake_s = max(1.0, deadline - time.monotonic())
    outcome: queue.Queue = queue.Queue()
    abandoned = False

    def attempt():
        try:
            outcome.put(connect(host, port, handshake_s))
        except BaseException as error:  # handed to the caller's thread
            outcome.put(error)

    with native_log_quieted():
        threading.Thread(target=attempt, name="flexpar-connect", daemon=True).start()
        try:
            result = outcome.get(timeout=handshake_s + 1.0)
        except queue.Empty:
            result = TimeoutError("something listens there but does not answer as a flexpar job does")
            abandoned = True
    if isinstance(result, dist.TCPStore):
        return result
    if isinstance(result, (RuntimeError, OSError)):  # DistNetworkError is a RuntimeError
        error = _unreachable(host, port, timeout_s, result)
        # A thread still inside TCPStore's C++ handshake must not meet the interpreter's
        # teardown (it aborts the process): the command line exits at once instead.
        error.exit_at_once = abandoned
        raise error from None
    raise result


def _probe(host: str, port: int, timeout_s: float) -> None:
    """Unreachable at once when nothing listens at host:port (TCPStore would retry until its timeout)."""
    try:
        socket.create_connection((host, port), timeout=min(timeout_s, 5.0)).close()
    except OSError as error:
        raise _unreachable(host, port, timeout_s, error) from None


def _unreachable(host: str, port: int, timeout_s: float, error: BaseException) -> "Unreachable":
    text = str(getattr(error, "strerror", None) or error).strip()
    reason = text.splitlines()[0] if text else type(error).__name__
    return Unreachable(
        f"no flexpar job answers at {host}:{port} within {timeout_s:g} s ({reason}); "
        "check the address the job printed, and that the job is still running"
    )
