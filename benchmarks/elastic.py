"""Elastic changes on a 25M-parameter Adam job: flexpar vs torchrun checkpoint-restart.

    python benchmarks/elastic.py [--json PATH] [--quick] [--rounds N (at most; default 3)]

One invocation measures, alternating flexpar and baseline rounds:

- flexpar, one `fit()` per round on 2 CPU processes (oversubscribed: 3 processes
  on 2 cores at the peak; every join by the blocking transfer, `join_stream_mb=0`:
  join_stream.py measures streamed joins) with the schedule "+1" (scale out 2->3), a kill -9 of
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

The pieces: elastic_plan.py (the job and the changes of a round),
elastic_torchrun.py (the baseline), elastic_floor.py (the floor and
flexpar's transfer by part), elastic_report.py (the JSON and the table).
"""

from __future__ import annotations

import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import harness
from elastic_floor import measure_floor
from elastic_plan import (
    FAILURES,
    PLANNED_DEVICE_COUNTS,
    SCALE_INS,
    SCALE_OUTS,
    Settings,
    make_job,
    model_factory,
)
from elastic_report import print_report, summarise
from elastic_torchrun import torchrun_round
from harness import median

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
        "first_new_step": first,
        "event_stall_s": event["stall_s"],
        "commit_gap_s": gap,
        "normal_step_s": normal,
        "stall_s": max(0.0, gap - normal),
        "detail": event["detail"],
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
    job = make_job(model_factory(settings))
    metrics = os.path.join(workdir, f"flexpar-{index}.jsonl")
    started = time.perf_counter()
    job.fit(
        # max_devices=5: the schedule's validator counts every "+1" and "-1" but not
        # the faults, which remove a joiner each; at most 3 devices ever run.
        steps=settings.steps,
        devices=2,
        max_devices=5,
        schedule=settings.schedule,
        faults=settings.faults,
        oversubscribe=True,
        metrics=metrics,
        display=False,
        quiet=True,
        timeout_s=30.0,
        # The blocking transfer at every join: what this benchmark and sim_validation.py's scale-out row
        # measure (a streamed join's boundary holds only the small state; join_stream.py measures those).
        join_stream_mb=0,
    )
    result = analyse_flexpar(harness.metrics_records(metrics), settings)
    result["wall_s"] = time.perf_counter() - started
    result["metrics"] = metrics
    return result


def main() -> None:
    parser = harness.base_parser(__doc__.splitlines()[0])
    parser.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="most flexpar/baseline rounds (default 3 while they fit in ~5.5 min, quick 1)",
    )
    args = parser.parse_args()
    settings = Settings(args.quick, args.rounds or (1 if args.quick else 3))
    parameter_count = sum(p.numel() for p in model_factory(settings)().parameters())
    # Kept after the run: sim_validation.py reads the rounds' metrics files named in the JSON.
    workdir = tempfile.mkdtemp(prefix="flexpar-elastic-")
    print(
        f"elastic benchmark: {parameter_count / 1e6:.1f}M parameters, Adam, {settings.rounds} round(s); "
        f"files in {workdir}",
        flush=True,
    )
    started = time.perf_counter()

    def flexpar_side(index: int) -> dict:
        done = flexpar_round(settings, workdir, index)
        print(
            f"  round {index}: flexpar done in {done['wall_s']:.0f} s, device counts "
            f"{done['device_counts']}"
            + ("" if done["as_planned"] else f" (NOT as planned {PLANNED_DEVICE_COUNTS}: a joiner was late)"),
            flush=True,
        )
        return done

    def torchrun_side(index: int) -> dict:
        done = torchrun_round(settings, workdir, index)
        print(f"  round {index}: torchrun done in {done['wall_s']:.0f} s", flush=True)
        return done

    rounds = harness.alternate(
        {"flexpar": flexpar_side, "torchrun": torchrun_side}, settings.rounds, budget_s=settings.budget_s
    )
    floor = measure_floor(settings)
    settings.rounds = len(rounds["flexpar"])
    summary = summarise(settings, rounds["flexpar"], rounds["torchrun"], floor, parameter_count)
    summary["wall_s"] = time.perf_counter() - started
    print_report(summary)
    harness.write_json(args.json, summary)


if __name__ == "__main__":
    harness.run(main)
