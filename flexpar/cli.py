"""`flexpar run | join | scale | status | plot | simulate | demo`.

`flexpar run` maps its flags one to one onto `FitOptions` and runs the user's
script in this process, as `__main__`; the script's own `fit()` call then picks
the flags up (they override what the script passes).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import types
from typing import Optional, Sequence

from flexpar import control, options as options_module


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
    parser.add_argument("--secret-file", help="file holding the job's secret (default: a fresh one, printed)")


_RUN_FIELDS = ("devices", "max_devices", "steps", "epochs", "schedule", "emulate_speeds", "host", "port",
               "timeout_s", "backend", "oversubscribe", "metrics", "display", "checkpoint_every",
               "checkpoint_dir", "resume")


def read_secret(secret_file: Optional[str]) -> Optional[str]:
    """The job secret from --secret-file, else FLEXPAR_SECRET, else None."""
    if secret_file:
        with open(secret_file, encoding="utf-8") as handle:
            return handle.read().strip()
    return os.environ.get("FLEXPAR_SECRET")


def command_run(arguments) -> int:
    overrides = {field: getattr(arguments, field) for field in _RUN_FIELDS}
    overrides["secret"] = read_secret(arguments.secret_file) if arguments.secret_file else None
    # Check the flags now, before the script runs (steps are the script's business).
    try:
        options_module.FitOptions(**{**{k: v for k, v in overrides.items() if v is not None}, "steps": 1,
                                     "epochs": None})
    except ValueError as error:
        print(f"flexpar run: {error}", file=sys.stderr)
        return 2
    path = os.path.abspath(arguments.script)
    if not os.path.exists(path):
        print(f"flexpar run: no such script: {arguments.script}", file=sys.stderr)
        return 2
    run_script_as_main(path, [arguments.script] + list(arguments.script_arguments), overrides)
    return 0


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


def _parse_address(address: str) -> tuple:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise SystemExit(f"flexpar: address {address!r} is not HOST:PORT (the job prints it at start)")
    return host, int(port)


def command_join(arguments) -> int:
    from flexpar.launch import join

    secret = read_secret(arguments.secret_file)
    if not secret:
        print("flexpar join: give the job's secret in FLEXPAR_SECRET or --secret-file", file=sys.stderr)
        return 2
    _parse_address(arguments.address)
    return join(arguments.address, arguments.devices, secret, arguments.script, arguments.emulate_speed)


def command_scale(arguments) -> int:
    secret = read_secret(arguments.secret_file)
    if not secret:
        print("flexpar scale: give the job's secret in FLEXPAR_SECRET or --secret-file", file=sys.stderr)
        return 2
    host, port = _parse_address(arguments.address)
    text = arguments.devices
    request = {"delta": int(text)} if text[:1] in "+-" else {"devices": int(text)}
    store = control.connect(host, port, 10.0)
    body = json.dumps(request, sort_keys=True).encode()
    control.Channel(store, "events").send(
        {"type": "scale", "request": request, "proof": control.sign(secret, b"scale:", body)}
    )
    print(f"flexpar: asked {arguments.address} to scale: {request}")
    return 0


def command_status(arguments) -> int:
    host, port = _parse_address(arguments.address)
    store = control.connect(host, port, 10.0)
    status = control.get_json(store, "status") if control.has(store, "status") else {}
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
    from flexpar.metrics import plot_timeline

    plot_timeline(arguments.metrics, arguments.output)
    print(f"flexpar: wrote {arguments.output}")
    return 0


def command_demo(arguments) -> int:
    from flexpar import demo

    return demo.main(steps=arguments.steps, output_dir=arguments.output_dir)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flexpar", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)

    run = commands.add_parser("run", help="run a training script on local devices")
    _add_run_flags(run)
    run.add_argument("script")
    run.add_argument("script_arguments", nargs=argparse.REMAINDER)
    run.set_defaults(handler=command_run)

    join = commands.add_parser("join", help="add this host's devices to a running job")
    join.add_argument("address", help="HOST:PORT the job printed")
    join.add_argument("--devices", type=int, default=1)
    join.add_argument("--script", help="the job's script on this host (default: the path the job ran)")
    join.add_argument("--secret-file")
    join.add_argument("--emulate-speed", type=float, default=1.0, help="emulated relative speed (testing)")
    join.set_defaults(handler=command_join)

    scale = commands.add_parser("scale", help="change the job's local device count")
    scale.add_argument("address")
    scale.add_argument("--devices", required=True, help="N, +K or -K")
    scale.add_argument("--secret-file")
    scale.set_defaults(handler=command_scale)

    status = commands.add_parser("status", help="show a running job's device set and progress")
    status.add_argument("address")
    status.add_argument("--json", action="store_true")
    status.set_defaults(handler=command_status)

    plot = commands.add_parser("plot", help="draw a metrics file as a timeline")
    plot.add_argument("metrics")
    plot.add_argument("-o", "--output", default="timeline.png")
    plot.set_defaults(handler=command_plot)

    simulate = commands.add_parser("simulate", help="simulate a cluster scenario", add_help=False)
    simulate.add_argument("simulate_arguments", nargs=argparse.REMAINDER)
    simulate.set_defaults(handler=lambda arguments: _simulate(arguments.simulate_arguments))

    demo = commands.add_parser("demo", help="train a small real model and show an elastic change")
    demo.add_argument("--steps", type=int, default=160)
    demo.add_argument("--output-dir", default="runs/demo")
    demo.set_defaults(handler=command_demo)
    return parser


def _simulate(argv) -> int:
    from flexpar.sim.cli import main as simulate_main

    return simulate_main(argv)


def main(argv: Optional[Sequence[str]] = None) -> int:
    arguments = build_parser().parse_args(argv)
    if arguments.command in ("run", "simulate"):
        return arguments.handler(arguments)  # the script's own errors keep their traceback
    try:
        return arguments.handler(arguments)
    except ValueError as error:
        print(f"flexpar: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
