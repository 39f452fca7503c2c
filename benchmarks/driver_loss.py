"""Losing the driver: a restarted driver re-adopts the running devices, vs today's full restart.

Per round, alternating the two paths on the same job (benchmarks/driver_loss_job.py: 2 CPU devices,
a 2.8M-parameter MLP with Adam): start the job under `flexpar run`; at a step drawn at random, kill -9
its driver; 2 s later run the resume command the devices printed; wait for the end.
- adopt: `--driver-grace 60`: the devices wait with their state in memory and the restarted driver
  re-adopts them;
- restart: `--driver-grace 0`, the present path: the survivors write their checkpoint and exit, and the
  resume command starts the whole job again from it (fresh workers: imports, model build, warm-up).
One run without a driver loss gives the reference for `max_rel_err`.

Figures: `driver_loss_resume_s` / `driver_loss_restart_s` (medians: from the new driver's start to the
first step it commits), `driver_start_s` (from its start to its banner: its own start-up, adopt rounds),
`resume_after_start_s` (per adopt round, resume_s less its own start-up; re-adoption's goal: <= 1 s),
`driver_loss_steps_lost` (committed steps lost, max over the adopt rounds), `max_rel_err` (final
parameters against the run without a loss, max over every round and tensor).
"""

from __future__ import annotations

import os
import random
import re
import shlex
import signal
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import torch  # noqa: E402
from harness import cli, output, processes, timing  # noqa: E402
from harness.folders import run_folder  # noqa: E402
from harness.records import metrics_records  # noqa: E402

JOB = os.path.join(HERE, "driver_loss_job.py")
RESTART_DELAY_S = 2.0  # re-adoption's goal is measured with the driver restarted 2 s after its death
NOTE = {"adopt": "restart it with: ", "restart": "Resume with: "}


def _flexpar(arguments, folder, name, environment):
    return subprocess.Popen(
        [sys.executable, "-m", "flexpar", *arguments],
        stdout=open(os.path.join(folder, f"{name}.out"), "w"),
        stderr=open(os.path.join(folder, f"{name}.err"), "w"),
        cwd=folder,
        env=environment,
        start_new_session=True,
    )


def _wait(predicate, what, timeout_s=300.0, poll_s=0.01):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll_s)
    raise RuntimeError(f"timed out waiting for {what}")


def _steps(metrics):
    return [r for r in metrics_records(metrics) if r["kind"] == "step"] if os.path.exists(metrics) else []


def _read(path):
    return open(path).read() if os.path.exists(path) else ""


def run_once(folder, steps, path=None, kill_at=None):
    """One job; with `path` ("adopt" or "restart"), its driver killed at step `kill_at` and restarted."""
    os.makedirs(folder)
    metrics, final = os.path.join(folder, "metrics.jsonl"), os.path.join(folder, "final.pt")
    environment = dict(os.environ, DRIVER_LOSS_STEPS=str(steps), DRIVER_LOSS_FINAL=final)
    grace = "60" if path == "adopt" else "0"
    flags = ["--devices", "2", "--oversubscribe", "--no-display", "--port", str(processes.free_port())]
    flags += ["--metrics", metrics, "--checkpoint-dir", folder, "--checkpoint-every", "25", "--driver-grace", grace]
    first = _flexpar(["run", *flags, JOB], folder, "driver-1", environment)
    result = {"path": path or "reference", "kill_at": kill_at}
    started_drivers = [first]
    try:
        if path is None:
            assert first.wait(timeout=600) == 0, _read(os.path.join(folder, "driver-1.err"))[-3000:]
        else:
            _wait(lambda: len(_steps(metrics)) > kill_at, f"step {kill_at}", poll_s=0.002)
            os.kill(first.pid, signal.SIGKILL)
            killed = time.time()
            first.wait()
            committed_at_kill = max(r["step"] for r in _steps(metrics)) + 1
            said = _wait(
                lambda: processes.commands_said(os.path.join(folder, "driver-1.err"), NOTE[path]),
                "the devices' resume command",
            )
            command = shlex.split(said[-1])
            time.sleep(max(0.0, killed + RESTART_DELAY_S - time.time()))
            started = time.time()
            second = _flexpar(command[1:], folder, "driver-2", environment)
            started_drivers.append(second)
            banner = _wait(lambda: "job at" in _read(os.path.join(folder, "driver-2.out")), "the banner")
            result["driver_start_s"] = time.time() - started if banner else None
            after = _wait(lambda: [r for r in _steps(metrics) if r["time"] > started], "a step after the restart")
            result["resume_s"] = after[0]["time"] - started
            result["steps_lost"] = max(0, committed_at_kill - after[0]["step"])
            adopt = [r for r in metrics_records(metrics) if r.get("event") == "adopt"]
            result["no_driver_s"] = adopt[0]["no_driver_s"] if adopt else None
            result["steps_in_flight_lost"] = adopt[0]["steps_lost"] if adopt else None
            assert second.wait(timeout=600) == 0, _read(os.path.join(folder, "driver-2.err"))[-3000:]
            said = _read(os.path.join(folder, "driver-2.out"))
            result["resumed_by"] = re.search(r"resumed by (\w+)", said).group(1)
    finally:
        for process in started_drivers:  # each in a session of its own, with the workers it started
            processes.kill_group(process.pid)
    result["final"] = torch.load(final, weights_only=True)
    return result


def max_relative_error(state, reference):
    return max(
        float((state[name] - tensor).abs().max() / max(float(tensor.abs().max()), 1e-12))
        for name, tensor in reference.items()
    )


def main():
    parser = cli.base_parser(__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=None, help="rounds of each path (default 3; --quick 1)")
    parser.add_argument("--seed", type=int, default=0)
    arguments = parser.parse_args()
    rounds = arguments.rounds or (1 if arguments.quick else 3)
    steps = 30 if arguments.quick else 60
    draw = random.Random(arguments.seed)
    say = output.progress("driver_loss")
    with run_folder("flexpar-driver-loss-") as root:
        say("reference run (no driver loss)")
        reference = run_once(os.path.join(root, "reference"), steps)["final"]
        kills = [draw.randint(8, steps - 15) for _ in range(rounds)]

        def runner(path):
            def one(index):
                say(f"{path} round {index + 1}: kill -9 of the driver at step {kills[index]}")
                return run_once(os.path.join(root, f"{path}-{index}"), steps, path, kills[index])

            return one

        results = timing.alternate({"adopt": runner("adopt"), "restart": runner("restart")}, rounds)
    rows = []
    for runs in results.values():
        for run in runs:
            run["max_rel_err"] = max_relative_error(run.pop("final"), reference)
            rows.append(run)
    adopt, restart = results["adopt"], results["restart"]
    resume_s, restart_s = timing.median_of(adopt, "resume_s"), timing.median_of(restart, "resume_s")
    start_s = timing.median_of(adopt, "driver_start_s")
    for run in rows:  # what the path costs beyond the new driver's own start-up
        run["after_start_s"] = run["resume_s"] - run["driver_start_s"]
    after_start_s = timing.median_of(adopt, "after_start_s")
    figures = {
        "driver_loss_resume_s": resume_s,
        "driver_loss_restart_s": restart_s,
        "resume_vs_restart": timing.ratio(resume_s, restart_s),
        "driver_start_s": start_s,
        "driver_start_restart_s": timing.median_of(restart, "driver_start_s"),
        "resume_after_start_s": after_start_s,
        "restart_after_start_s": timing.median_of(restart, "after_start_s"),
        "resume_goal_met": after_start_s is not None and after_start_s <= 1.0,
        "driver_loss_steps_lost": max(run["steps_lost"] for run in adopt),
        "steps_in_flight_lost": max(run["steps_in_flight_lost"] or 0 for run in adopt),
        "restart_steps_lost": max(run["steps_lost"] for run in restart),
        "no_driver_s": timing.median_of(adopt, "no_driver_s"),
        "max_rel_err": max(run["max_rel_err"] for run in rows),
        "all_adopted": all(run["resumed_by"] == "adoption" for run in adopt),
        "rounds": rows,
        "steps": steps,
    }
    columns = ["path", "kill_at", "driver_start_s", "resume_s", "after_start_s", "steps_lost", "no_driver_s"]
    columns.append("max_rel_err")
    output.print_table(rows, columns, title="driver loss: re-adoption vs full restart")
    for key, value in figures.items():
        if key != "rounds":
            print(f"{key}: {output.fmt(value) if isinstance(value, float) else value}")
    output.write_json(arguments.json, figures)


if __name__ == "__main__":
    cli.run(main)
