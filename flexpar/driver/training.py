"""The driver's training phase: start (or re-adopt) the devices, run the driver's loop, load the result.

`launch.run` calls `train` once the job is checked, hosted and its coordinator
built. Here are the driver's ways out: Ctrl-C or a second SIGTERM stop the
workers at once (exit 130 or 143); a first SIGTERM lets the devices finish the
step in flight and keep a checkpoint (`finish` then exits 143 and says how to
resume). Whatever happens, the devices that are this driver's are told to stop
and the callbacks are closed.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading

import torch

from flexpar.comm import state_transfer as training_state
from flexpar.comm.protocol import JOB_ENDED, get_blob, tell_devices
from flexpar.core import frozen, membership, resume_words, stream_split
from flexpar.core import ledger as sample_ledger
from flexpar.driver import readopt
from flexpar.driver.driver_loop import DriverLoop
from flexpar.driver.waker import DriverWaker
from flexpar.errors import TrainingError
from flexpar.observe.log_lines import format_sharding
from flexpar.options import FitOptions
from flexpar.worker import checkpoints
from flexpar.worker.settings import RunSettings


def train(job, options: FitOptions, checked, hosted, coordinator, local) -> tuple:
    """Train until the job ends; returns (the summary, whether SIGTERM finished it) with the result in the model.

    `checked` and `hosted` are prestart's CheckedJob and launch's HostedJob.

    Ctrl-C or a second SIGTERM stops the workers at once (exit 130 or 143); whatever happens, the
    devices that are this driver's are told to stop and the callbacks are closed.
    """
    store, callbacks = hosted.store, hosted.callbacks
    waker = DriverWaker(options.host, store.port, options.timeout_s, store)
    loop = None
    ended_well = False
    terminated = threading.Event()
    try:
        with _finish_on_sigterm(coordinator, terminated):
            resumed_from, resumed_by = _start(coordinator, waker, options, checked.initial)
            loop = DriverLoop(
                store,
                coordinator,
                options,
                checked.total_steps,
                job.global_batch,
                hosted.address,
                hosted.run_dir,
                hosted.metrics_path,
                exit_codes=lambda: dict(local.exit_codes),
                callbacks=callbacks,
                resumed_from=resumed_from,
                adopted=resumed_by == "adoption",
                sharding=format_sharding(job.shard_optimizer, job.shard_redundancy),
            )
            loop.run(waker)
        data = get_blob(store, "result", hosted.secret)
        result = training_state.from_bytes(data, torch.device("cpu"))
        _load_result(checked.model, result["model"])
        summary = loop.summary(result["step"])
        _record_job_end(job, options, checked, hosted.run_dir, result["step"])
        summary["resumed_from"] = resumed_from if resumed_by else None
        summary["resumed_by"] = resumed_by
        callbacks.call("on_end", summary)
        ended_well = True
    except TrainingError:
        if coordinator.stop_reason != membership.STOPPED_BEFORE_START:
            raise
        print("flexpar: stopped by SIGTERM before training started; nothing to keep", file=sys.stderr, flush=True)
        raise SystemExit(143) from None
    except (KeyboardInterrupt, _SecondSigterm) as interruption:
        what, code = (
            ("a second SIGTERM", 143) if isinstance(interruption, _SecondSigterm) else ("interrupted (Ctrl-C)", 130)
        )
        tell_devices(store, "stop", what)
        local.shutdown(grace_s=2.0)
        print(f"flexpar: {what}; the workers are stopped", file=sys.stderr, flush=True)
        raise SystemExit(code) from None
    finally:
        if loop is None:
            waker.close()
        # Devices still in the adoption window, or waiting at an address where this driver declined them
        # (another job's), are not this driver's to stop: they wait on for a driver of their own.
        if store.check(["done"]):  # joiners still on their way leave quietly: there is nothing left to join
            tell_devices(store, "stop", JOB_ENDED)
        elif coordinator.declined is None and coordinator.state.adoption is None:
            tell_devices(store, "stop", "the driver stopped")
        local.shutdown()
        callbacks.close(failed=not ended_well)
    return summary, terminated.is_set()


def _record_job_end(job, options: FitOptions, checked, run_dir: str, final_step: int) -> None:
    """With sample_ledger=True and epochs= over a stream: the pass ends no step met, which the job's end
    meets once it has trained its last step (stream_split.job_end_pass_ends), go to the ledger, so that it
    names every item of the job's passes as trained or left out (the devices record the pass ends their
    steps meet; these, only the driver that counted the passes knows)."""
    counted = checked.epoch_count
    if not options.sample_ledger or counted is None or final_step < checked.total_steps:
        return
    ends = stream_split.job_end_pass_ends(counted.lengths, counted.chunk, checked.total_steps, job.pass_end)
    sample_ledger.write_job_end(os.path.join(run_dir, "ledger.jsonl"), checked.total_steps, ends)


def _start(coordinator, waker, options: FitOptions, initial: int) -> tuple:
    """Start the devices, or (--resume) re-adopt those that outlived the earlier driver; returns
    (the step training resumes from, "adoption" or "checkpoint"), or (-1, None) for a fresh start."""
    if not options.resume:
        coordinator.apply(membership.Start(initial))
        return -1, None
    readopt.run_window(coordinator, waker)
    if coordinator.nothing_to_adopt is None:
        resumed_from = coordinator.published[-1].adopted.step
        if not options.quiet:
            print(f"flexpar: {readopt.adopted_summary(coordinator)}", flush=True)
        return resumed_from, "adoption"
    return checkpoints.checkpoint_step(coordinator.nothing_to_adopt.checkpoint), "checkpoint"


def finish(terminated: bool, summary: dict, settings: RunSettings) -> None:
    """After a SIGTERM that finished the job: say where it stopped and how to resume, and exit 143."""
    if not terminated:
        return
    where = (
        f"; checkpoint {summary['checkpoint']}; resume with: {resume_with_devices(settings.resume_command, summary)}"
        if summary["checkpoint"]
        else ("; no checkpoint (pass --checkpoint-dir to keep one)")
    )
    print(f"flexpar: stopped by SIGTERM after step {summary['steps']}{where}", file=sys.stderr, flush=True)
    raise SystemExit(143)


def resume_with_devices(command: str, summary: dict) -> str:
    """The job's resume command (launch.resume_command, no device count) with the count of this host's
    devices the job ended with, so that it comes back as it was: `--devices K` after `--resume`
    (flexpar/core/resume_words.py)."""
    return resume_words.with_device_count(command, resume_words.local_count(summary.get("devices", ())), always=True)


def _load_result(model, model_state: dict) -> None:
    """The trained state from rank 0: trainable parameters and changed buffers; the frozen part is the driver's."""
    problem = frozen.load_problem(frozen.model_layout(model), list(model_state))
    if problem:
        raise TrainingError(f"the job's result cannot be loaded: {problem}")
    model.load_state_dict(model_state, strict=False)


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
