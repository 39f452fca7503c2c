"""The baseline of benchmarks/elastic.py: torchrun's elastic mode, whose workers restart from a checkpoint.

Two agents (`python -m torch.distributed.run --nnodes=2:3`, c10d rendezvous,
one worker per agent) train restart_worker.py; a third agent joins on the same
host; torchrun stops every worker and starts a fresh set, which imports
torch, rebuilds the model, loads the checkpoint and re-forms the process
group. The stall and its parts are read from the workers' records.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

from elastic_plan import GLOBAL_BATCH, Settings
from harness import command_line, free_port, json_lines, median

WORKER_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "restart_worker.py")


def _wait_for(predicate, timeout_s: float, agents: list, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"torchrun baseline: timed out waiting for {what}")
        if any(agent.poll() not in (None, 0) for agent in agents):
            raise RuntimeError(f"torchrun baseline: an agent exited early while waiting for {what}")
        time.sleep(0.05)


def _stop_agents(agents: list, pid_folder: str) -> None:
    """End the agents this round started, then their workers (the figures are in by now).

    Agents first, so that none can start a replacement worker; then each worker
    by the pid it left in `pid_folder` (workers run in sessions of their own, so
    they outlive a killed agent). A graceful stop would cost seconds of torchrun's
    shutdown per round and measure nothing.
    """
    for agent in agents:
        if agent.poll() is None:
            agent.kill()
        agent.wait()
    for name in os.listdir(pid_folder) if os.path.isdir(pid_folder) else ():
        _kill_worker(int(name))


def _kill_worker(pid: int) -> None:
    """SIGKILL `pid` if it is still one of this benchmark's restart workers (pids get reused)."""
    if "restart_worker.py" not in command_line(pid):
        return
    try:
        os.kill(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def torchrun_command(settings: Settings, port: int, run_id: str, files: dict) -> list:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=2:3",
        "--nproc-per-node=1",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        f"--rdzv-id={run_id}",
        # Without it, the first two agents would wait 30 s for a third before starting.
        "--rdzv-conf=last_call_timeout=1",
        "--max-restarts=3",
        "--monitor-interval=0.1",
        WORKER_SCRIPT,
        "--records",
        files["log"],
        "--checkpoint",
        files["checkpoint"],
        "--pid-folder",
        files["pids"],
        "--global-batch",
        str(GLOBAL_BATCH),
        "--model",
        settings.model_name,
        "--threads",
        "1",
    ]


def torchrun_environment() -> dict:
    environment = dict(os.environ)
    # torch 2.13's agents cache the shared TCPStore's address from the first
    # rendezvous round; a node that joins later reads it afresh and waits forever
    # for MASTER_ADDR (the "role_info" rendezvous timeout). This documented
    # opt-out makes every round publish it again, which is what elastic joins need.
    environment["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    environment["OMP_NUM_THREADS"] = "1"  # as flexpar on 2 cores with up to 3 devices: one thread each
    return environment


def torchrun_round(settings: Settings, workdir: str, index: int) -> dict:
    """Two torchrun agents train; a third joins; the workers restart from the checkpoint."""
    folder = os.path.join(workdir, f"torchrun-{index}")
    os.makedirs(folder, exist_ok=True)
    files = {name: os.path.join(folder, name) for name in ("log", "checkpoint", "pids")}
    port = free_port()
    command = torchrun_command(settings, port, f"elastic-bench-{os.getpid()}-{index}", files)
    environment = torchrun_environment()
    agents = []
    outputs = contextlib.ExitStack()  # the agents' log files, closed when the round ends

    def start_agent(number: int):
        output = outputs.enter_context(open(os.path.join(folder, f"agent-{number}.log"), "w"))  # noqa: SIM115
        agents.append(
            subprocess.Popen(command, env=environment, stdout=output, stderr=subprocess.STDOUT, start_new_session=True)
        )  # its own group: no terminal signals

    def steps_with(world: int) -> int:
        return sum(1 for r in json_lines(files["log"]) if r["kind"] == "step" and r["world"] == world)

    started = time.perf_counter()
    timeline = {}  # seconds since the round started, for seeing where a round's time goes

    def mark(name: str) -> None:
        timeline[name] = time.perf_counter() - started

    try:
        start_agent(0)
        start_agent(1)
        _wait_for(lambda: steps_with(2) >= settings.baseline_old_steps, 180, agents, "the first two workers")
        mark("old_set_training")
        requested = time.time()
        start_agent(2)
        _wait_for(lambda: steps_with(3) >= settings.baseline_new_steps, 180, agents, "the restarted workers")
        mark("new_set_done")
    finally:
        _stop_agents(agents, files["pids"])
        outputs.close()
        mark("agents_stopped")
    for leftover in (files["checkpoint"], files["checkpoint"] + ".tmp"):  # hundreds of MB each
        if os.path.exists(leftover):
            os.remove(leftover)
    result = analyse_torchrun(json_lines(files["log"]), requested)
    result["wall_s"] = time.perf_counter() - started
    result["timeline_s"] = timeline
    return result


def analyse_torchrun(records: list, requested: float) -> dict:
    """Stall and its parts, from the last old-set commit to the first new-set commit."""
    steps = [r for r in records if r["kind"] == "step"]
    old = [r for r in steps if r["world"] == 2]
    new = [r for r in steps if r["world"] == 3]
    start = next(r for r in records if r["kind"] == "start" and r["world"] == 3)
    last_old, first_new = old[-1]["time"], new[0]["time"]
    intervals = [b["time"] - a["time"] for a, b in zip(new, new[1:])]
    normal = median(intervals) if intervals else float("nan")
    gap = first_new - last_old
    return {
        "commit_gap_s": gap,
        "normal_step_s": normal,
        "stall_s": max(0.0, gap - normal),
        "request_to_first_step_s": first_new - requested,
        "steps_lost": old[-1]["step"] + 1 - start["step"],
        "step_time_2_s": median([b["time"] - a["time"] for a, b in zip(old, old[1:])]) if len(old) > 1 else None,
        "save_s": median([r["save_s"] for r in steps if r["save_s"] > 0] or [0.0]),  # 0: a set's first
        "parts_s": {
            "stop_and_rendezvous": start["process_started"] - last_old,
            "import_torch": start["imported"] - start["process_started"],
            "form_process_group": start["group_formed"] - start["imported"],
            # Mostly torch.optim's first use, which imports torch._dynamo.
            "build_model_and_optimizer": start["model_built"] - start["group_formed"],
            "load_checkpoint": start["loaded"] - start["model_built"],
            "build_ddp": start["ddp_ready"] - start["loaded"],
            "first_step": first_new - start["ddp_ready"],
        },
    }
