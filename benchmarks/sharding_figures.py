"""The figures of benchmarks/sharding.py, from its fits' records and parameters (pure: no processes).

Each function reads what one fit left (its metrics records in file order, or
its trained parameters) and returns numbers; `figures` puts the sides
together into the benchmark's JSON keys, and says for each figure it could
not compute why (`unmeasured`), so that a fit that hung or failed leaves a
reason in the report, never a number made up for it.
"""

from __future__ import annotations

from typing import Mapping, Optional, Sequence

from harness import median, median_of, ratio

# The goals of sharded optimizer state on 4 devices: (figure, "<=" or ">=", bound).
GOALS = (
    ("optimizer_bytes_ratio_r2", "<=", 0.55),
    ("optimizer_bytes_ratio_r1", "<=", 0.30),
    ("peak_rss_ratio", "<=", 0.85),
    ("step_time_ratio", ">=", 0.90),
    ("failure_lost_steps", "<=", 0),
    ("max_rel_err", "<=", 1e-5),
)

# The figures, in the order the table shows them.
FIGURES = (
    "optimizer_bytes_ratio",
    "optimizer_bytes_ratio_r2",
    "optimizer_bytes_ratio_r1",
    "peak_rss_ratio",
    "peak_rss_ratio_r2",
    "step_time_ratio",
    "step_time_ratio_r1",
    "join_stall_ratio",
    "join_bytes_ratio",
    "failure_lost_steps",
    "failure_resume_s",
    "failure_resume_s_backward",
    "failure_resume_s_backward_unsharded",
    "max_rel_err",
)


def steps_of(records: Sequence[Mapping]) -> list:
    return [record for record in records if record["kind"] == "step"]


def events_of(records: Sequence[Mapping], kind: str) -> list:
    return [record for record in records if record["kind"] == "event" and record["event"] == kind]


def largest_optimizer_bytes(records: Sequence[Mapping]) -> Optional[int]:
    """The largest optimizer-state bytes any device reported at the start of any step (None: no step had state).

    The state exists from the first update on; a device's part is largest
    where the partition gives it the most elements.
    """
    values = [value for record in steps_of(records) for value in record.get("optimizer_bytes", ())]
    return max(values) if values and max(values) > 0 else None


def steady_step_s(records: Sequence[Mapping], skip: int) -> Optional[float]:
    """The median `step_time_s` of the steps from `skip` on (the first ones start up); None if there are none."""
    times = [record["step_time_s"] for record in steps_of(records) if record["step"] >= skip]
    return median(times) if times else None


def join_figures(records: Sequence[Mapping]) -> dict:
    """The first join's stall (`stall_s`) and the bytes its boundary sent (`state_bytes_sent`); None: no join."""
    joins = events_of(records, "join")
    if not joins:
        return {"join_stall_s": None, "join_bytes": None}
    return {"join_stall_s": joins[0]["stall_s"], "join_bytes": joins[0].get("state_bytes_sent")}


def failure_figures(records: Sequence[Mapping]) -> dict:
    """The first failure: committed steps it cost, and its stall (seconds from the last commit to level again).

    `failure_lost_steps`: steps recorded as committed before the failure event
    (file order) that the job had to run again: the last such step + 1 - the
    event's `step` (the first step that runs after it), at least 0. None: no failure.
    """
    committed = -1
    for record in records:
        if record["kind"] == "step":
            committed = max(committed, record["step"])
        elif record["kind"] == "event" and record["event"] == "failure":
            return {
                "failure_lost_steps": max(0, committed + 1 - record["step"]),
                "failure_resume_s": record["stall_s"],
                "failure_detail": record["detail"],
            }
    return {"failure_lost_steps": None, "failure_resume_s": None, "failure_detail": None}


def steps_recorded_once(records: Sequence[Mapping], steps: int) -> bool:
    """Whether steps 0 .. steps-1 each have exactly one step record."""
    return sorted(record["step"] for record in steps_of(records)) == list(range(steps))


def device_counts(records: Sequence[Mapping]) -> list:
    """The device counts the fit went through, in order (each run of equal counts once)."""
    counts: list = []
    for record in steps_of(records):
        if not counts or counts[-1] != len(record["devices"]):
            counts.append(len(record["devices"]))
    return counts


def relative_errors(parameters: Mapping, reference: Mapping) -> dict:
    """name -> max|a - b| / max|b| of each tensor (a tensor of zeros in `reference`: the absolute difference)."""
    errors = {}
    for name, expected in reference.items():
        actual = parameters[name]
        scale = float(expected.abs().max()) if expected.numel() else 0.0
        difference = float((actual.double() - expected.double()).abs().max()) if expected.numel() else 0.0
        errors[name] = difference / scale if scale > 0 else difference
    return errors


def max_relative_error(parameters: Mapping, reference: Mapping) -> float:
    """max over tensors of max|a - b| / max|b| (`relative_errors`)."""
    return max(relative_errors(parameters, reference).values(), default=0.0)


def worst_tensor(parameters: Mapping, reference: Mapping) -> str:
    """The tensor with the largest relative error, and its error: "2.weight 3.0e-03" (which part of the
    model a difference is in says more than its size)."""
    errors = relative_errors(parameters, reference)
    name = max(errors, key=errors.get)
    return f"{name} {errors[name]:.1e}"


def elements_beyond(parameters: Mapping, reference: Mapping, tolerance: float = 1e-5) -> int:
    """How many elements differ by more than `tolerance` x their tensor's max|b|: a few elements
    (updates of near-zero gradients that went the other way) or the whole model."""
    count = 0
    for name, expected in reference.items():
        scale = float(expected.abs().max()) if expected.numel() else 0.0
        difference = (parameters[name].double() - expected.double()).abs()
        count += int((difference > tolerance * scale).sum())
    return count


def figures(rounds: Mapping[str, Sequence[Mapping]], elastic: Mapping[str, Mapping], unmeasured: dict) -> dict:
    """The benchmark's JSON keys from its fits.

    `rounds`: side ("unsharded", "r2", "r1") -> per-round dicts with
    `optimizer_bytes`, `peak_rss_bytes`, `step_s`. `elastic`: fit ->
    its figures (`join_figures`, `failure_figures`): "unsharded" and
    "sharded" with the schedule (the latter with `max_rel_err`, None when
    not measured) and "kill_update" (the sharded fit killed in the update
    phase). `failure_lost_steps` is the larger of the sharded fits' (None
    unless both measured it); `failure_resume_s` is the update-phase kill's,
    `failure_resume_s_backward` the schedule's (sharded, and unsharded beside
    it). `unmeasured` (figure -> why) is extended with every figure that
    comes out None and has no reason yet.
    """
    medians = {side: {key: median_of(runs, key) for key in runs[0]} for side, runs in rounds.items() if runs}
    unsharded, r2, r1 = (medians.get(side, {}) for side in ("unsharded", "r2", "r1"))
    sharded_elastic, unsharded_elastic = elastic.get("sharded", {}), elastic.get("unsharded", {})
    kill = elastic.get("kill_update", {})
    lost = [fit.get("failure_lost_steps") for fit in (sharded_elastic, kill)]
    result = {
        "optimizer_bytes_ratio_r2": ratio(r2.get("optimizer_bytes"), unsharded.get("optimizer_bytes")),
        "optimizer_bytes_ratio_r1": ratio(r1.get("optimizer_bytes"), unsharded.get("optimizer_bytes")),
        "peak_rss_ratio": ratio(r1.get("peak_rss_bytes"), unsharded.get("peak_rss_bytes")),
        "peak_rss_ratio_r2": ratio(r2.get("peak_rss_bytes"), unsharded.get("peak_rss_bytes")),
        "step_time_ratio": ratio(unsharded.get("step_s"), r2.get("step_s")),
        "step_time_ratio_r1": ratio(unsharded.get("step_s"), r1.get("step_s")),
        "join_stall_ratio": ratio(sharded_elastic.get("join_stall_s"), unsharded_elastic.get("join_stall_s")),
        "join_bytes_ratio": ratio(sharded_elastic.get("join_bytes"), unsharded_elastic.get("join_bytes")),
        "failure_lost_steps": None if None in lost else max(lost),
        "failure_resume_s": kill.get("failure_resume_s"),
        "failure_resume_s_backward": sharded_elastic.get("failure_resume_s"),
        "failure_resume_s_backward_unsharded": unsharded_elastic.get("failure_resume_s"),
        "max_rel_err": sharded_elastic.get("max_rel_err"),
    }
    # The headline figure is the default redundancy's (2).
    result["optimizer_bytes_ratio"] = result["optimizer_bytes_ratio_r2"]
    for key, value in result.items():
        if value is None and key not in unmeasured:
            unmeasured[key] = "an input of it was not measured (see the sides' figures)"
    result["goals"] = goal_verdicts(result)
    result["sides"] = medians
    result["elastic"] = dict(elastic)
    result["unmeasured"] = dict(unmeasured)
    return result


def goal_verdicts(result: Mapping) -> dict:
    """figure -> its goal and verdict, e.g. "<= 0.55: met" ("missed", "not measured"), for sharded optimizer
    state's goals."""
    verdicts = {}
    for key, sense, bound in GOALS:
        value = result.get(key)
        if value is None:
            verdict = "not measured"
        else:
            verdict = "met" if (value <= bound if sense == "<=" else value >= bound) else "missed"
        verdicts[key] = f"{sense} {bound:g}: {verdict}"
    return verdicts
