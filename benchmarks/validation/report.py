"""The validation's document for people: what calibrates what, the rows, and a note for each miss."""

from __future__ import annotations

from collections.abc import Sequence

from harness import fmt, print_table

from .balance_rows import why_flexpar_step, why_uniform
from .comparison import Comparison
from .elastic_rows import boundaries_text, why_stall
from .join_rows import why_join


def calibration_rows(
    balance: dict, elastic_raw: dict, probe: dict, noise: float | None, balance_cal, elastic_cal, elastic_extra
) -> list:
    """What calibrates what, with the values used."""
    network, workload, elastic_costs = (
        balance_cal.parameters.network,
        balance_cal.parameters.workload,
        elastic_cal.parameters.elastic,
    )
    return [
        {
            "parameter": "seconds per VW, local-0..",
            "value": [round(v, 5) for v in balance["seconds_per_vw"]],
            "from": "balance.py seconds_per_vw (busy / VWs, balanced window)",
        },
        {
            "parameter": "noise sigma",
            "value": noise,
            "from": "spread of per-step busy / VW not shared by the other devices (balance.py metrics)"
            if noise is not None
            else "no metrics files: 0 (noise-free)",
        },
        {
            "parameter": "gradient bytes (balance)",
            "value": workload.gradient_bytes,
            "from": f"balance model: {probe['parameter_count']} parameters x 4",
        },
        {
            "parameter": "all-reduce bandwidth B/s",
            "value": network.bandwidth_bytes_per_s,
            "from": f"probe: all_reduce_s = {probe['all_reduce_s']:.4g} over {probe['world']} processes",
        },
        {"parameter": "optimizer_s", "value": workload.optimizer_s, "from": "probe: the balance job's optimizer step"},
        {
            "parameter": "pg_formation_s + per device x n",
            "value": [elastic_costs.pg_formation_s, elastic_costs.pg_formation_per_device_s],
            "from": f"probe: boundaries without a transfer, by group size {boundaries_text(probe)}"
            if probe.get("boundary_s_by_size")
            else f"elastic.py process_group_formation_s {elastic_raw['process_group_formation_s']:.3g}",
        },
        {
            "parameter": "broadcast bandwidth B/s",
            "value": elastic_cal.parameters.network.broadcast_bandwidth_bytes_per_s,
            "from": f"elastic.py state_bytes / transfer path {fmt(elastic_extra['transfer_path_s'])} s "
            "(receive in a fresh process, spanning the source's capture + send, + restore)",
        },
        {
            "parameter": "detection_s",
            "value": elastic_costs.detection_s,
            "from": "probe: SIGKILL during all-reduce -> first survivor's error",
        },
        {
            "parameter": "host cores, shared",
            "value": elastic_costs.host_cores,
            "from": "this host's cores (the probe and the benchmarks share them)",
        },
        {
            "parameter": "recovery_notice_s",
            "value": elastic_costs.recovery_notice_s,
            "from": "half of each poll on the failure -> new generation path (device follower, device wait "
            "loop; the driver's loop is woken by the reports)",
        },
        {
            "parameter": "lost compute, failed step",
            "value": elastic_extra["failed_step_compute_s"],
            "from": "elastic.py metrics: survivors' busy in 3-device steps, the part after the victim's death "
            "at 2-process contention",
        },
    ]


def explanations(
    comparisons: Sequence[Comparison],
    balance: dict,
    elastic: dict,
    elastic_extra: dict,
    balance_extra: dict,
    probe: dict,
    join_figures: dict | None = None,
) -> list[str]:
    """Where the model is off: a note for each counted row over the goal, from the data at hand."""
    notes = []
    for row in comparisons:
        if row.counted and row.relative_error is not None and row.relative_error > row.goal:
            direction = "over" if row.predicted > row.measured else "under"
            unit = f"in units of max(measured, {row.floor:g} s)" if row.floor else "relative"
            head = (
                f"{row.figure}: predicted {row.predicted:.4g} vs measured {row.measured:.4g} "
                f"({direction}; error {row.relative_error:.2f} {unit}, goal {row.goal:g}). "
            )
            notes.append(
                head
                + _against_interval(row)
                + _why(row, balance, elastic, elastic_extra, balance_extra, probe, join_figures)
            )
        elif row.counted and row.relative_error is None:
            notes.append(_why_undefined(row, elastic_extra))
    floor_row = next((row for row in comparisons if "raw gloo" in row.figure), None)
    if floor_row is not None and floor_row.relative_error is not None:
        notes.append(
            f"Priced at the raw gloo send ({fmt(elastic.get('broadcast_s'))} s for "
            f"{elastic['state_bytes'] / 1e6:.0f} MB), the scale-out would be predicted at "
            f"{floor_row.predicted:.3g} s (error {floor_row.relative_error:.0%}): besides the bytes, "
            "flexpar's transfer captures the state, allocates the receiver's tensors (fresh "
            "pages) and restores them into the model and optimizer."
        )
    return notes


def _why(row: Comparison, balance, elastic, elastic_extra, balance_extra, probe, join_figures=None) -> str:
    if "join_stream" in row.figure:
        return why_join(row, join_figures)
    if "uniform" in row.figure:
        return why_uniform(balance)
    if "balance:" in row.figure:
        return why_flexpar_step(row, balance_extra, probe)
    return why_stall(row, elastic, elastic_extra, probe)


def _against_interval(row: Comparison) -> str:
    """Whether a prediction that misses the goal lies inside the measured median's bootstrap interval."""
    if row.measured_interval is None:
        return ""
    low, high = row.measured_interval
    inside = low <= row.predicted <= high
    return f"The measured median's 90% bootstrap interval over its single changes is {low:.4g}-{high:.4g} s: " + (
        "the prediction lies inside it. " if inside else "the prediction lies outside it. "
    )


def _why_undefined(row: Comparison, elastic_extra: dict) -> str:
    """A counted row with no relative error: say which side is missing and what that means."""
    if row.predicted is None:
        return f"{row.figure}: no prediction (an input it needs is missing), so the goal cannot be shown to hold."
    if row.measured is None:
        return f"{row.figure}: the benchmark did not report it, so the goal cannot be shown to hold."
    text = (
        f"{row.figure}: measured {row.measured:.3g} s, predicted {row.predicted:.3g} s; a relative error to "
        "0 is undefined, so the goal counts as not met."
    )
    noise = elastic_extra.get("step_interval_noise_s")
    if row.measured == 0 and noise is not None:
        text += (
            " elastic.py clips gap - normal step at 0: the change cost less than one step's jitter "
            f"(about {noise:.2g} s here); see the event stall_s row for flexpar's own timing of it."
        )
    return text


def print_report(document: dict) -> None:
    print_table(
        document["calibration"],
        ["parameter", "value", "from"],
        title="\nCalibration (measured figures -> model parameters; none of these is predicted)",
    )
    rows = [
        {
            "figure": row["figure"],
            "predicted": row["predicted"],
            "measured": row["measured"],
            "measured 90%": _interval_text(row.get("measured_interval")),
            "rel. error": row["relative_error"],
            "counted": "yes" if row["counted"] else "diagnostic",
        }
        for row in document["comparisons"]
    ]
    print_table(
        rows,
        ["figure", "predicted", "measured", "measured 90%", "rel. error", "counted"],
        title="\nPredicted vs measured (seconds; 'measured 90%': bootstrap interval of the measured "
        "median over its single changes)",
    )
    summary = document["summary"]
    print(
        f"\nmax_relative_error (counted rows): {fmt(summary['max_relative_error'])} "
        f"(goal {summary['goal']}): {'met' if summary['goal_met'] else 'NOT met'}; "
        f"all rows: {fmt(summary['max_relative_error_all_rows'])}"
    )
    for note in document["notes"]:
        print(f"- {note}")


def _interval_text(interval) -> str:
    return "-" if interval is None else f"{interval[0]:.3g}-{interval[1]:.3g}"
