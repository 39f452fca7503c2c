"""Fault soak: does an elastic run under random, combined faults equal the failure-free run?

Many short runs of a small job (benchmarks/soak_job.py), each with a schedule
drawn at random from a seed: joins and planned leaves, and kill -9, SIGSTOP (a
hung peer) and SIGTERM (preemption) of devices at random steps and phases
(forward, backward, gradient sync, state transfer, group formation, checkpoint
write). A run has several faults; some land on the same step (two at once),
and some are a group-formation fault on another device at a kill's step, which
fires in the recovery from that kill (a fault during recovery).

Each run is checked against the failure-free single-process run of the same
job: its parameters (rtol 1e-5, atol 1e-6, as the tests' long runs), and its
sample ledger (every committed step consumed its global batch once: no sample
lost, none repeated). A fault counts as injected when it fired (the worker's
"fault:" line for signals; a schedule entry that applied or cancelled a
joiner); runs are added until the injected count reaches --faults.

JSON keys: faults_injected, runs, hangs (a run not finished within
60 s + faults x timeout_s, killed), failed_runs (a run that stopped with an
error), divergent_runs, samples_lost, samples_repeated, hung_peer_detection_s
(median seconds from a SIGSTOP to the survivors' next generation, level: the
failure event's time), and per-run details.

    python benchmarks/soak.py --faults 100 --seed 0 --json soak.json
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import Optional

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import common  # noqa: E402
from soak_job import VIRTUAL_WORKERS  # noqa: E402

SIGNAL_PHASES = ("forward", "backward", "sync", "transfer", "formation", "checkpoint")
SIGNAL_NAMES = {"kill": "SIGKILL", "stop": "SIGSTOP", "term": "SIGTERM"}
# Relative frequency of each kind of fault in a drawn run.
KIND_WEIGHTS = {"kill": 4, "stop": 2, "term": 3, "join": 3, "leave": 2}
FIRST_STEP, LAST_STEP = 2, 28
STEPS = 36
CHECKPOINT_EVERY = 5


@dataclass
class RunPlan:
    """One run: its starting devices, scheduled changes and signal faults."""

    index: int
    devices: int
    schedule: list = field(default_factory=list)  # (step, +1 | -1)
    faults: list = field(default_factory=list)    # (step, device, phase, signal name)

    @property
    def size(self) -> int:
        return len(self.schedule) + len(self.faults)

    def fault_text(self) -> str:
        return ",".join(f"{step}:{device}:{phase}:{kind}" for step, device, phase, kind in self.faults)

    def schedule_text(self) -> str:
        return ",".join(f"{step}:{delta:+d}" for step, delta in sorted(self.schedule))


def draw_run(rng: random.Random, index: int) -> RunPlan:
    """A run's plan: 2-4 faults, never more device losses than can leave one device standing.

    Signals go to the devices the run starts with, each at most once, at most
    devices - 1 of them (a joiner may still be warming up when they fire).
    Planned leaves never outnumber the joins before them, so they take
    joiners, not the devices the signals need. Joins never take the job past
    one device per virtual worker.
    """
    devices = rng.choice((2, 3))
    plan = RunPlan(index, devices)
    targets = [f"local-{i}" for i in range(devices)]
    rng.shuffle(targets)
    losses_left, joins = devices - 1, 0
    count = rng.randint(2, 4)
    while plan.size < count:
        kind = rng.choices(list(KIND_WEIGHTS), weights=list(KIND_WEIGHTS.values()))[0]
        previous = plan.faults[-1][0] if plan.faults else None
        # One fault in four lands on the step of the previous one: two at once.
        step = previous if previous is not None and rng.random() < 0.25 else rng.randint(FIRST_STEP, LAST_STEP)
        if kind == "join":
            if devices + sum(1 for _, delta in plan.schedule if delta > 0) >= VIRTUAL_WORKERS:
                continue
            plan.schedule.append((step, +1))
            joins += 1
        elif kind == "leave":
            last_join = max((s for s, d in plan.schedule if d > 0), default=LAST_STEP)
            if joins == 0 or last_join >= LAST_STEP:
                continue  # a leave comes strictly after a join, and takes that joiner
            joins -= 1
            plan.schedule.append((max(step, last_join + 1), -1))
        else:
            if losses_left == 0:
                continue
            losses_left -= 1
            device = targets.pop()
            plan.faults.append((step, device, rng.choice(SIGNAL_PHASES), kind))
            # One kill in five brings a second fault into its recovery: a group-formation
            # fault on another device fires at the next formation, which is the recovery's.
            if kind == "kill" and losses_left and rng.random() < 0.2 and plan.size < count:
                losses_left -= 1
                plan.faults.append((step, targets.pop(), "formation", "kill"))
    return plan


def plans(seed: int):
    rng = random.Random(seed)
    index = 0
    while True:
        yield draw_run(rng, index)
        index += 1


@dataclass
class RunResult:
    index: int
    plan: dict
    wall_s: float
    injected: int = 0
    hang: bool = False
    failed: str = ""
    divergent: bool = False
    samples_lost: int = 0
    samples_repeated: int = 0
    steps: int = 0
    hung_detection_s: list = field(default_factory=list)


_FAULT_LINE = re.compile(r"flexpar: fault: (\S+) gets (SIG\w+) at step (\d+) \((\w+)\) at ([\d.]+)")


def run_one(plan: RunPlan, folder: str, timeout_s: float, heartbeat_timeout_s: float, references: dict) -> RunResult:
    import torch

    import soak_job
    from flexpar import ledger

    output = os.path.join(folder, f"run-{plan.index:03d}")
    os.makedirs(output, exist_ok=True)
    joins = sum(1 for _, delta in plan.schedule if delta > 0)
    spec = {"output": output, "steps": STEPS, "devices": plan.devices, "max_devices": plan.devices + joins,
            "schedule": plan.schedule_text(), "faults": plan.fault_text(), "timeout_s": timeout_s,
            "heartbeat_timeout_s": heartbeat_timeout_s, "checkpoint_every": CHECKPOINT_EVERY}
    spec_path = os.path.join(output, "spec.json")
    with open(spec_path, "w") as handle:
        json.dump(spec, handle)
    bound_s = 60.0 + plan.size * timeout_s
    started = time.monotonic()
    with open(os.path.join(output, "stderr.txt"), "w") as stderr:
        process = subprocess.Popen([sys.executable, os.path.join(HERE, "soak_job.py"), spec_path],
                                   stdout=subprocess.DEVNULL, stderr=stderr, start_new_session=True)
        try:
            code = process.wait(timeout=bound_s)
        except subprocess.TimeoutExpired:
            code = None
        finally:
            _kill_group(process.pid)
    result = RunResult(plan.index, asdict(plan), time.monotonic() - started)
    text = open(os.path.join(output, "stderr.txt")).read()
    fired = [match.groups() for match in _FAULT_LINE.finditer(text)]
    result.injected = len(fired)
    if code is None:
        result.hang = True
        return result
    if code != 0:
        result.failed = (text.strip().splitlines() or ["(no output)"])[-1][:300]
        return result
    summary = json.load(open(os.path.join(output, "summary.json")))
    result.steps = summary["steps"]
    result.injected += sum(1 for outcome in summary["schedule"]
                           if outcome["status"] in ("on time", "late") or "warming up when" in outcome["detail"])
    if result.steps not in references:
        references[result.steps] = soak_job.reference(result.steps).state_dict()
    model = torch.load(os.path.join(output, "model.pt"), weights_only=True)
    for name, value in references[result.steps].items():
        if not torch.allclose(model[name], value, rtol=1e-5, atol=1e-6):
            result.divergent = True
    job = soak_job.make_job()
    audit = ledger.audit(ledger.read(summary["sample_ledger"]), job.seed, len(job.dataset), job.global_batch,
                         result.steps)
    result.samples_lost = audit.samples_lost + audit.steps_missing * job.global_batch
    result.samples_repeated = audit.samples_repeated
    records = [json.loads(line) for line in open(os.path.join(output, "metrics.jsonl"))]
    failures = [r for r in records if r["kind"] == "event" and r["event"] == "failure"]
    for device, name, _, _, at in fired:
        if name == "SIGSTOP":
            noticed = [f["time"] for f in failures if device in f["detail"] and f["time"] >= float(at)]
            if noticed:
                result.hung_detection_s.append(min(noticed) - float(at))
    return result


def _kill_group(pid: int) -> None:
    """The run's driver and everything it started (stopped workers included) end here."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    # Workers the driver's death orphaned keep its process group; stopped ones die with SIGKILL too.


def run_soak(faults: int, seed: int, folder: Optional[str] = None, timeout_s: float = 30.0,
             heartbeat_timeout_s: float = 5.0, progress=print) -> dict:
    folder = folder or tempfile.mkdtemp(prefix="flexpar-soak-")
    references: dict = {}
    results = []
    injected = 0
    for plan in plans(seed):
        if injected >= faults:
            break
        result = run_one(plan, folder, timeout_s, heartbeat_timeout_s, references)
        results.append(result)
        injected += result.injected
        progress(f"run {plan.index}: devices {plan.devices}, schedule '{plan.schedule_text()}', faults "
                 f"'{plan.fault_text()}': {result.injected} fired, {result.wall_s:.1f} s"
                 + (", HANG" if result.hang else "") + (f", FAILED: {result.failed}" if result.failed else "")
                 + (", DIVERGENT" if result.divergent else "")
                 + (f", lost {result.samples_lost}" if result.samples_lost else "")
                 + (f", repeated {result.samples_repeated}" if result.samples_repeated else ""))
    detections = [value for result in results for value in result.hung_detection_s]
    return {
        "faults_injected": injected,
        "runs": len(results),
        "hangs": sum(result.hang for result in results),
        "failed_runs": sum(bool(result.failed) for result in results),
        "divergent_runs": sum(result.divergent for result in results),
        "samples_lost": sum(result.samples_lost for result in results),
        "samples_repeated": sum(result.samples_repeated for result in results),
        "hung_peer_detection_s": statistics.median(detections) if detections else None,
        "hung_peers": len(detections),
        "timeout_s": timeout_s,
        "heartbeat_timeout_s": heartbeat_timeout_s,
        "seed": seed,
        "wall_s_median": statistics.median(result.wall_s for result in results) if results else None,
        "wall_s_max": max((result.wall_s for result in results), default=None),
        "folder": folder,
        "details": [asdict(result) for result in results],
    }


def main() -> int:
    parser = common.base_parser(__doc__.splitlines()[0])
    parser.add_argument("--faults", type=int, default=100, help="faults to inject in all (default 100)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=30.0, help="the jobs' collective timeout (s)")
    parser.add_argument("--heartbeat-timeout", type=float, default=5.0, help="the jobs' heartbeat timeout (s)")
    arguments = parser.parse_args()
    faults = 12 if arguments.quick else arguments.faults
    report = run_soak(faults, arguments.seed, timeout_s=arguments.timeout,
                      heartbeat_timeout_s=arguments.heartbeat_timeout)
    keys = ("faults_injected", "runs", "hangs", "failed_runs", "divergent_runs", "samples_lost",
            "samples_repeated", "hung_peer_detection_s", "hung_peers", "wall_s_median", "wall_s_max")
    common.print_table([{"figure": key, "value": report[key]} for key in keys], ["figure", "value"], "fault soak")
    common.write_json(arguments.json, report)
    bad = report["hangs"] + report["failed_runs"] + report["divergent_runs"] + report["samples_lost"] + \
        report["samples_repeated"]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
