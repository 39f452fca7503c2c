"""The worker processes this host starts for the job, and the devices they run on.

`LocalDevices.spawn` starts one worker process per device id, forked from the
fork server (flexpar/driver/fork_server.py), each running
`flexpar.worker.process.main`; the coordinator calls it (and `stop`, and
`exits` to learn of ended processes) as membership decides.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Optional

import torch

from flexpar.driver.readopt import AdoptedProcess
from flexpar.options import cpu_count
from flexpar.worker.process import main as worker_main
from flexpar.worker.settings import WorkerArgs


def detect_devices(backend: str) -> tuple:
    """(kind, count, backend): CUDA GPUs over NCCL when present, else CPU processes over gloo."""
    if backend in ("auto", "nccl") and torch.cuda.is_available():
        return "cuda", torch.cuda.device_count(), "nccl"
    if backend == "nccl":
        raise ValueError("backend='nccl' needs CUDA GPUs, and none is visible; use backend='gloo'")
    return "cpu", cpu_count(), "gloo"


class StartingProcess:
    """A worker process whose start runs on a thread of its own, so that the driver's loop never waits on it.

    A fork server answers a start only once it has imported torch (seconds):
    a re-adopting driver starts its fork server moments before the first join
    it carries out, and a blocking `Process.start()` then held its loop for
    that long while the devices trained on: a device's leave (SIGTERM) and the
    join themselves waited 0.7 s, 18 of the soak's fast steps. The part of
    `multiprocessing.Process` that `LocalDevices` uses: `is_alive` (true while
    starting), `kill` (carried out once started), `join`, `exitcode`.
    """

    def __init__(self, process):
        self.process = process
        self._killed = False
        self._failed: Optional[BaseException] = None
        self._starting = threading.Thread(target=self._start, name=f"{process.name}-start", daemon=True)
        self._starting.start()

    def _start(self) -> None:
        try:
            self.process.start()
        except BaseException as error:  # said, and the device counts as ended (exit code 1)
            self._failed = error
            print(f"flexpar: {self.process.name} could not start: {error}", file=sys.stderr, flush=True)
            return
        if self._killed:  # stopped while it was starting
            self.process.kill()

    @property
    def exitcode(self) -> Optional[int]:
        if self._starting.is_alive():
            return None
        return 1 if self._failed is not None else self.process.exitcode

    def is_alive(self) -> bool:
        if self._starting.is_alive():
            return True
        return self._failed is None and self.process.is_alive()

    def kill(self) -> None:
        self._killed = True  # read by the starting thread after its start
        if not self._starting.is_alive() and self._failed is None:
            self.process.kill()

    def join(self, timeout: Optional[float] = None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        self._starting.join(timeout)
        if not self._starting.is_alive() and self._failed is None:
            self.process.join(None if deadline is None else max(0.0, deadline - time.monotonic()))


class LocalDevices:
    """The worker processes this host started, and the GPUs they hold."""

    def __init__(self, context, host: str, port: int, secret: str, kind: str, threads: int, speeds):
        self.host, self.port, self.secret = host, port, secret
        self.kind, self.threads, self.speeds = kind, threads, speeds or ()
        self.context = context
        self.processes: dict = {}
        self.gpus: dict = {}
        self.reported: set = set()
        self.exit_codes: dict = {}  # device id -> exit code, for processes that ended

    def spawn(self, device_ids) -> None:
        for device_id in device_ids:
            index = int(device_id.rsplit("-", 1)[1])
            device = "cpu"
            if self.kind == "cuda":
                free = sorted(set(range(torch.cuda.device_count())) - set(self.gpus.values()))
                if not free:
                    print(f"flexpar: no free GPU for {device_id}", file=sys.stderr)
                    continue
                self.gpus[device_id] = free[0]
                device = f"cuda:{free[0]}"
            speed = self.speeds[index] if index < len(self.speeds) else 1.0
            args = WorkerArgs(self.host, self.port, device_id, self.secret, device, self.threads, speed)
            process = self.context.Process(target=worker_main, args=(args,), name=f"flexpar-{device_id}")
            self.processes[device_id] = StartingProcess(process)

    def adopt(self, device_id: str, pid: int, device: str) -> None:
        """Take over a device this host's earlier driver started (re-adoption): watched and stopped by pid."""
        self.processes[device_id] = AdoptedProcess(pid)
        if device.startswith("cuda:"):
            self.gpus[device_id] = int(device.split(":", 1)[1])

    def stop(self, device_id: str) -> None:
        process = self.processes.get(device_id)
        if process is not None and process.is_alive():
            process.kill()

    def exits(self) -> list:
        ended = [d for d, p in self.processes.items() if not p.is_alive() and d not in self.reported]
        for device_id in ended:
            self.reported.add(device_id)
            self.gpus.pop(device_id, None)
            self.exit_codes[device_id] = self.processes[device_id].exitcode
        return ended

    def shutdown(self, grace_s: float = 5.0) -> None:
        deadline = time.monotonic() + grace_s
        for process in self.processes.values():
            process.join(timeout=max(0.0, deadline - time.monotonic()))
        for process in self.processes.values():
            if process.is_alive():
                process.kill()
                process.join(timeout=5)
