"""A worker process from start to exit: signals, the Worker's run, and what the exit code says.

`main(args)` is what the driver's and `flexpar join`'s processes run. The
training itself is `flexpar.worker.Worker`; this module is the process
around it: Ctrl-C left to the driver, SIGTERM as a planned leave
(preemption), errors said once to the driver, and an exit that no
DataLoader or gloo thread can hang.
"""

from __future__ import annotations

import os
import signal
import sys
import time
import traceback

import torch
import torch.distributed as dist

from flexpar.comm.protocol import JOB_ENDED
from flexpar.errors import DeterminismBreach, ShardStateLost, UserCodeError
from flexpar.worker.device_link import DeviceLink, DriverLost, Evicted, JobStopped
from flexpar.worker.host import say
from flexpar.worker.lifecycle import Worker
from flexpar.worker.phase import Phase
from flexpar.worker.settings import EXIT_DRIVER_LOST, EXIT_EVICTED, WorkerArgs


def main(args: WorkerArgs) -> None:
    """Entry point of a worker process (local or joining)."""
    # Ctrl-C reaches the whole process group; the driver alone answers it and stops us.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # The fork server ignores SIGTERM (fork_server._sigterm_ignored); until its Worker is built
    # and it can leave (_leave_on_sigterm), a device told to go simply goes.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if args.threads:
        torch.set_num_threads(args.threads)
    keep_freed_memory()
    # 60 s until the Worker has read the job's settings, then the job's timeout_s (Worker.__init__).
    try:
        link = DeviceLink(args.host, args.port, args.device_id, timeout_s=60.0, secret=args.secret)
    except RuntimeError as error:  # the job's driver went between this device's start and its first word
        reason = (str(error).strip().splitlines() or [type(error).__name__])[0]
        say(
            f"flexpar: device {args.device_id}: the job at {args.host}:{args.port} is gone ({reason}); it does not join"
        )
        os._exit(EXIT_DRIVER_LOST)
    worker = None
    try:
        try:
            worker = Worker(args, link)
        except ValueError as refusal:
            if "secret" not in str(refusal):
                raise
            raise Evicted(str(refusal)) from None
        _leave_on_sigterm(worker)
        worker.run()
        code = 0
    except JobStopped as stopped:
        if str(stopped) == JOB_ENDED and worker is not None and not worker.membership.members:
            say(f"flexpar: device {args.device_id}: the job ended before this device joined")
        code = 0
    except DriverLost as lost:
        # Worker.run said what happened and where the state is; SIGTERM while it waited for a driver: let go.
        code = 0 if lost.let_go else EXIT_DRIVER_LOST
    except Evicted as refusal:
        if link.leave_requested_at is not None:
            code = 0  # asked to stop before it was admitted: it was let go
        else:
            if args.remote or not str(refusal).startswith("refused: "):  # the driver said a local refusal
                say(f"flexpar: device {args.device_id}: {refusal}")
            code = EXIT_EVICTED
    except Exception as error:  # the user's code (or ours) raised: stop the job, say why once
        try:
            link.events.send(
                {
                    "type": "error",
                    "device_id": args.device_id,
                    "message": _describe(error),
                    # A sharded job's lost state is no bug: its one line says all (no traceback to read).
                    "traceback": ""
                    if isinstance(error, (ShardStateLost, DeterminismBreach))
                    else traceback.format_exc(),
                }
            )
        except Exception:  # no driver to tell: say it here
            traceback.print_exc()
        code = 1
    finally:
        if worker is not None:
            worker.loader.close()  # a streaming job's DataStreams closes its streams
            worker.checkpoints.wait()  # a checkpoint in flight is finished before the process exits
        link.close()
        if dist.is_initialized():
            dist.destroy_process_group()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except OSError:  # a dead driver's pipe (this device outlived it): nothing to keep
            pass
    os._exit(code)  # skip interpreter teardown: DataLoader / gloo threads must not hang the exit


# glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# The largest mmap threshold glibc accepts on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX), and a trim
# threshold far above any step's churn: freed memory stays with the process for the next VW.
_MMAP_THRESHOLD_BYTES = 32 << 20
_TRIM_THRESHOLD_BYTES = (1 << 31) - 1  # mallopt takes a C int: its largest (2 GiB)


def keep_freed_memory() -> bool:
    """Have glibc keep the memory a step frees for the next one, instead of returning it to the OS.

    Every VW's backward allocates a gradient per parameter (16 MB for a 2048x2048
    layer) and frees it once added to `.grad`. By default glibc serves such sizes
    with fresh mmaps, or trims the heap's top after the free, so each VW touches
    new pages: on the 2-core machine the one-device job of benchmarks/overhead.py
    took 130,000-230,000 page faults a second, 24-44% of its CPU time in the
    kernel, and its throughput moved with them from run to run. With a fixed mmap
    threshold (the largest glibc takes, 32 MB: larger tensors are still mmapped)
    and no trimming, the pages stay mapped and are reused: the process keeps its
    peak footprint, which the next step needs anyway. Returns whether it applied
    (glibc only; elsewhere nothing changes).
    """
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_BYTES)) and bool(
            libc.mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD_BYTES)
        )
    except (OSError, AttributeError):  # not glibc
        return False


# SIGTERMs this close after the first are the same notice: a SLURM step's or a systemd
# unit's SIGTERM reaches every process, and `flexpar join` passes its own on as well.
SAME_NOTICE_S = 2.0


def _leave_on_sigterm(worker: "Worker") -> None:
    """SIGTERM (a preemption notice) makes this device leave at the next step boundary.

    The leave is planned (the others lose milliseconds, not a step); a second
    SIGTERM (more than SAME_NOTICE_S after the first), or no leave within the
    grace period, kills the process, which the others then recover from as
    from any failure.
    """
    link = worker.link
    grace_s = worker.args.preemption_grace_s or worker.settings.preemption_grace_s

    def on_sigterm(signum, frame):
        if link.leave_requested_at is not None:
            if time.monotonic() - link.leave_requested_at < SAME_NOTICE_S:
                return  # the same notice twice: to the whole host, and passed on by `flexpar join`
            print(f"flexpar: device {worker.args.device_id}: second SIGTERM: exiting now", file=sys.stderr, flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        if worker.phase in (Phase.WARMING, Phase.WAITING):  # not let in yet: Worker.withdrawing
            what = "SIGTERM before it was let in: it withdraws (if it is being let in at this moment, it leaves"
            what += " at its first step boundary)"
        else:
            what = (
                f"SIGTERM: leaving at the next step boundary (a second SIGTERM over {SAME_NOTICE_S:g} s later, "
                f"or {grace_s:g} s without a boundary, stops it at once)"
            )
        print(f"flexpar: device {worker.args.device_id}: {what}", file=sys.stderr, flush=True)
        link.request_leave(worker.proof, grace_s)

    signal.signal(signal.SIGTERM, on_sigterm)


def _describe(error: Exception) -> str:
    if isinstance(error, (UserCodeError, ShardStateLost, DeterminismBreach)):
        return str(error)
    return f"{type(error).__name__}: {error}"
