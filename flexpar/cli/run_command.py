"""`flexpar run [flags] SCRIPT [script arguments]`: the user's script, run here with the flags in force.

The flags map one to one onto `FitOptions`; the script runs in this process
as `__main__`, and its own `fit()` call picks them up (they override what the
script passes: flexpar/options.py's `command_line_options`).
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import signal
import sys
import traceback
import types

from flexpar import options as options_module
from flexpar.cli.cluster_environment import listen_address, read_secret
from flexpar.errors import TrainingError, UserCodeError


def add_run_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--devices", type=int, help="devices to start with (default: all GPUs, else 1 CPU process)")
    parser.add_argument("--max-devices", type=int, help="the most devices the job may grow to")
    parser.add_argument("--steps", type=int, help="optimizer steps (overrides the script)")
    parser.add_argument("--epochs", type=int, help="epochs (overrides the script)")
    parser.add_argument(
        "--schedule",
        help=(
            "scripted device changes, e.g. '100:+1,200:-2': a leave at step N takes effect at the "
            "boundary before step N, a join once its new device is warm"
        ),
    )
    parser.add_argument("--emulate-speeds", help="emulated relative device speeds, e.g. '1,1,0.5,0.25'")
    parser.add_argument("--host", help="address to listen on (default 127.0.0.1, loopback only)")
    parser.add_argument("--port", type=int, help="port to listen on (default: a free one)")
    parser.add_argument("--timeout", dest="timeout_s", type=float, help="collective timeout in seconds (default 30)")
    parser.add_argument("--backend", choices=["auto", "gloo", "nccl"])
    parser.add_argument("--oversubscribe", action="store_true", default=None, help="allow more CPU devices than cores")
    parser.add_argument("--metrics", help="JSON-lines metrics file (default under runs/)")
    parser.add_argument(
        "--no-display", dest="display", action="store_false", default=None, help="no live display; log lines only"
    )
    parser.add_argument("--checkpoint-every", type=int, help="write a checkpoint every N steps")
    parser.add_argument("--checkpoint-dir", help="where checkpoints go")
    parser.add_argument("--resume", action="store_true", default=None, help="continue from the latest checkpoint")
    parser.add_argument(
        "--secret-file",
        help="file holding the job's secret (default: FLEXPAR_SECRET, FLEXPAR_SECRET_FILE, "
        "else a fresh one kept in the run directory)",
    )
    parser.add_argument(
        "--show-secret",
        action="store_true",
        default=None,
        help="print the secret in the banner (it is printed anyway when --host is not loopback)",
    )
    parser.add_argument(
        "--preemption-grace",
        dest="preemption_grace_s",
        type=float,
        help="seconds a device may take to leave after SIGTERM before it is killed (default 30)",
    )
    parser.add_argument(
        "--heartbeat-timeout",
        dest="heartbeat_timeout_s",
        type=float,
        help="seconds of silence after which a device counts as hung and failed (default 5)",
    )
    parser.add_argument(
        "--verbose",
        action="store_true",
        default=None,
        help="show devices' tracebacks here (they are always written to the run directory)",
    )
    parser.add_argument(
        "--eval-every", type=int, help="evaluate every N steps (and after the last) when the job has an evaluation set"
    )
    parser.add_argument(
        "--tracker",
        dest="trackers",
        action="append",
        choices=["tensorboard", "mlflow", "wandb", "csv"],
        help="log to an experiment tracker in the run directory (repeatable)",
    )
    parser.add_argument("--keep-checkpoints", type=int, help="keep only the newest K checkpoints")
    parser.add_argument(
        "--join-stream-mb",
        type=float,
        help="MB each member streams to a joiner per step while it listens (default: a share of the step "
        "time at the link's rate; 0: joins with a blocking transfer)",
    )
    parser.add_argument(
        "--join-mode",
        choices=("auto", "stream", "blocking"),
        help="how a joiner comes in: auto (default: the way predicted to cost the members less), stream "
        "(it listens while the state streams) or blocking (the whole state at the boundary)",
    )
    parser.add_argument(
        "--checkpoint-frozen",
        action="store_true",
        default=None,
        help="write the frozen weights into checkpoints too (default: the trainable state and their digests)",
    )
    parser.add_argument(
        "--driver-grace",
        dest="driver_grace_s",
        type=float,
        help="seconds devices that lost the driver wait for a driver restarted at the same address "
        "with --resume (the job's resume command) before they exit with the survivors' checkpoint "
        "(default 60; 0: at once)",
    )


_RUN_FIELDS = (
    "devices",
    "max_devices",
    "steps",
    "epochs",
    "schedule",
    "emulate_speeds",
    "host",
    "port",
    "timeout_s",
    "backend",
    "oversubscribe",
    "metrics",
    "display",
    "checkpoint_every",
    "checkpoint_dir",
    "resume",
    "show_secret",
    "preemption_grace_s",
    "heartbeat_timeout_s",
    "verbose",
    "eval_every",
    "trackers",
    "keep_checkpoints",
    "checkpoint_frozen",
    "driver_grace_s",
    "join_stream_mb",
    "join_mode",
)


def _misplaced_flags(parser: argparse.ArgumentParser, script_arguments: list) -> tuple:
    """(flexpar's flags found after the script, with their values; the script's own arguments)."""
    takes_value = {}
    for action in parser._actions:
        for option in action.option_strings:
            takes_value[option] = action.nargs != 0
    misplaced, rest = [], []
    arguments = list(script_arguments)
    while arguments:
        argument = arguments.pop(0)
        name = argument.split("=", 1)[0]
        if name in takes_value and name not in ("-h", "--help"):
            misplaced.append(argument)
            if takes_value[name] and "=" not in argument and arguments:
                misplaced.append(arguments.pop(0))
        else:
            rest.append(argument)
    return misplaced, rest


def command_run(arguments) -> int:
    # `kill -USR1 <pid>` prints every thread's stack to stderr: how to see where a job that seems stuck waits.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    script_arguments = list(arguments.script_arguments)
    if script_arguments[:1] == ["--"]:
        script_arguments = script_arguments[1:]
    if not _double_dash_after_script(arguments):  # everything after `--` is the script's, unchecked
        misplaced, rest = _misplaced_flags(arguments.parser, script_arguments)
        if misplaced:
            meant = " ".join(["flexpar run", *_flags_before_script(arguments), *misplaced, arguments.script, *rest])
            print(
                f"flexpar run: {misplaced[0]} comes after the script {arguments.script}, where it would go to "
                "the script, not to flexpar. flexpar's flags go before the script (as with torchrun and "
                f"accelerate launch):\n  {meant}\nIf {arguments.script} takes {misplaced[0]} itself, put "
                f"its arguments after `--`: flexpar run [flags] {arguments.script} -- {' '.join(script_arguments)}",
                file=sys.stderr,
            )
            return 2
    listen_address(arguments)
    overrides = {field: getattr(arguments, field) for field in _RUN_FIELDS}
    try:
        overrides["secret"] = read_secret(arguments.secret_file)
        # Check the flags now, before the script runs (steps are the script's business).
        options_module.FitOptions(
            **{**{k: v for k, v in overrides.items() if v is not None}, "steps": 1, "epochs": None}
        )
    except ValueError as error:
        print(f"flexpar run: {error}", file=sys.stderr)
        return 2
    path = os.path.abspath(arguments.script)
    if not os.path.exists(path):
        print(f"flexpar run: no such script: {arguments.script}", file=sys.stderr)
        return 2
    try:
        run_script_as_main(path, [arguments.script] + script_arguments, overrides)
    except (TrainingError, UserCodeError, ValueError, TypeError) as error:
        if arguments.verbose or not _raised_by_flexpar(error):
            raise  # the script's own errors keep their traceback
        print(f"flexpar: {error}", file=sys.stderr)
        return 1
    return 0


def _double_dash_after_script(arguments) -> bool:
    """Whether `--` follows the script on the command line (argparse drops it from the remainder)."""
    before = _flags_before_script(arguments)
    argv = list(arguments.argv)
    position = argv.index("run") + 1 + len(before) + 1 if "run" in argv else len(argv)
    return argv[position : position + 1] == ["--"]


def _flags_before_script(arguments) -> list:
    """The flags the user did put before the script, as typed (to show the corrected command)."""
    argv = list(arguments.argv)
    try:
        end = argv.index(arguments.script, argv.index("run") + 1)
    except ValueError:
        return []
    return argv[argv.index("run") + 1 : end]


def _raised_by_flexpar(error: BaseException) -> bool:
    """Whether flexpar itself raised `error` (a checked problem, worded for the user)."""
    if isinstance(error, (TrainingError, UserCodeError)) or getattr(error, "flexpar_message", False):
        return True
    frames = traceback.extract_tb(error.__traceback__)
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # flexpar/
    return bool(frames) and os.path.abspath(frames[-1].filename).startswith(package + os.sep)


def run_script_as_main(path: str, argv: list, overrides: dict) -> None:
    """Run a script as `__main__` with the launcher's options in force."""
    module = types.ModuleType("__main__")
    module.__file__ = path
    module.__builtins__ = __builtins__
    sys.modules["__main__"] = module
    sys.argv = argv
    sys.path.insert(0, os.path.dirname(path))
    with open(path, encoding="utf-8") as handle:
        code = compile(handle.read(), path, "exec")
    with options_module.command_line_options(overrides):
        exec(code, module.__dict__)
