"""The driver: checks the job, hosts the coordinator, starts and watches local workers.

`run(job, options)` is what `Job.fit()` calls. `join(...)` is what
`flexpar join` calls on another host. Both start worker processes that import
the user's script (as `__mp_main__`) and then run `worker.main`.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import secrets
import socket
import sys
import time
import types
from dataclasses import asdict
from typing import Optional

import torch

from flexpar import control, membership, state as training_state
from flexpar.job import (
    FitResult, Job, build_model, build_optimizer, first_batch_check,
    model_digest, pickle_pieces,
)
from flexpar.options import FitOptions, cpu_count
from flexpar.version import __version__
from flexpar.worker import RunSettings, WorkerArgs, main as worker_main


def detect_devices(backend: str) -> tuple:
    """(kind, count, backend): CUDA GPUs over NCCL when present, else CPU processes over gloo."""
    if backend in ("auto", "nccl") and torch.cuda.is_available():
        return "cuda", torch.cuda.device_count(), "nccl"
    if backend == "nccl":
        raise ValueError("backend='nccl' needs CUDA GPUs, and none is visible; use backend='gloo'")
    return "cpu", cpu_count(), "gloo"


def worker_context():
    """How worker processes start: a fork server that has imported torch once.

    Each worker is forked from that server (single-threaded, CUDA untouched),
    so it skips the seconds of `import torch` and still imports the user's
    script afresh, as spawn does. Where fork servers do not exist, spawn.
    """
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    context = multiprocessing.get_context("forkserver")
    # torch._dynamo is what torch.optim imports on first use: seconds, paid once here.
    context.set_forkserver_preload(["flexpar.worker", "torch.optim", "torch.distributed", "torch._dynamo"])
    from multiprocessing import forkserver

    forkserver.ensure_running()  # start it now: it imports while the driver checks the job
    return context


class LocalDevices:
    """The worker processes this host started, and the GPUs they hold."""

    def __init__(self, context, host: str, port: int, secret: str, kind: str, threads: int, speeds):
        self.host, self.port, self.secret = host, port, secret
        self.kind, self.threads, self.speeds = kind, threads, speeds or ()
        self.context = context
        self.processes: dict = {}
        self.gpus: dict = {}
        self.reported: set = set()

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
            process.start()
            self.processes[device_id] = process

    def stop(self, device_id: str) -> None:
        process = self.processes.get(device_id)
        if process is not None and process.is_alive():
            process.kill()

    def exits(self) -> list:
        ended = [d for d, p in self.processes.items() if not p.is_alive() and d not in self.reported]
        for device_id in ended:
            self.reported.add(device_id)
            self.gpus.pop(device_id, None)
        return ended

    def shutdown(self, grace_s: float = 5.0) -> None:
        deadline = time.monotonic() + grace_s
        for process in self.processes.values():
            process.join(timeout=max(0.0, deadline - time.monotonic()))
        for process in self.processes.values():
            if process.is_alive():
                process.kill()
                process.join(timeout=5)


def run(job: Job, options: FitOptions) -> FitResult:
    """Check everything that can be checked here, then train on worker processes."""
    kind, available, backend = detect_devices(options.backend)
    context = worker_context()
    initial = options.devices or (available if kind == "cuda" else 1)
    max_devices = options.validate_devices(initial, available, kind)
    model = build_model(job)
    build_optimizer(job, model)
    first_batch_check(job, model)
    payload = pickle_pieces(job)
    total_steps = options.steps or options.epochs * job.steps_per_epoch()
    resume_path = None
    if options.resume:
        resume_path = training_state.latest_checkpoint(options.checkpoint_dir)
        if resume_path is None:
            raise ValueError(f"resume=True but {options.checkpoint_dir} holds no checkpoint (step-*.pt)")
    settings = RunSettings(total_steps, backend, options.timeout_s, options.bucket_mb,
                           options.checkpoint_every, options.checkpoint_dir, resume_path,
                           tuple((f.step, f.device, f.phase) for f in options.faults))
    secret = options.secret or secrets.token_hex(16)
    store = control.connect(options.host, options.port, options.timeout_s, server=True)
    address = f"{options.host}:{store.port}"
    _publish_job(store, payload, settings, secret, model_digest(model))
    if not options.quiet:
        print(f"flexpar: job at {address} (secret {secret}); devices: {initial} x {kind}", flush=True)
    threads = max(1, available // max_devices) if kind == "cpu" else 0
    local = LocalDevices(context, options.host, store.port, secret, kind, threads, options.emulate_speeds)
    grace_s = options.timeout_s + 5.0
    state = membership.Membership(initial_devices=initial, max_devices=max_devices, grace_s=grace_s)
    coordinator = control.Coordinator(
        store, secret, store.get("job/salt").decode(), model_digest(model), __version__, state,
        spawn_local=local.spawn, stop_local=local.stop, local_exits=local.exits,
        on_note=lambda message: print(f"flexpar: {message}", file=sys.stderr, flush=True),
    )
    try:
        from flexpar.driver_loop import DriverLoop

        loop = DriverLoop(store, coordinator, options, total_steps, job.global_batch, address)
        coordinator.apply(membership.Start(initial))
        loop.run()
        data = control.get_blob(store, "result", secret)
        result = training_state.from_bytes(data, torch.device("cpu"))
        model.load_state_dict(result["model"])
        return FitResult(model, loop.summary(result["step"]))
    finally:
        if not store.check(["done"]):
            store.set("stop", "the driver stopped")
        local.shutdown()


def _publish_job(store, payload: bytes, settings: RunSettings, secret: str, digest: str) -> None:
    control.put_blob(store, "job/payload", payload, secret)
    store.set("job/settings", json.dumps(asdict(settings)))
    store.set("job/salt", secrets.token_hex(8))
    store.set("job/version", __version__)
    store.set("job/digest", digest)
    main_file = getattr(sys.modules.get("__main__"), "__file__", None)
    store.set("job/script", os.path.abspath(main_file) if main_file else "")


# ------------------------------------------------------------------ joining


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


def join(address: str, devices: int, secret: str, script: Optional[str] = None, speed: float = 1.0) -> int:
    """Start `devices` workers on this host that join the running job at `address`."""
    host, _, port_text = address.rpartition(":")
    store = control.connect(host, int(port_text), 30.0)
    script = script or store.get("job/script").decode()
    if script and not os.path.exists(script):
        raise ValueError(f"the job's script {script} is not on this host; pass --script PATH")
    settings = json.loads(store.get("job/settings"))
    kind = "cuda" if settings["backend"] == "nccl" else "cpu"
    context = worker_context()
    processes = []
    for local_index in range(devices):
        number = store.add("remote/counter", 1)
        device_id = f"{socket.gethostname()}-{number}"
        device = f"cuda:{local_index % max(1, torch.cuda.device_count())}" if kind == "cuda" else "cpu"
        threads = max(1, cpu_count() // devices) if kind == "cpu" else 0
        args = WorkerArgs(host, int(port_text), device_id, secret, device, threads, speed, remote=True)
        process = context.Process(target=_joiner_main, args=(args, script), name=f"flexpar-{device_id}")
        process.start()
        processes.append(process)
    for process in processes:
        process.join()
    return max((process.exitcode or 0) for process in processes)
