"""What a worker process is started with, and the exit codes it ends with (plain data).

`WorkerArgs` come from whoever starts the process (the driver, `flexpar join`);
`RunSettings` from the driver, through the store, with the job.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

# Exit codes of a worker process, read by the driver and by `flexpar join`.
EXIT_EVICTED = 3
EXIT_DRIVER_LOST = 4
EXIT_MAIN_GUARD = (
    78  # fit() ran while the worker imported the user's script: the driver reports MAIN_GUARD_MESSAGE once
)

MAIN_GUARD_MESSAGE = (
    "fit() was called while a worker process imported your script. Put the training call under "
    '`if __name__ == "__main__":` so that workers can import the script without starting training again.'
)


@dataclass(frozen=True)
class WorkerArgs:
    """What a worker process needs to find its job; everything else comes from the store."""

    host: str
    port: int
    device_id: str
    secret: str
    device: str = "cpu"
    threads: int = 0
    speed: float = 1.0
    remote: bool = False
    preemption_grace_s: Optional[float] = None  # this host's own (flexpar join --preemption-grace)


@dataclass(frozen=True)
class RunSettings:
    """The parts of FitOptions a worker needs, published by the driver with the job."""

    total_steps: int
    backend: str
    timeout_s: float
    bucket_mb: float
    checkpoint_every: Optional[int]
    checkpoint_dir: Optional[str]
    resume_path: Optional[str]
    faults: tuple = ()  # (step, device_id, phase, signal): send the signal there (tests only)
    rescue_dir: str = ""  # where the last committed step goes if the driver is lost
    script: str = ""  # the job's script
    resume_command: str = (
        ""  # the command that resumes the job from its checkpoints (flexpar.driver.launch.resume_command)
    )
    preemption_grace_s: float = 30.0
    sample_ledger: bool = False  # count the samples each step consumed (flexpar.core.ledger)
    eval_every: Optional[int] = None  # evaluate every N committed steps (and after the last)
    eval_keys: tuple = ()  # the sorted metric names of job.evaluate (found by the driver)
    eval_verdict: bool = False  # wait after each evaluation for the driver's callbacks (on_eval may stop)
    keep_checkpoints: Optional[int] = None  # keep only the newest K checkpoints
    checkpoint_frozen: bool = False  # checkpoints hold the frozen weights too
    model_factory: Optional[dict] = None  # flexpar.core.frozen.factory_reference(job.model): export rebuilds by it
    driver_grace_s: float = 60.0  # after losing the driver, how long to wait for a restarted one
    driver_pid: int = 0  # the driver's process (tests' and the soak's driver faults: STEP:driver:PHASE)
    address: str = ""  # where the job listens (HOST:PORT, as the devices reach it)
    join_stream_mb: Optional[float] = None  # FitOptions.join_stream_mb (flexpar/worker/streaming.py)
    join_mode: str = "auto"  # FitOptions.join_mode (flexpar/worker/join_way.py)
