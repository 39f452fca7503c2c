"""Fault soak: does an elastic run under random, combined faults equal the failure-free run?

Many short runs of a small job (benchmarks/soak_job.py), each with a schedule
drawn at random from a seed (benchmarks/soak_plan.py): joins and planned
leaves, and kill -9, SIGSTOP (a hung peer) and SIGTERM (preemption) of devices
at random steps and phases (forward, backward, gradient sync, state transfer,
group formation, checkpoint write, evaluation), and, every fourth run, kill -9 of
the driver (forward, backward, sync or a join's state transfer), restarted with the
devices' resume command 0.5 s later (it re-adopts them). A run has several faults; some
land on the same step (two at once), and some are a group-formation fault on
another device at a kill's step, which fires in the recovery from that kill (a
fault during recovery). Every drawn fault is placed where it can fire.

Each run is checked against the failure-free single-process run of the same
job: it must reach its last step (STEPS; no drawn run is meant to end early),
its parameters must match (rtol 1e-5, atol 1e-6, as the tests' long runs), its
sample ledger must show every committed step consuming its global batch once
(no sample lost, none repeated), and every evaluation (every EVAL_EVERY steps
and after the last) must be there once, with each evaluation sample evaluated
exactly once and the metrics of the failure-free run's evaluation. What fired
is read from the run's output (benchmarks/soak_tally.py): a fault counts as
injected only when it fired; runs are added until the injected count reaches
--faults.

JSON keys: faults_injected, runs, hangs (a run not finished within
60 s + faults x timeout_s, killed), failed_runs (a run that stopped with an
error, or ended before its last step), divergent_runs, samples_lost,
samples_repeated, eval_missing (evaluations not recorded), eval_samples_lost /
eval_samples_repeated (evaluation samples an evaluation skipped / saw twice),
eval_divergent (evaluations whose metrics differ from the failure-free run's),
lost_state_stops (--shard: runs stopped as allowed below), shard,
driver_overrun_max (the most steps the devices committed past a driver fault's step:
soak_checks.driver_overrun),
hung_peer_detection_s (median seconds from a SIGSTOP to the survivors' next
generation, level: the failure event's time); what fired: fired_by_kind,
fired_by_phase, simultaneous (steps at which two or more signals fired),
signal_with_change (steps at which a signal fired and a join or leave was
scheduled), during_recovery (signals that fired while the job recovered from
another device's kill or SIGSTOP); what was drawn and did not fire:
not_fired, not_fired_by_kind, not_fired_by_phase; and per-run details.

Every third run (from the second; not with `--shard`) trains the same samples as a stream of 6
shards (soak_job.ShardStream), its ledger's items checked against the split and the pass ends.
With `--shard` the job's optimizer state is sharded (`Job(shard_optimizer=True)`)
and the signals are dealt one more phase, "update"; the checks are the same,
but for one stop allowed after two failures at once (`lost_state_stops`,
soak_checks.lost_state_stop_allowed).

    python benchmarks/soak.py --faults 100 --seed 0 --json soak.json
    python benchmarks/soak.py --shard --faults 100 --seed 0 --json soak-shard.json
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import harness
import soak_checks
import soak_tally
from soak_plan import CHECKPOINT_EVERY, EVAL_EVERY, SHARDED_PHASES, SIGNAL_PHASES, STEPS, RunPlan, plans

HERE = os.path.dirname(os.path.abspath(__file__))
# A driver killed by a driver fault is restarted this long after its death, with its devices' resume command.
RESTART_DELAY_S = 0.5
WAITING_NOTE = "restart it with: "


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
    eval_missing: int = 0
    eval_samples_lost: int = 0
    eval_samples_repeated: int = 0
    eval_divergent: int = 0
    steps: int = 0
    hung_detection_s: list = field(default_factory=list)
    fired: list = field(default_factory=list)  # soak_tally.Fired as dicts
    not_fired: list = field(default_factory=list)  # (kind, phase, step, device)
    simultaneous: int = 0
    signal_with_change: int = 0
    during_recovery: int = 0
    lost_state_stop: bool = False  # sharded: stopped with the state-lost line after two failures at once
    driver_overrun: Optional[int] = None  # steps committed past a driver fault's step (soak_checks)

    @property
    def bad(self) -> bool:
        return bool(
            self.hang
            or self.failed
            or self.divergent
            or self.samples_lost
            or self.samples_repeated
            or self.eval_missing
            or self.eval_samples_lost
            or self.eval_samples_repeated
            or self.eval_divergent
        )


def run_one(
    plan: RunPlan, folder: str, timeout_s: float, heartbeat_timeout_s: float, references: dict, shard: bool = False
) -> RunResult:
    """Run `plan`'s job (sharded with `shard`) and check it; `references` caches the failure-free run
    (filled on first use)."""
    import soak_job
    import torch

    output = os.path.join(folder, f"run-{plan.index:03d}")
    os.makedirs(output, exist_ok=True)
    spec = {
        "output": output,
        "steps": STEPS,
        "devices": plan.devices,
        "max_devices": plan.devices + plan.joins,
        "schedule": plan.schedule_text(),
        "faults": plan.fault_text(),
        "timeout_s": timeout_s,
        "heartbeat_timeout_s": heartbeat_timeout_s,
        "checkpoint_every": CHECKPOINT_EVERY,
        "eval_every": EVAL_EVERY,
        "shard": shard,
        "streaming": plan.streaming,
    }
    spec_path = os.path.join(output, "spec.json")
    with open(spec_path, "w") as handle:
        json.dump(spec, handle)
    bound_s = 60.0 + plan.size * timeout_s
    started = time.monotonic()
    command = [sys.executable, os.path.join(HERE, "soak_job.py"), spec_path]
    # Appended to: a restarted driver writes to the file its devices write to.
    with open(os.path.join(output, "stderr.txt"), "a") as stderr:
        if plan.driver_fault is None:
            # The run's driver and everything it started (stopped workers included) end with it.
            code = harness.run_in_own_group(command, bound_s, stdout=subprocess.DEVNULL, stderr=stderr)
        else:
            code = run_restarting_the_driver(command, bound_s, stderr)
    result = RunResult(plan.index, asdict(plan), time.monotonic() - started)
    text = open(os.path.join(output, "stderr.txt")).read()
    summary_path = os.path.join(output, "summary.json")
    summary = json.load(open(summary_path)) if code == 0 and os.path.exists(summary_path) else None
    metrics_path = os.path.join(output, "metrics.jsonl")
    records = [json.loads(line) for line in open(metrics_path)] if os.path.exists(metrics_path) else []
    events = [r for r in records if r["kind"] == "event"]
    _record_tally(result, soak_tally.tally(plan, text, summary["schedule"] if summary else None, records))
    result.driver_overrun = soak_checks.driver_overrun(result.fired, events)
    if code is None:
        result.hang = True
        return result
    if code != 0 and shard and soak_checks.lost_state_stop_allowed(text, result.simultaneous, result.during_recovery):
        result.lost_state_stop = True
        return result
    if code != 0 or summary is None:
        result.failed = (text.strip().splitlines() or ["(no output)"])[-1][:300] if code else "no summary.json"
        return result
    result.steps = summary["steps"]
    result.failed = ending_problem(summary)[:300]
    kind = "stream" if plan.streaming else "map"
    if kind not in references:  # the failure-free loop over the same data, once per kind
        model, evaluations = soak_job.reference(STEPS, EVAL_EVERY, plan.streaming)
        references[kind] = {"model": model.state_dict(), "evaluations": evaluations}
    reference = references[kind]
    model = torch.load(os.path.join(output, "model.pt"), weights_only=True)
    for name, value in reference["model"].items():
        if not torch.allclose(model[name], value, rtol=1e-5, atol=1e-6):
            result.divergent = True
    audit = soak_job.audit(summary["sample_ledger"], STEPS, plan.streaming)
    result.samples_lost = audit.samples_lost + audit.steps_missing * soak_job.GLOBAL_BATCH
    result.samples_repeated = audit.samples_repeated
    soak_checks.check_evaluations(result, [r for r in records if r["kind"] == "eval"], reference["evaluations"])
    failures = [e for e in events if e["event"] == "failure"]
    for fault in result.fired:
        if fault["kind"] == "stop":
            noticed = [f["time"] for f in failures if fault["device"] in f["detail"] and f["time"] >= fault["time"]]
            if noticed:
                result.hung_detection_s.append(min(noticed) - fault["time"])
    return result


def run_restarting_the_driver(command: list, bound_s: float, stderr) -> Optional[int]:
    """Run `command` (a job whose driver gets kill -9) like `harness.run_in_own_group`, and each time its
    driver dies by SIGKILL, run the resume command its devices print (`--resume`: a driver that re-adopts
    them) RESTART_DELAY_S later, as Kubernetes or a SLURM requeue would; the last driver's exit status,
    or None past `bound_s` (a hang). Every process started ends with it."""
    deadline = time.monotonic() + bound_s
    leaders, notes = [], 0
    try:
        while True:
            process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=stderr, start_new_session=True)
            leaders.append(process.pid)
            try:
                code = process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                return None
            if code != -signal.SIGKILL:
                return code
            stderr.flush()
            resume, notes = _resume_command(stderr.name, notes, deadline)
            if resume is None:  # no device holds a step to re-adopt: the run ends as killed
                return code
            time.sleep(RESTART_DELAY_S)
            command = [sys.executable, "-m", "flexpar", *shlex.split(resume)[1:]]
    finally:
        for leader in leaders:  # the first driver's session holds its devices, waiting or re-adopted
            harness.kill_group(leader)


def _resume_command(path: str, seen: int, deadline: float) -> tuple:
    """(the resume command, the count of waiting notes so far) once a device said after the last loss that
    it waits ("... restart it with: CMD": more than `seen` notes); (None, seen) if none did within 60 s."""
    give_up = min(deadline, time.monotonic() + 60.0)
    while time.monotonic() < give_up:
        said = harness.commands_said(path, WAITING_NOTE)
        if len(said) > seen:
            return said[-1], len(said)
        time.sleep(0.05)
    return None, seen


def ending_problem(summary: dict) -> str:
    """Why a run that exited cleanly is still not a whole run ("" when it is): it ended before
    STEPS, or was stopped. No drawn run is meant to end early (one of the devices it starts with
    never gets a signal), so a shorter run is a failure, never compared with a shorter reference."""
    steps, stopped = summary["steps"], summary.get("stopped") or ""
    if steps != STEPS:
        return f"ended after {steps} of {STEPS} steps" + (f" (stopped: {stopped})" if stopped else "")
    return f"stopped: {stopped}" if stopped else ""


def _record_tally(result: RunResult, tally: "soak_tally.Tally") -> None:
    result.fired = [asdict(fault) for fault in tally.fired]
    result.not_fired = list(tally.not_fired)
    result.injected = len(tally.fired)
    result.simultaneous, result.signal_with_change = tally.simultaneous, tally.signal_with_change
    result.during_recovery = tally.during_recovery


# The figures that must be 0, in the order the table shows them.
PROBLEMS = (
    "hangs",
    "failed_runs",
    "divergent_runs",
    "samples_lost",
    "samples_repeated",
    "eval_missing",
    "eval_samples_lost",
    "eval_samples_repeated",
    "eval_divergent",
)


def run_soak(
    faults: int,
    seed: int,
    folder: Optional[str] = None,
    timeout_s: float = 30.0,
    heartbeat_timeout_s: float = 5.0,
    progress=print,
    references: Optional[dict] = None,
    shard: bool = False,
) -> dict:
    """Runs drawn from `seed` until `faults` have fired; the report (see the module doc).
    `references`: the failure-free run's cache (run_one), shared by callers that run more;
    `shard`: the job's optimizer state sharded (its runs dealt the "update" phase too)."""
    folder = folder or tempfile.mkdtemp(prefix="flexpar-soak-")
    started = time.monotonic()
    references = {} if references is None else references
    results = []
    injected = 0
    for plan in plans(seed, SHARDED_PHASES if shard else SIGNAL_PHASES, streaming=not shard):
        if injected >= faults:
            break
        result = run_one(plan, folder, timeout_s, heartbeat_timeout_s, references, shard)
        results.append(result)
        injected += result.injected
        progress(describe(plan, result))
    return report(results, seed, timeout_s, heartbeat_timeout_s, folder, time.monotonic() - started, shard)


def describe(plan: RunPlan, result: RunResult) -> str:
    """One progress line per run."""
    problems = [
        ("HANG", result.hang),
        (f"FAILED: {result.failed}", result.failed),
        ("DIVERGENT", result.divergent),
        (f"lost {result.samples_lost}", result.samples_lost),
        (f"repeated {result.samples_repeated}", result.samples_repeated),
        (f"evaluations missing {result.eval_missing}", result.eval_missing),
        (f"evaluation samples lost {result.eval_samples_lost}", result.eval_samples_lost),
        (f"evaluation samples repeated {result.eval_samples_repeated}", result.eval_samples_repeated),
        (f"evaluations divergent {result.eval_divergent}", result.eval_divergent),
        ("stopped: optimizer state lost (two failures at once)", result.lost_state_stop),
    ]
    missed = f", not fired: {result.not_fired}" if result.not_fired else ""
    return (
        f"run {plan.index}: devices {plan.devices}, schedule '{plan.schedule_text()}', faults "
        f"'{plan.fault_text()}': {result.injected} fired{missed}, {result.wall_s:.1f} s"
        + "".join(f", {text}" for text, present in problems if present)
    )


def report(
    results: list,
    seed: int,
    timeout_s: float,
    heartbeat_timeout_s: float,
    folder: str,
    wall_s: float,
    shard: bool = False,
) -> dict:
    """The soak's JSON (see the module doc)."""
    detections = [value for result in results for value in result.hung_detection_s]
    tallies = [
        soak_tally.Tally(
            fired=[soak_tally.Fired(**fault) for fault in result.fired],
            not_fired=result.not_fired,
            simultaneous=result.simultaneous,
            signal_with_change=result.signal_with_change,
            during_recovery=result.during_recovery,
        )
        for result in results
    ]
    return {
        "faults_injected": sum(result.injected for result in results),
        "runs": len(results),
        "hangs": sum(result.hang for result in results),
        "failed_runs": sum(bool(result.failed) for result in results),
        "divergent_runs": sum(result.divergent for result in results),
        "samples_lost": sum(result.samples_lost for result in results),
        "samples_repeated": sum(result.samples_repeated for result in results),
        "eval_missing": sum(result.eval_missing for result in results),
        "eval_samples_lost": sum(result.eval_samples_lost for result in results),
        "eval_samples_repeated": sum(result.eval_samples_repeated for result in results),
        "eval_divergent": sum(result.eval_divergent for result in results),
        "hung_peer_detection_s": statistics.median(detections) if detections else None,
        "hung_peers": len(detections),
        "lost_state_stops": sum(result.lost_state_stop for result in results),
        "driver_overrun_max": max((r.driver_overrun for r in results if r.driver_overrun is not None), default=None),
        **soak_tally.counts(tallies, SHARDED_PHASES if shard else SIGNAL_PHASES),
        "shard": shard,
        "timeout_s": timeout_s,
        "heartbeat_timeout_s": heartbeat_timeout_s,
        "seed": seed,
        "wall_s": wall_s,
        "wall_s_median": statistics.median(result.wall_s for result in results) if results else None,
        "wall_s_max": max((result.wall_s for result in results), default=None),
        "folder": folder,
        "details": [asdict(result) for result in results],
    }


def main() -> int:
    parser = harness.base_parser(__doc__.splitlines()[0])
    parser.add_argument("--faults", type=int, default=100, help="faults to inject in all (default 100)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=30.0, help="the jobs' collective timeout (s)")
    parser.add_argument("--heartbeat-timeout", type=float, default=5.0, help="the jobs' heartbeat timeout (s)")
    parser.add_argument("--shard", action="store_true", help="shard the job's optimizer state")
    arguments = parser.parse_args()
    faults = 12 if arguments.quick else arguments.faults
    result = run_soak(
        faults,
        arguments.seed,
        timeout_s=arguments.timeout,
        heartbeat_timeout_s=arguments.heartbeat_timeout,
        shard=arguments.shard,
    )
    keys = (
        ("faults_injected", "runs")
        + PROBLEMS
        + (
            "hung_peer_detection_s",
            "hung_peers",
            "lost_state_stops",
            "driver_overrun_max",
            "simultaneous",
            "signal_with_change",
            "during_recovery",
            "not_fired",
            "wall_s",
            "wall_s_median",
            "wall_s_max",
        )
    )
    rows = [{"figure": key, "value": result[key]} for key in keys]
    rows += [
        {"figure": f"fired: {name}", "value": count}
        for name, count in {**result["fired_by_kind"], **result["fired_by_phase"]}.items()
    ]
    harness.print_table(rows, ["figure", "value"], "fault soak")
    harness.write_json(arguments.json, result)
    return 1 if any(result[key] for key in PROBLEMS) else 0


if __name__ == "__main__":
    harness.run(main)
