"""What the validation predicts of elastic.py: the scale-out, scale-in and failure stalls."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import elastic_plan
import numpy as np
from elastic_report import change_values
from harness import fmt, median

from flexpar.options import cpu_count
from flexpar.sim import calibrate, host_contention, pg_formation_seconds, predict_elastic_stalls

from .comparison import Comparison, median_interval
from .failure_rows import failed_steps_inputs, predict_failure_stall, recovery_notice_seconds
from .inputs import read_step_records
from .probe import boundaries_by_size


def transfer_path_seconds(parts: Mapping[str, float]) -> float | None:
    """flexpar's state transfer to a joiner, source to level receiver: receive + restore, as a joiner does them.

    The receiver's receive starts with the source's capture and send (same
    barrier) and ends with the last tensor's bytes, so it spans them. A joiner
    is a fresh process that receives the model into its own tensors
    (`fresh_receive_s`, `fresh_restore_s`); without those figures, a
    long-lived receiver's `receive_s` and `restore_s` stand in.
    """
    if not parts:
        return None
    for receive, restore in (("fresh_receive_s", "fresh_restore_s"), ("receive_s", "restore_s")):
        if parts.get(receive) is not None and parts.get(restore) is not None:
            return float(parts[receive] + parts[restore])
    return None


def step_interval_noise_s(records: Sequence[dict]) -> float | None:
    """Robust spread (1.4826 x median absolute deviation) of commit-to-commit intervals.

    Within each generation, its first step left out (it carries the change), each
    interval's deviation from the generation's median. A stall read from step
    records is a gap minus a normal step, so one such figure is uncertain by
    about this much. None with fewer than 3 intervals.
    """
    steps = sorted((r for r in records if r["kind"] == "step"), key=lambda r: r["step"])
    by_generation: dict[int, list[float]] = {}
    for previous, current in zip(steps, steps[1:]):
        if current["generation"] == previous["generation"] and current["step"] == previous["step"] + 1:
            by_generation.setdefault(current["generation"], []).append(current["time"] - previous["time"])
    deviations = []
    for intervals in by_generation.values():
        middle = float(np.median(intervals))
        deviations += [interval - middle for interval in intervals]
    if len(deviations) < 3:
        return None
    return 1.4826 * float(np.median(np.abs(deviations)))


def compare_elastic(elastic: dict, probe: dict) -> tuple:
    """Counted and diagnostic rows for elastic.py, the calibration, and the lost compute it used."""
    parts = elastic.get("flexpar_transfer_parts_s") or {}
    transfer_s = transfer_path_seconds(parts)
    measured_inputs = {
        "devices": 2,  # the job runs on 2 devices before each change
        "state_bytes": elastic["state_bytes"],
        "broadcast_bytes": elastic["state_bytes"],
        **boundary_calibration(elastic, probe, cores=float(cpu_count())),
        "broadcast_s": transfer_s,
        "detection_s": probe.get("detection_s"),
        "recovery_notice_s": recovery_notice_seconds(),
    }
    calibration = calibrate(measured_inputs)
    out = predict_elastic_stalls(calibration, devices_before=2)
    shrink = predict_elastic_stalls(calibration, devices_before=3)
    inputs = [
        value
        for r in elastic.get("flexpar_rounds", [])
        for value in failed_steps_inputs(read_step_records(r.get("metrics", "")))
    ]
    failure, lost_s = None, None
    if inputs and probe.get("detection_s") is not None:
        failure, lost_s = predict_failure_stall(inputs, calibration.parameters)
    # elastic.py's figures are medians over every round's changes of each kind.
    changes = {
        "scale_out": elastic_plan.SCALE_OUTS,
        "scale_in": elastic_plan.SCALE_INS,
        "failure": elastic_plan.FAILURES,
    }
    flexpar_rounds = elastic.get("flexpar_rounds", [])
    by_round = {kind: change_values(flexpar_rounds, names, "stall_s") for kind, names in changes.items()}
    events_by_round = {kind: change_values(flexpar_rounds, names, "event_stall_s") for kind, names in changes.items()}
    interval = {kind: median_interval(values) for kind, values in events_by_round.items()}
    rows = [
        # Counted from flexpar's boundary record since the scale-out is a few tenths
        # of a second: the step-record figure's noise (one step's time varies by
        # about 0.06 s here) is a third of it.
        Comparison(
            "elastic: scale-out 2->3 stall (scale_out_event_stall_s)",
            out["scale_out_stall_s"] if transfer_s is not None else None,
            elastic.get("scale_out_event_stall_s"),
            True,
            "group formation + state transfer to a joiner (flexpar's path) vs the event record: last "
            "member's commit -> all level",
            interval["scale_out"],
        ),
        # A scale-in stall of milliseconds is far below what step records resolve
        # (one step's time varies by tens of ms here): it is counted from flexpar's
        # boundary record, which times it directly.
        Comparison(
            "elastic: scale-in 3->2 stall (scale_in_event_stall_s)",
            shrink["scale_in_stall_s"],
            elastic.get("scale_in_event_stall_s"),
            True,
            "one boundary without a transfer (probe) vs the event record: last member's commit -> all level",
            interval["scale_in"],
        ),
        # Like the scale-in, counted from flexpar's boundary record: the step-record
        # figure also holds the first step after the change minus a median step,
        # which varies by about 0.1 s between rounds here.
        Comparison(
            "elastic: failure 3->2 stall (failure_event_stall_s)",
            failure,
            elastic.get("failure_event_stall_s"),
            True,
            "lost compute of the step in flight + recovery notice + group formation vs the event "
            "record: last commit -> survivors level",
            interval["failure"],
        ),
    ]
    rows += [
        Comparison(
            "elastic: scale-in 3->2 [step records: gap - normal step]",
            shrink["scale_in_stall_s"],
            elastic.get("scale_in_stall_s"),
            False,
            "as the counted row vs step records",
        ),
        Comparison(
            "elastic: scale-out 2->3 [step records: gap - normal step]",
            out["scale_out_stall_s"] if transfer_s is not None else None,
            elastic.get("scale_out_stall_s"),
            False,
            "as the counted row vs step records",
        ),
        Comparison(
            "elastic: failure 3->2 [step records: gap - normal step]",
            failure,
            elastic.get("failure_resume_s"),
            False,
            "as the counted row vs step records",
        ),
    ]
    four = boundaries_by_size(probe).get(4)
    if four is not None:
        # Not used in the fit: a check of the contention term (4 busy processes on this host's cores).
        rows.append(
            Comparison(
                "probe: boundary of 4 processes [not in the fit]",
                pg_formation_seconds(4, calibration.parameters.elastic),
                four,
                False,
                "base + per device x 4, x host contention",
            )
        )
    if elastic.get("broadcast_s"):
        floor = calibrate({**measured_inputs, "broadcast_s": elastic["broadcast_s"]})
        rows.append(
            Comparison(
                "elastic: scale-out 2->3 stall [transfer = raw gloo send floor]",
                predict_elastic_stalls(floor, devices_before=2)["scale_out_stall_s"],
                elastic.get("scale_out_event_stall_s"),
                False,
                "group formation + state bytes at gloo's send bandwidth",
            )
        )
    noise = [step_interval_noise_s(read_step_records(r.get("metrics", ""))) for r in elastic.get("flexpar_rounds", [])]
    noise = [value for value in noise if value is not None]
    return (
        rows,
        calibration,
        {
            "transfer_path_s": transfer_s,
            "failed_step_compute_s": lost_s,
            "failed_step_inputs": inputs,
            "step_interval_noise_s": median(noise) if noise else None,
            "stall_s_by_round": by_round,
            "event_stall_s_by_round": events_by_round,
        },
    )


def boundary_calibration(elastic: dict, probe: dict, cores: float) -> dict:
    """Group formation (base + per device) from the probe's boundaries of 2 and 3 processes.

    Those are the group sizes elastic.py forms (3 after a join, 2 after a
    leave or a failure). Every member of a probe boundary is busy, so each
    size's time is first divided by its host contention (``cores``: those of
    this host, which the probe and the benchmarks share). Without the
    sizes, elastic.py's fresh-group figure (3 processes, formation only)
    stands in for every size.
    """
    sizes = {size: seconds / host_contention(size, cores) for size, seconds in boundaries_by_size(probe).items()}
    if 2 in sizes and 3 in sizes:
        base, per_device = nonnegative_line_fit({n: sizes[n] for n in (2, 3)})
        return {"pg_formation_s": base, "pg_formation_per_device_s": per_device, "host_cores": cores}
    return {"pg_formation_s": elastic["process_group_formation_s"], "host_cores": cores}


def nonnegative_line_fit(points: Mapping[int, float]) -> tuple:
    """Least squares ``y = base + per_device * n`` with both terms >= 0 (costs are not negative).

    Where the free fit has a negative term, the optimum lies on a boundary:
    a line through the origin, or a flat line (the mean); the one that
    misses the points less wins.
    """
    sizes = sorted(points)
    mean_n = sum(sizes) / len(sizes)
    mean_y = sum(points.values()) / len(sizes)
    spread = sum((n - mean_n) ** 2 for n in sizes)
    per_device = sum((n - mean_n) * (points[n] - mean_y) for n in sizes) / spread
    base = mean_y - per_device * mean_n
    if base >= 0 and per_device >= 0:
        return base, per_device

    def misses(candidate: tuple) -> float:
        return sum((points[n] - candidate[0] - candidate[1] * n) ** 2 for n in sizes)

    through_origin = (0.0, sum(n * points[n] for n in sizes) / sum(n * n for n in sizes))
    flat = (mean_y, 0.0)
    return min((through_origin, flat), key=misses)


def boundaries_text(probe: dict) -> str:
    return ", ".join(f"{size}: {seconds:.3g} s" for size, seconds in sorted(boundaries_by_size(probe).items()))


def why_stall(row: Comparison, elastic: dict, elastic_extra: dict, probe: dict) -> str:
    """Why a stall row misses: what its model is made of, then what the measurement can resolve."""
    return _stall_model(row, elastic, elastic_extra, probe) + _stall_resolution(row, elastic_extra)


def _stall_model(row: Comparison, elastic: dict, elastic_extra: dict, probe: dict) -> str:
    if "scale-in" in row.figure:
        return (
            "The model's scale-in is one boundary without a transfer (retire the old group, form the "
            "new one, take stock of steps and the last commit), priced from the probe's boundaries by "
            f"group size ({boundaries_text(probe) or 'not measured'}; each right after a training step of "
            "elastic.py's job), with the survivors as the busy "
            "processes (the leaver skips its last update and exits at the lowest priority). The old "
            "group's teardown is released once the members are level (flexpar.sync.GroupReaper)."
        )
    if "failure" in row.figure:
        return (
            f"Of the prediction, {fmt(elastic_extra['failed_step_compute_s'])} s is the lost compute of "
            "the step in flight (from neighbouring steps' busy times, the part after the victim's death "
            "at one busy process fewer); the rest is the recovery notice (polls) and a new group. "
            "Store round trips and the survivors' reports arriving apart are not in the model."
        )
    parts = elastic.get("flexpar_transfer_parts_s") or {}
    source_side = (parts.get("capture_s") or 0.0) + (parts.get("send_s") or 0.0)
    text = (
        f"The model is group formation + flexpar's transfer path timed on its own "
        f"({fmt(elastic_extra.get('transfer_path_s'))} s, of which the source's capture + send "
        f"{source_side:.3g} s). "
    )
    step_records = elastic.get("scale_out_stall_s")
    if step_records is not None:
        text += (
            f"From step records (diagnostic) the stall reads {step_records:.3g} s: that figure also holds "
            "the first step of the new set over a normal one (new assignment, loader restart), which is not "
            "in the model. "
        )
    return text


def _stall_resolution(row: Comparison, elastic_extra: dict) -> str:
    text = ""
    noise = elastic_extra.get("step_interval_noise_s")
    rounds = elastic_extra.get("stall_s_by_round", {})
    events = elastic_extra.get("event_stall_s_by_round", {})
    key = next((key for key in ("scale_out", "scale_in", "failure") if key.replace("_", "-") in row.figure), None)
    if key and events.get(key):
        text += (
            f" The single changes measured {', '.join(f'{value:.3g}' for value in events[key])} s "
            "from boundary records."
        )
    if noise is not None:
        text += (
            f" Resolution of step records: a stall is a gap minus a normal step; one step's time varies by "
            f"about {noise:.2g} s here (robust spread of commit intervals)"
        )
        if key and rounds.get(key):
            text += f", and the single changes measured {', '.join(f'{value:.3g}' for value in rounds[key])} s"
        text += "."
    return text
