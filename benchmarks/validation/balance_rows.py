"""What the validation predicts of balance.py: step times, balanced, uniform (DDP) and after the slowdown."""

from __future__ import annotations

import glob
import math
import os
from collections.abc import Mapping, Sequence

import numpy as np
from harness import median

from flexpar.sim import DeviceSpec, Event, Scenario, calibrate, simulate

from .comparison import Comparison
from .inputs import read_step_records

# Steps the simulation runs in each window: long enough that the median of a
# noisy simulated window does not depend on the draw (the benchmark's own
# windows are shorter; the quantity compared is the median either way).
SIMULATED_WINDOW_STEPS = 400
SIMULATED_WARMUP_STEPS = 10


def noise_sigma(log_deviations_by_device: Mapping[str, Sequence[float]]) -> float:
    """Lognormal sigma of per-step compute noise: per device, half the 16-84 percentile
    range of its log deviations (which is sigma for lognormal data), then the median over
    devices. Devices with fewer than 3 values are skipped; 0.0 when none is left.

    Quantiles rather than a standard deviation: a step's time is the slowest device's,
    so what matters is the upper middle of each device's distribution, not a rare outlier.
    """
    spreads = []
    for values in log_deviations_by_device.values():
        if len(values) < 3:
            continue
        low, high = np.percentile(np.asarray(values, dtype=float), [16, 84])
        spreads.append(float(high - low) / 2.0)
    return float(np.median(spreads)) if spreads else 0.0


def per_vw_samples(step_records: Sequence[dict], first_step: int, end_step: int) -> list[dict[str, float]]:
    """Per step record with first_step <= step < end_step: {device_id: busy / VWs}."""
    steps = []
    for record in step_records:
        if first_step <= record["step"] < end_step:
            steps.append(
                {
                    device_id: busy / count
                    for device_id, count, busy in zip(record["devices"], record["assignment"], record["busy_s"])
                    if count > 0 and busy > 0
                }
            )
    return steps


def independent_log_deviations(steps: Sequence[Mapping[str, float]]) -> dict[str, list[float]]:
    """Each device's log(seconds per VW) deviation that the other devices did not share that step.

    log x[d, s] = device level + step factor + independent part. The step factor
    (the median over devices of their deviations from their own medians) is
    whatever slowed or sped up every device at once, e.g. other load on the host;
    it moves every device's busy time, hence the step time, by the same ratio, so
    it does not make the slowest device slower than the others. The simulator's
    noise is independent per device and step, so only the rest is its noise.
    (With few devices the step factor absorbs a little of the independent part.)
    """
    logs: dict[str, list[tuple]] = {}
    for index, step in enumerate(steps):
        for device_id, value in step.items():
            logs.setdefault(device_id, []).append((index, math.log(value)))
    levels = {device_id: float(np.median([value for _, value in pairs])) for device_id, pairs in logs.items()}
    by_step: dict[int, dict[str, float]] = {}
    for device_id, pairs in logs.items():
        for index, value in pairs:
            by_step.setdefault(index, {})[device_id] = value - levels[device_id]
    deviations: dict[str, list[float]] = {}
    for values in by_step.values():
        if len(values) < 2:
            continue  # one device alone cannot tell its own noise from the host's
        shared = float(np.median(list(values.values())))
        for device_id, value in values.items():
            deviations.setdefault(device_id, []).append(value - shared)
    return deviations


def balance_step_records(metrics_dir: str | None) -> list[list[dict]]:
    """Step records of each flexpar round that balance.py kept (flexpar-ROUND.jsonl)."""
    if not metrics_dir:
        return []
    rounds = []
    for path in sorted(glob.glob(os.path.join(metrics_dir, "flexpar-*.jsonl"))):
        rounds.append([r for r in read_step_records(path) if r["kind"] == "step"])
    return [records for records in rounds if records]


def balance_noise(balance: dict, rounds: Sequence[Sequence[dict]]) -> float | None:
    """Noise sigma from the balanced window's per-step busy / VW (pooled over rounds); None without records."""
    config = balance["config"]
    pooled: dict[str, list[float]] = {}
    for records in rounds:  # each round's own device levels; the deviations are pooled
        steps = per_vw_samples(records, config["warmup_steps"], config["change_step"])
        for device_id, values in independent_log_deviations(steps).items():
            pooled.setdefault(device_id, []).extend(values)
    return noise_sigma(pooled) if pooled else None


def simulated_step_times(
    table: Sequence[float], calibration, virtual_workers: int, policy: str, noise: float, slowdown: tuple | None = None
) -> np.ndarray:
    """Per-step times of one simulated run: a balanced window, then (optionally) a slowdown and another window.

    `slowdown` = (device index, factor): that device's seconds per VW are
    multiplied by `factor` before step SIMULATED_WARMUP_STEPS + SIMULATED_WINDOW_STEPS.
    """
    change = SIMULATED_WARMUP_STEPS + SIMULATED_WINDOW_STEPS
    events = ()
    if slowdown is not None:
        device, factor = slowdown
        events = (Event("slowdown", (f"local-{device}",), at_step=change, factor=factor),)
    scenario = Scenario(
        name="sim-validation",
        steps=change + (SIMULATED_WINDOW_STEPS if slowdown else 0),
        virtual_workers=virtual_workers,
        devices=tuple(DeviceSpec(f"local-{index}", seconds) for index, seconds in enumerate(table)),
        events=events,
        parameters=calibration.parameters,
        policies=(policy,),
        noise=noise,
        seed=0,
    )
    result = simulate(scenario, policy)
    return np.repeat(result.segment_step_s, result.segment_steps)


def predict_balance(balance: dict, table: Sequence[float], calibration, noise: float) -> dict:
    """Predicted medians, with the benchmark's windows: flexpar balanced, DDP uniform, flexpar after the slowdown.

    - balanced: the steps after the warm-up, before the slowdown;
    - after the slowdown: the second half of the steps after it (balance.py's `settled_step_s`);
    - uniform: DDP's equal split; its first two steps dropped, as balance.py does.
    """
    config = balance["config"]
    virtual_workers = balance["virtual_workers"]
    factor = config["speeds"][config["changed_device"]] / config["changed_speed"]
    flexpar_times = simulated_step_times(
        table, calibration, virtual_workers, "flexpar", noise, slowdown=(config["changed_device"], factor)
    )
    change = SIMULATED_WARMUP_STEPS + SIMULATED_WINDOW_STEPS
    after = flexpar_times[change:]
    uniform_times = simulated_step_times(table, calibration, virtual_workers, "uniform", noise)
    return {
        "flexpar_step_s": float(np.median(flexpar_times[SIMULATED_WARMUP_STEPS:change])),
        "settled_step_s": float(np.median(after[len(after) // 2 :])),
        "uniform_step_s": float(np.median(uniform_times[2:])),
    }


def balance_calibration(balance: dict, probe: dict, table: Sequence[float]):
    return calibrate(
        {
            "seconds_per_vw": list(table),
            "devices": balance["devices"],
            "virtual_workers": balance["virtual_workers"],
            "parameter_count": probe["parameter_count"],
            "all_reduce_s": probe["all_reduce_s"],
            "optimizer_s": probe["optimizer_s"],
        }
    )


def compare_balance(balance: dict, probe: dict, noise: float | None) -> tuple:
    """Counted and diagnostic rows for balance.py, and the calibration that made them."""
    settled = [r["settled_step_s"] for r in balance.get("rounds", []) if r.get("settled_step_s") is not None]
    measured = {
        "flexpar_step_s": balance["step_time_s"],
        "uniform_step_s": balance["uniform_step_s"],
        "settled_step_s": median(settled) if settled else None,
    }
    names = {
        "flexpar_step_s": "balance: flexpar step, balanced (step_time_s)",
        "uniform_step_s": "balance: torch DDP step, uniform split (uniform_step_s)",
        "settled_step_s": "balance: flexpar step after local-0 slows (settled_step_s)",
    }
    models = {
        "flexpar_step_s": "real balancer; max(VWs x s/VW x noise + all-reduce) + optimizer",
        "uniform_step_s": "equal split (V/n each); max(VWs x s/VW x noise + all-reduce) + optimizer",
        "settled_step_s": "as balanced, local-0's s/VW x old/new speed (a simulator slowdown event)",
    }
    sigma = noise or 0.0
    measured_table = list(balance["seconds_per_vw"])
    calibration = balance_calibration(balance, probe, measured_table)
    predicted = predict_balance(balance, measured_table, calibration, sigma)
    noise_free = predict_balance(balance, measured_table, calibration, 0.0) if sigma else predicted
    rows = [Comparison(names[key], predicted[key], measured[key], True, models[key]) for key in names]
    single = balance.get("single_device_seconds_per_vw")
    if single:
        single_table = [single / speed for speed in balance["speeds"]]
        single_calibration = balance_calibration(balance, probe, single_table)
        single_predicted = predict_balance(balance, single_table, single_calibration, sigma)
        rows += [
            Comparison(
                names[key] + " [s/VW = single device / speed]",
                single_predicted[key],
                measured[key],
                False,
                models[key] + "; s/VW = single-device loop / emulated speed",
            )
            for key in names
        ]
    return rows, calibration, {"predicted": predicted, "predicted_noise_free": noise_free}


def ddp_slowest_seconds_per_vw(balance: dict) -> float | None:
    """Median over rounds of DDP's slowest rank's busy time / its VWs (its busy has no waiting in it)."""
    per_rank = balance["virtual_workers"] // balance["devices"]
    values = [max(r["uniform_busy_s"]) / per_rank for r in balance.get("rounds", []) if r.get("uniform_busy_s")]
    return median(values) if values else None


def why_flexpar_step(row: Comparison, balance_extra: dict, probe: dict) -> str:
    key = "settled_step_s" if "settled" in row.figure else "flexpar_step_s"
    noise_free = balance_extra["predicted_noise_free"][key]
    text = (
        f"Noise-free the model gives {noise_free:.4g} s, of which all-reduce + optimizer are "
        f"{probe['all_reduce_s'] + probe['optimizer_s']:.3g} s (probe). "
    )
    if row.predicted > row.measured:
        return text + (
            "The model prices every VW at the per-VW time measured at the balanced counts and "
            "treats the noise as independent per device; both overstate the slowest device here."
        )
    return text + (
        f"{row.measured - noise_free:.3g} s of each measured step is outside the devices' own busy "
        "time and outside the probe's all-reduce and optimizer: the step loop, coordination and "
        "host contention on 2 shared cores, which the step model does not price."
    )


def why_uniform(balance: dict) -> str:
    per_rank = balance["virtual_workers"] // balance["devices"]
    slow = int(np.argmax(balance["seconds_per_vw"]))
    text = (
        f"DDP's step is its slowest rank's {per_rank} VWs. The model prices them at local-{slow}'s s/VW as "
        f"flexpar's worker measured it ({balance['seconds_per_vw'][slow]:.4g} s, running "
        f"{balance['assignment'][slow]:g} VWs per step)"
    )
    ddp = ddp_slowest_seconds_per_vw(balance)
    if ddp is not None:
        text += f"; DDP's own busy time gives {ddp:.4g} s per VW"
    single = balance.get("single_device_seconds_per_vw")
    if single:
        plain = [single / speed for speed in balance["speeds"]]
        ratios = ", ".join(f"{measured / expected:.2f}" for measured, expected in zip(balance["seconds_per_vw"], plain))
        text += (
            f"; the plain single-device loop / speed gives {plain[slow]:.4g} s. flexpar's per-VW times are "
            f"{ratios} x the plain loop's (local-0..), DDP's slowest rank's about "
            f"{(ddp or plain[slow]) / plain[slow]:.2f} x"
        )
    return text + (
        ". The simulator's `uniform` policy is flexpar with an equal split, priced with flexpar's "
        "own per-VW costs: it predicts torch DDP only as far as DDP's VWs cost what flexpar's do, "
        "and here they cost less. The diagnostic row priced with the plain loop's s/VW shows "
        "the split and the step model themselves."
    )
