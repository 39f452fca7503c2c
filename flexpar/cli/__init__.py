"""`flexpar run | join | scale | status | plot | export | simulate | demo`.

`flexpar run` maps its flags one to one onto `FitOptions` and runs the user's
script in this process, as `__main__`; the script's own `fit()` call then picks
the flags up (they override what the script passes). As with torchrun and
`accelerate launch`, flexpar's flags come before the script and everything
after the script is the script's; a flexpar flag found after the script is
refused with the command that was meant (`--` hands the rest to the script
unchecked).

Where a job is and its secret come from the command line, else from the
cluster's environment (see `cluster_address` and `read_secret`).
"""

from __future__ import annotations

import argparse
import difflib
import os
import signal
import sys
from typing import Optional, Sequence

from flexpar.cli.cluster_environment import ADDRESS_VARIABLES
from flexpar.cli.job_commands import (
    command_demo,
    command_export,
    command_join,
    command_plot,
    command_scale,
    command_status,
)
from flexpar.cli.run_command import add_run_flags, command_run
from flexpar.comm.store import Unreachable
from flexpar.sim.cli import SIMULATE_DESCRIPTION, add_simulate_arguments, shipped_scenarios
from flexpar.sim.cli import run_from_arguments as run_simulation


def build_parser() -> argparse.ArgumentParser:
    # No abbreviated flags: `--dev 2` must not mean --devices before the script and go to the
    # script after it (where only exact flexpar flags are caught).
    parser = argparse.ArgumentParser(prog="flexpar", description=__doc__.splitlines()[0], allow_abbrev=False)
    commands = parser.add_subparsers(dest="command", required=True)

    run = commands.add_parser(
        "run",
        help="run a training script on local devices",
        allow_abbrev=False,
        usage="flexpar run [flexpar flags] SCRIPT [script arguments]",
        epilog="flexpar's flags go before the script; what follows the script is the script's.",
    )
    add_run_flags(run)
    run.add_argument("script")
    run.add_argument("script_arguments", nargs=argparse.REMAINDER)
    run.set_defaults(handler=command_run, parser=run)

    address_help = f"HOST:PORT the job printed (default: from {', '.join(ADDRESS_VARIABLES)})"
    secret_help = "file holding the job's secret (default: FLEXPAR_SECRET, else the file FLEXPAR_SECRET_FILE names)"
    join = commands.add_parser("join", help="add this host's devices to a running job", allow_abbrev=False)
    join.add_argument("address", nargs="?", help=address_help)
    join.add_argument("--devices", type=int, default=1)
    join.add_argument("--script", help="the job's script on this host (default: the path the job ran)")
    join.add_argument("--secret-file", help=secret_help)
    join.add_argument("--emulate-speed", type=float, default=1.0, help="emulated relative speed (testing)")
    join.add_argument(
        "--preemption-grace",
        type=float,
        default=None,
        help="seconds this host's devices may take to leave after SIGTERM (default: the job's, 30)",
    )
    join.add_argument(
        "--timeout",
        type=float,
        default=60.0,
        help="seconds to wait for the job to answer (a joiner may start before its job; default 60)",
    )
    join.set_defaults(handler=command_join, parser=join)

    scale = commands.add_parser(
        "scale", help="change the job's device count and wait for its answer", allow_abbrev=False
    )
    scale.add_argument("address", nargs="?", help=address_help)
    scale.add_argument("--devices", required=True, help="N, +K or -K")
    scale.add_argument("--secret-file", help=secret_help)
    scale.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for the job's answer")
    scale.set_defaults(handler=command_scale, parser=scale)

    status = commands.add_parser("status", help="show a running job's device set and progress")
    status.add_argument("address", nargs="?", help=address_help)
    status.add_argument("--json", action="store_true")
    status.add_argument("--timeout", type=float, default=1.0, help="seconds to wait for the job to answer")
    status.set_defaults(handler=command_status, parser=status)

    plot = commands.add_parser("plot", help="draw a metrics file as a timeline")
    plot.add_argument("metrics")
    plot.add_argument("-o", "--output", default="timeline.png")
    plot.set_defaults(handler=command_plot, parser=plot)

    export = commands.add_parser("export", help="write a checkpoint's model weights as safetensors")
    export.add_argument("checkpoint", help="a flexpar checkpoint (step-NNNNNNNN.pt)")
    export.add_argument("-o", "--output", default="model.safetensors")
    export.add_argument("--adapter", help="a peft model's adapter folder (default: OUTPUT-adapter)")
    export.add_argument(
        "--script",
        help="the training script, where the model factory is defined (needed only to rebuild frozen weights "
        "that the checkpoint holds as digests, or a peft model)",
    )
    export.add_argument("--model", help="the model factory, NAME in --script or MODULE:NAME, if not recorded")
    export.set_defaults(handler=command_export, parser=export)

    # simulate's own arguments on its subparser, so `flexpar simulate --help` prints them
    # (an argparse.REMAINDER pass-through swallowed nothing that starts with a dash).
    simulate = commands.add_parser(
        "simulate",
        help="simulate a cluster scenario",
        description=SIMULATE_DESCRIPTION,
        epilog=f"shipped scenarios: {', '.join(shipped_scenarios())}",
    )
    add_simulate_arguments(simulate)
    simulate.set_defaults(handler=run_simulation, parser=simulate)

    demo = commands.add_parser("demo", help="train a small real model and show an elastic change")
    demo.add_argument("--steps", type=int, default=160)
    demo.add_argument("--output-dir", default="runs/demo")
    demo.set_defaults(handler=command_demo, parser=demo)
    return parser


def _exit_on_early_sigterm() -> None:
    """SIGTERM before training or joining has started ends the command at once.

    In a container flexpar often runs as process 1, for which the kernel
    ignores any signal that has no handler: a pod deleted while its job or
    joiner starts would wait out its whole grace period. The run and join
    paths install their own handlers (a clean stop, a planned leave) later.
    """
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return

    def on_sigterm(signum, frame):
        print("flexpar: stopped by SIGTERM before training started; nothing to keep", file=sys.stderr, flush=True)
        raise SystemExit(143)

    signal.signal(signal.SIGTERM, on_sigterm)


def closest_flags(parser: argparse.ArgumentParser, unknown: Sequence[str]) -> str:
    """'; did you mean --devices?' for the flags among `unknown` close to one of `parser`'s ('' if none)."""
    flags = [flag for action in parser._actions for flag in action.option_strings if flag.startswith("--")]
    guesses = []
    for argument in unknown:
        if not argument.startswith("--"):
            continue
        name = argument.split("=", 1)[0]
        match = difflib.get_close_matches(name, flags, n=1, cutoff=0.6)
        if match:
            guesses.append(f"{match[0]} for {name}" if len(unknown) > 1 else match[0])
    return f"; did you mean {', '.join(guesses)}?" if guesses else ""


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    _exit_on_early_sigterm()
    parser = build_parser()
    arguments, unknown = parser.parse_known_args(argv)
    if unknown:
        # A subcommand's unknown flag (`flexpar run --devcies 2 train.py`): that command's usage.
        command_parser = getattr(arguments, "parser", None) or parser
        command_parser.error(f"unrecognized arguments: {' '.join(unknown)}{closest_flags(command_parser, unknown)}")
    arguments.argv = argv
    if arguments.command in ("run", "simulate"):
        return arguments.handler(arguments)  # the script's own errors keep their traceback
    try:
        return arguments.handler(arguments)
    except Unreachable as error:
        print(f"flexpar {arguments.command}: {error}", file=sys.stderr, flush=True)
        if error.exit_at_once:
            sys.stdout.flush()
            os._exit(1)
        return 1
    except ValueError as error:
        print(f"flexpar: {error}", file=sys.stderr)
        return 2
