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
import contextlib
import json
import os
import secrets
import signal
import sys
import time
import traceback
import types
from typing import Optional, Sequence

from flexpar.comm.channel import Channel
from flexpar.comm.protocol import get_json, has, scale_proof
from flexpar.comm.store import Unreachable, connect_client
from flexpar import options as options_module
from flexpar.errors import TrainingError, UserCodeError


def _add_run_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--devices", type=int, help="devices to start with (default: all GPUs, else 1 CPU process)")
    parser.add_argument("--max-devices", type=int, help="the most devices the job may grow to")
    parser.add_argument("--steps", type=int, help="optimizer steps (overrides the script)")
    parser.add_argument("--epochs", type=int, help="epochs (overrides the script)")
    parser.add_argument("--schedule", help="scripted device changes, e.g. '100:+1,200:-2'")
    parser.add_argument("--emulate-speeds", help="emulated relative device speeds, e.g. '1,1,0.5,0.25'")
    parser.add_argument("--host", help="address to listen on (default 127.0.0.1, loopback only)")
    parser.add_argument("--port", type=int, help="port to listen on (default: a free one)")
    parser.add_argument("--timeout", dest="timeout_s", type=float, help="collective timeout in seconds (default 30)")
    parser.add_argument("--backend", choices=["auto", "gloo", "nccl"])
    parser.add_argument("--oversubscribe", action="store_true", default=None,
                        help="allow more CPU devices than cores")
    parser.add_argument("--metrics", help="JSON-lines metrics file (default under runs/)")
    parser.add_argument("--no-display", dest="display", action="store_false", default=None,
                        help="no live display; log lines only")
    parser.add_argument("--checkpoint-every", type=int, help="write a checkpoint every N steps")
    parser.add_argument("--checkpoint-dir", help="where checkpoints go")
    parser.add_argument("--resume", action="store_true", default=None, help="continue from the latest checkpoint")
    parser.add_argument("--secret-file",
                        help="file holding the job's secret (default: FLEXPAR_SECRET, FLEXPAR_SECRET_FILE, "
                             "else a fresh one kept in the run directory)")
    parser.add_argument("--show-secret", action="store_true", default=None,
                        help="print the secret in the banner (it is printed anyway when --host is not loopback)")
    parser.add_argument("--preemption-grace", dest="preemption_grace_s", type=float,
                        help="seconds a device may take to leave after SIGTERM before it is killed (default 30)")
    parser.add_argument("--heartbeat-timeout", dest="heartbeat_timeout_s", type=float,
                        help="seconds of silence after which a device counts as hung and failed (default 5)")
    parser.add_argument("--verbose", action="store_true", default=None,
                        help="show devices' tracebacks here (they are always written to the run directory)")
    parser.add_argument("--eval-every", type=int,
                        help="evaluate every N steps (and after the last) when the job has an evaluation set")
    parser.add_argument("--tracker", dest="trackers", action="append", choices=["tensorboard", "mlflow", "csv"],
                        help="log to an experiment tracker in the run directory (repeatable)")
    parser.add_argument("--keep-checkpoints", type=int, help="keep only the newest K checkpoints")


_RUN_FIELDS = ("devices", "max_devices", "steps", "epochs", "schedule", "emulate_speeds", "host", "port",
               "timeout_s", "backend", "oversubscribe", "metrics", "display", "checkpoint_every",
               "checkpoint_dir", "resume", "show_secret", "preemption_grace_s", "heartbeat_timeout_s", "verbose",
               "eval_every", "trackers", "keep_checkpoints")


# ------------------------------------------------------------ the cluster's environment


def read_secret(secret_file: Optional[str]) -> Optional[str]:
    """The job's secret: --secret-file, else FLEXPAR_SECRET, else the file FLEXPAR_SECRET_FILE names.

    The file form is how a Kubernetes Secret is mounted; the value form how a
    shell or a scheduler passes it. None when none is given.
    """
    path = secret_file or (None if os.environ.get("FLEXPAR_SECRET") else os.environ.get("FLEXPAR_SECRET_FILE"))
    if path:
        try:
            with open(path, encoding="utf-8") as handle:
                secret = handle.read().strip()
        except OSError as error:
            raise ValueError(f"cannot read the secret file {path}: {error.strerror}") from None
        if not secret:
            raise ValueError(f"the secret file {path} is empty")
        return secret
    return os.environ.get("FLEXPAR_SECRET") or None


ADDRESS_VARIABLES = ("FLEXPAR_ADDRESS", "MASTER_ADDR/MASTER_PORT", "PET_RDZV_ENDPOINT")


def cluster_address(environment=None) -> Optional[tuple]:
    """(HOST:PORT, the variable it came from) from the cluster's environment, or None.

    First match wins: FLEXPAR_ADDRESS (HOST:PORT); MASTER_ADDR with
    MASTER_PORT (torchrun, Kubeflow PyTorchJob, SLURM recipes); PET_RDZV_ENDPOINT
    (HOST:PORT, Kubeflow TrainJob / torchrun's rendezvous endpoint).
    """
    environment = os.environ if environment is None else environment
    if environment.get("FLEXPAR_ADDRESS"):
        return environment["FLEXPAR_ADDRESS"], "FLEXPAR_ADDRESS"
    if environment.get("MASTER_ADDR") and environment.get("MASTER_PORT"):
        port = environment["MASTER_PORT"].strip()
        if not port.isdigit():
            # Kubernetes' service links set <SERVICE>_PORT=tcp://IP:PORT, so a Service named
            # "master" yields MASTER_PORT=tcp://...: not a port, and never to be guessed at.
            raise SystemExit(f"flexpar: MASTER_PORT={port!r} is not a port number (a Kubernetes Service "
                             "named 'master' sets it so: set enableServiceLinks: false in the pod spec, "
                             "or give the address with FLEXPAR_ADDRESS=HOST:PORT)")
        return f"{environment['MASTER_ADDR'].strip()}:{port}", "MASTER_ADDR/MASTER_PORT"
    if environment.get("PET_RDZV_ENDPOINT"):
        return environment["PET_RDZV_ENDPOINT"], "PET_RDZV_ENDPOINT"
    return None


def _job_address(given: Optional[str], command: str) -> tuple:
    """(host, port) of the job: the argument, else the environment; SystemExit naming both if neither."""
    if given:
        return _parse_address(given)
    found = cluster_address()
    if found is None:
        raise SystemExit(f"flexpar {command}: give the job's address HOST:PORT (the job prints it), or set "
                         f"one of {', '.join(ADDRESS_VARIABLES)}")
    address, variable = found
    return _parse_address(address, variable)


def _listen_address(arguments) -> None:
    """`flexpar run` in a cluster: the port (and, off loopback, all interfaces) from the environment."""
    found = cluster_address()
    if found is None or (arguments.port is not None and arguments.host is not None):
        return
    host, port = _parse_address(*found)
    if arguments.port is None:
        arguments.port = port
    if arguments.host is None:
        # The advertised name (a Service, a node name) is reached from other hosts:
        # listen on every interface, unless it is this host's loopback.
        arguments.host = host if options_module.is_loopback(host) else "0.0.0.0"


# ------------------------------------------------------------ run


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
    script_arguments = list(arguments.script_arguments)
    if script_arguments[:1] == ["--"]:
        script_arguments = script_arguments[1:]
    if not _double_dash_after_script(arguments):  # everything after `--` is the script's, unchecked
        misplaced, rest = _misplaced_flags(arguments.parser, script_arguments)
        if misplaced:
            meant = " ".join(["flexpar run", *_flags_before_script(arguments), *misplaced, arguments.script, *rest])
            print(f"flexpar run: {misplaced[0]} comes after the script {arguments.script}, where it would go to "
                  "the script, not to flexpar. flexpar's flags go before the script (as with torchrun and "
                  f"accelerate launch):\n  {meant}\nIf {arguments.script} takes {misplaced[0]} itself, put "
                  f"its arguments after `--`: flexpar run [flags] {arguments.script} -- {' '.join(script_arguments)}",
                  file=sys.stderr)
            return 2
    _listen_address(arguments)
    overrides = {field: getattr(arguments, field) for field in _RUN_FIELDS}
    try:
        overrides["secret"] = read_secret(arguments.secret_file)
        # Check the flags now, before the script runs (steps are the script's business).
        options_module.FitOptions(**{**{k: v for k, v in overrides.items() if v is not None}, "steps": 1,
                                     "epochs": None})
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
    if isinstance(error, (TrainingError, UserCodeError)):
        return True
    frames = traceback.extract_tb(error.__traceback__)
    package = os.path.dirname(os.path.abspath(__file__))
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


def _parse_address(address: str, source: str = "") -> tuple:
    host, _, port = address.strip().rpartition(":")
    bracketed = host.startswith("[") and host.endswith("]")  # [IPv6]:PORT
    if not host or not port.isdigit() or not 0 < int(port) < 65536 or "/" in host or (
            ":" in host and not bracketed):
        where = f" (from {source})" if source else ""
        raise SystemExit(f"flexpar: address {address!r}{where} is not HOST:PORT (the job prints it at start)")
    return host.strip("[]"), int(port)


def _secret_or_exit(arguments, command: str) -> str:
    secret = read_secret(arguments.secret_file)
    if not secret:
        raise SystemExit(f"flexpar {command}: give the job's secret with --secret-file FILE, FLEXPAR_SECRET or "
                         "FLEXPAR_SECRET_FILE (a job on loopback keeps it in its run directory, file 'secret')")
    return secret


def command_join(arguments) -> int:
    from flexpar.driver.launch import join

    secret = _secret_or_exit(arguments, "join")
    host, port = _job_address(arguments.address, "join")
    if arguments.preemption_grace is not None and arguments.preemption_grace <= 0:
        raise SystemExit(f"flexpar join: --preemption-grace {arguments.preemption_grace} must be positive (seconds)")
    if arguments.timeout <= 0:
        raise SystemExit(f"flexpar join: --timeout {arguments.timeout:g} must be positive (seconds)")
    return join(f"{host}:{port}", arguments.devices, secret, arguments.script, arguments.emulate_speed,
                arguments.preemption_grace, connect_timeout_s=arguments.timeout)


def command_scale(arguments) -> int:
    """Ask the job to scale and wait for its answer: exit 0 only when it accepted."""
    secret = _secret_or_exit(arguments, "scale")
    host, port = _job_address(arguments.address, "scale")
    text = arguments.devices.strip()
    try:
        request = {"delta": int(text)} if text[:1] in "+-" else {"devices": int(text)}
    except ValueError:
        raise SystemExit(f"flexpar scale: --devices {text!r} is not N, +K or -K") from None
    if request.get("devices", 1) < 1:
        raise SystemExit(f"flexpar scale: --devices {text}: a job needs at least one device")
    request["id"] = secrets.token_hex(8)
    store = connect_client(host, port, arguments.timeout)
    with _answers(host, port):
        return _ask_to_scale(store, host, port, request, secret, arguments.timeout)


@contextlib.contextmanager
def _answers(host: str, port: int):
    """A job that stops answering mid-conversation (stopped, finished, SIGSTOPped) is one line too."""
    try:
        yield
    except RuntimeError as error:  # the store client's timeout or a dropped connection
        reason = (str(error).strip().splitlines() or [type(error).__name__])[0]
        raise Unreachable(f"the job at {host}:{port} stopped answering ({reason})") from None


def _ask_to_scale(store, host: str, port: int, request: dict, secret: str, timeout_s: float) -> int:
    Channel(store, "events").send(
        {"type": "scale", "request": request, "proof": scale_proof(secret, request)}
    )
    key = f"answer/{request['id']}"
    deadline = time.monotonic() + timeout_s
    while not has(store, key):
        if time.monotonic() > deadline:
            print(f"flexpar scale: no answer from {host}:{port} within {timeout_s:g} s; the job may "
                  "be busy or finished (see `flexpar status`)", file=sys.stderr)
            return 1
        time.sleep(0.05)
    answer = get_json(store, key)
    store.delete_key(key)
    if answer["accepted"]:
        print(f"flexpar scale: accepted: {answer['message']}")
        return 0
    print(f"flexpar scale: refused: {answer['message']}", file=sys.stderr)
    return 1


def command_status(arguments) -> int:
    host, port = _job_address(arguments.address, "status")
    store = connect_client(host, port, arguments.timeout)
    with _answers(host, port):
        status = get_json(store, "status") if has(store, "status") else {}
    if arguments.json:
        print(json.dumps(status))
        return 0
    print(f"generation {status.get('generation')}: devices {', '.join(status.get('devices', []))}")
    if "step" in status:
        print(f"step {status['step']}/{status['total_steps']}, {status['samples_per_s']:.1f} samples/s, "
              f"loss {status['loss']:.4f}, assignment {status['assignment']}")
    if status.get("waiting") or status.get("starting"):
        print(f"joining: {', '.join(status.get('starting', []) + status.get('waiting', []))}")
    return 0


def command_plot(arguments) -> int:
    from flexpar.observe.plot import plot_timeline

    plot_timeline(arguments.metrics, arguments.output)
    print(f"flexpar: wrote {arguments.output}")
    return 0


def command_export(arguments) -> int:
    from flexpar.export import export

    try:
        path = export(arguments.checkpoint, arguments.output)
    except ImportError as error:
        print(f"flexpar export: {error}", file=sys.stderr)
        return 1
    print(f"flexpar: wrote {path}")
    return 0


def command_demo(arguments) -> int:
    from flexpar import demo

    return demo.main(steps=arguments.steps, output_dir=arguments.output_dir)


def build_parser() -> argparse.ArgumentParser:
    # No abbreviated flags: `--dev 2` must not mean --devices before the script and go to the
    # script after it (where only exact flexpar flags are caught).
    parser = argparse.ArgumentParser(prog="flexpar", description=__doc__.splitlines()[0], allow_abbrev=False)
    commands = parser.add_subparsers(dest="command", required=True)

    run = commands.add_parser(
        "run", help="run a training script on local devices", allow_abbrev=False,
        usage="flexpar run [flexpar flags] SCRIPT [script arguments]",
        epilog="flexpar's flags go before the script; what follows the script is the script's.")
    _add_run_flags(run)
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
    join.add_argument("--preemption-grace", type=float, default=None,
                      help="seconds this host's devices may take to leave after SIGTERM (default: the job's, 30)")
    join.add_argument("--timeout", type=float, default=60.0,
                      help="seconds to wait for the job to answer (a joiner may start before its job; default 60)")
    join.set_defaults(handler=command_join, parser=join)

    scale = commands.add_parser("scale", help="change the job's device count and wait for its answer",
                                allow_abbrev=False)
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
    export.set_defaults(handler=command_export, parser=export)

    simulate = commands.add_parser("simulate", help="simulate a cluster scenario", add_help=False)
    simulate.add_argument("simulate_arguments", nargs=argparse.REMAINDER)
    simulate.set_defaults(handler=lambda arguments: _simulate(arguments.simulate_arguments))

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


def _simulate(argv) -> int:
    from flexpar.sim.cli import main as simulate_main

    return simulate_main(argv)


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    _exit_on_early_sigterm()
    parser = build_parser()
    arguments, unknown = parser.parse_known_args(argv)
    if unknown:
        # A subcommand's unknown flag (`flexpar run --devcies 2 train.py`): that command's usage.
        (getattr(arguments, "parser", None) or parser).error(f"unrecognized arguments: {' '.join(unknown)}")
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


if __name__ == "__main__":
    sys.exit(main())
