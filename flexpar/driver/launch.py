"""The driver: checks the job, hosts the coordinator, starts and watches local workers.

`run(job, options)` is what `Job.fit()` calls. `join(...)` is what
`flexpar join` calls on another host. Both start worker processes that import
the user's script (as `__mp_main__`) and then run `worker_process.main`.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shlex
import signal
import socket
import sys
import threading
import time
import types
from dataclasses import asdict
from typing import Optional

import torch

from flexpar import callbacks as callbacks_module
from flexpar.comm import state_transfer as training_state
from flexpar.comm.protocol import get_blob, put_blob, tell_devices
from flexpar.comm.store import Unreachable, connect, connect_client
from flexpar.driver.coordinator import Coordinator
from flexpar.driver.driver_loop import DriverWaker
from flexpar.core import membership
from flexpar.driver.driver_loop import DriverLoop
from flexpar.driver.fork_server import worker_context
from flexpar.driver.job_checks import first_batch_check, pickle_pieces
from flexpar.errors import TrainingError
from flexpar.observe import trackers as trackers_module
from flexpar.options import FitOptions, cpu_count, is_loopback
from flexpar.version import __version__
from flexpar.worker import evaluator
from flexpar.worker.process import main as worker_main
from flexpar.worker.settings import RunSettings, WorkerArgs
from flexpar.worker.user_code import build_model, build_optimizer, model_digest


def detect_devices(backend: str) -> tuple:
    """(kind, count, backend): CUDA GPUs over NCCL when present, else CPU processes over gloo."""
    if backend in ("auto", "nccl") and torch.cuda.is_available():
        return "cuda", torch.cuda.device_count(), "nccl"
    if backend == "nccl":
        raise ValueError("backend='nccl' needs CUDA GPUs, and none is visible; use backend='gloo'")
    return "cpu", cpu_count(), "gloo"


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


def run(job, options: FitOptions) -> tuple:
    """Check everything that can be checked here, then train `job` (a `flexpar.Job`) on worker processes.

    Returns (the trained model, the summary): `Job.fit` hands them to the user as a `FitResult`.
    """
    kind, available, backend = detect_devices(options.backend)
    context = worker_context(options.verbose)
    initial = options.devices or (available if kind == "cuda" else 1)
    max_devices = options.validate_devices(initial, available, kind, job.virtual_workers)
    model = build_model(job)
    build_optimizer(job, model)
    first_batch_check(job, model)
    if options.eval_every and job.evaluate is None:
        raise ValueError(f"eval_every={options.eval_every} needs an evaluation set: "
                         "Job(..., eval_dataset=DATASET, evaluate=FUNCTION)")
    eval_keys = evaluator.metric_keys(job, model) if job.evaluate is not None else ()
    payload = pickle_pieces(job)
    total_steps = options.steps or options.epochs * job.steps_per_epoch()
    resume_path = None
    if options.resume:
        resume_path = training_state.latest_checkpoint(options.checkpoint_dir)
        if resume_path is None:
            raise ValueError(f"resume=True but {options.checkpoint_dir} holds no checkpoint (step-*.pt)")
    run_dir, metrics_path = run_paths(options)
    callbacks = callbacks_module.Dispatcher(options.callbacks + tuple(trackers_module.create(options.trackers, run_dir)))
    script = getattr(sys.modules.get("__main__"), "__file__", None) or ""
    settings = RunSettings(total_steps, backend, options.timeout_s, options.bucket_mb,
                           options.checkpoint_every, options.checkpoint_dir, resume_path,
                           tuple((f.step, f.device, f.phase, f.signal) for f in options.faults),
                           rescue_dir=os.path.abspath(run_dir), script=os.path.abspath(script) if script else "",
                           resume_command=resume_command(os.path.abspath(options.checkpoint_dir or run_dir)),
                           preemption_grace_s=options.preemption_grace_s, sample_ledger=options.sample_ledger,
                           eval_every=options.eval_every, eval_keys=tuple(eval_keys),
                           eval_verdict=bool(options.eval_every and eval_keys and callbacks.can_stop_at_eval),
                           keep_checkpoints=options.keep_checkpoints)
    secret = options.secret or secrets.token_hex(16)
    store = connect(options.host, options.port, options.timeout_s, server=True)
    address = f"{advertised_host(options.host)}:{store.port}"
    _publish_job(store, payload, settings, secret, model_digest(model))
    secret_note = _keep_secret(options, secret, run_dir)
    if not options.quiet:
        _banner(address, initial, kind, max_devices, options, secret_note, resume_path, cores=available)
    threads = max(1, available // max_devices) if kind == "cpu" else 0
    local = LocalDevices(context, options.host, store.port, secret, kind, threads, options.emulate_speeds)
    grace_s = options.timeout_s + 5.0
    local_capacity = None if (kind == "cpu" and options.oversubscribe) else available
    state = membership.Membership(initial_devices=initial, max_devices=max_devices, grace_s=grace_s,
                                  local_capacity=local_capacity)
    coordinator = Coordinator(
        store, secret, store.get("job/salt").decode(), model_digest(model), __version__, state,
        spawn_local=local.spawn, stop_local=local.stop, local_exits=local.exits,
        heartbeat_timeout_s=options.heartbeat_timeout_s,
        on_note=lambda message: print(f"flexpar: {message}", file=sys.stderr, flush=True),
    )
    loop = DriverLoop(store, coordinator, options, total_steps, job.global_batch, address,
                      run_dir, metrics_path, exit_codes=lambda: dict(local.exit_codes), callbacks=callbacks)
    ended_well = False
    terminated = threading.Event()
    try:
        with _finish_on_sigterm(coordinator, terminated):
            coordinator.apply(membership.Start(initial))
            loop.run(DriverWaker(options.host, store.port, options.timeout_s, store))
        data = get_blob(store, "result", secret)
        result = training_state.from_bytes(data, torch.device("cpu"))
        model.load_state_dict(result["model"])
        summary = loop.summary(result["step"])
        summary["resumed_from"] = training_state.checkpoint_step(resume_path) if resume_path else None
        callbacks.call("on_end", summary)
        ended_well = True
    except TrainingError:
        if coordinator.stop_reason != membership.STOPPED_BEFORE_START:
            raise
        print("flexpar: stopped by SIGTERM before training started; nothing to keep", file=sys.stderr, flush=True)
        raise SystemExit(143) from None
    except (KeyboardInterrupt, _SecondSigterm) as interruption:
        what, code = (("a second SIGTERM", 143) if isinstance(interruption, _SecondSigterm)
                      else ("interrupted (Ctrl-C)", 130))
        tell_devices(store, "stop", what)
        local.shutdown(grace_s=2.0)
        print(f"flexpar: {what}; the workers are stopped", file=sys.stderr, flush=True)
        raise SystemExit(code) from None
    finally:
        if not store.check(["done"]):
            tell_devices(store, "stop", "the driver stopped")
        local.shutdown()
        callbacks.close(failed=not ended_well)
    if terminated.is_set():
        where = f"; checkpoint {summary['checkpoint']}" if summary["checkpoint"] else (
            "; no checkpoint (pass --checkpoint-dir to keep one)")
        print(f"flexpar: stopped by SIGTERM after step {summary['steps']}{where}", file=sys.stderr, flush=True)
        raise SystemExit(143)
    return model, summary


def resume_command(directory: str, argv: Optional[list] = None, script_argv: Optional[list] = None) -> str:
    """The command that resumes this job from the checkpoints in `directory`, ready to paste.

    Under `flexpar run`, the same command line with `--resume --checkpoint-dir
    DIRECTORY` added; for a plain `python train.py ARGS`, `flexpar run` with
    those two flags on the same script and arguments (the script's own fit()
    options stay in force). `argv` is the process's whole command line
    (sys.orig_argv), `script_argv` the script's own (sys.argv).
    """
    argv = list(getattr(sys, "orig_argv", None) or [sys.executable] + sys.argv) if argv is None else argv
    script_argv = list(sys.argv) if script_argv is None else script_argv
    added = ["flexpar", "run", "--resume", "--checkpoint-dir", directory]
    typed = script_argv[0] if script_argv and script_argv[0].endswith(".py") else ""
    # Absolute: the devices that print it may run on other hosts or in other folders.
    script = os.path.abspath(typed) if typed else "SCRIPT"
    for index, word in enumerate(argv[:-1]):  # .../bin/flexpar run ..., or python -m flexpar run ...
        if os.path.basename(word) == "flexpar" and argv[index + 1] == "run":
            rest = argv[index + 2:]
            position = rest.index(typed) if typed in rest else len(rest)
            return shlex.join(added + _without_resume_flags(rest[:position]) + [script] + rest[position + 1:])
    rest = script_argv[1:] if typed else []
    return shlex.join(added + [script] + (["--"] + rest if rest else []))


def _without_resume_flags(flags: list) -> list:
    """`flags` less --resume and --checkpoint-dir (resume_command puts its own first)."""
    kept, skip_value = [], False
    for flag in flags:
        if skip_value:
            skip_value = False
        elif flag == "--checkpoint-dir":
            skip_value = True
        elif flag != "--resume" and not flag.startswith("--checkpoint-dir="):
            kept.append(flag)
    return kept


def run_paths(options: FitOptions) -> tuple:
    """(run directory, metrics file): the metrics file's folder, or a fresh one under run_dir."""
    if options.metrics:
        return os.path.dirname(os.path.abspath(options.metrics)), options.metrics
    run_dir = os.path.join(options.run_dir, time.strftime("%Y%m%d-%H%M%S") + f"-{os.getpid()}")
    return run_dir, os.path.join(run_dir, "metrics.jsonl")


def advertised_host(host: str) -> str:
    """The name others join by: this host's name where the job listens on every interface."""
    if host in ("0.0.0.0", "::", ""):
        return socket.gethostname()  # not getfqdn: a reverse DNS lookup can take seconds in a container
    return host


def _keep_secret(options: FitOptions, secret: str, run_dir: str) -> str:
    """Where the banner says the secret is: printed only if the job is joinable from elsewhere.

    A secret the user gave is theirs already. A fresh one goes to a file only
    the owner can read; it is printed only when other hosts can reach the job
    (not loopback) or the user asked (`show_secret`), so logs do not hold it.
    """
    if options.secret:
        return "secret: the one you gave"
    os.makedirs(run_dir, exist_ok=True)
    path = os.path.join(run_dir, "secret")
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(descriptor, 0o600)  # a file left by an earlier run keeps its mode through O_CREAT
    with os.fdopen(descriptor, "w") as handle:
        handle.write(secret + "\n")
    if options.show_secret or not is_loopback(options.host):
        return f"secret {secret} (also in {path})"
    return f"secret in {path}"


def _banner(address, initial, kind, max_devices, options, secret_note, resume_path, cores=0) -> None:
    if max_devices > initial:
        growth = f"may grow to {max_devices}"
    else:
        growth = "cannot grow"
    how = ""
    if not options.max_devices:
        beyond_cores = (f"; more than this host's {cores} cores also need --oversubscribe"
                        if kind == "cpu" and not options.oversubscribe and cores else "")
        how = f" (--max-devices N, or fit(max_devices=N), allows more{beyond_cores})"
    print(f"flexpar: job at {address}; {initial} x {kind} device{'s' if initial != 1 else ''}, "
          f"{growth}{how}; {secret_note}", flush=True)
    if resume_path:
        print(f"flexpar: resuming from step {training_state.checkpoint_step(resume_path)} ({resume_path})",
              flush=True)


class _SecondSigterm(BaseException):
    """A second SIGTERM to the driver: stop the workers now, as Ctrl-C does (not an Exception: nothing
    of the user's may swallow it)."""


@contextlib.contextmanager
def _finish_on_sigterm(coordinator, terminated: threading.Event):
    """SIGTERM to the driver: the devices stop after the step in flight (final checkpoint).

    A second SIGTERM stops at once, as Ctrl-C does. Signal handlers can only
    be set in the main thread; elsewhere SIGTERM keeps its default.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_sigterm(signum, frame):
        if terminated.is_set():
            raise _SecondSigterm()
        terminated.set()
        coordinator.request_finish("the driver got SIGTERM", note=False)

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _publish_job(store, payload: bytes, settings: RunSettings, secret: str, digest: str) -> None:
    put_blob(store, "job/payload", payload, secret)
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


def join(address: str, devices: int, secret: str, script: Optional[str] = None, speed: float = 1.0,
         preemption_grace_s: Optional[float] = None, connect_timeout_s: float = 60.0) -> int:
    """Start `devices` workers on this host that join the running job at `address`.

    Waits up to `connect_timeout_s` for the job to answer (under SLURM or
    Kubernetes a joiner may start before its job listens). SIGTERM (a
    preemption notice) is passed on to the workers, which leave at the next
    step boundary; a second SIGTERM (more than worker_process.SAME_NOTICE_S after the
    first) is passed on too and stops them at once.
    Returns the workers' worst exit code (0: all left or finished).
    """
    host, _, port_text = address.rpartition(":")
    print(f"flexpar join: connecting to the job at {address} (waiting up to {connect_timeout_s:g} s)",
          file=sys.stderr, flush=True)
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
        args = WorkerArgs(host, int(port_text), device_id, secret, device, threads, speed, remote=True,
                          preemption_grace_s=preemption_grace_s)
        process = context.Process(target=_joiner_main, args=(args, script), name=f"flexpar-{device_id}")
        process.start()
        processes.append(process)
        device_ids.append(device_id)
    plural = "s" if devices != 1 else ""
    print(f"flexpar join: started {devices} {kind} device{plural} ({', '.join(device_ids)}); each joins at a step "
          "boundary once warm", file=sys.stderr, flush=True)

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
    codes = [128 - process.exitcode if (process.exitcode or 0) < 0 else process.exitcode or 0
             for process in processes]
    ended = ", ".join(f"{device_id} exit {code}" for device_id, code in zip(device_ids, codes))
    print(f"flexpar join: this host's devices have ended ({ended}; 0: left or finished)", file=sys.stderr,
          flush=True)
    return max(codes)
