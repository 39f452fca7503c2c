"""`flexpar join`: start this host's devices and have them join a running job.

Each joining worker process imports the job's script as `__mp_main__` (as
multiprocessing's spawn does), so the job's pickled pieces resolve, then runs
`flexpar.worker.process.main` like any worker: it warms up and is let in at a
step boundary.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import types
from typing import Optional

import torch

from flexpar.comm.store import Unreachable, connect_client
from flexpar.driver.fork_server import worker_context
from flexpar.options import cpu_count
from flexpar.worker.process import main as worker_main
from flexpar.worker.settings import WorkerArgs


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
) -> int:
    """Start `devices` workers on this host that join the running job at `address`.

    Waits up to `connect_timeout_s` for the job to answer (under SLURM or
    Kubernetes a joiner may start before its job listens). SIGTERM (a
    preemption notice) is passed on to the workers, which leave at the next
    step boundary; a second SIGTERM (more than flexpar.worker.process.SAME_NOTICE_S after the
    first) is passed on too and stops them at once.
    Returns the workers' worst exit code (0: all left or finished).
    """
    host, _, port_text = address.rpartition(":")
    print(
        f"flexpar join: connecting to the job at {address} (waiting up to {connect_timeout_s:g} s)",
        file=sys.stderr,
        flush=True,
    )
    store = connect_client(host, int(port_text), connect_timeout_s, wait_for_job=True)
    try:
        script = script or store.get("job/script").decode()
        settings = json.loads(store.get("job/settings"))
    except RuntimeError as error:  # connected, then the job stopped answering
        raise Unreachable(f"the job at {address} stopped answering ({str(error).strip()[:200]})") from None
    if script and not os.path.exists(script):
        raise ValueError(f"the job's script {script} is not on this host; pass --script PATH")
    kind = "cuda" if settings["backend"] == "nccl" else "cpu"
    context = worker_context()
    processes, device_ids = [], []
    for local_index in range(devices):
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
        process = context.Process(target=_joiner_main, args=(args, script), name=f"flexpar-{device_id}")
        process.start()
        processes.append(process)
        device_ids.append(device_id)
    plural = "s" if devices != 1 else ""
    print(
        f"flexpar join: started {devices} {kind} device{plural} ({', '.join(device_ids)}); each joins at a step "
        "boundary once warm",
        file=sys.stderr,
        flush=True,
    )

    def pass_on(signum, frame):
        for process in processes:
            if process.is_alive():
                os.kill(process.pid, signal.SIGTERM)

    previous = signal.signal(signal.SIGTERM, pass_on)
    try:
        for process in processes:
            while process.is_alive():
                process.join(timeout=0.2)
    except KeyboardInterrupt:
        for process in processes:
            process.kill()
        print("flexpar join: interrupted (Ctrl-C); this host's workers are stopped", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
    # A worker killed by a signal has exitcode -N: report it as a shell does (128 + N), not as 0.
    codes = [128 - process.exitcode if (process.exitcode or 0) < 0 else process.exitcode or 0 for process in processes]
    ended = ", ".join(f"{device_id} exit {code}" for device_id, code in zip(device_ids, codes))
    print(f"flexpar join: this host's devices have ended ({ended}; 0: left or finished)", file=sys.stderr, flush=True)
    return max(codes)
