"""Sharded optimizer state: memory, step time, joins and failures vs the same job unsharded.

    python benchmarks/sharding.py [--json PATH] [--quick] [--rounds N]

The job (benchmarks/sharding_job.py): a 25.2M-parameter MLP (1024 -> 4096 ->
4096 -> 1024 -> 16), AdamW, V=16, global batch 256 (16 samples per VW: each
step computes for about a second, as data-parallel training does, not a
step made of communication alone), 4 CPU devices (processes on this host's
cores, oversubscribed), trained three ways side by side in one run:
unsharded, sharded at redundancy 2 (the default: every part on 2 devices)
and sharded at redundancy 1.

Fixed device set (alternating rounds unsharded, r2, r1; medians over rounds):
- `optimizer_bytes_ratio_r2`, `optimizer_bytes_ratio_r1`: the largest device's
  optimizer-state bytes (the step records' `optimizer_bytes`) / the unsharded
  device's. `optimizer_bytes_ratio` is the r2 figure (sharding's headline, at
  the default redundancy). Goals <= 0.55 (r2), <= 0.30 (r1).
- `peak_rss_ratio`: the largest worker's peak resident memory (VmHWM, read by
  harness.PeakMemoryWatcher), sharded r1 / unsharded (goal <= 0.85);
  `peak_rss_ratio_r2` beside it.
- `step_time_ratio`: the median step time (`step_time_s`, steps from the third
  on) unsharded / sharded r2 (goal >= 0.90); `step_time_ratio_r1` beside it.
- `max_rel_err_fixed`: the largest difference of a sharded round's trained
  parameters from the unsharded round's (same steps).

Device changes (each fit in a process of its own under a watch that kills it
when no record comes for a while: a hang is reported, never waited for):
- the schedule, unsharded and sharded r2: 4 devices, "+1" (4 -> 5), "-1"
  (5 -> 4), then a kill -9 of local-1 during backward (3 devices);
  `join_stall_ratio`, `join_bytes_ratio`: the join event's `stall_s` and
  `state_bytes_sent`, sharded / unsharded; `max_rel_err`: max over parameters
  of max|a - b| / max|b| between the two fits' trained parameters (goal <= 1e-5).
  AdamW turns float summation-order differences in near-zero gradient sums
  into lr-sized updates, and the order follows the VW split, which the
  balancer sets from measured (noisy) speeds: `assignments_match` says whether
  both fits ran the same split at every step, and `max_rel_err_unsharded_floor`
  is the same figure between the unsharded fit with the schedule and one
  without any change (what a changed order does to the unsharded job alone);
  `max_rel_err_vs_fixed`: the sharded fit against that unchanged one. Beside
  each: the tensor it is in (`_where`) and how many elements differ by more
  than 1e-5 of their tensor's largest value (`_elements`).
- a kill -9 of local-1 in the "update" phase of a sharded r2 fit (after its
  update of its own part, before its broadcast of it: those values exist
  nowhere else), halfway through the fixed rounds' steps: `failure_resume_s`
  (its failure event's stall) and `max_rel_err_kill_update` (against the
  unsharded fixed round 0). `failure_lost_steps`: committed steps a kill cost
  (the last step recorded before the failure event + 1 - the event's step),
  the larger of this kill's and the schedule's (goal 0).

A figure that could not be measured is null in the JSON and its reason is in
`unmeasured`; the table prints it as "-" and the reasons below it.
The pieces: sharding_job.py (the job, and one fit in its own process),
sharding_figures.py (the figures from the records).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import harness
import sharding_figures
import sharding_job
from sharding_figures import failure_figures, join_figures, max_relative_error, worst_tensor

HERE = os.path.dirname(os.path.abspath(__file__))
FIXED_SIDES = {"unsharded": None, "r2": 2, "r1": 1}  # side -> shard_redundancy
DEVICES = 4
# The elastic fits' collective timeout: a peer that neither finishes nor dies is given up on
# after it; the watch (Settings.idle_s) calls a fit hung only when it recorded nothing for longer.
ELASTIC_TIMEOUT_S = 30.0
# Fixed-set rounds are repeated while time allows (the fits with changes, about 3 minutes, come after).
ROUNDS_BUDGET_S = 200.0


@dataclass(frozen=True)
class Settings:
    quick: bool
    rounds: int
    global_batch: int
    round_steps: int  # steps of a fixed-set fit
    skip: int  # its first steps, left out of the step time
    join_at: int
    leave_at: int
    kill_at: int
    elastic_steps: int
    idle_s: float  # an elastic fit that records nothing for this long is hung (> its collective timeout)

    @classmethod
    def make(cls, quick: bool, rounds) -> "Settings":
        # A joiner needs seconds before it is admitted (start, import, build, warm up): about
        # 8 full-size steps of 5 processes on 2 cores, or some 20 of the quick model's; a
        # "-1" before the joiner is admitted would cancel the join instead of removing a device.
        if quick:
            return cls(True, rounds or 1, 64, 5, 2, 2, 24, 28, 32, 45.0)
        return cls(False, rounds or 3, 256, 8, 2, 2, 14, 18, 22, 60.0)

    def schedule(self) -> str:
        return f"{self.join_at}:+1,{self.leave_at}:-1"

    def fault(self) -> str:
        return f"{self.kill_at}:local-1:backward"


# ----------------------------------------------------------------- fixed device set


def fixed_round(settings: Settings, workdir: str, side: str, index: int, models: dict) -> dict:
    """One fit on 4 devices: the largest device's optimizer bytes and peak RSS, the median step time."""
    spec = {
        "quick": settings.quick,
        "global_batch": settings.global_batch,
        "shard_redundancy": FIXED_SIDES[side],
        "steps": settings.round_steps,
        "devices": DEVICES,
    }
    metrics = os.path.join(workdir, f"{side}-{index}.jsonl")
    with harness.PeakMemoryWatcher() as watcher:
        model, _ = sharding_job.fit(spec, metrics)
    records = harness.metrics_records(metrics)
    models[(side, index)] = {name: value.detach().clone() for name, value in model.state_dict().items()}
    run = {
        "optimizer_bytes": sharding_figures.largest_optimizer_bytes(records),
        "peak_rss_bytes": watcher.largest(),
        "step_s": sharding_figures.steady_step_s(records, settings.skip),
    }
    harness.progress("sharding")(f"{side} round {index}: {json.dumps(run)}")
    return run


def fixed_set_errors(models: dict, rounds: int) -> dict:
    """Each sharded side's largest difference from the unsharded round of the same index."""
    errors = {}
    for side in ("r2", "r1"):
        values = [
            max_relative_error(models[(side, index)], models[("unsharded", index)])
            for index in range(rounds)
            if (side, index) in models and ("unsharded", index) in models
        ]
        errors[side] = max(values) if values else None
    return errors


# ----------------------------------------------------------------- elastic


def run_watched(command: list, metrics: str, idle_s: float, bound_s: float, stderr, poll_s: float = 0.5) -> str:
    """Run `command` in a session of its own: "finished", "failed (exit N)", "hung" or "past the bound".

    "hung": `metrics` did not change for `idle_s` seconds after the fit wrote
    its first record (a worker waits forever, e.g. in a collective). The
    process group is killed in every case.
    """
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=stderr, start_new_session=True)
    started = last_change = time.monotonic()
    last_size = -1
    try:
        while True:
            code = process.poll()
            if code is not None:
                return "finished" if code == 0 else f"failed (exit {code})"
            now = time.monotonic()
            size = os.path.getsize(metrics) if os.path.exists(metrics) else -1
            if size != last_size:
                last_size, last_change = size, now
            if size > 0 and now - last_change > idle_s:
                return "hung"
            if now - started > bound_s:
                return "past the bound"
            time.sleep(poll_s)
    finally:
        harness.kill_group(process.pid)
        process.wait()


def elastic_fit(settings: Settings, workdir: str, name: str, changes: dict) -> dict:
    """One fit with device changes (`changes`: shard_redundancy, steps, schedule, faults), in its own
    process: its figures and parameters, or why not (`why`)."""
    output = os.path.join(workdir, name)
    os.makedirs(output, exist_ok=True)
    spec = {
        "quick": settings.quick,
        "global_batch": settings.global_batch,
        "devices": DEVICES,
        "max_devices": DEVICES + 1,
        "timeout_s": ELASTIC_TIMEOUT_S,
        "output": output,
        **changes,
    }
    spec_path = os.path.join(output, "spec.json")
    with open(spec_path, "w") as handle:
        json.dump(spec, handle)
    metrics = os.path.join(output, "metrics.jsonl")
    with open(os.path.join(output, "stderr.txt"), "w") as stderr:
        outcome = run_watched(
            [sys.executable, os.path.join(HERE, "sharding_job.py"), spec_path],
            metrics,
            settings.idle_s,
            bound_s=120.0 + 10.0 * spec["steps"],
            stderr=stderr,
        )
    records = harness.json_lines(metrics)
    result = {
        "outcome": outcome,
        "device_counts": sharding_figures.device_counts(records),
        "assignments": [record["assignment"] for record in sharding_figures.steps_of(records)],
    }
    result.update(join_figures(records))
    result.update(failure_figures(records))
    model_path = os.path.join(output, "model.pt")
    if outcome == "finished" and os.path.exists(model_path):
        import torch

        result["model"] = torch.load(model_path, weights_only=True)
        result["steps_recorded_once"] = sharding_figures.steps_recorded_once(records, spec["steps"])
    else:
        result["why"] = _what_went_wrong(name, spec, outcome, records, os.path.join(output, "stderr.txt"))
    shown = {key: value for key, value in result.items() if key not in ("model", "assignments")}
    harness.progress("sharding")(f"{name}: {json.dumps(shown, default=str)}")
    return result


def _what_went_wrong(name: str, spec: dict, outcome: str, records: list, stderr_path: str) -> str:
    steps = sharding_figures.steps_of(records)
    events = [f"{r['event']} at step {r['step']}" for r in records if r["kind"] == "event"]
    last_lines = [line for line in open(stderr_path, encoding="utf-8", errors="replace").read().splitlines() if line]
    return (
        f"the fit {name} (schedule '{spec.get('schedule', '')}', fault '{spec.get('faults', '')}') {outcome}: "
        f"last step recorded {steps[-1]['step'] if steps else 'none'}, events {events}"
        + (f", its last output line: {last_lines[-1][:300]}" if last_lines else "")
    )


def measure_elastic(settings: Settings, workdir: str, models: dict, unmeasured: dict) -> dict:
    """The fits with device changes, each in its own watched process; reasons for what failed into `unmeasured`.

    - "unsharded" and "sharded" (r2): +1, -1, then a kill -9 of local-1 during
      backward (the same phase on both sides, so both redo the killed step on
      3 devices): the join figures, and the sharded fit's `max_rel_err`
      against the unsharded one. Adam turns float summation-order differences
      in near-zero gradient sums into lr-sized updates, and the balancer's
      split (from measured, noisy speeds) decides that order: `assignments_match`
      says whether both fits ran the same split at every step, and
      "unsharded_fixed" (4 devices, no change) gives the unsharded job's own
      figure for a changed order (`max_rel_err_unsharded_floor`).
    - "kill_update": sharded, a kill -9 of local-1 in the "update" phase (after its
      update of its own part, before it broadcast it) halfway through the
      fixed rounds' steps: `failure_resume_s`, and its parameters against the
      unsharded fixed round 0 (`max_rel_err_kill_update`). `failure_lost_steps`
      is the larger of this kill's and the schedule's.
    """
    schedule = {"steps": settings.elastic_steps, "schedule": settings.schedule(), "faults": settings.fault()}
    kill_at = settings.round_steps // 2
    fits = {
        "unsharded": {"shard_redundancy": None, **schedule},
        "sharded": {"shard_redundancy": 2, **schedule},
        "kill_update": {"shard_redundancy": 2, "steps": settings.round_steps, "faults": f"{kill_at}:local-1:update"},
        "unsharded_fixed": {"shard_redundancy": None, "steps": settings.elastic_steps},
    }
    results = {name: elastic_fit(settings, workdir, name, changes) for name, changes in fits.items()}
    unsharded, sharded, kill, fixed = (results[name] for name in fits)
    for name in ("unsharded", "sharded"):
        if "why" in results[name]:
            for key in ("join_stall_ratio", "join_bytes_ratio", "max_rel_err"):
                unmeasured.setdefault(key, results[name]["why"])
    if "model" in sharded and "model" in unsharded:
        sharded["max_rel_err"] = max_relative_error(sharded["model"], unsharded["model"])
        sharded["max_rel_err_where"] = worst_tensor(sharded["model"], unsharded["model"])
        sharded["elements_beyond_1e-5"] = sharding_figures.elements_beyond(sharded["model"], unsharded["model"])
        sharded["assignments_match"] = sharded["assignments"] == unsharded["assignments"]
    if "model" in unsharded and "model" in fixed:
        unsharded["max_rel_err_unsharded_floor"] = max_relative_error(unsharded["model"], fixed["model"])
        unsharded["max_rel_err_unsharded_floor_where"] = worst_tensor(unsharded["model"], fixed["model"])
        unsharded["elements_beyond_1e-5"] = sharding_figures.elements_beyond(unsharded["model"], fixed["model"])
    if "model" in sharded and "model" in fixed:
        sharded["max_rel_err_vs_fixed"] = max_relative_error(sharded["model"], fixed["model"])
    if "model" in kill and ("unsharded", 0) in models:
        kill["max_rel_err_kill_update"] = max_relative_error(kill["model"], models[("unsharded", 0)])
    for key, fit in (("failure_lost_steps", sharded), ("failure_lost_steps", kill), ("failure_resume_s", kill)):
        if fit.get(key) is None:
            unmeasured.setdefault(key, fit.get("why", f"{fit['outcome']}, but no failure event was recorded"))
    for result in results.values():
        result.pop("model", None)
        result.pop("assignments", None)
    return results


# ----------------------------------------------------------------- main


def main() -> int:
    parser = harness.base_parser(__doc__.splitlines()[0])
    parser.add_argument(
        "--rounds", type=int, default=None, help="rounds of (unsharded, r2, r1) fits (default 3; quick 1)"
    )
    arguments = parser.parse_args()
    settings = Settings.make(arguments.quick, arguments.rounds)
    say = harness.progress("sharding")
    model = sharding_job.make_job(settings.quick, settings.global_batch).model()
    parameters = sum(parameter.numel() for parameter in model.parameters())
    say(f"{parameters / 1e6:.1f}M parameters, AdamW, {DEVICES} devices, V={sharding_job.VIRTUAL_WORKERS}, {settings}")
    started = time.perf_counter()
    unmeasured: dict = {}
    models: dict = {}
    with harness.run_folder("flexpar-sharding-") as workdir:
        rounds = harness.alternate(
            {
                side: (lambda index, side=side: fixed_round(settings, workdir, side, index, models))
                for side in FIXED_SIDES
            },
            settings.rounds,
            budget_s=ROUNDS_BUDGET_S,
        )
        elastic = measure_elastic(settings, workdir, models, unmeasured)
    result = sharding_figures.figures(rounds, elastic, unmeasured)
    errors = fixed_set_errors(models, settings.rounds)
    result.update(
        {
            "max_rel_err_fixed": max((value for value in errors.values() if value is not None), default=None),
            "max_rel_err_fixed_by_side": errors,
            "max_rel_err_kill_update": elastic["kill_update"].get("max_rel_err_kill_update"),
            "max_rel_err_unsharded_floor": elastic["unsharded"].get("max_rel_err_unsharded_floor"),
            "max_rel_err_vs_fixed": elastic["sharded"].get("max_rel_err_vs_fixed"),
            "assignments_match": elastic["sharded"].get("assignments_match"),
            "max_rel_err_where": elastic["sharded"].get("max_rel_err_where"),
            "max_rel_err_elements": elastic["sharded"].get("elements_beyond_1e-5"),
            "max_rel_err_unsharded_floor_elements": elastic["unsharded"].get("elements_beyond_1e-5"),
            "max_rel_err_unsharded_floor_where": elastic["unsharded"].get("max_rel_err_unsharded_floor_where"),
            "parameters": parameters,
            "devices": DEVICES,
            "rounds": len(rounds["unsharded"]),
            "settings": asdict(settings),
            "wall_s": time.perf_counter() - started,
            "quick": settings.quick,
        }
    )
    report(result)
    harness.write_json(arguments.json, result)
    return 0


def report(result: dict) -> None:
    """The sides' medians, the figures with their goals, and why any figure is missing."""
    sides = result["sides"]
    harness.print_table(
        [{"side": side, **figures} for side, figures in sides.items()],
        ["side", "optimizer_bytes", "peak_rss_bytes", "step_s"],
        title="fixed device set, medians per side",
    )
    print()
    keys = [
        *sharding_figures.FIGURES,
        "assignments_match",
        "max_rel_err_where",
        "max_rel_err_elements",
        "max_rel_err_unsharded_floor",
        "max_rel_err_unsharded_floor_where",
        "max_rel_err_unsharded_floor_elements",
        "max_rel_err_vs_fixed",
        "max_rel_err_fixed",
        "max_rel_err_kill_update",
        "parameters",
        "wall_s",
    ]
    harness.print_table(
        [{"figure": key, "value": result[key], "goal": result["goals"].get(key, "")} for key in keys],
        ["figure", "value", "goal"],
    )
    for key, why in result["unmeasured"].items():
        print(f"not measured: {key}: {why}")


if __name__ == "__main__":
    harness.run(main)
