"""Connecting to the job's store: the TCPStore the driver hosts, and clients that fail in one line.

Every process of a job talks to the others outside the training collectives
through this store (flexpar/comm/protocol.py lists its keys). The driver
listens (`connect(..., server=True)`), on loopback unless told otherwise;
workers and the command line connect as clients (`connect_client`: an
`Unreachable` error in one line instead of c10d's dumps or a hang).
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import os
import queue
import re
import socket
import sys
import threading
import time

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
    # store): c10d logs each timed-out handshake with a C++ frame dump, which a waiting device does not
    # show (it says in its own line what it waits for).
    with _native_log_filtered():
        store = connect(host, port, min(handshake_s, timeout_s))
    store.set_timeout(datetime.timedelta(seconds=timeout_s))
    return store


_NATIVE_LOG_LINE = re.compile(
    r"^(\[rank\d+\]:)?(\[[IWEF]\d|frame #|Exception raised from |<omitting python frames>)|^\s*$"
)


def is_native_log_line(line: str) -> bool:
    """A line of c10d's C++ log (`[E1206 00:53:38.418 socket.cpp:1028] ...`, after `[rank0]:` once the
    process has a process group) or of the exception and frame dump that follows it."""
    return _NATIVE_LOG_LINE.match(line) is not None


# File descriptor 2 is the process's: two threads pointing it at their own pipes at once (a device's
# follower and main thread both reconnect) would each restore the other's pipe. One at a time.
_DESCRIPTOR_2 = threading.Lock()


@contextlib.contextmanager
def _native_log_filtered():
    """For the duration, file descriptor 2 goes through a pipe; c10d's lines are dropped, every other
    line (another thread's, flexpar's own) is written to the real stderr afterwards, in order.

    C++ writes straight to the descriptor, and torch reads its log level only at start-up: the
    descriptor is the one place to quiet it for one call (`_quiet_native_stderr` drops everything,
    which suits a command line's own connection attempt, not a device whose other threads speak).
    """
    with _DESCRIPTOR_2:
        yield from _filtered_descriptor_2()


def _filtered_descriptor_2():
    sys.stderr.flush()
    saved = os.dup(2)
    read_end, write_end = os.pipe()
    chunks: list = []

    def drain():
        while True:
            data = os.read(read_end, 65536)
            if not data:
                return
            chunks.append(data)

    reader = threading.Thread(target=drain, name="flexpar-native-log", daemon=True)
    reader.start()
    os.dup2(write_end, 2)
    os.close(write_end)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)  # the pipe's last writer closes: the reader sees its end
        os.close(saved)
        reader.join()
        os.close(read_end)
        text = b"".join(chunks).decode("utf-8", "replace")
        kept = "".join(line for line in text.splitlines(keepends=True) if not is_native_log_line(line))
        if kept:
            try:
                os.write(2, kept.encode())
            except OSError:  # a dead driver's pipe
                pass


@contextlib.contextmanager
def _quiet_native_stderr():
    """Silence c10d's own C++ log lines (retries, frame dumps) for a moment.

    They are written by the C++ side straight to file descriptor 2, so the
    descriptor itself is pointed at /dev/null and restored afterwards. Used
    only around a command-line client's connection attempt, whose failure we
    report in one line of our own.
    """
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


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

    with _quiet_native_stderr():
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
