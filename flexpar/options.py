"""How a job runs: the options of `Job.fit()` and of `flexpar run`, one to one.

`FitOptions` is validated on construction, so a bad value is reported before
any process starts. The CLI builds the same dataclass from its flags.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import difflib
import math
from dataclasses import dataclass
from typing import Optional, Sequence, Union

from flexpar import callbacks as callbacks_module
from flexpar.core.join_choice import MODES as JOIN_MODES
from flexpar.errors import ArgumentError
from flexpar.observe import trackers as trackers_module
from flexpar.worker.fault_injection import SIGNALS, START_PHASES
from flexpar.worker.host import cpu_count  # noqa: F401  (flexpar.options.cpu_count: the driver's, the CLI's)


@dataclass(frozen=True)
class ScheduleChange:
    """At step `step`, add (`delta` > 0) or remove (`delta` < 0) devices."""

    step: int
    delta: int


def _parse_entries(text, entry_type, parse_entry) -> tuple:
    """A comma-separated option as a tuple of `entry_type`.

    `text` may be empty/None (no entries), a string of comma-separated entries
    (each given to `parse_entry`, which raises ValueError with its own message),
    or already a sequence of entries or of their fields (from Python callers).
    """
    if not text:
        return ()
    if not isinstance(text, str):
        return tuple(item if isinstance(item, entry_type) else entry_type(*item) for item in text)
    return tuple(parse_entry(part.strip()) for part in text.split(","))


def parse_schedule(text: Union[str, Sequence, None]) -> tuple:
    """'100:+1,200:-2' -> (ScheduleChange(100, 1), ScheduleChange(200, -2))."""
    return _parse_entries(text, ScheduleChange, _schedule_entry)


def _schedule_entry(part: str) -> ScheduleChange:
    step_text, _, delta_text = part.partition(":")
    try:
        return ScheduleChange(int(step_text), int(delta_text))
    except ValueError:
        raise ValueError(f"schedule entry {part!r} is not STEP:+N or STEP:-N (e.g. '100:+1,200:-2')") from None


@dataclass(frozen=True)
class SpeedChange:
    """At step `step`, emulated device `device` (local index) runs at relative `speed`."""

    step: int
    device: int
    speed: float


def parse_speed_changes(text) -> tuple:
    """'100:0=0.5' -> (SpeedChange(100, 0, 0.5),): an emulation aid for tests and benchmarks."""
    return _parse_entries(text, SpeedChange, _speed_entry)


def _speed_entry(part: str) -> SpeedChange:
    try:
        step_text, rest = part.split(":")
        device_text, speed_text = rest.split("=")
        change = SpeedChange(int(step_text), int(device_text), float(speed_text))
    except ValueError:
        raise ValueError(f"speed change {part!r} is not STEP:DEVICE=SPEED (e.g. '100:0=0.5')") from None
    if not 0 < change.speed <= 1 or change.step < 0 or change.device < 0:
        raise ValueError(f"speed change {part!r}: speed in (0, 1], step and device >= 0")
    return change


FAULT_PHASES = (
    "forward",
    "backward",
    "sync",
    "update",
    "transfer",
    "formation",
    "checkpoint",
    "eval",
    "record",
    "stream",
    "finish",
) + START_PHASES
# The driver's own: it dies as the record of the step arrives, before it writes it (the devices committed
# the step, their rank 0 sent its record, nobody wrote it).
DRIVER_ONLY_PHASES = ("record",)
FAULT_SIGNALS = tuple(SIGNALS) + ("tamper", "starve")


@dataclass(frozen=True)
class Fault:
    """Fault injection for tests: at `step` during `phase`, `device` gets `signal`.

    Phases: forward, backward, sync (with gradient buckets in flight), update
    (after this device's optimizer update of step `step`, before a sharded job's
    parameter broadcast), transfer (while this device sends the training state
    to a joiner, or hands a sharded job's state over), formation (as a
    new generation's group forms; `step` is the device's committed step),
    checkpoint (as rank 0 writes a checkpoint), eval (in the evaluation after `step`
    committed steps, before its all-reduce), stream (a streamed join: as this
    device posts its slice of the state after step `step`'s update), finish (a sharded job's end: after the
    all-reduce that says every member wrote its part of the final checkpoint; `step` is the job's last
    committed step, its steps count). Signals: kill (kill -9: a
    crash), term (SIGTERM: a preemption notice) and stop (SIGSTOP: a hung peer);
    tamper (phase stream only: the device sends a slice with one value changed);
    starve (the device's follower thread stops running, as on a loaded host, until the
    device notices that its driver is gone, or 10 s).
    `device` "driver" (kill only): the device that is rank 0 there (the sender,
    for transfer) kills the job's driver with kill -9, as an OOM killer would.
    """

    step: int
    device: str
    phase: str
    signal: str = "kill"


def parse_faults(text) -> tuple:
    """'7:local-1:backward' -> (Fault(7, 'local-1', 'backward'),); '7:local-1:forward:term' sends SIGTERM."""
    return _parse_entries(text, Fault, _fault_entry)


def _fault_entry(part: str) -> Fault:
    pieces = part.split(":")
    if (
        len(pieces) not in (3, 4)
        or not pieces[0].isdigit()
        or pieces[2] not in FAULT_PHASES
        or (len(pieces) == 4 and pieces[3] not in FAULT_SIGNALS)
    ):
        raise ValueError(
            f"fault {part!r} is not STEP:DEVICE:PHASE[:SIGNAL] with PHASE one of "
            f"{', '.join(FAULT_PHASES)} and SIGNAL one of {', '.join(FAULT_SIGNALS)}"
        )
    if pieces[1] == "driver" and pieces[3:] not in ([], ["kill"]):
        raise ValueError(f"fault {part!r}: the driver can only be killed (STEP:driver:PHASE)")
    if pieces[3:] == ["tamper"] and pieces[2] != "stream":
        raise ValueError(f"fault {part!r}: tamper is a fault of the stream phase only (STEP:DEVICE:stream:tamper)")
    if pieces[1] != "driver" and pieces[2] in DRIVER_ONLY_PHASES:
        raise ValueError(f"fault {part!r}: {pieces[2]} is a phase of the driver only (STEP:driver:{pieces[2]})")
    return Fault(int(pieces[0]), pieces[1], pieces[2], *pieces[3:])


@dataclass(frozen=True)
class FitOptions:
    """Everything about a run that is not the model: length, devices, elasticity, output."""

    steps: Optional[int] = None
    epochs: Optional[int] = None
    devices: Optional[int] = None
    max_devices: Optional[int] = None
    schedule: tuple = ()
    emulate_speeds: Optional[tuple] = None
    speed_changes: tuple = ()
    faults: tuple = ()
    host: str = "127.0.0.1"
    port: int = 0
    timeout_s: float = 30.0
    backend: str = "auto"
    oversubscribe: bool = False
    metrics: Optional[str] = None
    run_dir: str = "runs"
    display: Optional[bool] = None
    log_every: int = 10
    checkpoint_every: Optional[int] = None
    checkpoint_dir: Optional[str] = None
    resume: bool = False
    bucket_mb: float = 25.0
    secret: Optional[str] = None
    quiet: bool = False
    verbose: bool = False  # devices' tracebacks on the terminal, not only in the run directory
    show_secret: bool = False  # print the secret in the banner even when listening on loopback
    preemption_grace_s: float = 30.0  # after SIGTERM, how long a device may take to leave
    heartbeat_timeout_s: float = 5.0  # a device silent this long is dead (a hung peer), well under timeout_s
    sample_ledger: bool = False  # record the samples each committed step consumed (ledger.jsonl)
    eval_every: Optional[int] = None  # evaluate every N steps (and after the last) when the job has an eval set
    callbacks: tuple = ()  # objects with on_step / on_event / on_eval / on_end (flexpar.callbacks)
    trackers: tuple = ()  # "tensorboard", "mlflow", "wandb", "csv" (flexpar.observe.trackers)
    keep_checkpoints: Optional[int] = None  # keep only the newest K checkpoints
    checkpoint_frozen: bool = False  # checkpoints hold the frozen weights too (default: trainable state + digests)
    driver_grace_s: float = 60.0  # devices that lost the driver wait this long for a restarted one (0: exit)
    # A joiner listens while the state streams to it (flexpar/worker/streaming.py): each sender's MB per step
    # (None: a share of the step time at the link's rate; 0: no streaming, the blocking transfer).
    join_stream_mb: Optional[float] = None
    # How a joiner comes in (flexpar/core/join_choice.py): "auto" predicts both ways' cost to the members
    # and takes the cheaper; "stream" or "blocking" forces one (join_stream_mb=0 forces "blocking" too).
    join_mode: str = "auto"

    def __post_init__(self):
        object.__setattr__(self, "schedule", parse_schedule(self.schedule))
        object.__setattr__(self, "speed_changes", parse_speed_changes(self.speed_changes))
        object.__setattr__(self, "faults", parse_faults(self.faults))
        if self.emulate_speeds is not None:
            object.__setattr__(self, "emulate_speeds", _parse_speeds(self.emulate_speeds))
        if (self.steps is None) == (self.epochs is None):
            raise ValueError(f"give exactly one of steps= and epochs= (got steps={self.steps}, epochs={self.epochs})")
        _positive("steps", self.steps)
        _positive("epochs", self.epochs)
        _positive("devices", self.devices)
        _positive("max_devices", self.max_devices)
        _positive("checkpoint_every", self.checkpoint_every)
        _positive("log_every", self.log_every)
        _positive("eval_every", self.eval_every)
        _positive("keep_checkpoints", self.keep_checkpoints)
        if self.join_stream_mb is not None and not self.join_stream_mb >= 0:
            raise ValueError(
                f"join_stream_mb={self.join_stream_mb} must be >= 0 (MB a sender streams to a joiner per step; "
                "0: joins with a blocking transfer)"
            )
        if self.join_mode not in JOIN_MODES:
            raise ValueError(
                f"join_mode={self.join_mode!r}: choose one of {', '.join(repr(mode) for mode in JOIN_MODES)} "
                "(auto: the cheaper way for the members, predicted at each join)"
            )
        if self.join_mode == "stream" and self.join_stream_mb == 0:
            raise ValueError(
                "join_mode='stream' contradicts join_stream_mb=0 (which joins with the blocking transfer): "
                "drop one of them"
            )
        if self.devices is not None and self.max_devices is not None and self.devices > self.max_devices:
            raise ValueError(_more_than_max_devices(self.devices, self.max_devices))
        if self.keep_checkpoints is not None and self.checkpoint_dir is None:
            raise ValueError(f"keep_checkpoints={self.keep_checkpoints} needs checkpoint_dir= (where they are)")
        if self.checkpoint_frozen and self.checkpoint_dir is None:
            raise ValueError("checkpoint_frozen=True needs checkpoint_dir= (where the checkpoints go)")
        object.__setattr__(self, "callbacks", callbacks_module.check_callbacks(self.callbacks))
        object.__setattr__(self, "trackers", trackers_module.check_names(self.trackers))
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s={self.timeout_s} must be positive (seconds)")
        if self.preemption_grace_s <= 0:
            raise ValueError(f"preemption_grace_s={self.preemption_grace_s} must be positive (seconds)")
        if self.heartbeat_timeout_s <= 0:
            raise ValueError(f"heartbeat_timeout_s={self.heartbeat_timeout_s} must be positive (seconds)")
        grace = self.driver_grace_s
        if not isinstance(grace, (int, float)) or isinstance(grace, bool) or not 0 <= grace < math.inf:
            raise ValueError(
                f"driver_grace_s={grace!r} must be a number of seconds >= 0 (how long devices that lost the "
                "driver wait for a restarted one; 0: they exit at once with the survivors' checkpoint)"
            )
        if self.backend not in ("auto", "gloo", "nccl"):
            raise ValueError(f"backend={self.backend!r}: choose 'auto', 'gloo' or 'nccl'")
        if self.checkpoint_every is not None and self.checkpoint_dir is None:
            raise ValueError(f"checkpoint_every={self.checkpoint_every} needs checkpoint_dir= (where to write them)")
        if self.resume and self.checkpoint_dir is None:
            raise ValueError("resume=True needs checkpoint_dir= (where the checkpoints are)")
        for change in self.schedule:
            if change.step < 1 or change.delta == 0:
                raise ValueError(
                    f"schedule entry {change.step}:{change.delta:+d}: the step must be >= 1 and the change non-zero"
                )
        if not 0 <= self.port < 65536:
            raise ValueError(f"port={self.port} is not a TCP port (0 picks a free one)")

    def validate_devices(self, initial: int, available: int, kind: str, virtual_workers: Optional[int] = None) -> int:
        """The maximum device count, after checking every count the schedule reaches.

        Every device runs at least one virtual worker, so a job never has more
        devices than `virtual_workers`: asking for more is an error, and a default
        maximum (every GPU) is capped there.
        """
        count = initial
        counts = [initial]
        for change in sorted(self.schedule, key=lambda change: change.step):
            count += change.delta
            counts.append(count)
            if count < 1:
                raise ValueError(
                    f"the schedule leaves {count} devices after step {change.step}: at least one must stay"
                )
        peak = max(counts)
        if virtual_workers is not None:
            for what, count in (("devices", initial), ("the schedule's peak", peak), ("max_devices", self.max_devices)):
                if count is not None and count > virtual_workers:
                    raise ValueError(
                        f"{what} is {count} but the job has {virtual_workers} virtual workers, and every device "
                        f"runs at least one: ask for at most {virtual_workers} devices, or cut the global batch "
                        "into more virtual workers"
                    )
        # Without --max-devices: what the schedule reaches, or every GPU of this host.
        maximum = self.max_devices or max(peak, available if kind == "cuda" else peak)
        if virtual_workers is not None:
            maximum = min(maximum, virtual_workers)
        if self.max_devices is not None and initial > self.max_devices:
            raise ValueError(_more_than_max_devices(initial, self.max_devices, chosen=self.devices is None))
        if peak > maximum:
            raise ValueError(f"the schedule reaches {peak} devices but max_devices={maximum}; raise --max-devices")
        if kind == "cuda" and peak > available:
            raise ValueError(
                f"asked for {peak} devices but this machine has {available} GPUs; ask for at most "
                f"{available} (or add devices from other hosts with `flexpar join`)"
            )
        if kind == "cpu" and peak > available and not self.oversubscribe:
            raise ValueError(
                f"asked for {peak} CPU devices but this machine has {available} cores; ask for at "
                f"most {available}, or pass oversubscribe=True (--oversubscribe) to run more CPU "
                "processes than cores"
            )
        if self.emulate_speeds is not None and len(self.emulate_speeds) < initial:
            raise ValueError(
                f"emulate_speeds has {len(self.emulate_speeds)} entries for {initial} devices; "
                "give one relative speed per device"
            )
        return maximum


def _parse_speeds(speeds) -> tuple:
    if isinstance(speeds, str):
        speeds = [part for part in speeds.split(",") if part.strip()]
    try:
        values = tuple(float(speed) for speed in speeds)
    except ValueError:
        raise ValueError(f"emulate_speeds={speeds!r}: give numbers like '1,1,0.5'") from None
    for value in values:
        if not 0 < value <= 1:
            raise ValueError(f"emulate_speeds entry {value}: relative speeds are in (0, 1]; 1 is the real speed")
    return values


def _more_than_max_devices(devices: int, max_devices: int, chosen: bool = False) -> str:
    """`chosen`: flexpar chose the device count (every GPU of this host), the user did not give it."""
    what = f"devices={devices}" + (" (every GPU here, the default)" if chosen else "")
    return (
        f"{what} is more than max_devices={max_devices}, the most the job may grow to: ask for at "
        f"most {max_devices} device{'' if max_devices == 1 else 's'} (--devices), or raise max_devices (--max-devices)"
    )


def _positive(name, value):
    if value is not None and (not isinstance(value, int) or value < 1):
        raise ValueError(f"{name}={value!r} must be a positive whole number")


# The launcher (`flexpar run`) runs the user's script in-process; the options it
# was given on the command line override what the script passes to fit(). A
# context variable scopes them to that run, rather than an environment variable.
_command_line = contextvars.ContextVar("flexpar_command_line", default=None)


@contextlib.contextmanager
def command_line_options(overrides: dict):
    token = _command_line.set(dict(overrides))
    try:
        yield
    finally:
        _command_line.reset(token)


def resolve(fit_arguments: dict) -> FitOptions:
    """The options of one fit() call: its arguments, overridden by the command line."""
    merged = {key: value for key, value in fit_arguments.items() if value is not None}
    overrides = _command_line.get() or {}
    if overrides.get("steps") is not None or overrides.get("epochs") is not None:
        merged.pop("steps", None)
        merged.pop("epochs", None)
    merged.update({key: value for key, value in overrides.items() if value is not None})
    known = [field.name for field in dataclasses.fields(FitOptions)]
    for name in sorted(set(merged) - set(known)):  # a typo, as with a flag: the closest option
        close = difflib.get_close_matches(name, known, n=1)
        raise ArgumentError(
            f"fit() has no option {name}="
            + (f"; did you mean {close[0]}=?" if close else " (its options are flexpar.FitOptions' fields)")
        )
    return FitOptions(**merged)


def is_loopback(host: str) -> bool:
    """Whether `host` is reachable only from this machine (127.0.0.0/8, ::1, localhost)."""
    return host in ("localhost", "::1") or host.startswith("127.")
