"""Elastic changes on a 25M-parameter Adam job: flexpar vs torchrun checkpoint-restart.

    python benchmarks/elastic.py [--json PATH] [--quick] [--rounds N (at most; default 3)]

One invocation measures, alternating flexpar and baseline rounds:

- flexpar, one `fit()` per round on 2 CPU processes (oversubscribed: 3 processes
  on 2 cores at the peak) with the schedule "+1" (scale out 2->3), a kill -9 of
  the joiner during backward (failure 3->2), "+1" again, "-1" (planned scale in
  3->2), then "+1" and "-1" once more, "+1" and a kill once more, "+1" and
  "-1" twice more, and "+1" and a kill a third time (a scale-in costs
  milliseconds with a heavy tail and a failure less than a step: one per
  round is too few to judge either).
- the baseline, torchrun's own elastic mode (`--nnodes=2:3`, c10d rendezvous,
  one worker per agent): two agents train, a third agent joins on the same host,
  torchrun stops every worker and starts a fresh set, which imports torch,
  rebuilds the model, loads the checkpoint and re-forms the process group
  (`restart_worker.py`).
- the physical floor: a plain gloo broadcast of the state's bytes (parameters
  + Adam state, as one torch.save buffer) between local processes, and where
  flexpar's own transfer path spends its time (capture, send, receive, restore).

Stall, for both sides, from the step records: the gap between the last commit
before the change and the first commit after it, minus a normal step of the
new device set. flexpar's own figure (`stall_s` of the event record: from the
last commit among the new set's members until every member is level, the
joiner's restore included) is reported beside it. Every figure is the median
over the rounds.
"""

from __future__ import annotations

import contextlib
import json
import math
import multiprocessing
import os
import signal
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import restart_worker
import torch
from common import base_parser, free_port, median, print_table, write_json
from restart_worker import adam, cross_entropy, make_dataset

WORKER_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "restart_worker.py")
GLOBAL_BATCH = 24
VIRTUAL_WORKERS = 6  # splits evenly over 2 and 3 devices


# The changes of a flexpar round, in order: "+1" (a device joins), "kill" (the
# newest member is killed during backward) and "-1" (the newest member leaves).
# A scale-in costs a few milliseconds with a heavy tail and a failure less than
# a step: a round has several of each (over a run's six, a scale-in's boundary
# record read 2 to 11 ms and a failure's 0.15 to 0.26 s, so a median of six
# moved by a third between runs).
ROUND_CHANGES = ("+1", "kill", "+1", "-1", "+1", "-1", "+1", "kill", "+1", "-1", "+1", "-1", "+1", "kill")
# The names of each kind's changes, in order; each figure is a median over every
# round's changes of its kind.
SCALE_OUTS = ("scale_out", "scale_out_again", "scale_out_third", "scale_out_fourth", "scale_out_fifth",
              "scale_out_sixth", "scale_out_seventh")
SCALE_INS = ("scale_in", "scale_in_again", "scale_in_third", "scale_in_fourth")
FAILURES = ("failure", "failure_again", "failure_third")


def planned_device_counts(changes=ROUND_CHANGES, devices: int = 2) -> list:
    """The device counts a round goes through when every change fires as planned."""
    counts = [devices]
    for change in changes:
        counts.append(counts[-1] + (1 if change == "+1" else -1))
    return counts


PLANNED_DEVICE_COUNTS = planned_device_counts()


class Settings:
    """The size of one invocation: full (default) or --quick."""

    def __init__(self, quick: bool, rounds: int):
        self.quick = quick
        self.model_name = "small" if quick else "full"
        self.rounds = rounds
        # flexpar schedule: step indices of the changes, spaced so that each change
        # has settled before the next fires. A joiner needs seconds (start, import the
        # script, build, warm up) before it is admitted: about 3 full-size steps, or
        # 12 of the quick model's short ones; `lead` leaves room beyond that, since the
        # fault can only fire once the joiner trains, and a "-1" that fires before
        # the joiner is admitted would cancel it instead of removing it. After a
        # leave or a kill, 4 steps on 2 devices give the change's generation a
        # normal step.
        lead = 16 if quick else 6
        self.change_steps = []
        step = 3
        for change in ROUND_CHANGES:
            self.change_steps.append(step)
            step += lead if change == "+1" else 4
        self.steps = step
        self.join_steps = self._steps_of("+1")
        self.leave_steps = self._steps_of("-1")
        # The third agent starts once the old set has committed a step (it then needs
        # seconds of `import torch` before it reaches the rendezvous, while the old
        # set trains on); the new set runs 3 steps: 2 intervals give a normal step.
        self.baseline_old_steps = 1
        self.baseline_new_steps = 3
        self.broadcast_repeats = 1 if quick else 2
        # flexpar's own transfer between 3 processes on 2 cores took 0.12 to 0.68 s
        # from one repeat to the next on the development machine: its parts are
        # medians over more repeats (about 0.5 s each).
        self.transfer_repeats = 1 if quick else 9
        # A joiner receives in a process that never held the state: fresh processes
        # (before the joiner received the model in place) took 0.29-0.34 s (median)
        # where a long-lived receiver took 0.18-0.24 s.
        self.fresh_receivers = 1 if quick else 7
        # Rounds are repeated while time allows: no new round starts that would push
        # the run past this (the floor measurement, ~30 s, comes after the rounds).
        self.budget_s = 330.0

    def _steps_of(self, kind: str) -> tuple:
        return tuple(step for step, change in zip(self.change_steps, ROUND_CHANGES) if change == kind)

    @property
    def schedule(self) -> str:
        return ",".join(f"{step}:{change}" for step, change in zip(self.change_steps, ROUND_CHANGES)
                        if change != "kill")

    @property
    def faults(self) -> str:
        # Joiners are numbered from local-2 on, in order; a kill hits the newest.
        faults, joined = [], 0
        for step, change in zip(self.change_steps, ROUND_CHANGES):
            joined += change == "+1"
            if change == "kill":
                faults.append(f"{step}:local-{1 + joined}:backward")
        return ",".join(faults)


def model_factory(settings: Settings):
    return restart_worker.MODELS[settings.model_name]


# ----------------------------------------------------------------- step records


def _commit_intervals(times: dict, steps) -> list:
    return [times[step] - times[step - 1] for step in steps if step in times and step - 1 in times]


def normal_step_s(step_records: list, generation: int, first_step: int) -> float:
    """Median commit-to-commit interval of `generation`, its first step excluded."""
    times = {record["step"]: record["time"] for record in step_records}
    later = [r["step"] for r in step_records if r["generation"] == generation and r["step"] > first_step]
    intervals = _commit_intervals(times, later)
    if not intervals:  # a generation too short to have a steady step: use everything else
        intervals = _commit_intervals(times, [step for step in times if step != first_step])
    return median(intervals) if intervals else float("nan")


def measure_change(step_records: list, event: dict, request_step) -> dict:
    """One change, as the step records show it.

    `event["step"]` is the first step of the new device set; `request_step`
    is the step at which the driver fired the schedule entry (its request is
    the commit of the step before), or None for a failure.
    """
    times = {record["step"]: record["time"] for record in step_records}
    first = event["step"]
    generation = next(r["generation"] for r in step_records if r["step"] == first)
    gap = times[first] - times[first - 1]
    normal = normal_step_s(step_records, generation, first)
    measured = {
        "first_new_step": first, "event_stall_s": event["stall_s"], "commit_gap_s": gap,
        "normal_step_s": normal, "stall_s": max(0.0, gap - normal), "detail": event["detail"],
    }
    if request_step is not None:
        measured["request_step"] = request_step
        measured["request_to_first_step_s"] = times[first] - times[request_step - 1]
    return measured


def analyse_flexpar(records: list, settings: Settings) -> dict:
    """The changes of one flexpar round, matched to the schedule and the faults, in order."""
    steps = [r for r in records if r["kind"] == "step"]
    events = [r for r in records if r["kind"] == "event"]
    joins = [e for e in events if e["event"] == "join"]
    failures = [e for e in events if e["event"] == "failure"]
    leaves = [e for e in events if e["event"] == "leave"]
    found = {}
    for name, event, request_step in zip(SCALE_OUTS, joins, settings.join_steps):
        found[name] = measure_change(steps, event, request_step)
    for name, event, request_step in zip(SCALE_INS, leaves, settings.leave_steps):
        found[name] = measure_change(steps, event, request_step)
    for name, event in zip(FAILURES, failures):
        found[name] = measure_change(steps, event, None)
    two = [r for r in steps if len(r["devices"]) == 2]
    three = [r for r in steps if len(r["devices"]) == 3]
    found["step_time_2_s"] = _steady_step_s(steps, two)
    found["step_time_3_s"] = _steady_step_s(steps, three)
    found["device_counts"] = _device_counts(steps)
    # Anything else means a change fired before the one before it had settled.
    found["as_planned"] = found["device_counts"] == PLANNED_DEVICE_COUNTS
    return found


def _steady_step_s(all_steps: list, subset: list) -> float:
    """Median interval over steps of `subset` whose predecessor ran in the same generation."""
    generation_of = {r["step"]: r["generation"] for r in all_steps}
    times = {r["step"]: r["time"] for r in all_steps}
    steady = [r["step"] for r in subset if r["step"] >= 2 and generation_of.get(r["step"] - 1) == r["generation"]]
    intervals = _commit_intervals(times, steady)
    return median(intervals) if intervals else float("nan")


def _device_counts(step_records: list) -> list:
    counts = []
    for record in step_records:
        if not counts or counts[-1] != len(record["devices"]):
            counts.append(len(record["devices"]))
    return counts


# ----------------------------------------------------------------- flexpar side


def flexpar_round(settings: Settings, workdir: str, index: int) -> dict:
    """One fit() with the schedule and faults of `settings`; its changes measured."""
    import flexpar
    from flexpar.observe.metrics import read_records

    job = flexpar.Job(
        model=model_factory(settings), optimizer=adam, loss=cross_entropy, dataset=make_dataset(),
        global_batch=GLOBAL_BATCH, virtual_workers=VIRTUAL_WORKERS, seed=0,
    )
    metrics = os.path.join(workdir, f"flexpar-{index}.jsonl")
    started = time.perf_counter()
    job.fit(
        # max_devices=5: the schedule's validator counts every "+1" and "-1" but not
        # the faults, which remove a joiner each; at most 3 devices ever run.
        steps=settings.steps, devices=2, max_devices=5, schedule=settings.schedule,
        faults=settings.faults, oversubscribe=True, metrics=metrics, display=False, quiet=True,
        timeout_s=30.0,
    )
    result = analyse_flexpar(read_records(metrics), settings)
    result["wall_s"] = time.perf_counter() - started
    result["metrics"] = metrics
    return result


# ---------------------------------------------------------------- baseline side


def _read_lines(path: str) -> list:
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.endswith("\n")]


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
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            if b"restart_worker.py" not in handle.read():
                return
        os.kill(pid, signal.SIGKILL)
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        pass


def torchrun_command(settings: Settings, port: int, run_id: str, files: dict) -> list:
    return [
        sys.executable, "-m", "torch.distributed.run",
        "--nnodes=2:3", "--nproc-per-node=1",
        "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id={run_id}",
        # Without it, the first two agents would wait 30 s for a third before starting.
        "--rdzv-conf=last_call_timeout=1",
        "--max-restarts=3", "--monitor-interval=0.1",
        WORKER_SCRIPT, "--records", files["log"], "--checkpoint", files["checkpoint"],
        "--pid-folder", files["pids"], "--global-batch", str(GLOBAL_BATCH),
        "--model", settings.model_name, "--threads", "1",
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
        agents.append(subprocess.Popen(command, env=environment, stdout=output, stderr=subprocess.STDOUT,
                                       start_new_session=True))  # its own group: no terminal signals

    def steps_with(world: int) -> int:
        return sum(1 for r in _read_lines(files["log"]) if r["kind"] == "step" and r["world"] == world)

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
    result = analyse_torchrun(_read_lines(files["log"]), requested)
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
        "commit_gap_s": gap, "normal_step_s": normal, "stall_s": max(0.0, gap - normal),
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


# ------------------------------------------------------ floor and transfer parts


def trained_state(settings: Settings):
    """Model and Adam after one step, so the optimizer holds its full state."""
    torch.manual_seed(0)
    model = model_factory(settings)()
    optimizer = adam(model.parameters())
    inputs, labels = make_dataset()[:4]
    cross_entropy(model, (inputs, labels)).backward()
    optimizer.step()
    return model, optimizer


def _timed(function):
    started = time.perf_counter()
    value = function()
    return value, time.perf_counter() - started


def _state_tensors(model, optimizer) -> list:
    """Every tensor of the training state that a joiner must receive, in a fixed order."""
    tensors = list(model.state_dict().values())
    for parameter in model.parameters():
        state = optimizer.state[parameter]
        tensors += [state[key] for key in sorted(state) if torch.is_tensor(state[key])]
    return tensors


def _floor_worker(rank: int, world: int, port: int, model_name: str, repeats: int, transfer_repeats: int,
                  fresh_receivers: int, results) -> None:
    """One process of the floor measurement; rank 0 reports every figure it measured.

    Last, rank 1 sits out while rank 0 sends flexpar's state to each of
    `fresh_receivers` new processes in turn (`_fresh_receiver`), rank 2 idle
    beside them, as an old member is while a joiner receives.
    """
    import datetime

    import torch.distributed as dist

    from flexpar.worker.process import keep_freed_memory

    keep_freed_memory()  # the source and the others are workers in a job: as every worker does first
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0, timeout=datetime.timedelta(seconds=120))
    model, optimizer = trained_state(Settings(quick=model_name == "small", rounds=1))
    while int(store.add("floor/joiners_built", 0)) < fresh_receivers:  # their model builds must not overlap
        time.sleep(0.05)
    figures: dict = {}

    def record(key: str, seconds: float) -> None:
        figures.setdefault(key, []).append(_slowest(seconds))

    def form(name: str) -> float:
        if dist.is_initialized():
            # Without this barrier the slowest rank's time would include the
            # skew left by the transfers before (the sender finishes first),
            # which is not group formation: it read 0.10 s for 3 processes
            # against about 0.01 s measured apart.
            dist.barrier()
            dist.destroy_process_group()
        _, seconds = _timed(lambda: dist.init_process_group(
            "gloo", store=dist.PrefixStore(name, store), rank=rank, world_size=world))
        dist.barrier()
        return seconds

    form("pg/0")  # the first group of a process also pays gloo's start-up: not what flexpar pays
    from flexpar.comm import state_transfer as training_state

    data = training_state.to_bytes(training_state.capture(model, optimizer, None, 1, {}))
    state_bytes = len(data)
    payload = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    for repeat in range(repeats):
        record("pg_again_s", form(f"pg/{repeat + 1}"))  # a fresh group in running processes, as flexpar does
        _floor_transfers(rank, payload, record)
        _direct_transfer(rank, _state_tensors(model, optimizer), record)
    del data, payload  # 2 x 302 MB that flexpar's transfer does not hold
    for repeat in range(transfer_repeats):
        _flexpar_transfer(rank, model, optimizer, record)
    dist.barrier()
    dist.destroy_process_group()
    for repeat in range(fresh_receivers if rank != 1 else 0):
        dist.init_process_group("gloo", store=dist.PrefixStore(f"join/{repeat}", store), rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=120))
        dist.barrier()
        if rank == 0:
            training_state.send_state(training_state.capture(model, optimizer, None, 1, {}), [1],
                                      torch.device("cpu"))
        dist.barrier()
        dist.destroy_process_group()
    if rank == 0:
        results.put({"state_bytes": state_bytes, **figures})


def one_virtual_worker_batch():
    """A batch of one VW of this job (the first samples): what a warm-up or a probe's step runs."""
    return make_dataset()[:GLOBAL_BATCH // VIRTUAL_WORKERS]


def _fresh_receiver(port: int, repeat: int, model_name: str, results) -> None:
    """A joiner's side of the transfer, in a process that never held the state.

    Like a joiner (flexpar.worker_process.main, Worker.warm_up), it keeps the
    memory it frees (`keep_freed_memory`, every worker's first call), has
    built the model and run one VW's forward and backward without an update,
    receives the model's tensors into its own (`receive_state` with its
    state_dict) and the rest into fresh memory, then restores. Forked from
    flexpar's fork server (fit() started it), it has the workers' allocator
    tunables too. It says when it is built: the floor waits for every
    receiver before it measures anything.
    """
    import datetime

    import torch.distributed as dist

    from flexpar.comm import state_transfer as training_state
    from flexpar.worker.process import keep_freed_memory

    keep_freed_memory()
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=180))
    model = model_factory(Settings(quick=model_name == "small", rounds=1))()
    optimizer = adam(model.parameters())
    cross_entropy(model, one_virtual_worker_batch()).backward()  # the warm-up
    optimizer.zero_grad(set_to_none=True)
    store.add("floor/joiners_built", 1)
    dist.init_process_group("gloo", store=dist.PrefixStore(f"join/{repeat}", store), rank=1, world_size=3,
                            timeout=datetime.timedelta(seconds=120))
    dist.barrier()
    received, receive_s = _timed(lambda: training_state.receive_state(0, torch.device("cpu"), model.state_dict()))
    _, restore_s = _timed(lambda: training_state.restore(model, optimizer, None, received))
    results.put({"fresh_receive_s": receive_s, "fresh_restore_s": restore_s})
    dist.barrier()
    dist.destroy_process_group()


def _floor_transfers(rank: int, payload: torch.Tensor, record) -> None:
    """The state's bytes by plain gloo: broadcast 1 -> 2, and send 1 -> 1 (what one joiner needs)."""
    import torch.distributed as dist

    dist.barrier()
    _, seconds = _timed(lambda: dist.broadcast(payload, 0))
    record("broadcast_3_s", seconds)
    dist.barrier()
    seconds = 0.0
    if rank == 0:
        _, seconds = _timed(lambda: dist.send(payload, 1))
    elif rank == 1:
        _, seconds = _timed(lambda: dist.recv(payload, 0))
    record("send_2_s", seconds)


def _flexpar_transfer(rank: int, model, optimizer, record) -> None:
    """flexpar's own path (flexpar.state), function by function, rank 0 -> rank 1.

    The receiver's `receive_s` runs from the same barrier as the sender's
    capture and send, so it spans them: the path ends at receive + restore.
    A joiner, which receives in a process that never held the state, is
    timed apart (`_fresh_receiver`).
    """
    import torch.distributed as dist

    from flexpar.comm import state_transfer as training_state

    cpu = torch.device("cpu")
    parts = dict.fromkeys(("flexpar_capture_s", "flexpar_send_s", "flexpar_receive_s", "flexpar_restore_s"), 0.0)
    dist.barrier()
    if rank == 0:
        state, parts["flexpar_capture_s"] = _timed(lambda: training_state.capture(model, optimizer, None, 1, {}))
        _, parts["flexpar_send_s"] = _timed(lambda: training_state.send_state(state, [1], cpu))
    elif rank == 1:
        loaded, parts["flexpar_receive_s"] = _timed(lambda: training_state.receive_state(0, cpu))
        _, parts["flexpar_restore_s"] = _timed(lambda: training_state.restore(model, optimizer, None, loaded))
    for key, seconds in parts.items():
        record(key, seconds)


def _direct_transfer(rank: int, tensors: list, record) -> None:
    """What a copy-free path would cost: each state tensor sent straight into the receiver's own."""
    import torch.distributed as dist

    dist.barrier()
    seconds = 0.0
    if rank == 0:
        _, seconds = _timed(lambda: [dist.send(tensor, 1) for tensor in tensors])
    elif rank == 1:
        _, seconds = _timed(lambda: [dist.recv(tensor, 0) for tensor in tensors])
    record("direct_tensor_send_s", seconds)


def _slowest(seconds: float) -> float:
    """The largest of every rank's figure: a transfer ends when its last receiver has it."""
    import torch.distributed as dist

    value = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return float(value.item())


def measure_floor(settings: Settings) -> dict:
    """Broadcast floor, process-group formation and flexpar's transfer parts (3 processes)."""
    # A fork server that has imported torch (flexpar's fit() already started one)
    # keeps three `import torch` off this measurement's wall time.
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["torch", "torch.distributed", "torch.optim", "torch._dynamo", "flexpar.comm.state_transfer"])
    results = context.Queue()
    port = free_port()
    processes = [context.Process(target=_floor_worker, name=f"elastic-floor-{rank}",
                                 args=(rank, 3, port, settings.model_name, settings.broadcast_repeats,
                                       settings.transfer_repeats, settings.fresh_receivers, results))
                 for rank in range(3)]
    # Each waits for its turn (its own group) without using the CPU.
    processes += [context.Process(target=_fresh_receiver, name=f"elastic-joiner-{repeat}",
                                  args=(port, repeat, settings.model_name, results))
                  for repeat in range(settings.fresh_receivers)]
    for process in processes:
        process.start()
    fresh: dict = {}
    try:
        while True:
            message = results.get(timeout=300)
            if "fresh_receive_s" not in message:
                figures = {**message, **{f"flexpar_{key}": values for key, values in fresh.items()}}
                break
            for key, seconds in message.items():
                fresh.setdefault(key, []).append(seconds)
    finally:
        for process in processes:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()
    return {key: (median(value) if isinstance(value, list) else value) for key, value in figures.items()}


# ------------------------------------------------------------------- reporting


def change_values(rounds: list, changes: tuple, key: str) -> list:
    """`key` of the named changes of every round, in order, where it was measured (not None or NaN)."""
    values = [r[change][key] for r in rounds for change in changes if change in r and key in r[change]]
    return [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]


def _medians(rounds: list, changes: tuple, key: str):
    """Median of `key` over the named changes of every round."""
    values = change_values(rounds, changes, key)
    return median(values) if values else None


def _plain_medians(rounds: list, key: str):
    values = [r[key] for r in rounds if r.get(key) is not None and not math.isnan(r[key])]
    return median(values) if values else None


def summarise(settings, flexpar_rounds, torchrun_rounds, floor, parameter_count) -> dict:
    scale_out = [dict(r[name]) for name in SCALE_OUTS for r in flexpar_rounds if name in r]
    scale_out_stall = median([c["stall_s"] for c in scale_out]) if scale_out else None
    restart_stall = _plain_medians(torchrun_rounds, "stall_s")
    step_time = _plain_medians(flexpar_rounds, "step_time_2_s")
    scale_in_stall = _medians(flexpar_rounds, SCALE_INS, "stall_s")
    return {
        "baseline": (
            "torchrun elastic (python -m torch.distributed.run --nnodes=2:3 --nproc-per-node=1, c10d "
            "rendezvous on 127.0.0.1, a third agent joins on the same host; DDP over gloo, checkpoint "
            "(torch.save of model+optimizer) after every step, loaded by the restarted workers). It "
            "needs TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: without it, torch 2.13 agents reuse the "
            "first round's cached store address and the joining agent times out (role_info / "
            "MASTER_ADDR), which is the failure shared/DESIGN.md records."
        ),
        "model": settings.model_name, "parameter_count": parameter_count,
        "state_bytes": floor["state_bytes"], "global_batch": GLOBAL_BATCH,
        "virtual_workers": VIRTUAL_WORKERS, "rounds": settings.rounds,
        "scale_out_stall_s": scale_out_stall,
        "scale_out_event_stall_s": median([c["event_stall_s"] for c in scale_out]) if scale_out else None,
        "scale_out_request_to_first_step_s": (
            median([c["request_to_first_step_s"] for c in scale_out]) if scale_out else None),
        "restart_stall_s": restart_stall,
        "restart_request_to_first_step_s": _plain_medians(torchrun_rounds, "request_to_first_step_s"),
        "restart_step_time_s": _plain_medians(torchrun_rounds, "step_time_2_s"),
        "restart_step_time_3_workers_s": _plain_medians(torchrun_rounds, "normal_step_s"),
        "restart_checkpoint_save_s": _plain_medians(torchrun_rounds, "save_s"),
        "restart_steps_lost": [r["steps_lost"] for r in torchrun_rounds],
        "scale_out_speedup": (restart_stall / scale_out_stall) if restart_stall and scale_out_stall else None,
        "scale_in_stall_s": scale_in_stall,
        "scale_in_event_stall_s": _medians(flexpar_rounds, SCALE_INS, "event_stall_s"),
        "scale_in_request_to_first_step_s": _medians(flexpar_rounds, SCALE_INS, "request_to_first_step_s"),
        "scale_in_goal_s": (step_time + 0.2) if step_time is not None else None,
        "step_time_s": step_time,
        "step_time_3_devices_s": _plain_medians(flexpar_rounds, "step_time_3_s"),
        "failure_resume_s": _medians(flexpar_rounds, FAILURES, "stall_s"),
        "failure_event_stall_s": _medians(flexpar_rounds, FAILURES, "event_stall_s"),
        "failure_last_commit_to_first_step_s": _medians(flexpar_rounds, FAILURES, "commit_gap_s"),
        "broadcast_s": floor["send_2_s"],
        "broadcast_3_processes_s": floor["broadcast_3_s"],
        "process_group_formation_s": floor["pg_again_s"],
        # The calls of flexpar.state: the source's capture and send_state, the
        # receiver's receive_state (from the same start, so it spans the source's
        # part) and restore; fresh_receive_s and fresh_restore_s are the same in a new
        # process that has built the model, as a joiner receives.
        "flexpar_transfer_parts_s": {key.replace("flexpar_", ""): floor[key] for key in (
            "flexpar_capture_s", "flexpar_send_s", "flexpar_receive_s", "flexpar_restore_s",
            "flexpar_fresh_receive_s", "flexpar_fresh_restore_s")},
        "direct_tensor_send_s": floor["direct_tensor_send_s"],
        "restart_parts_s": {key: median([r["parts_s"][key] for r in torchrun_rounds])
                            for key in (torchrun_rounds[0]["parts_s"] if torchrun_rounds else {})},
        "flexpar_rounds": flexpar_rounds, "torchrun_rounds": torchrun_rounds,
    }


def print_report(summary: dict) -> None:
    rows = [
        {"figure": "scale out 2->3: stall (step records)", "flexpar": summary["scale_out_stall_s"],
         "torchrun restart": summary["restart_stall_s"], "note": f"speedup {_fmt(summary['scale_out_speedup'])}x (goal >= 10)"},
        {"figure": "scale out 2->3: stall (event stall_s)", "flexpar": summary["scale_out_event_stall_s"]},
        {"figure": "scale out: request -> first new step", "flexpar": summary["scale_out_request_to_first_step_s"],
         "torchrun restart": summary["restart_request_to_first_step_s"]},
        {"figure": "scale in 3->2: stall (step records)", "flexpar": summary["scale_in_stall_s"],
         "note": f"goal <= one step + 0.2 = {_fmt(summary['scale_in_goal_s'])}"},
        {"figure": "scale in 3->2: stall (event stall_s)", "flexpar": summary["scale_in_event_stall_s"]},
        {"figure": "scale in: request -> first new step", "flexpar": summary["scale_in_request_to_first_step_s"]},
        {"figure": "failure 3->2 (kill -9): stall (step records)", "flexpar": summary["failure_resume_s"]},
        {"figure": "failure 3->2: stall (event stall_s)", "flexpar": summary["failure_event_stall_s"]},
        {"figure": "step time, 2 devices (commit to commit)", "flexpar": summary["step_time_s"],
         "torchrun restart": summary["restart_step_time_s"],
         "note": f"baseline incl. its checkpoint save, {_fmt(summary['restart_checkpoint_save_s'])} s"},
        {"figure": "step time, 3 devices (on 2 cores)", "flexpar": summary["step_time_3_devices_s"],
         "torchrun restart": summary["restart_step_time_3_workers_s"]},
        {"figure": "floor: gloo send of the state, 1 -> 1", "flexpar": summary["broadcast_s"],
         "note": f"{summary['state_bytes'] / 1e6:.0f} MB"},
        {"figure": "floor: gloo broadcast, 1 -> 2", "flexpar": summary["broadcast_3_processes_s"]},
        {"figure": "state tensors sent straight into the joiner's", "flexpar": summary["direct_tensor_send_s"],
         "note": "into tensors that exist already: no allocation, no restore"},
        {"figure": "new process group in running processes", "flexpar": summary["process_group_formation_s"]},
    ]
    print_table(rows, ["figure", "flexpar", "torchrun restart", "note"],
                title=f"\nElastic changes, {summary['parameter_count'] / 1e6:.1f}M parameters + Adam, "
                      f"medians of {summary['rounds']} rounds (seconds)")
    print("\nflexpar state transfer, by part (seconds):",
          ", ".join(f"{k} {v:.3f}" for k, v in summary["flexpar_transfer_parts_s"].items()))
    print("torchrun restart stall, by part (seconds):",
          ", ".join(f"{k} {v:.3f}" for k, v in summary["restart_parts_s"].items()))
    print(f"\nbaseline: {summary['baseline']}")


def _fmt(value) -> str:
    return "-" if value is None else f"{value:.3g}"


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=None,
                        help="most flexpar/baseline rounds (default 3 while they fit in ~5.5 min, quick 1)")
    args = parser.parse_args()
    settings = Settings(args.quick, args.rounds or (1 if args.quick else 3))
    parameter_count = sum(p.numel() for p in model_factory(settings)().parameters())
    workdir = tempfile.mkdtemp(prefix="flexpar-elastic-")
    print(f"elastic benchmark: {parameter_count / 1e6:.1f}M parameters, Adam, {settings.rounds} round(s); "
          f"files in {workdir}", flush=True)
    flexpar_rounds, torchrun_rounds = [], []
    started = time.perf_counter()
    for index in range(settings.rounds):  # alternating: flexpar, baseline, flexpar, ...
        elapsed = time.perf_counter() - started
        if index >= 2 and elapsed * (index + 1) / index > settings.budget_s:
            print(f"  stopping after {index} rounds: another would pass the {settings.budget_s:.0f} s budget")
            break
        flexpar_rounds.append(flexpar_round(settings, workdir, index))
        done = flexpar_rounds[-1]
        print(f"  round {index}: flexpar done in {done['wall_s']:.0f} s, device counts "
              f"{done['device_counts']}" + ("" if done["as_planned"] else
                                           f" (NOT as planned {PLANNED_DEVICE_COUNTS}: a joiner was late)"),
              flush=True)
        torchrun_rounds.append(torchrun_round(settings, workdir, index))
        print(f"  round {index}: torchrun done in {torchrun_rounds[-1]['wall_s']:.0f} s", flush=True)
    floor = measure_floor(settings)
    settings.rounds = len(flexpar_rounds)
    summary = summarise(settings, flexpar_rounds, torchrun_rounds, floor, parameter_count)
    summary["wall_s"] = time.perf_counter() - started
    print_report(summary)
    write_json(args.json, summary)


if __name__ == "__main__":
    main()
