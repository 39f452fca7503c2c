"""The commands that talk to a running job (`join`, `scale`, `status`) or read its files (`plot`, `export`),
and `demo`."""

from __future__ import annotations

import contextlib
import hmac
import json
import secrets
import sys
import time

from flexpar.cli.cluster_environment import job_address, secret_or_exit, secret_origin
from flexpar.comm import waiting
from flexpar.comm.channel import Channel
from flexpar.comm.protocol import get_json, has, scale_proof, secret_check
from flexpar.comm.store import Unreachable, connect_client

# join, export, plot and demo import their modules when they run: those pull in the driver and the
# worker (torch's compiler modules among them), most of a second that `status` and `scale` need not pay.


def command_join(arguments) -> int:
    from flexpar.driver.join import join

    secret = secret_or_exit(arguments, "join")
    host, port = job_address(arguments.address, "join")
    if arguments.preemption_grace is not None and arguments.preemption_grace <= 0:
        raise SystemExit(f"flexpar join: --preemption-grace {arguments.preemption_grace} must be positive (seconds)")
    if arguments.timeout <= 0:
        raise SystemExit(f"flexpar join: --timeout {arguments.timeout:g} must be positive (seconds)")
    return join(
        f"{host}:{port}",
        arguments.devices,
        secret,
        arguments.script,
        arguments.emulate_speed,
        arguments.preemption_grace,
        connect_timeout_s=arguments.timeout,
        secret_origin=secret_origin(arguments.secret_file),
    )


def command_scale(arguments) -> int:
    """Ask the job to scale and wait for its answer: exit 0 only when it accepted."""
    secret = secret_or_exit(arguments, "scale")
    host, port = job_address(arguments.address, "scale")
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
        # Checked here first, as `flexpar join` does, to say where the wrong secret was read (the job's
        # own refusal, for a request that gets past this, cannot know).
        expected = store.get("job/secret_check").decode()
        if not hmac.compare_digest(secret_check(secret, store.get("job/salt").decode()), expected):
            print(
                f"flexpar scale: wrong secret: {secret_origin(arguments.secret_file)} does not match the job at "
                f"{host}:{port}; give the job's own (a job on loopback keeps it in its run directory, file "
                "'secret'); nothing was asked",
                file=sys.stderr,
            )
            return 1
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
    Channel(store, "events").send({"type": "scale", "request": request, "proof": scale_proof(secret, request)})
    key = f"answer/{request['id']}"
    deadline = time.monotonic() + timeout_s
    while not has(store, key):
        if time.monotonic() > deadline:
            print(
                f"flexpar scale: no answer from {host}:{port} within {timeout_s:g} s; the job may "
                "be busy or finished (see `flexpar status`)",
                file=sys.stderr,
            )
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
    host, port = job_address(arguments.address, "status")
    try:
        store = connect_client(host, port, arguments.timeout)
    except Unreachable:
        # No driver answers. Devices of this host that lost theirs and wait for a restarted one say so
        # in files of their own (flexpar/comm/waiting.py); without any, the one line of Unreachable.
        reports = waiting.read(port)
        if not reports:
            raise
        if arguments.json:
            print(json.dumps({"driver": False, "waiting": reports}))
        else:
            print(f"flexpar status: {waiting.describe(f'{host}:{port}', reports, time.time())}")
        return 1
    with _answers(host, port):
        status = get_json(store, "status") if has(store, "status") else {}
    if arguments.json:
        print(json.dumps(status))
        return 0
    print(f"generation {status.get('generation')}: devices {', '.join(status.get('devices', []))}")
    if "step" in status:
        print(
            f"step {status['step']} ({status['step'] + 1}/{status['total_steps']} done), "
            f"{status['samples_per_s']:.1f} samples/s, "
            f"loss {status['loss']:.4f}, assignment {status['assignment']}"
        )
    if "stream_items" in status:  # a streaming dataset: its length is unknown, its progress is in items
        print(f"stream: {status['stream_items']} items trained, pass {status['stream_passes_ended']} (from 0)")
    streaming = [
        f"{device} (streaming, {share:.0%} of the state)" for device, share in status.get("streaming", {}).items()
    ]
    if status.get("waiting") or status.get("starting") or streaming:
        print(f"joining: {', '.join(status.get('starting', []) + status.get('waiting', []) + streaming)}")
    return 0


def command_plot(arguments) -> int:
    from flexpar.observe.plot import plot_timeline

    plot_timeline(arguments.metrics, arguments.output)
    print(f"flexpar: wrote {arguments.output}")
    return 0


def command_export(arguments) -> int:
    from flexpar.export import export_with_adapter

    try:
        path, adapter = export_with_adapter(
            arguments.checkpoint, arguments.output, arguments.adapter, arguments.script, arguments.model
        )
    except ImportError as error:
        print(f"flexpar export: {error}", file=sys.stderr)
        return 1
    print(f"flexpar: wrote {path}")
    if adapter:
        print(f"flexpar: wrote the peft adapter to {adapter} (PeftModel.from_pretrained(base_model, {adapter!r}))")
    return 0


def command_demo(arguments) -> int:
    from flexpar import demo

    return demo.main(steps=arguments.steps, output_dir=arguments.output_dir)
