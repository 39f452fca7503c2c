"""The command line: `flexpar run` maps onto fit() one to one; `flexpar plot` draws the metrics."""

import dataclasses
import json
import os
import signal
import socket
import stat
import subprocess
import sys
import textwrap
import threading
import time

import pytest
from conftest import flexpar_command

from flexpar.driver import launch, training
from flexpar.options import FitOptions
from flexpar.worker import orphan
from flexpar.worker.settings import RunSettings

TESTS = os.path.dirname(os.path.abspath(__file__))


def test_run_overrides_the_script_and_plot_draws_it(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(
        textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {TESTS!r})
        import pieces
        if __name__ == "__main__":
            model, summary = pieces.make_job().fit(steps=50, devices=1)
            print("steps", summary["steps"], "generations", summary["generations"], "devices", len(summary["devices"]))
    """)
    )
    metrics, picture = tmp_path / "m.jsonl", tmp_path / "timeline.png"
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "flexpar",
            "run",
            "--devices",
            "2",
            "--steps",
            "4",
            "--oversubscribe",
            "--no-display",
            "--metrics",
            str(metrics),
            str(script),
        ],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert run.returncode == 0, run.stderr
    assert "steps 4 generations 1 devices 2" in run.stdout, "the asked device count, not the script's"
    from flexpar.observe.metrics import read_records

    records = read_records(metrics)  # every record of the run validates against the schema
    steps = [record for record in records if record["kind"] == "step"]
    # The device set never changed. A rebalance between the two devices may happen
    # (it follows their measured speeds, which a busy host can skew): not a change.
    assert [r["event"] for r in records if r["kind"] == "event" and r["event"] != "rebalance"] == ["start"]
    assert [len(record["devices"]) for record in steps] == [2, 2, 2, 2]
    plot = subprocess.run(
        [sys.executable, "-m", "flexpar", "plot", str(metrics), "-o", str(picture)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert plot.returncode == 0, plot.stderr
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bad_flag_is_refused_before_the_script_runs(tmp_path):
    script = tmp_path / "never.py"
    script.write_text("raise SystemExit('the script ran')\n")
    run = subprocess.run(
        [sys.executable, "-m", "flexpar", "run", "--schedule", "5:x", str(script)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode != 0 and "is not STEP:+N" in run.stderr and "the script ran" not in run.stderr


def test_contradictory_join_flags_are_refused_before_the_script_runs(tmp_path):
    script = tmp_path / "never.py"
    script.write_text("raise SystemExit('the script ran')\n")
    for flags, said in (
        (["--join-mode", "stream", "--join-stream-mb", "0"], "join_mode='stream' contradicts join_stream_mb=0"),
        (["--join-mode", "sometimes"], "invalid choice: 'sometimes'"),
    ):
        run = subprocess.run(
            [sys.executable, "-m", "flexpar", "run", *flags, str(script)], capture_output=True, text=True, timeout=60
        )
        assert run.returncode == 2 and said in run.stderr and "the script ran" not in run.stderr, run.stderr


# ------------------------------------------------------------ launcher conventions


def test_flexpar_flags_after_the_script_are_refused_with_the_right_command(tmp_path):
    script = tmp_path / "never.py"
    script.write_text("raise SystemExit('the script ran')\n")
    run = flexpar_command("run", "--oversubscribe", str(script), "--devices", "4", "--max-devices=8", "--lr", "3")
    assert run.returncode == 2 and "the script ran" not in run.stderr
    assert "--devices comes after the script" in run.stderr
    assert f"flexpar run --oversubscribe --devices 4 --max-devices=8 {script} --lr 3" in run.stderr


def test_arguments_after_a_double_dash_go_to_the_script(tmp_path):
    script = tmp_path / "echo.py"
    script.write_text("import sys\nprint('ARGV', sys.argv[1:])\n")
    run = flexpar_command("run", str(script), "--", "--devices", "4")
    assert run.returncode == 0, run.stderr
    assert "ARGV ['--devices', '4']" in run.stdout


def test_status_of_a_closed_port_answers_in_one_line():
    # No wall-clock bound here (timings belong in benchmarks): the command's own 30 s limit is the
    # guard against waiting out a store timeout, which would be longer than that.
    status = flexpar_command("status", "127.0.0.1:1", timeout_s=30)
    assert status.returncode == 1
    assert status.stderr.strip().count("\n") == 0 and "no flexpar job answers at 127.0.0.1:1" in status.stderr
    assert "frame #" not in status.stderr and status.stdout == ""


def test_status_and_scale_load_no_driver_nor_worker():
    """`flexpar status` took 2.4-5 s a call: `import torch` (the store client is torch's TCPStore) and
    flexpar's whole package, the driver's and the worker's modules (torch's compiler pieces among them)
    on top. Now the command line loads only what a command uses: status and scale pay for torch alone."""
    heavy = ("flexpar.job", "flexpar.driver.launch", "flexpar.worker.process")
    probe = f"import sys, flexpar.cli; print(sorted(m for m in sys.modules if m in {heavy!r}))"
    loaded = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert loaded.returncode == 0 and loaded.stdout.strip() == "[]", loaded.stdout + loaded.stderr
    import flexpar

    assert flexpar.Job.__module__ == "flexpar.job"  # what the package offers is still there, on first use


def test_status_and_join_read_the_address_from_the_cluster_environment():
    environment = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1", "PET_RDZV_ENDPOINT": "no-port"}
    environment.pop("FLEXPAR_ADDRESS", None)
    status = flexpar_command("status", environment=environment)
    assert "127.0.0.1:1" in status.stderr, "MASTER_ADDR/MASTER_PORT win over PET_RDZV_ENDPOINT"
    environment["FLEXPAR_ADDRESS"] = "127.0.0.1:3"
    status = flexpar_command("status", environment=environment)
    assert "127.0.0.1:3" in status.stderr, "FLEXPAR_ADDRESS wins"
    del environment["FLEXPAR_ADDRESS"], environment["MASTER_ADDR"]
    join = flexpar_command("join", environment={**environment, "FLEXPAR_SECRET": "s"})
    assert join.returncode != 0 and "'no-port' (from PET_RDZV_ENDPOINT)" in join.stderr
    nothing = {key: value for key, value in environment.items() if key not in ("PET_RDZV_ENDPOINT", "MASTER_PORT")}
    join = flexpar_command("join", environment={**nothing, "FLEXPAR_SECRET": "s"})
    assert "FLEXPAR_ADDRESS" in join.stderr and "PET_RDZV_ENDPOINT" in join.stderr


# ------------------------------------------------------------ scale answers, limits, SIGTERM

LONG_JOB = """
if __name__ == "__main__":
    pieces.make_job(delay_s=0.03).fit(steps=100000, devices=1)
"""


def _scale(job, devices, secret_file=None):
    return flexpar_command(
        "scale", job.address, "--devices", devices, "--secret-file", secret_file or job.secret_file, timeout_s=60
    )


def _wait_for_step(metrics, step, timeout_s=60.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if metrics.exists() and any(
            json.loads(line).get("step", -1) >= step and json.loads(line)["kind"] == "step"
            for line in metrics.read_text().splitlines()
        ):
            return
        time.sleep(0.1)
    raise AssertionError(f"step {step} did not commit in time")


def test_scale_waits_for_the_answer_and_sigterm_stops_the_job_with_a_checkpoint(tmp_path, command_line_job):
    cores = len(os.sched_getaffinity(0))
    checkpoints, metrics = tmp_path / "checkpoints", tmp_path / "m.jsonl"
    job = command_line_job(
        [
            "--max-devices",
            str(cores + 1),
            "--no-display",
            "--checkpoint-dir",
            str(checkpoints),
            "--metrics",
            str(metrics),
        ],
        LONG_JOB,
    ).wait_for_banner()
    out, _ = job.output()
    assert f"may grow to {cores + 1}" in out
    # The secret is not printed on loopback; its file is the owner's alone.
    secret = open(job.secret_file).read().strip()
    assert secret not in out and stat.S_IMODE(os.stat(job.secret_file).st_mode) == 0o600
    wrong = tmp_path / "wrong"
    wrong.write_text("not-the-secret")
    refused = _scale(job, "+1", str(wrong))
    assert refused.returncode == 1 and f"wrong secret: the secret in {wrong} does not match" in refused.stderr
    over_max = _scale(job, f"+{cores + 1}")
    assert over_max.returncode == 1 and f"--max-devices {cores + 1}" in over_max.stderr
    over_cores = _scale(job, f"+{cores}")
    assert over_cores.returncode == 1 and "--oversubscribe" in over_cores.stderr
    below_one = _scale(job, "-1")
    assert below_one.returncode == 1 and "at least one must stay" in below_one.stderr
    accepted = _scale(job, "+1")
    assert accepted.returncode == 0 and "1 -> 2 devices" in accepted.stdout, accepted.stderr
    _wait_for_step(metrics, 3)
    job.process.send_signal(signal.SIGTERM)
    assert job.wait(timeout_s=60) == 143
    _, err = job.output()
    # One line of its own (the plain log also records the stop event, as it records every event).
    stopped = [line for line in err.splitlines() if "SIGTERM" in line and line.startswith("flexpar:")]
    assert len(stopped) == 1 and "stopped by SIGTERM after step" in stopped[0], err
    # The job as it ended: grown to 2 devices by the scale above (its script says devices=1).
    assert f"; resume with: flexpar run --resume --devices 2 --checkpoint-dir {checkpoints}" in stopped[0], stopped[0]
    assert "Traceback" not in err and "frame #" not in err
    step = int(stopped[0].split("after step ")[1].split(";")[0])
    assert os.path.exists(checkpoints / f"step-{step:08d}.pt"), "the final checkpoint holds the last step"
    events = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [e["event"] for e in events if e["kind"] == "event" and e["event"] == "stop"] == ["stop"]


def test_ctrl_c_stops_the_job_in_one_line(command_line_job, tmp_path):
    metrics = tmp_path / "m.jsonl"
    job = command_line_job(
        ["--devices", "2", "--oversubscribe", "--no-display", "--metrics", str(metrics)], LONG_JOB
    ).wait_for_banner()
    _wait_for_step(metrics, 2)
    os.killpg(job.process.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the whole process group
    assert job.wait(timeout_s=60) == 130
    _, err = job.output()
    assert "interrupted (Ctrl-C)" in err and "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert "frame #" not in err


def test_no_display_logs_lines_the_last_step_is_checkpointed_and_a_resume_says_where(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(
        textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {TESTS!r})
        import pieces
        if __name__ == "__main__":
            pieces.make_job(delay_s=0.01).fit(steps=30, devices=2)
    """)
    )
    checkpoints = tmp_path / "checkpoints"
    common = ["--oversubscribe", "--no-display", "--checkpoint-every", "25", "--checkpoint-dir", str(checkpoints)]
    run = flexpar_command(
        "run", *common, "--show-secret", "--metrics", str(tmp_path / "a.jsonl"), str(script), timeout_s=180
    )
    assert run.returncode == 0, run.stderr
    secret = open(tmp_path / "secret").read().strip()
    assert f"secret {secret}" in run.stdout, "--show-secret prints it"
    lines = run.stderr.splitlines()
    assert "step 9 (10/30 done" in run.stderr and "step 29 (30/30 done" in run.stderr, run.stderr
    assert any(line.startswith("event start at step 0") for line in lines)
    assert sorted(os.listdir(checkpoints)) == ["step-00000025.pt", "step-00000030.pt"]
    # The same command again, without --resume: refused in one line before any worker starts.
    again = flexpar_command("run", *common, "--metrics", str(tmp_path / "c.jsonl"), str(script), timeout_s=180)
    assert again.returncode == 1 and again.stderr.count("\n") == 1, again.stderr
    assert again.stderr.startswith(
        f"flexpar: checkpoint_dir {checkpoints} holds another run's checkpoints (steps 25, 30): continue that "
        "run with --resume (fit(resume=True)), or give this run another folder"
    ), again.stderr
    assert sorted(os.listdir(checkpoints)) == ["step-00000025.pt", "step-00000030.pt"]
    resumed = flexpar_command(
        "run", *common, "--steps", "40", "--resume", "--metrics", str(tmp_path / "b.jsonl"), str(script), timeout_s=180
    )
    assert resumed.returncode == 0, resumed.stderr
    assert f"resuming from step 30 ({checkpoints / 'step-00000030.pt'})" in resumed.stdout
    assert "step 39 (40/40 done" in resumed.stderr, resumed.stderr
    assert "secret in " in resumed.stdout, "on loopback only its file is named"


def test_a_device_error_is_said_once_with_its_traceback_in_the_run_directory(tmp_path):
    script = tmp_path / "broken.py"
    script.write_text(
        textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {TESTS!r})
        import pieces

        import flexpar

        def exploding_loss(model, batch):
            if not model.training:  # the driver's first-batch check (eval mode) passes
                return pieces.Loss()(model, batch)
            raise KeyError("the label column is missing")

        if __name__ == "__main__":
            flexpar.Job(model=pieces.make_model, optimizer=pieces.sgd, loss=exploding_loss,
                        dataset=pieces.make_dataset(), global_batch=48, virtual_workers=4).fit(steps=5, devices=2)
    """)
    )
    metrics = tmp_path / "m.jsonl"
    run = flexpar_command(
        "run", "--oversubscribe", "--no-display", "--metrics", str(metrics), str(script), timeout_s=120
    )
    assert run.returncode == 1
    said = [line for line in run.stderr.splitlines() if "the label column is missing" in line]
    assert len(said) == 1 and said[0].startswith("flexpar: device local-"), run.stderr
    assert "Traceback" not in run.stderr
    log = (tmp_path / "error.log").read_text()
    assert "Traceback" in log and "exploding_loss" in log
    verbose = flexpar_command(
        "run", "--oversubscribe", "--no-display", "--verbose", "--metrics", str(metrics), str(script), timeout_s=120
    )
    assert verbose.returncode != 0 and "exploding_loss" in verbose.stderr


def test_a_missing_main_guard_is_said_once(tmp_path):
    script = tmp_path / "unguarded.py"
    script.write_text(
        textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {TESTS!r})
        import pieces
        pieces.make_job().fit(steps=3, devices=2)
    """)
    )
    run = flexpar_command(
        "run", "--oversubscribe", "--no-display", "--metrics", str(tmp_path / "m.jsonl"), str(script), timeout_s=120
    )
    assert run.returncode == 1
    assert run.stderr.count('if __name__ == "__main__":') == 1 and "Traceback" not in run.stderr, run.stderr


# ------------------------------------------------------------ answers in one line, wherever they come from


def test_a_typo_before_the_script_shows_runs_usage_and_abbreviations_are_not_flags(tmp_path):
    script = tmp_path / "never.py"
    script.write_text("raise SystemExit('the script ran')\n")
    typo = flexpar_command("run", "--devcies", "2", str(script))
    assert typo.returncode == 2 and "usage: flexpar run" in typo.stderr and "--devcies" in typo.stderr
    # `--dev 2` must not mean --devices before the script (and the script's own flag after it).
    short = flexpar_command("run", "--dev", "2", str(script))
    assert short.returncode == 2 and "the script ran" not in short.stderr


def _listener(answer):
    """A program at an address that is not a flexpar job: silent, or answering as an HTTP server would."""
    server = socket.create_server(("127.0.0.1", 0))
    held = []

    def serve():
        while True:
            try:
                connection, _ = server.accept()
            except OSError:
                return
            held.append(connection)
            if answer:
                connection.recv(1024)
                connection.sendall(b"HTTP/1.0 400 Bad Request\r\n\r\n")

    threading.Thread(target=serve, daemon=True).start()
    return server, held


def test_status_and_scale_at_an_address_that_is_no_flexpar_job_answer_in_one_line():
    """A wrong address used to hang for minutes (an HTTP server) or until the listener gave up."""
    for answer in (False, True):
        server, held = _listener(answer)
        address = f"127.0.0.1:{server.getsockname()[1]}"
        try:
            # The subprocess timeout (30 s) is only the hang guard: the command's own --timeout is 1 s.
            status = flexpar_command("status", address, "--timeout", "1", timeout_s=30)
            scale = flexpar_command(
                "scale",
                address,
                "--devices",
                "+1",
                "--timeout",
                "1",
                timeout_s=30,
                environment={**os.environ, "FLEXPAR_SECRET": "s"},
            )
        finally:
            server.close()
            for connection in held:
                connection.close()
        for result in (status, scale):
            assert result.returncode == 1 and result.stdout == ""
            assert result.stderr.strip().count("\n") == 0 and f"no flexpar job answers at {address}" in result.stderr


def test_a_kubernetes_service_link_in_master_port_is_refused_by_name():
    environment = {**os.environ, "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "tcp://10.0.0.1:29500"}
    environment.pop("FLEXPAR_ADDRESS", None)
    status = flexpar_command("status", environment=environment)
    assert status.returncode == 1 and "MASTER_PORT='tcp://10.0.0.1:29500' is not a port number" in status.stderr
    assert "enableServiceLinks: false" in status.stderr


def test_the_secret_is_printed_only_off_loopback_and_its_file_is_the_owners_even_if_it_existed(tmp_path):
    (tmp_path / "secret").write_text("old\n")
    os.chmod(tmp_path / "secret", 0o644)
    note = launch._keep_secret(FitOptions(steps=1, host="127.0.0.1"), "s3cret", str(tmp_path))
    assert note == f"secret in {tmp_path / 'secret'}" and "s3cret" not in note
    assert stat.S_IMODE(os.stat(tmp_path / "secret").st_mode) == 0o600
    assert (tmp_path / "secret").read_text() == "s3cret\n"
    shown = launch._keep_secret(FitOptions(steps=1, host="0.0.0.0"), "s3cret", str(tmp_path))
    assert shown.startswith("secret s3cret "), "joinable from elsewhere: the banner shows it"


def test_the_banner_says_how_far_the_job_can_grow(capsys):
    launch._banner("h:1", 2, "cpu", 2, FitOptions(steps=1), "secret in x", cores=2)
    assert (
        "2 x cpu devices, cannot grow (--max-devices N, or fit(max_devices=N), allows more; more than this "
        "host's 2 cores also need --oversubscribe)"
    ) in capsys.readouterr().out
    launch._banner("h:1", 1, "cpu", 3, FitOptions(steps=1, max_devices=3, oversubscribe=True), "s", cores=2)
    assert "1 x cpu device, may grow to 3; s" in capsys.readouterr().out
    # A sharded job says so, and its redundancy (it did not).
    options = FitOptions(steps=1, max_devices=3, oversubscribe=True)
    launch._banner("h:1", 1, "cpu", 3, options, "s", cores=2, sharding="sharded by elements, redundancy 2")
    assert "may grow to 3; optimizer state sharded by elements, redundancy 2; s" in capsys.readouterr().out


def test_the_resume_command_is_the_jobs_own_with_resume_added(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    script = str(tmp_path / "t.py")
    assert (
        launch.resume_command(
            "/ck", ["python3", "/venv/bin/flexpar", "run", "--devices", "2", "t.py", "--lr", "1"], ["t.py", "--lr", "1"]
        )
        == f"flexpar run --resume --checkpoint-dir /ck {script} --lr 1"
    ), "no --devices: the job may have grown since it started, and the restarted driver re-adopts them all"
    assert (
        launch.resume_command("/my ck", ["python3", "-u", "t.py", "--lr", "1"], ["t.py", "--lr", "1"])
        == f"flexpar run --resume --checkpoint-dir '/my ck' {script} -- --lr 1"
    )
    # The job's own --resume and --checkpoint-dir give way to the ones that resume it.
    assert (
        launch.resume_command(
            "/ck",
            [
                "python3",
                "-m",
                "flexpar",
                "run",
                "--checkpoint-dir",
                "ck",
                "--resume",
                "--checkpoint-dir=ck",
                "--steps",
                "9",
                "--devices=3",
                "t.py",
            ],
            ["t.py"],
        )
        == f"flexpar run --resume --checkpoint-dir /ck --steps 9 {script}"
    )
    # A driver stopped by SIGTERM says the count of its host's devices it ended with.
    devices = {"devices": ["local-0", "local-1", "node2-0"]}
    assert (
        training.resume_with_devices(f"flexpar run --resume --checkpoint-dir /ck {script}", devices)
        == f"flexpar run --resume --devices 2 --checkpoint-dir /ck {script}"
    )


def test_a_resume_command_gives_the_jobs_device_count_as_it_is_not_as_it_started(tmp_path):
    """A job started as `python train.py --devices 1` (the script's own flag, kept after `--`) that grew to
    2: the command printed when its driver is lost, or stopped by SIGTERM, says flexpar's `--devices 2`
    (which overrides the script's 1); a command without a count leaves it to re-adoption (issue 46)."""
    script = str(tmp_path / "t.py")
    grown = f"flexpar run --resume --checkpoint-dir /ck {script} -- --devices 1 --lr 1"
    as_it_is = f"flexpar run --resume --devices 2 --checkpoint-dir /ck {script} -- --devices 1 --lr 1"
    assert training.resume_with_devices(grown, {"devices": ["local-0", "local-1"]}) == as_it_is
    settings = RunSettings(
        total_steps=9,
        backend="gloo",
        timeout_s=1.0,
        bucket_mb=1.0,
        checkpoint_every=None,
        checkpoint_dir="/ck",
        resume_path=None,
        resume_command=grown,
    )
    assert orphan.as_it_is(settings, ("local-0", "local-1", "node2-0")).resume_command == as_it_is
    plain = dataclasses.replace(settings, resume_command=f"flexpar run --resume --checkpoint-dir /ck {script}")
    assert orphan.as_it_is(plain, ("local-0", "local-1")).resume_command == plain.resume_command


SLOW_JOB = """
if __name__ == "__main__":
    pieces.make_job(delay_s=1.0).fit(steps=100000, devices=1)
"""


def test_a_second_sigterm_stops_at_once_in_one_line(command_line_job, tmp_path):
    metrics = tmp_path / "m.jsonl"
    job = command_line_job(["--no-display", "--metrics", str(metrics)], SLOW_JOB).wait_for_banner()
    _wait_for_step(metrics, 0)
    job.process.send_signal(signal.SIGTERM)  # a step takes ~4 s: the second comes before its boundary
    time.sleep(0.5)
    job.process.send_signal(signal.SIGTERM)
    assert job.wait(timeout_s=60) == 143
    _, err = job.output()
    assert "flexpar: a second SIGTERM; the workers are stopped" in err and "Ctrl-C" not in err, err
    assert "Traceback" not in err and "frame #" not in err


def test_a_plain_python_run_says_a_user_error_in_one_line_on_top(tmp_path):
    script = tmp_path / "unguarded.py"
    script.write_text(
        textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {TESTS!r})
        import pieces
        pieces.make_job().fit(steps=3, devices=2, oversubscribe=True, display=False)
    """)
    )
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert run.returncode == 1
    assert run.stderr.startswith("flexpar: fit() was called while a worker process imported your script"), run.stderr
    assert run.stderr.count('if __name__ == "__main__":') == 1 and "Traceback" not in run.stderr, run.stderr


CLUSTER_VARIABLES = (
    "FLEXPAR_ADDRESS",
    "MASTER_ADDR",
    "MASTER_PORT",
    "PET_RDZV_ENDPOINT",
    "FLEXPAR_SECRET",
    "FLEXPAR_SECRET_FILE",
)


def test_run_listens_where_the_cluster_environment_points(monkeypatch):
    """`flexpar run` under torchrun-style variables: their port, every interface unless the host is loopback."""
    import argparse

    from flexpar.cli import cluster_environment as cli

    for variable in CLUSTER_VARIABLES:
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("MASTER_ADDR", "trainer-0.jobs.svc")
    monkeypatch.setenv("MASTER_PORT", "29500")
    arguments = argparse.Namespace(host=None, port=None)
    cli.listen_address(arguments)
    assert (arguments.host, arguments.port) == ("0.0.0.0", 29500), "reached from other hosts: every interface"
    monkeypatch.setenv("FLEXPAR_ADDRESS", "127.0.0.1:4000")  # wins over MASTER_*
    arguments = argparse.Namespace(host=None, port=None)
    cli.listen_address(arguments)
    assert (arguments.host, arguments.port) == ("127.0.0.1", 4000), "loopback stays loopback"
    arguments = argparse.Namespace(host="127.0.0.2", port=5000)
    cli.listen_address(arguments)
    assert (arguments.host, arguments.port) == ("127.0.0.2", 5000), "flags win over the environment"


def test_the_secret_comes_from_the_flag_then_the_value_then_the_file(monkeypatch, tmp_path):
    from flexpar.cli import cluster_environment as cli

    for variable in CLUSTER_VARIABLES:
        monkeypatch.delenv(variable, raising=False)
    flag_file, mounted = tmp_path / "flag", tmp_path / "mounted"
    flag_file.write_text("from-flag\n")
    mounted.write_text("from-mounted-file\n")
    assert cli.read_secret(None) is None
    monkeypatch.setenv("FLEXPAR_SECRET_FILE", str(mounted))
    assert cli.read_secret(None) == "from-mounted-file"
    monkeypatch.setenv("FLEXPAR_SECRET", "from-value")
    assert cli.read_secret(None) == "from-value"
    assert cli.read_secret(str(flag_file)) == "from-flag"
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError, match="is empty"):
        cli.read_secret(str(tmp_path / "empty"))
    with pytest.raises(ValueError, match="cannot read the secret file"):
        cli.read_secret(str(tmp_path / "missing"))


def test_a_plain_python_run_says_flexpars_own_refusal_in_one_line(tmp_path):
    """A bad option (here more CPU devices than cores, without oversubscribe) is flexpar's own ValueError:
    one line on top, no traceback; a ValueError raised in the user's own code keeps its traceback."""
    script = tmp_path / "too_many.py"
    script.write_text(
        textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {TESTS!r})
        import pieces
        from flexpar.options import cpu_count
        if __name__ == "__main__":
            devices = cpu_count() + 1
            pieces.make_job(virtual_workers=devices, global_batch=4 * devices).fit(steps=3, devices=devices,
                                                                                  display=False)
    """)
    )
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert run.returncode == 1
    assert run.stderr.startswith("flexpar: ") and "--oversubscribe" in run.stderr, run.stderr
    assert "Traceback" not in run.stderr and run.stderr.count("\n") == 1, run.stderr

    # A checkpoint folder that holds another run's checkpoints, under plain python: the same one line.
    (tmp_path / "ck").mkdir()
    (tmp_path / "ck" / "step-00000040.pt").write_bytes(b"")
    script.write_text(
        textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {TESTS!r})
        import pieces
        if __name__ == "__main__":
            pieces.make_job().fit(steps=3, devices=1, display=False, checkpoint_every=1, checkpoint_dir="ck")
    """)
    )
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert run.returncode == 1 and "Traceback" not in run.stderr and run.stderr.count("\n") == 1, run.stderr
    assert run.stderr.startswith("flexpar: checkpoint_dir ck holds another run's checkpoints (step 40): ")

    script.write_text(
        textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {TESTS!r})
        import pieces

        def broken_model():
            raise ValueError("the user's own mistake")

        if __name__ == "__main__":
            pieces.make_job(model=broken_model).fit(steps=3, devices=1, display=False)
    """)
    )
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert run.returncode == 1
    assert "Traceback" in run.stderr and "broken_model" in run.stderr and "the user's own mistake" in run.stderr
