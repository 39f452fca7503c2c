"""`flexpar join`: start this host's devices and have them join a running job.

Each joining worker process imports the job's script as `__mp_main__` (as
multiprocessing's spawn does), so the job's pickled pieces resolve, then runs
`flexpar.worker.process.main` like any worker: it warms up and is let in at a
step boundary. The secret is checked against the job before anything starts,
and a SIGTERM at any moment of the start leaves no device of this host in the
job (`StartedDevices`).
"""

from __future__ import annotations

import hmac
import json
import os
import signal
import socket
import sys
import threading
import types
from typing import Optional

import torch

from flexpar.comm.protocol import secret_check
from flexpar.comm.store import Unreachable, connect_client
from flexpar.driver.fork_server import worker_context
from flexpar.options import cpu_count
from flexpar.worker.fault_injection import fire_start_fault
from flexpar.worker.process import main as worker_main
from flexpar.worker.settings import EXIT_EVICTED, WorkerArgs


def import_script_as_main(path: str) -> None:
    """Import the user's script the way multiprocessing's spawn does: as `__mp_main__`.

    The job's pieces were pickled by reference to `__main__.<name>`; with the
    script registered under both names, they resolve, and the script's own
    `if __name__ == "__main__":` block does not run.
    """
    module = types.ModuleType("__mp_main__")
    module.__file__ = path
    sys.modules["__mp_main__"] = module
    sys.modules["__main__"] = module
    sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
    with open(path, encoding="utf-8") as handle:
        code = compile(handle.read(), path, "exec")
    exec(code, module.__dict__)


def _joiner_main(args: WorkerArgs, script: str) -> None:
    if script:
        import_script_as_main(script)
    worker_main(args)


def join(
    address: str,
    devices: int,
    secret: str,
    script: Optional[str] = None,
    speed: float = 1.0,
    preemption_grace_s: Optional[float] = None,
    connect_timeout_s: float = 60.0,
    secret_origin: str = "the secret given",
) -> int:
    """Start `devices` workers on this host that join the running job at `address`.

    Waits up to `connect_timeout_s` for the job to answer (under SLURM or
    Kubernetes a joiner may start before its job listens), and checks the
    secret (`secret_origin` says where it came from) before it starts
    anything. SIGTERM (a preemption notice, or a scale-down while this host
    still starts) means at every moment that no device of this host stays in
    the job (`StartedDevices`): before a worker process exists, the command
    ends at once (code 143); after, it is passed on to the workers, which
    withdraw if they were not let in yet, or leave at the next step boundary;
    a second SIGTERM (more than flexpar.worker.process.SAME_NOTICE_S after the
    first) is passed on too and stops them at once.
    Returns the workers' worst exit code (0: all left, withdrew or finished).
    """
    started = StartedDevices()
    in_main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, started.on_sigterm) if in_main_thread else None
    try:
        try:
            return _join(
                started, address, devices, secret, script, speed, preemption_grace_s, connect_timeout_s, secret_origin
            )
        except KeyboardInterrupt:  # Ctrl-C: this host's workers stop at once
            for process in started.processes:
                process.kill()
            print("flexpar join: interrupted (Ctrl-C); this host's workers are stopped", file=sys.stderr)
            return 130
    finally:
        if in_main_thread:
            signal.signal(signal.SIGTERM, previous)


def _join(started, address, devices, secret, script, speed, preemption_grace_s, connect_timeout_s, secret_origin):
    host, _, port_text = address.rpartition(":")
    print(
        f"flexpar join: connecting to the job at {address} (waiting up to {connect_timeout_s:g} s)",
        file=sys.stderr,
        flush=True,
    )
    store = connect_client(host, int(port_text), connect_timeout_s, wait_for_job=True)
    try:
        secret_ok = hmac.compare_digest(
            secret_check(secret, store.get("job/salt").decode()), store.get("job/secret_check").decode()
        )
        script = script or store.get("job/script").decode()
        settings = json.loads(store.get("job/settings"))
    except RuntimeError as error:  # connected, then the job stopped answering
        raise Unreachable(f"the job at {address} stopped answering ({str(error).strip()[:200]})") from None
    if not secret_ok:
        print(
            f"flexpar join: wrong secret: {secret_origin} does not match the job at {address}; give the job's "
            "own (a job on loopback keeps it in its run directory, file 'secret'); no device was started",
            file=sys.stderr,
            flush=True,
        )
        return EXIT_EVICTED
    if script and not os.path.exists(script):
        raise ValueError(f"the job's script {script} is not on this host; pass --script PATH")
    kind = "cuda" if settings["backend"] == "nccl" else "cpu"
    context = None  # the fork server starts with the first device: a SIGTERM before then starts none
    faults = settings.get("faults", ())
    for local_index in range(devices):
        if started.terminated:
            break
        number = store.add("remote/counter", 1)
        device_id = f"{socket.gethostname()}-{number}"
        device = f"cuda:{local_index % max(1, torch.cuda.device_count())}" if kind == "cuda" else "cpu"
        threads = max(1, cpu_count() // devices) if kind == "cpu" else 0
        args = WorkerArgs(
            host,
            int(port_text),
            device_id,
            secret,
            device,
            threads,
            speed,
            remote=True,
            preemption_grace_s=preemption_grace_s,
        )
        fire_start_fault(device_id, faults, "launch")
        context = context or worker_context()
        process = context.Process(target=_joiner_main, args=(args, script), name=f"flexpar-{device_id}")
        started.start(process, device_id)
        fire_start_fault(device_id, faults, "launched")
    if not started.terminated:
        plural = "s" if devices != 1 else ""
        print(
            f"flexpar join: started {devices} {kind} device{plural} ({', '.join(started.device_ids)}); each "
            "joins at a step boundary once warm",
            file=sys.stderr,
            flush=True,
        )
    return started.wait()


class StartedDevices:
    """The worker processes this joiner started, and what SIGTERM means for them at every moment of its start.

    Before any worker process exists, SIGTERM ends the command at once (as
    `flexpar run` before training; a container's process 1 would otherwise
    wait out its grace period). From the moment one is being started, it is
    passed on instead: the handler never interrupts `start` (the fork
    server would fork the worker anyway, after its launcher had given up on
    it), and a worker whose start a SIGTERM overtook is told as soon as its
    pid is known. No further worker starts after a SIGTERM.
    """

    def __init__(self):
        self.processes: list = []
        self.device_ids: list = []
        self.terminated = False
        self._starting = False
        self._told: set = set()  # pids the first SIGTERM was passed on to
        # pids of workers seen to end. The handler asks this, not `is_alive()`: a poll from the handler
        # could read a worker's exit status under the main thread's own poll of it (in `wait`).
        self._ended: set = set()

    def on_sigterm(self, signum, frame) -> None:
        self.terminated = True
        if not self.processes and not self._starting:
            print(
                "flexpar join: stopped by SIGTERM before this host's devices started; nothing joined",
                file=sys.stderr,
                flush=True,
            )
            raise SystemExit(128 + signal.SIGTERM)
        for process in self.processes:
            self._tell(process)

    def _tell(self, process) -> None:
        self._told.add(process.pid)
        if process.pid not in self._ended:
            try:
                os.kill(process.pid, signal.SIGTERM)
            except ProcessLookupError:  # ended, not yet seen to
                pass

    def start(self, process, device_id: str) -> None:
        self._starting = True
        try:
            process.start()
            self.processes.append(process)
            self.device_ids.append(device_id)
        finally:
            self._starting = False
        if self.terminated and process.pid not in self._told:
            self._tell(process)

    def wait(self) -> int:
        """Wait for every worker to end; their worst exit code, said in one line."""
        for process in self.processes:
            while process.is_alive():
                process.join(timeout=0.2)
            self._ended.add(process.pid)
        codes = [_exit_code(process.exitcode) for process in self.processes]
        ended = ", ".join(
            f"{device_id} exit {code}"
            + (" (stopped by SIGTERM before it could join)" if exitcode == -signal.SIGTERM else "")
            for device_id, code, exitcode in zip(self.device_ids, codes, (p.exitcode for p in self.processes))
        )
        print(
            f"flexpar join: this host's devices have ended ({ended}; 0: left, withdrew or finished)",
            file=sys.stderr,
            flush=True,
        )
        return max(codes)


def _exit_code(exitcode: Optional[int]) -> int:
    """A worker's exit as a shell reports it (128 + N for a signal N), except SIGTERM's default: a worker
    dies of it only before it installed its own handler, before it announced itself to the job, so
    it withdrew as asked (0)."""
    if exitcode == -signal.SIGTERM:
        return 0
    return 128 - exitcode if (exitcode or 0) < 0 else exitcode or 0
