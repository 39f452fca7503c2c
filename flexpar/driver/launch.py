"""The driver's start: check the job, host the store and the coordinator, start the local workers.

`run(job, options)` is what `Job.fit()` calls: it checks what can be checked
here (flexpar/driver/prestart.py, with flexpar/driver/job_checks.py), publishes the job in the store, starts
the local devices (flexpar/driver/local_devices.py: worker processes forked
from the fork server, each running `flexpar.worker.process.main`), and runs
the driver's loop (flexpar/driver/driver_loop.py) until the job ends; then it
loads the trained model. `flexpar join` on another host is
flexpar/driver/join.py.

With `resume=True` (`flexpar run --resume`: the job's resume command), the
driver first asks its address whether devices that outlived the job's earlier
driver are waiting there (an adoption window: flexpar/driver/readopt.py): it
re-adopts them and trains on from the step they hold, without reading a
checkpoint; only when none comes back does it resume from the newest
checkpoint with fresh devices.
"""

from __future__ import annotations

import dataclasses
import json
import os
import secrets
import shlex
import socket
import sys
import time
from dataclasses import asdict
from typing import Optional, Sequence

from flexpar import callbacks as callbacks_module
from flexpar.comm import waiting
from flexpar.comm.protocol import DRIVER_KEY, put_blob, secret_check, tell_devices
from flexpar.comm.store import connect
from flexpar.core import adoption, factory_checks, frozen, membership
from flexpar.data import pass_record
from flexpar.driver import readopt, training
from flexpar.driver.coordinator import Coordinator
from flexpar.driver.job_checks import check_checkpoint_folder, checkpoint_folder
from flexpar.driver.local_devices import LocalDevices
from flexpar.driver.prestart import CheckedJob, check_job, resume_note  # noqa: F401  (resume_note: kept importable here)
from flexpar.observe import trackers as trackers_module
from flexpar.observe.log_lines import format_sharding
from flexpar.options import FitOptions, is_loopback
from flexpar.version import __version__
from flexpar.worker import checkpoints
from flexpar.worker.settings import RunSettings
from flexpar.worker.user_code import model_digest


@dataclasses.dataclass(frozen=True)
class HostedJob:
    """The job as the driver hosts it: its store and address, its published settings, its callbacks."""

    store: object
    secret: str
    address: str
    run_dir: str
    metrics_path: str
    callbacks: callbacks_module.Dispatcher
    settings: RunSettings


def run(job, options: FitOptions) -> tuple:
    """Check everything that can be checked here, then train `job` (a `flexpar.Job`) on worker processes.

    Returns (the trained model, the summary): `Job.fit` hands them to the user as a `FitResult`.
    """
    # The checkpoint folder is this run's until it returns or raises (a lock in it: job_checks.lock_folder).
    folder = check_checkpoint_folder(options)
    try:
        checked = check_job(job, options)
        hosted = _host_job(job, options, checked)
        _record_stream_passes(options, checked, hosted.run_dir)
        local = _local_devices(options, checked, hosted)
        state = _membership(job, options, checked)
        coordinator = _coordinator(job, options, checked, hosted, state, local)
        _announce_driver(hosted.store, options)
        summary, terminated = training.train(job, options, checked, hosted, coordinator, local)
        training.finish(terminated, summary, hosted.settings)
    finally:
        if folder is not None:
            folder.release()
    return checked.model, summary


def _host_job(job, options: FitOptions, checked: CheckedJob) -> HostedJob:
    """Open the job's store (where a second driver at the same address stops), publish the job, print the banner."""
    run_dir, metrics_path = run_paths(options)
    callbacks = callbacks_module.Dispatcher(
        options.callbacks + tuple(trackers_module.create(options.trackers, run_dir, resume=options.resume))
    )
    secret = options.secret or secrets.token_hex(16)
    store = connect(options.host, options.port, options.timeout_s, server=True)  # a second driver stops here
    address = f"{advertised_host(options.host)}:{store.port}"
    pins = resume_pins(options, store.port, run_dir, metrics_path)
    settings = _run_settings(job, options, checked, callbacks, address, run_dir, pins)
    _publish_job(store, checked.payload, settings, secret, model_digest(checked.model))
    secret_note = _keep_secret(options, secret, run_dir)
    if not options.quiet:
        _banner(
            address,
            checked.initial,
            checked.kind,
            checked.max_devices,
            options,
            secret_note,
            cores=checked.available,
            sharding=format_sharding(job.shard_optimizer, job.shard_redundancy),
        )
    return HostedJob(store, secret, address, run_dir, metrics_path, callbacks, settings)


def _run_settings(
    job, options: FitOptions, checked: CheckedJob, callbacks, address: str, run_dir: str, pins
) -> RunSettings:
    """What every device of the job is told: the options resolved once into the workers' settings."""
    script = getattr(sys.modules.get("__main__"), "__file__", None) or ""
    return RunSettings(
        checked.total_steps,
        checked.backend,
        options.timeout_s,
        options.bucket_mb,
        options.checkpoint_every,
        options.checkpoint_dir,
        None,
        tuple((f.step, f.device, f.phase, f.signal) for f in options.faults),
        rescue_dir=os.path.abspath(run_dir),
        script=os.path.abspath(script) if script else "",
        resume_command=resume_command(os.path.abspath(options.checkpoint_dir or run_dir), pins=pins),
        preemption_grace_s=options.preemption_grace_s,
        sample_ledger=options.sample_ledger,
        eval_every=options.eval_every,
        eval_keys=checked.eval_keys,
        eval_verdict=bool(options.eval_every and checked.eval_keys and callbacks.can_stop_at_eval),
        keep_checkpoints=options.keep_checkpoints,
        checkpoint_frozen=options.checkpoint_frozen,
        model_factory=frozen.factory_reference(job.model),
        driver_grace_s=options.driver_grace_s,
        driver_pid=os.getpid(),
        address=address,
        join_stream_mb=options.join_stream_mb,
        join_mode=options.join_mode,
    )


def _local_devices(options: FitOptions, checked: CheckedJob, hosted: HostedJob) -> LocalDevices:
    """This host's devices, started later by the coordinator; a CPU device gets its share of the cores."""
    threads = max(1, checked.available // checked.max_devices) if checked.kind == "cpu" else 0
    return LocalDevices(
        checked.context, options.host, hosted.store.port, hosted.secret, checked.kind, threads, options.emulate_speeds
    )


def _membership(job, options: FitOptions, checked: CheckedJob) -> membership.Membership:
    """The device set's first state; with --resume, the adoption window opened on it."""
    state = membership.Membership(
        initial_devices=checked.initial,
        max_devices=checked.max_devices,
        grace_s=options.timeout_s + 5.0,
        local_capacity=None if (checked.kind == "cpu" and options.oversubscribe) else checked.available,
        hand_off=bool(job.shard_optimizer),  # a sharded job's leavers hold state: they hand it over first
    )
    if options.resume:
        newest = checked.newest
        state = readopt.open_window(state, newest, checkpoints.checkpoint_step(newest) if newest else -1)
    return state


def _coordinator(job, options, checked: CheckedJob, hosted: HostedJob, state, local: LocalDevices) -> Coordinator:
    """The coordinator that carries out the membership's decisions on this job's store and local devices."""
    store, settings = hosted.store, hosted.settings

    def resume_from(action: membership.NothingToAdopt) -> None:
        """No device came back: the newest checkpoint's settings, published before any device starts."""
        if not action.checkpoint:
            raise ValueError(
                f"resume=True but {options.checkpoint_dir} holds no checkpoint (step-*.pt), and no device "
                f"waits at {hosted.address} to be re-adopted"
            )
        store.set("job/settings", json.dumps(asdict(dataclasses.replace(settings, resume_path=action.checkpoint))))
        if not options.quiet:
            step = checkpoints.checkpoint_step(action.checkpoint)
            print(f"flexpar: resuming from step {step} ({action.checkpoint})", flush=True)

    return Coordinator(
        store,
        hosted.secret,
        store.get("job/salt").decode(),
        model_digest(checked.model),
        __version__,
        state,
        spawn_local=local.spawn,
        stop_local=local.stop,
        local_exits=local.exits,
        heartbeat_timeout_s=options.heartbeat_timeout_s,
        on_note=lambda message: print(f"flexpar: {message}", file=sys.stderr, flush=True),
        frozen_reference=checked.reference.result,
        job_shapes=factory_checks.model_shapes(checked.model),
        adopt_local=local.adopt,
        fingerprint=adoption.fingerprint(job, settings, __version__),
        resume_from=resume_from,
        seen_waiting=lambda: [report["device_id"] for report in waiting.read(store.port)],
    )


def _record_stream_passes(options: FitOptions, checked: CheckedJob, run_dir: str) -> None:
    """epochs= over a stream: the pass lengths counted, kept where `--resume` looks (the checkpoint folder,
    else the run directory), so that a resumed or re-adopting driver does not read the stream again."""
    counted = checked.epoch_count
    if counted is not None and not counted.reused:
        folder = checkpoint_folder(options)[0] or run_dir
        pass_record.write(folder, counted.fingerprint, [list(group) for group in counted.lengths])


def _announce_driver(store, options: FitOptions) -> None:
    """Last before training: what this driver is, and whether it re-adopts devices that outlived the one before it."""
    instance = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time(), "adopting": options.resume}
    tell_devices(store, DRIVER_KEY, json.dumps(instance))


def resume_pins(options: FitOptions, port: int, run_dir: str, metrics_path: str) -> list:
    """Flags the resume command adds so that a restarted driver is this job's: at its address (a port
    that was picked free), with its secret (one made here), continuing its metrics file."""
    pins = [] if options.port else ["--port", str(port)]
    if not options.secret:
        pins += ["--secret-file", os.path.join(os.path.abspath(run_dir), "secret")]
    if not options.metrics:
        pins += ["--metrics", os.path.abspath(metrics_path)]
    return pins


def resume_command(
    directory: str, argv: Optional[list] = None, script_argv: Optional[list] = None, pins: Sequence[str] = ()
) -> str:
    """The command that resumes this job, ready to paste: it re-adopts the devices waiting at the job's
    address, or resumes from the checkpoints in `directory` when none is.

    Under `flexpar run`, the same command line with `--resume --checkpoint-dir
    DIRECTORY` and `pins` (`resume_pins`: the job's port, secret file and
    metrics file where the job made them up) added, and its `--devices`
    left out: the devices print this command when the driver is lost, by
    which time the job may have grown or shrunk, and the restarted driver
    re-adopts the devices that wait for it, however many (a driver that
    stops on SIGTERM adds the count it ended with: training.finish); for a plain `python
    train.py ARGS`, `flexpar run` with those flags on the same script and
    arguments (the script's own fit() options stay in force). `argv` is the
    process's whole command line (sys.orig_argv), `script_argv` the script's
    own (sys.argv).
    """
    argv = list(getattr(sys, "orig_argv", None) or [sys.executable] + sys.argv) if argv is None else argv
    script_argv = list(sys.argv) if script_argv is None else script_argv
    added = ["flexpar", "run", "--resume", "--checkpoint-dir", directory, *pins]
    typed = script_argv[0] if script_argv and script_argv[0].endswith(".py") else ""
    # Absolute: the devices that print it may run on other hosts or in other folders.
    script = os.path.abspath(typed) if typed else "SCRIPT"
    for index, word in enumerate(argv[:-1]):  # .../bin/flexpar run ..., or python -m flexpar run ...
        if os.path.basename(word) == "flexpar" and argv[index + 1] == "run":
            rest = argv[index + 2 :]
            position = rest.index(typed) if typed in rest else len(rest)
            kept = _without_flags(rest[:position], ("--checkpoint-dir", "--devices", *pins[::2]))
            return shlex.join(added + kept + [script] + rest[position + 1 :])
    rest = script_argv[1:] if typed else []
    return shlex.join(added + [script] + (["--"] + rest if rest else []))


def _without_flags(flags: list, valued: Sequence[str]) -> list:
    """`flags` less --resume and the `valued` flags with their values (resume_command puts its own first)."""
    kept, skip_value = [], False
    for flag in flags:
        if skip_value:
            skip_value = False
        elif flag in valued:
            skip_value = True
        elif flag != "--resume" and not any(flag.startswith(name + "=") for name in valued):
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


def _banner(address, initial, kind, max_devices, options, secret_note, cores=0, sharding="") -> None:
    if max_devices > initial:
        growth = f"may grow to {max_devices}"
    else:
        growth = "cannot grow"
    how = ""
    if not options.max_devices:
        beyond_cores = (
            f"; more than this host's {cores} cores also need --oversubscribe"
            if kind == "cpu" and not options.oversubscribe and cores
            else ""
        )
        how = f" (--max-devices N, or fit(max_devices=N), allows more{beyond_cores})"
    print(
        f"flexpar: job at {address}; {initial} x {kind} device{'s' if initial != 1 else ''}, "
        f"{growth}{how}; " + (f"optimizer state {sharding}; " if sharding else "") + secret_note,
        flush=True,
    )


def _publish_job(store, payload: bytes, settings: RunSettings, secret: str, digest: str) -> None:
    put_blob(store, "job/payload", payload, secret)
    store.set("job/settings", json.dumps(asdict(settings)))
    salt = secrets.token_hex(8)
    store.set("job/salt", salt)
    store.set("job/secret_check", secret_check(secret, salt))
    store.set("job/version", __version__)
    store.set("job/digest", digest)
    main_file = getattr(sys.modules.get("__main__"), "__file__", None)
    store.set("job/script", os.path.abspath(main_file) if main_file else "")
