"""Joining a running job from outside: the secret, the model check, `flexpar scale`/`status`,
and a joiner on another (emulated) host in its own network namespace."""

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import threading
import time
import uuid

import pieces
import pytest
from conftest import free_port

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/, where pieces.py is


def _flexpar(*arguments, env=None, timeout=120, prefix=()):
    return subprocess.run(
        [*prefix, sys.executable, "-m", "flexpar", *arguments],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


class BackgroundJob:
    """A job running fit() in a thread of this process, so the test can poke at it."""

    def __init__(self, job, **options):
        self.result, self.error = None, None
        self.thread = threading.Thread(target=self._run, args=(job, options), daemon=True)
        self.thread.start()

    def _run(self, job, options):
        try:
            self.result = job.fit(**options)
        except BaseException as error:  # reported by the test
            self.error = error

    def wait(self, timeout=180):
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "the job did not finish in time"
        if self.error is not None:
            raise self.error
        return self.result


def _wait_for_step(metrics_file, step, timeout=90):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if metrics_file.exists():
            steps = [json.loads(line) for line in metrics_file.read_text().splitlines() if '"step"' in line]
            if any(record["kind"] == "step" and record["step"] >= step for record in steps):
                return
        time.sleep(0.2)
    raise AssertionError(f"the job did not reach step {step}")


def _other_model_script(directory):
    """A copy of the test pieces whose make_model builds another architecture."""
    source = open(os.path.join(TESTS, "pieces.py")).read()
    (directory / "pieces.py").write_text(
        source.replace("def make_model():", "def make_model_original():").replace(
            "def make_wider_model():", "def make_model():"
        )
    )
    (directory / "train.py").write_text("import pieces\n")
    return str(directory / "train.py")


def _start_flexpar(*arguments, env=None):
    return subprocess.Popen(
        [sys.executable, "-m", "flexpar", *arguments],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **(env or {})},
    )


@pytest.mark.timeout(400)
def test_refusals_scale_and_status(tmp_path):
    port, secret = free_port(), uuid.uuid4().hex
    metrics = tmp_path / "metrics.jsonl"
    job = pieces.make_job(virtual_workers=6, delay_s=0.02)
    background = BackgroundJob(
        job,
        steps=200,
        devices=1,
        max_devices=3,
        port=port,
        secret=secret,
        metrics=str(metrics),
        display=False,
        quiet=True,
        oversubscribe=True,
        join_mode="stream",  # the test is of a stream's status line ("auto" may take the blocking way)
        join_stream_mb=0.0001,  # about 100 bytes a step: the joiner listens for over a hundred steps (a loaded
        # host answers a status call in seconds: a stream of tens of steps ended between two in a fresh-clone run)
    )
    address = f"127.0.0.1:{port}"
    _wait_for_step(metrics, 1)
    status = json.loads(_flexpar("status", address, "--json").stdout)
    assert status["devices"] == ["local-0"] and status["total_steps"] == 200 and status["step"] >= 1
    script = os.path.join(TESTS, "pieces.py")
    # Both bad joiners at once: the job must shrug them off and keep training.
    wrong = _start_flexpar("join", address, "--script", script, env={"FLEXPAR_SECRET": "not-the-secret"})
    other = _start_flexpar("join", address, "--script", _other_model_script(tmp_path), env={"FLEXPAR_SECRET": secret})
    # A wrong secret is refused saying where it was read, as `flexpar join` says it.
    secret_file = tmp_path / "wrong-secret"
    secret_file.write_text("not-the-secret\n")
    refused = _flexpar("scale", address, "--devices", "+1", "--secret-file", str(secret_file))
    assert refused.returncode == 1 and refused.stderr.startswith("flexpar scale: wrong secret: "), refused.stderr
    assert f"the secret in {secret_file} does not match the job at {address}" in refused.stderr, refused.stderr
    scaled = _flexpar("scale", address, "--devices", "+1", env={"FLEXPAR_SECRET": secret})
    assert scaled.returncode == 0, scaled.stderr
    # While the state streams to it, status lists the new device as joining, with its share.
    deadline, seen = time.time() + 120, ""
    while time.time() < deadline and "(streaming, " not in seen:
        seen = _flexpar("status", address).stdout
    assert re.search(r"joining: local-1 \(streaming, \d+% of the state\)", seen), seen
    assert wrong.wait(timeout=120) == 3 and "secret" in wrong.stderr.read()
    assert other.wait(timeout=120) == 3 and "the model differs" in other.stderr.read()
    model, summary = background.wait()
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert {len(r["devices"]) for r in records if r["kind"] == "step"} == {1, 2}, "scale +1 took effect"
    # 200 steps: float reduction-order noise grows past atol 1e-7 on near-zero weights.
    pieces.assert_same_parameters(model, pieces.reference(job, 200), atol=1e-6)


# ---------------------------------------------------------------- two hosts

_DRIVER = textwrap.dedent("""
    import sys, torch
    sys.path.insert(0, {tests!r})
    import pieces
    if __name__ == "__main__":
        job = pieces.make_job(virtual_workers=6, delay_s=0.03)
        model, summary = job.fit(steps=150, devices=1, max_devices=2, host={host!r}, port={port},
                                 secret={secret!r}, metrics={metrics!r}, display=False, quiet=True)
        torch.save(model.state_dict(), {output!r})
""")


@pytest.fixture
def namespace():
    """A second 'host': a network namespace joined to this one by a veth pair."""
    if shutil.which("ip") is None or os.geteuid() != 0:
        pytest.skip("needs root and iproute2 to make a network namespace")
    tag = uuid.uuid4().hex[:6]
    name, host_side, ns_side = f"fp{tag}", f"fpa{tag}", f"fpb{tag}"
    subnet = 200 + int(tag[:2], 16) % 50
    commands = [
        ["ip", "netns", "add", name],
        ["ip", "link", "add", host_side, "type", "veth", "peer", "name", ns_side],
        ["ip", "link", "set", ns_side, "netns", name],
        ["ip", "addr", "add", f"10.{subnet}.0.1/24", "dev", host_side],
        ["ip", "link", "set", host_side, "up"],
        ["ip", "netns", "exec", name, "ip", "addr", "add", f"10.{subnet}.0.2/24", "dev", ns_side],
        ["ip", "netns", "exec", name, "ip", "link", "set", ns_side, "up"],
        ["ip", "netns", "exec", name, "ip", "link", "set", "lo", "up"],
    ]
    for command in commands:
        made = subprocess.run(command, capture_output=True, text=True)
        if made.returncode != 0:
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
            subprocess.run(["ip", "link", "del", host_side], capture_output=True)
            pytest.skip(f"cannot make a network namespace here: {made.stderr.strip()}")
    yield {"name": name, "host_ip": f"10.{subnet}.0.1", "host_if": host_side, "ns_if": ns_side}
    subprocess.run(["ip", "netns", "del", name], capture_output=True)
    subprocess.run(["ip", "link", "del", host_side], capture_output=True)


@pytest.mark.timeout(400)
def test_joiner_on_another_host(tmp_path, namespace):
    port, secret = free_port(), uuid.uuid4().hex
    metrics, output = tmp_path / "metrics.jsonl", tmp_path / "model.pt"
    script = tmp_path / "driver.py"
    script.write_text(
        _DRIVER.format(
            tests=TESTS, host=namespace["host_ip"], port=port, secret=secret, metrics=str(metrics), output=str(output)
        )
    )
    # gloo picks its interface from GLOO_SOCKET_IFNAME (torch's documented way on multi-homed hosts).
    driver = subprocess.Popen(
        [sys.executable, str(script)],
        env={**os.environ, "GLOO_SOCKET_IFNAME": namespace["host_if"]},
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        _wait_for_step(metrics, 1)
        # The joiner finds the job through the cluster's environment alone (no address argument).
        joined = _flexpar(
            "join",
            "--script",
            str(script),
            env={
                "FLEXPAR_ADDRESS": f"{namespace['host_ip']}:{port}",
                "FLEXPAR_SECRET": secret,
                "GLOO_SOCKET_IFNAME": namespace["ns_if"],
            },
            prefix=("ip", "netns", "exec", namespace["name"]),
            timeout=150,
        )
        assert driver.wait(timeout=150) == 0, driver.stderr.read()
    finally:
        if driver.poll() is None:
            driver.kill()
    assert joined.returncode == 0, joined.stderr
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    remote = [r for r in records if r["kind"] == "step" and any(not d.startswith("local") for d in r["devices"])]
    assert remote, "the remote device took part in training"
    import torch

    model = pieces.make_model()
    model.load_state_dict(torch.load(output, weights_only=True))
    pieces.assert_same_parameters(model, pieces.reference(pieces.make_job(virtual_workers=6), 150), atol=1e-6)
