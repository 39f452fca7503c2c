"""Simulator validation: calibrate flexpar.sim on this machine, then predict the benchmarks' figures.

    python benchmarks/sim_validation.py [--quick] [--json PATH]
    python benchmarks/sim_validation.py --balance-json A [--balance-metrics DIR] --elastic-json B --json PATH

Without input JSONs it runs `benchmarks/balance.py` and `benchmarks/elastic.py`
(their `--quick` versions with `--quick`) as subprocesses. It always runs its
own small calibration measurement (the "probe": four gloo processes, some
tens of seconds on this machine, mostly their start-up) for the costs the
benchmarks do not measure apart from the figures to predict.

Which measured figure calibrates which model parameter, and which are predicted
(a figure that calibrates is never also a prediction):

| model parameter | calibrated from |
|---|---|
| seconds per VW of each device | balance.py `seconds_per_vw`: busy time / VWs of each device, as flexpar's workers report it (compute only, no waiting) |
| per-step compute noise (sigma) | the spread of the same per-step busy / VW samples (balance.py's metrics files) |
| gradient bytes | the balance model's parameter count x 4 |
| all-reduce bandwidth | probe: gloo all-reduce of those bytes over 4 processes |
| optimizer_s | probe: the balance job's optimizer step |
| host_cores | this host's cores: CPU phases of a boundary or a step stretch by busy processes / cores when there are more processes |
| pg_formation_s, pg_formation_per_device_s | probe: a boundary without a state transfer, each right after a training step of elastic.py's job in every member as in a job (the generation lookup, the members meeting in the store (`control.meet`), flexpar's `GroupReaper` and `fresh_group`, as `Worker.enter` uses them: the old group retired, a fresh one, "formed", `take_stock`'s one small all-reduce, the old group released after it) in groups of 2 and 3 running processes, timed by the member that arrives last, each divided by its host contention, then a least-squares line with both terms >= 0 (the 4-process boundary is a check, not in the fit) |
| recovery_notice_s | flexpar's poll periods: half of each poll on the path from the survivors' failure reports to their seeing the new generation |
| state bytes, broadcast bandwidth | elastic.py `state_bytes` and its `flexpar_transfer_parts_s` (flexpar's own transfer path, timed on its own outside fit(): receive_state in a fresh process, as a joiner receives, which spans the source's capture and send_state; then restore) |
| detection_s | probe: a peer killed with SIGKILL during an all-reduce, until the first survivor's error (elastic.py's victim dies long before the survivors reach the all-reduce, so there it only bounds when they can learn of it) |
| lost compute of the failed step | elastic.py's metrics: survivors' busy time of a 3-device step; after the victim's death (its fault point: its first VW's backward) at one busy process fewer |

Predicted (counted in `max_relative_error`, goal <= 0.15): balance.py's
balanced flexpar step time (`step_time_s`), its torch-DDP uniform step time
(`uniform_step_s`), flexpar's settled step time after the slowdown
(`settled_step_s`); elastic.py's scale-out, scale-in and failure stalls from
flexpar's boundary records (`scale_out_event_stall_s`,
`scale_in_event_stall_s`, `failure_event_stall_s`). A stall from step records
is a gap between commits minus a normal step, and one step's time varies by
about 0.06 s here: that cannot resolve a scale-in of a few milliseconds, nor
15% of a scale-out of 0.2 s (in one run, elastic.py's twelve single scale-outs read 0.07
to 0.46 s from step records and 0.16 to 0.25 s from the boundary records);
the failure's step-record figure also holds the first step after the change
minus a median step. The step-record figures are diagnostic rows.
Diagnostic rows (not counted, chosen before measuring, to show where the
model is sensitive): the same step times with each device's seconds per VW
taken from the single-device loop divided by its emulated speed, and the
scale-out stall with the broadcast priced at the raw gloo send floor.

The simulation uses the real balancer (`flexpar.balance`) through
`flexpar.sim.simulate`, with the benchmark's own step windows and its slowdown
as a simulator event.
"""

from __future__ import annotations

import glob
import json
import math
import multiprocessing
import os
import queue
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np
from common import base_parser, median, print_table, write_json

import elastic as elastic_benchmark  # its fault schedule and the names of its changes
from flexpar.worker import device_link as control
from flexpar.options import cpu_count
from flexpar.sim import (
    DeviceSpec,
    Event,
    Scenario,
    calibrate,
    failed_step_lost_seconds,
    failure_stall_seconds,
    host_contention,
    pg_formation_seconds,
    predict_elastic_stalls,
    relative_error,
    simulate,
)

BENCHMARKS = os.path.dirname(os.path.abspath(__file__))
GOAL = 0.15
# Steps the simulation runs in each window: long enough that the median of a
# noisy simulated window does not depend on the draw (the benchmark's own
# windows are shorter; the quantity compared is the median either way).
SIMULATED_WINDOW_STEPS = 400
SIMULATED_WARMUP_STEPS = 10
# A boundary takes a few milliseconds: the probe forms each group size this many
# times (a median over 10 moved by a third from one run to the next). Each
# repeat follows a training step of elastic.py's job (about 0.4 s with the
# 25M-parameter model on shared cores), so 20 rather than the 40 of
# back-to-back boundaries: a probe run takes about 30 s.
BOUNDARY_REPEATS = 20
# The probe's 2-process boundary also moves between runs in fresh processes
# (3.1 to 4.8 ms over five runs on the development machine, each a median of
# 40 back-to-back boundaries; 2.3 to 2.6 ms over eight runs once each followed
# a training step): the validation takes the median over this many probe runs.
PROBE_RUNS = 3


# ------------------------------------------------------------------ comparisons (pure)


@dataclass
class Comparison:
    """One predicted figure against its measurement."""

    figure: str
    predicted: float | None
    measured: float | None
    counted: bool
    model: str  # what the prediction is made of
    # Where the measured median could have landed with another draw of as many
    # single changes (`median_interval`); None where the figure is not a median of changes.
    measured_interval: tuple | None = None
    relative_error: float | None = field(init=False)

    def __post_init__(self) -> None:
        self.relative_error = error_of(self.predicted, self.measured)


def error_of(predicted: float | None, measured: float | None) -> float | None:
    """|predicted - measured| / |measured|; None when either is missing or the measurement is 0."""
    if predicted is None or measured is None or measured == 0:
        return None
    if not (math.isfinite(predicted) and math.isfinite(measured)):
        return None
    return relative_error(predicted, measured)


def verdict(comparisons: Sequence[Comparison], goal: float = GOAL) -> dict:
    """The headline: the largest relative error of the counted rows, and whether the goal holds.

    A counted row without a relative error (a missing input, or a measured 0)
    makes the goal not met: it cannot be shown to hold.
    """
    counted = [row for row in comparisons if row.counted]
    errors = [row.relative_error for row in counted if row.relative_error is not None]
    every = [row.relative_error for row in comparisons if row.relative_error is not None]
    undefined = [row.figure for row in counted if row.relative_error is None]
    worst = max(errors) if errors else None
    return {
        "max_relative_error": worst,
        "max_relative_error_all_rows": max(every) if every else None,
        "goal": f"<= {goal:g}",
        "goal_met": bool(counted) and not undefined and worst is not None and worst <= goal,
        "rows_over_goal": [row.figure for row in counted
                           if row.relative_error is not None and row.relative_error > goal],
        "rows_without_error": undefined,
    }


def median_interval(values: Sequence[float], coverage: float = 0.9, resamples: int = 4000,
                    seed: int = 0) -> tuple | None:
    """Bootstrap interval of the median of `values`: (low, high) holding `coverage` of resampled medians.

    A measured stall is the median over a run's single changes, and those
    spread widely (a scale-in read 2 to 11 ms in one run): this says how far
    that median could move with another draw of as many changes, i.e. how
    finely the measurement itself can judge a prediction. None with fewer
    than 3 values. Deterministic for a given seed.
    """
    if len(values) < 3:
        return None
    draws = np.random.default_rng(seed).choice(np.asarray(values, dtype=float), size=(resamples, len(values)))
    medians = np.median(draws, axis=1)
    tail = (1.0 - coverage) / 2.0
    low, high = np.quantile(medians, [tail, 1.0 - tail])
    return float(low), float(high)


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
            steps.append({device_id: busy / count for device_id, count, busy
                          in zip(record["devices"], record["assignment"], record["busy_s"])
                          if count > 0 and busy > 0})
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
    for index, values in by_step.items():
        if len(values) < 2:
            continue  # one device alone cannot tell its own noise from the host's
        shared = float(np.median(list(values.values())))
        for device_id, value in values.items():
            deviations.setdefault(device_id, []).append(value - shared)
    return deviations


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


def failed_steps_inputs(records: Sequence[dict]) -> list[dict]:
    """`failed_step_inputs` of every failure in a run's records that has them."""
    failures = [r for r in records if r["kind"] == "event" and r["event"] == "failure"]
    found = [failed_step_inputs(records, failure) for failure in failures]
    return [inputs for inputs in found if inputs is not None and inputs["victim_vws"]]


def failed_step_inputs(records: Sequence[dict], failure: dict) -> dict | None:
    """The step `failure` killed, estimated from the steps before it: what the survivors had to do.

    flexpar's survivors learn of a failure when they reach the step's all-reduce,
    i.e. after their own VWs: the step in flight is lost up to there. Per step of
    the generation that failed (its first step left out when there are others:
    a new set's first step is slow), the slowest survivor's busy time; the median
    (``survivor_busy_s``). ``victim_vws``: the VWs the failed devices had per
    step (the most of them), which says how far into the step a fault in the
    victim's first VW lands.
    """
    steps = [r for r in records if r["kind"] == "step" and r["step"] < failure["step"]]
    if not steps:
        return None
    generation = steps[-1]["generation"]
    same = [r for r in steps if r["generation"] == generation]
    if len(same) > 1:
        same = same[1:]
    survivors = set(failure["devices"])
    values = []
    for record in same:
        busy = [b for device_id, b in zip(record["devices"], record["busy_s"]) if device_id in survivors]
        if busy:
            values.append(max(busy))
    if not values:
        return None
    last = same[-1]
    victims = [count for device_id, count in zip(last["devices"], last["assignment"]) if device_id not in survivors]
    return {"survivor_busy_s": median(values), "victim_vws": max(victims) if victims else None,
            "devices_before": len(last["devices"])}


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


# ------------------------------------------------------------------ inputs: the two benchmarks


def run_benchmark(script: str, json_path: str, quick: bool, extra: Sequence[str] = ()) -> dict:
    """Run benchmarks/<script> as a subprocess writing `json_path`; return its JSON."""
    command = [sys.executable, os.path.join(BENCHMARKS, script), "--json", json_path, *extra]
    if quick:
        command.append("--quick")
    _progress(f"running {' '.join(os.path.basename(part) if part.endswith('.py') else part for part in command[1:])}")
    started = time.perf_counter()
    completed = subprocess.run(command, stdout=sys.stderr, stderr=sys.stderr, check=False)
    if completed.returncode != 0:
        raise RuntimeError(f"{script} exited with status {completed.returncode}")
    _progress(f"{script} took {time.perf_counter() - started:.0f} s")
    return load_json(json_path)


def load_json(path: str) -> dict:
    with open(path, encoding="utf-8") as handle:
        return json.load(handle)


def read_step_records(path: str) -> list[dict]:
    """Records of a flexpar metrics file (JSON lines); [] when it is gone."""
    if not path or not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


# ------------------------------------------------------------------ the probe: costs measured apart


def _probe_worker(rank: int, world: int, port: int, repeats: int, elastic_model: str, results) -> None:
    """One probe process: all-reduce and optimizer timings of the balance job, boundaries, then a kill.

    The last rank kills itself with SIGKILL while the others wait in an
    all-reduce; each survivor reports how long its error took to surface. The
    store lives in the parent, so that it outlives every probe process.
    """
    import datetime

    import balance as balance_benchmark  # the balance job's model and optimizer, by reference
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # as each device process of the benchmark
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("gloo", store=dist.PrefixStore("probe", store), rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=10))
    torch.manual_seed(rank)
    model = balance_benchmark.make_model()
    optimizer = balance_benchmark.make_optimizer(model.parameters())
    parameter_count = sum(parameter.numel() for parameter in model.parameters())
    gradient = torch.randn(parameter_count)

    def slowest(seconds: float) -> float:
        value = torch.tensor([seconds], dtype=torch.float64)
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return float(value.item())

    all_reduce_s, optimizer_s = [], []
    for repeat in range(repeats + 2):  # the first two warm up
        dist.barrier()
        started = time.perf_counter()
        dist.all_reduce(gradient)
        elapsed = slowest(time.perf_counter() - started)
        for parameter in model.parameters():
            parameter.grad = torch.randn_like(parameter)
        dist.barrier()
        started = time.perf_counter()
        optimizer.step()
        stepped = slowest(time.perf_counter() - started)
        if repeat >= 2:
            all_reduce_s.append(elapsed)
            optimizer_s.append(stepped)
    del model, optimizer  # the boundaries follow steps of elastic.py's job instead
    boundaries = _probe_boundaries(rank, world, store, BOUNDARY_REPEATS, elastic_step(elastic_model))
    if rank == 0:
        results.put({"kind": "timings", "parameter_count": parameter_count, "world": world,
                     "all_reduce_s": median(all_reduce_s), "optimizer_s": median(optimizer_s)})
    results.put({"kind": "boundaries", "rank": rank, "seconds": boundaries})
    dist.barrier()
    if rank == world - 1:
        time.sleep(0.3)  # let the others enter the all-reduce first
        store.set("probe/killed_at", repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        dist.all_reduce(gradient)
        surfaced = None
    except RuntimeError:  # gloo: connection reset / closed, or its timeout (DistError is one too)
        surfaced = time.time()
    detection = None if surfaced is None else surfaced - float(store.get("probe/killed_at").decode())
    results.put({"kind": "detection", "rank": rank, "detection_s": detection})
    results.close()
    results.join_thread()  # the queue's feeder thread must deliver before _exit
    os._exit(0)  # the group is broken: skip its teardown


def elastic_step(model_name: str) -> Callable[[], None]:
    """One training step of elastic.py's job in this process: a VW's forward and backward, then Adam.

    A boundary in a job comes right after a commit, i.e. after a step that
    swept the model, its gradients and Adam's state (about 400 MB for the
    25M-parameter model) through the caches; the probe's boundaries do the
    same. Measured on the development machine (medians of 2-process
    boundaries, fresh probe runs): back to back 1.7-2.3 ms; after each member
    swept 400 MB three times 3.3-3.4 ms; after this step 2.3-2.6 ms, where
    elastic.py's scale-ins read 2.4-3.8 ms (medians of a run's changes).
    """
    settings = elastic_benchmark.Settings(quick=model_name == "small", rounds=1)
    model, optimizer = elastic_benchmark.trained_state(settings)
    batch = elastic_benchmark.one_virtual_worker_batch()

    def step() -> None:
        elastic_benchmark.cross_entropy(model, batch).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def _probe_boundaries(rank: int, world: int, store, repeats: int, step: Callable[[], None]) -> dict:
    """What a flexpar boundary without a state transfer costs, for groups of 2 .. world processes.

    Each repeat follows a training step of elastic.py's job in every member
    (`elastic_step`), as a boundary follows a commit, and then does what a
    boundary does from a commit on when nobody needs the state (`Worker.run` and `Worker.enter`): read the generation's record
    from the store, meet the other members there (`control.meet`, as
    `DeviceLink.gather`), retire the old group (flexpar's `GroupReaper`) and form a
    fresh one (`fresh_group`, which releases the old group at the end),
    report it formed and take stock (source, receivers, last commit: one
    all-reduce). Every member times it from its own arrival, so the member
    that arrives last - whose time is the boundary's cost, as flexpar's stall
    counts it - times the least.
    Ranks outside a group size's members skip to the next size. The last
    group formed, of all `world` processes, is left for the kill.
    """
    import torch.distributed as dist

    from flexpar.comm import protocol as control, state_transfer as training_state
    from flexpar.comm.channel import Channel
    from flexpar.comm.collectives import GroupReaper, fresh_group

    if rank == 0:
        store.set("probe/generation", json.dumps({"members": list(range(world)), "failed": [], "left": []}))
    events = Channel(store, "probe/events")
    reaper = GroupReaper()  # a worker's, made with the worker
    seconds: dict = {}
    for size in range(2, world + 1):
        for repeat in range(repeats):
            if rank >= size:
                continue
            step()
            started = time.perf_counter()
            control.get_json(store, "probe/generation")  # the new generation's record
            control.meet(store, f"probe/{size}/{repeat}/arrived", size)  # as DeviceLink.gather, before forming
            with fresh_group(reaper.retire([]), "gloo", dist.PrefixStore(f"probe/{size}/{repeat}", store), rank,
                             size, 30):
                events.send({"type": "formed", "device_id": f"probe-{rank}", "generation": repeat})
                training_state.take_stock(0, time.time(), rank, size, "cpu")
                seconds.setdefault(size, []).append(time.perf_counter() - started)
    with fresh_group(reaper.retire([]), "gloo", dist.PrefixStore("probe/kill", store), rank, world, 10):
        pass
    return seconds


def boundary_seconds(per_rank: Sequence[Mapping[int, Sequence[float]]]) -> dict[int, float]:
    """Per group size: the median over repeats of the least member time (the last arrival's)."""
    sizes = sorted({size for seconds in per_rank for size in seconds})
    result = {}
    for size in sizes:
        series = [seconds[size] for seconds in per_rank if size in seconds]
        result[size] = median([min(values) for values in zip(*series)])
    return result


def run_probe(world: int = 4, repeats: int = 10, elastic_model: str = "full") -> dict:
    """All-reduce time, optimizer time, boundary cost and failure detection, in `world` fresh processes.

    `elastic_model`: elastic.py's model (its JSON's "model"), whose training
    step precedes each boundary.
    """
    import datetime

    import torch.distributed as dist
    from common import free_port

    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=60))
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["torch", "torch.distributed", "torch.optim"])
    results = context.Queue()
    processes = [context.Process(target=_probe_worker, name=f"sim-probe-{rank}",
                                 args=(rank, world, port, repeats, elastic_model, results)) for rank in range(world)]
    _progress(f"probe: {world} gloo processes (all-reduce, optimizer step, boundaries, kill -9 detection)")
    for process in processes:
        process.start()
    timings, detections, boundaries = None, [], []
    try:
        deadline = time.monotonic() + 180
        while (timings is None or len(detections) < world - 1 or len(boundaries) < world) \
                and time.monotonic() < deadline:
            try:
                message = results.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                break
            if message["kind"] == "timings":
                timings = message
            elif message["kind"] == "boundaries":
                boundaries.append(message["seconds"])
            else:
                detections.append(message["detection_s"])
    finally:
        for process in processes:
            process.join(timeout=20)
            if process.is_alive():
                process.kill()
                process.join()
        del store  # closes the probe's store server
    if timings is None:
        raise RuntimeError("the calibration probe did not report its timings")
    surfaced = [value for value in detections if value is not None]
    # The first survivor's error starts the recovery: in flexpar it reports the
    # failure and the coordinator tells the others (it also sees the exit itself).
    timings["detection_s"] = min(surfaced) if surfaced else None
    timings["detection_by_survivor_s"] = detections
    timings["boundary_s_by_size"] = boundary_seconds(boundaries) if len(boundaries) == world else {}
    return timings


# ------------------------------------------------------------------ balance: step times


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


def simulated_step_times(table: Sequence[float], calibration, virtual_workers: int, policy: str, noise: float,
                         slowdown: tuple | None = None) -> np.ndarray:
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
        name="sim-validation", steps=change + (SIMULATED_WINDOW_STEPS if slowdown else 0),
        virtual_workers=virtual_workers,
        devices=tuple(DeviceSpec(f"local-{index}", seconds) for index, seconds in enumerate(table)),
        events=events, parameters=calibration.parameters, policies=(policy,), noise=noise, seed=0,
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
    flexpar_times = simulated_step_times(table, calibration, virtual_workers, "flexpar", noise,
                                         slowdown=(config["changed_device"], factor))
    change = SIMULATED_WARMUP_STEPS + SIMULATED_WINDOW_STEPS
    after = flexpar_times[change:]
    uniform_times = simulated_step_times(table, calibration, virtual_workers, "uniform", noise)
    return {
        "flexpar_step_s": float(np.median(flexpar_times[SIMULATED_WARMUP_STEPS:change])),
        "settled_step_s": float(np.median(after[len(after) // 2:])),
        "uniform_step_s": float(np.median(uniform_times[2:])),
    }


def balance_calibration(balance: dict, probe: dict, table: Sequence[float]):
    return calibrate({
        "seconds_per_vw": list(table), "devices": balance["devices"], "virtual_workers": balance["virtual_workers"],
        "parameter_count": probe["parameter_count"], "all_reduce_s": probe["all_reduce_s"],
        "optimizer_s": probe["optimizer_s"],
    })


def compare_balance(balance: dict, probe: dict, noise: float | None) -> tuple:
    """Counted and diagnostic rows for balance.py, and the calibration that made them."""
    settled = [r["settled_step_s"] for r in balance.get("rounds", []) if r.get("settled_step_s") is not None]
    measured = {"flexpar_step_s": balance["step_time_s"], "uniform_step_s": balance["uniform_step_s"],
                "settled_step_s": median(settled) if settled else None}
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
        rows += [Comparison(names[key] + " [s/VW = single device / speed]", single_predicted[key], measured[key],
                            False, models[key] + "; s/VW = single-device loop / emulated speed")
                 for key in names]
    return rows, calibration, {"predicted": predicted, "predicted_noise_free": noise_free}


# ------------------------------------------------------------------ elastic: stalls


def compare_elastic(elastic: dict, probe: dict) -> tuple:
    """Counted and diagnostic rows for elastic.py, the calibration, and the lost compute it used."""
    parts = elastic.get("flexpar_transfer_parts_s") or {}
    transfer_s = transfer_path_seconds(parts)
    measured_inputs = {
        "devices": 2,  # the job runs on 2 devices before each change
        "state_bytes": elastic["state_bytes"], "broadcast_bytes": elastic["state_bytes"],
        **boundary_calibration(elastic, probe, cores=float(cpu_count())),
        "broadcast_s": transfer_s, "detection_s": probe.get("detection_s"),
        "recovery_notice_s": recovery_notice_seconds(),
    }
    calibration = calibrate(measured_inputs)
    out = predict_elastic_stalls(calibration, devices_before=2)
    shrink = predict_elastic_stalls(calibration, devices_before=3)
    inputs = [value for r in elastic.get("flexpar_rounds", [])
              for value in failed_steps_inputs(read_step_records(r.get("metrics", "")))]
    failure, lost_s = None, None
    if inputs and probe.get("detection_s") is not None:
        failure, lost_s = predict_failure_stall(inputs, calibration.parameters)
    # elastic.py's figures are medians over every round's changes of each kind.
    changes = {"scale_out": elastic_benchmark.SCALE_OUTS, "scale_in": elastic_benchmark.SCALE_INS,
               "failure": elastic_benchmark.FAILURES}
    flexpar_rounds = elastic.get("flexpar_rounds", [])
    by_round = {kind: elastic_benchmark.change_values(flexpar_rounds, names, "stall_s") for kind, names in changes.items()}
    events_by_round = {kind: elastic_benchmark.change_values(flexpar_rounds, names, "event_stall_s")
                       for kind, names in changes.items()}
    interval = {kind: median_interval(values) for kind, values in events_by_round.items()}
    rows = [
        # Counted from flexpar's boundary record since the scale-out is a few tenths
        # of a second: the step-record figure's noise (one step's time varies by
        # about 0.06 s here) is a third of it.
        Comparison("elastic: scale-out 2->3 stall (scale_out_event_stall_s)",
                   out["scale_out_stall_s"] if transfer_s is not None else None,
                   elastic.get("scale_out_event_stall_s"), True,
                   "group formation + state transfer to a joiner (flexpar's path) vs the event record: last "
                   "member's commit -> all level", interval["scale_out"]),
        # A scale-in stall of milliseconds is far below what step records resolve
        # (one step's time varies by tens of ms here): it is counted from flexpar's
        # boundary record, which times it directly.
        Comparison("elastic: scale-in 3->2 stall (scale_in_event_stall_s)", shrink["scale_in_stall_s"],
                   elastic.get("scale_in_event_stall_s"), True,
                   "one boundary without a transfer (probe) vs the event record: last member's commit -> all level",
                   interval["scale_in"]),
        # Like the scale-in, counted from flexpar's boundary record: the step-record
        # figure also holds the first step after the change minus a median step,
        # which varies by about 0.1 s between rounds here.
        Comparison("elastic: failure 3->2 stall (failure_event_stall_s)", failure,
                   elastic.get("failure_event_stall_s"), True,
                   "lost compute of the step in flight + recovery notice + group formation vs the event "
                   "record: last commit -> survivors level", interval["failure"]),
    ]
    rows += [
        Comparison("elastic: scale-in 3->2 [step records: gap - normal step]", shrink["scale_in_stall_s"],
                   elastic.get("scale_in_stall_s"), False, "as the counted row vs step records"),
        Comparison("elastic: scale-out 2->3 [step records: gap - normal step]",
                   out["scale_out_stall_s"] if transfer_s is not None else None,
                   elastic.get("scale_out_stall_s"), False, "as the counted row vs step records"),
        Comparison("elastic: failure 3->2 [step records: gap - normal step]", failure,
                   elastic.get("failure_resume_s"), False, "as the counted row vs step records"),
    ]
    four = boundaries_by_size(probe).get(4)
    if four is not None:
        # Not used in the fit: a check of the contention term (4 busy processes on this host's cores).
        rows.append(Comparison("probe: boundary of 4 processes [not in the fit]",
                               pg_formation_seconds(4, calibration.parameters.elastic), four, False,
                               "base + per device x 4, x host contention"))
    if elastic.get("broadcast_s"):
        floor = calibrate({**measured_inputs, "broadcast_s": elastic["broadcast_s"]})
        rows.append(Comparison("elastic: scale-out 2->3 stall [transfer = raw gloo send floor]",
                               predict_elastic_stalls(floor, devices_before=2)["scale_out_stall_s"],
                               elastic.get("scale_out_event_stall_s"), False,
                               "group formation + state bytes at gloo's send bandwidth"))
    noise = [step_interval_noise_s(read_step_records(r.get("metrics", ""))) for r in elastic.get("flexpar_rounds", [])]
    noise = [value for value in noise if value is not None]
    return rows, calibration, {"transfer_path_s": transfer_s, "failed_step_compute_s": lost_s,
                               "failed_step_inputs": inputs,
                               "step_interval_noise_s": median(noise) if noise else None,
                               "stall_s_by_round": by_round, "event_stall_s_by_round": events_by_round}


def recovery_notice_seconds() -> float:
    """Expected time from the survivors' failure reports to their seeing the rebuilt generation.

    The chain runs through two polls, each waited half its period on average:
    the device's follower thread (it reads the published generation), and the
    survivor's own wait loop (it reads what the follower saw). The driver's
    loop is woken by the reports themselves (control.DriverWaker), so it adds
    store round trips only, which (a fraction of a millisecond each) are left
    out. A planned change has no such chain: its generation rides in the
    step's all-reduce.
    """
    return 0.5 * (2 * control.DEVICE_POLL_S)


def fault_death_fraction(phase: str, victim_vws: int, backward_fraction: float) -> float:
    """How far into its step's compute a device dies at the fault point ``phase`` of its first VW.

    forward: at the start; backward: after the first VW's forward, taken as
    ``1 - backward_fraction`` of a VW; sync: after all of its VWs.
    """
    if phase == "forward":
        return 0.0
    if phase == "backward":
        return (1.0 - backward_fraction) / victim_vws
    if phase == "sync":
        return 1.0
    raise ValueError(f"fault phase {phase!r}: expected forward, backward or sync")


def predict_failure_stall(inputs: Sequence[dict], parameters) -> tuple:
    """elastic.py's failure stall (last commit -> survivors level) and the lost compute in it.

    The victim dies at elastic.py's fault point; the survivors run their VWs of
    the step to its all-reduce (one busy process fewer on the host from the
    death on), learn of it there, wait for the rebuilt generation and form a
    new group. Each failure of `inputs` (`failed_steps_inputs`) is predicted
    from its own generation's busy times; the medians over them.
    """
    phases = {fault.rsplit(":", 1)[1] for fault in elastic_benchmark.Settings(quick=False, rounds=1).faults.split(",")}
    if len(phases) != 1:
        raise ValueError(f"elastic.py's faults use phases {sorted(phases)}: expected one, to place every failure")
    phase = phases.pop()
    stalls, losses = [], []
    for value in inputs:
        busy, devices_before = value["survivor_busy_s"], value["devices_before"]
        fraction = fault_death_fraction(phase, value["victim_vws"], parameters.network.backward_fraction)
        lost = failed_step_lost_seconds(busy, devices_before, parameters.elastic, fraction)
        losses.append(lost)
        stalls.append(failure_stall_seconds(devices_before - 1, parameters.elastic, lost_compute_s=lost,
                                            death_at_s=fraction * busy))
    return median(stalls), median(losses)


def combine_probes(probes: Sequence[dict]) -> dict:
    """One probe from several runs: the median of each timing, and of each group size's boundary.

    The first run's other fields (parameter count, world) stand; each run's
    boundaries are kept under ``boundary_s_by_run``.
    """
    combined = dict(probes[0])
    for key in ("all_reduce_s", "optimizer_s", "detection_s"):
        values = [probe[key] for probe in probes if probe.get(key) is not None]
        combined[key] = median(values) if values else None
    runs = [boundaries_by_size(probe) for probe in probes]
    sizes = sorted({size for run in runs for size in run})
    combined["boundary_s_by_size"] = {size: median([run[size] for run in runs if size in run]) for size in sizes}
    combined["boundary_s_by_run"] = runs
    combined["runs"] = len(probes)
    return combined


def boundaries_by_size(probe: dict) -> dict[int, float]:
    """The probe's boundary seconds by group size (sizes are strings once the probe went through JSON)."""
    return {int(size): seconds for size, seconds in (probe.get("boundary_s_by_size") or {}).items()}


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


# ------------------------------------------------------------------ report


def calibration_rows(balance: dict, elastic_raw: dict, probe: dict, noise: float | None, balance_cal, elastic_cal,
                     elastic_extra) -> list:
    """What calibrates what, with the values used."""
    network, workload, elastic_costs = balance_cal.parameters.network, balance_cal.parameters.workload, \
        elastic_cal.parameters.elastic
    return [
        {"parameter": "seconds per VW, local-0..", "value": [round(v, 5) for v in balance["seconds_per_vw"]],
         "from": "balance.py seconds_per_vw (busy / VWs, balanced window)"},
        {"parameter": "noise sigma", "value": noise,
         "from": "spread of per-step busy / VW not shared by the other devices (balance.py metrics)" if noise is not None
         else "no metrics files: 0 (noise-free)"},
        {"parameter": "gradient bytes (balance)", "value": workload.gradient_bytes,
         "from": f"balance model: {probe['parameter_count']} parameters x 4"},
        {"parameter": "all-reduce bandwidth B/s", "value": network.bandwidth_bytes_per_s,
         "from": f"probe: all_reduce_s = {probe['all_reduce_s']:.4g} over {probe['world']} processes"},
        {"parameter": "optimizer_s", "value": workload.optimizer_s, "from": "probe: the balance job's optimizer step"},
        {"parameter": "pg_formation_s + per device x n", "value": [elastic_costs.pg_formation_s,
                                                                    elastic_costs.pg_formation_per_device_s],
         "from": f"probe: boundaries without a transfer, by group size {_boundaries_text(probe)}"
         if probe.get("boundary_s_by_size") else
         f"elastic.py process_group_formation_s {elastic_raw['process_group_formation_s']:.3g}"},
        {"parameter": "broadcast bandwidth B/s", "value": elastic_cal.parameters.network.broadcast_bandwidth_bytes_per_s,
         "from": f"elastic.py state_bytes / transfer path {_fmt(elastic_extra['transfer_path_s'])} s "
                 "(receive in a fresh process, spanning the source's capture + send, + restore)"},
        {"parameter": "detection_s", "value": elastic_costs.detection_s,
         "from": "probe: SIGKILL during all-reduce -> first survivor's error"},
        {"parameter": "host cores, shared", "value": elastic_costs.host_cores,
         "from": "this host's cores (the probe and the benchmarks share them)"},
        {"parameter": "recovery_notice_s", "value": elastic_costs.recovery_notice_s,
         "from": "half of each poll on the failure -> new generation path (device follower, device wait "
                 "loop; the driver's loop is woken by the reports)"},
        {"parameter": "lost compute, failed step", "value": elastic_extra["failed_step_compute_s"],
         "from": "elastic.py metrics: survivors' busy in 3-device steps, the part after the victim's death "
                 "at 2-process contention"},
    ]


def explanations(comparisons: Sequence[Comparison], balance: dict, elastic: dict, elastic_extra: dict,
                 balance_extra: dict, probe: dict) -> list[str]:
    """Where the model is off: a note for each counted row over the goal, from the data at hand."""
    notes = []
    for row in comparisons:
        if row.counted and row.relative_error is not None and row.relative_error > GOAL:
            direction = "over" if row.predicted > row.measured else "under"
            head = (f"{row.figure}: predicted {row.predicted:.4g} s vs measured {row.measured:.4g} s "
                    f"({direction} by {row.relative_error:.0%}). ")
            notes.append(head + _against_interval(row) + _why(row, balance, elastic, elastic_extra, balance_extra,
                                                              probe))
        elif row.counted and row.relative_error is None:
            notes.append(_why_undefined(row, elastic_extra))
    floor_row = next((row for row in comparisons if "raw gloo" in row.figure), None)
    if floor_row is not None and floor_row.relative_error is not None:
        notes.append(f"Priced at the raw gloo send ({_fmt(elastic.get('broadcast_s'))} s for "
                     f"{elastic['state_bytes'] / 1e6:.0f} MB), the scale-out would be predicted at "
                     f"{floor_row.predicted:.3g} s (error {floor_row.relative_error:.0%}): besides the bytes, "
                     "flexpar's transfer captures the state, allocates the receiver's tensors (fresh "
                     "pages) and restores them into the model and optimizer.")
    return notes


def _why(row: Comparison, balance, elastic, elastic_extra, balance_extra, probe) -> str:
    if "uniform" in row.figure:
        return _why_uniform(balance)
    if "balance:" in row.figure:
        return _why_flexpar_step(row, balance_extra, probe)
    text = _why_stall(row, elastic, elastic_extra, probe)
    noise = elastic_extra.get("step_interval_noise_s")
    rounds = elastic_extra.get("stall_s_by_round", {})
    events = elastic_extra.get("event_stall_s_by_round", {})
    key = next((key for key in ("scale_out", "scale_in", "failure") if key.replace("_", "-") in row.figure), None)
    if key and events.get(key):
        text += (f" The single changes measured {', '.join(f'{value:.3g}' for value in events[key])} s "
                 "from boundary records.")
    if noise is not None:
        text += (f" Resolution of step records: a stall is a gap minus a normal step; one step's time varies by "
                 f"about {noise:.2g} s here (robust spread of commit intervals)")
        if key and rounds.get(key):
            text += f", and the single changes measured {', '.join(f'{value:.3g}' for value in rounds[key])} s"
        text += "."
    return text


def _against_interval(row: Comparison) -> str:
    """Whether a prediction that misses the goal lies inside the measured median's bootstrap interval."""
    if row.measured_interval is None:
        return ""
    low, high = row.measured_interval
    inside = low <= row.predicted <= high
    return (f"The measured median's 90% bootstrap interval over its single changes is {low:.4g}-{high:.4g} s: "
            + ("the prediction lies inside it. " if inside else "the prediction lies outside it. "))


def _why_undefined(row: Comparison, elastic_extra: dict) -> str:
    """A counted row with no relative error: say which side is missing and what that means."""
    if row.predicted is None:
        return f"{row.figure}: no prediction (an input it needs is missing), so the goal cannot be shown to hold."
    if row.measured is None:
        return f"{row.figure}: the benchmark did not report it, so the goal cannot be shown to hold."
    text = (f"{row.figure}: measured {row.measured:.3g} s, predicted {row.predicted:.3g} s; a relative error to "
            "0 is undefined, so the goal counts as not met.")
    noise = elastic_extra.get("step_interval_noise_s")
    if row.measured == 0 and noise is not None:
        text += (" elastic.py clips gap - normal step at 0: the change cost less than one step's jitter "
                 f"(about {noise:.2g} s here); see the event stall_s row for flexpar's own timing of it.")
    return text


def _why_flexpar_step(row: Comparison, balance_extra: dict, probe: dict) -> str:
    key = "settled_step_s" if "settled" in row.figure else "flexpar_step_s"
    noise_free = balance_extra["predicted_noise_free"][key]
    text = (f"Noise-free the model gives {noise_free:.4g} s, of which all-reduce + optimizer are "
            f"{probe['all_reduce_s'] + probe['optimizer_s']:.3g} s (probe). ")
    if row.predicted > row.measured:
        return text + ("The model prices every VW at the per-VW time measured at the balanced counts and "
                       "treats the noise as independent per device; both overstate the slowest device here.")
    return text + (f"{row.measured - noise_free:.3g} s of each measured step is outside the devices' own busy "
                   "time and outside the probe's all-reduce and optimizer: the step loop, coordination and "
                   "host contention on 2 shared cores, which the step model does not price.")


def _boundaries_text(probe: dict) -> str:
    return ", ".join(f"{size}: {seconds:.3g} s" for size, seconds in sorted(boundaries_by_size(probe).items()))


def _why_stall(row: Comparison, elastic: dict, elastic_extra: dict, probe: dict) -> str:
    if "scale-in" in row.figure:
        return ("The model's scale-in is one boundary without a transfer (retire the old group, form the "
                "new one, take stock of steps and the last commit), priced from the probe's boundaries by "
                f"group size ({_boundaries_text(probe) or 'not measured'}; each right after a training step of "
                "elastic.py's job), with the survivors as the busy "
                "processes (the leaver skips its last update and exits at the lowest priority). The old "
                "group's teardown is released once the members are level (flexpar.sync.GroupReaper).")
    if "failure" in row.figure:
        return (f"Of the prediction, {_fmt(elastic_extra['failed_step_compute_s'])} s is the lost compute of "
                "the step in flight (from neighbouring steps' busy times, the part after the victim's death "
                "at one busy process fewer); the rest is the recovery notice (polls) and a new group. "
                "Store round trips and the survivors' reports arriving apart are not in the model.")
    parts = elastic.get("flexpar_transfer_parts_s") or {}
    source_side = (parts.get("capture_s") or 0.0) + (parts.get("send_s") or 0.0)
    text = (f"The model is group formation + flexpar's transfer path timed on its own "
            f"({_fmt(elastic_extra.get('transfer_path_s'))} s, of which the source's capture + send "
            f"{source_side:.3g} s). ")
    step_records = elastic.get("scale_out_stall_s")
    if step_records is not None:
        text += (f"From step records (diagnostic) the stall reads {step_records:.3g} s: that figure also holds "
                 "the first step of the new set over a normal one (new assignment, loader restart), which is not "
                 "in the model. ")
    return text


def _why_uniform(balance: dict) -> str:
    per_rank = balance["virtual_workers"] // balance["devices"]
    slow = int(np.argmax(balance["seconds_per_vw"]))
    text = (f"DDP's step is its slowest rank's {per_rank} VWs. The model prices them at local-{slow}'s s/VW as "
            f"flexpar's worker measured it ({balance['seconds_per_vw'][slow]:.4g} s, running "
            f"{balance['assignment'][slow]:g} VWs per step)")
    ddp = ddp_slowest_seconds_per_vw(balance)
    if ddp is not None:
        text += f"; DDP's own busy time gives {ddp:.4g} s per VW"
    single = balance.get("single_device_seconds_per_vw")
    if single:
        plain = [single / speed for speed in balance["speeds"]]
        ratios = ", ".join(f"{measured / expected:.2f}" for measured, expected in zip(balance["seconds_per_vw"], plain))
        text += (f"; the plain single-device loop / speed gives {plain[slow]:.4g} s. flexpar's per-VW times are "
                 f"{ratios} x the plain loop's (local-0..), DDP's slowest rank's about "
                 f"{(ddp or plain[slow]) / plain[slow]:.2f} x")
    return text + (". The simulator's `uniform` policy is flexpar with an equal split, priced with flexpar's "
                   "own per-VW costs: it predicts torch DDP only as far as DDP's VWs cost what flexpar's do, "
                   "and here they cost less. The diagnostic row priced with the plain loop's s/VW shows "
                   "the split and the step model themselves.")


def ddp_slowest_seconds_per_vw(balance: dict) -> float | None:
    """Median over rounds of DDP's slowest rank's busy time / its VWs (its busy has no waiting in it)."""
    per_rank = balance["virtual_workers"] // balance["devices"]
    values = [max(r["uniform_busy_s"]) / per_rank for r in balance.get("rounds", []) if r.get("uniform_busy_s")]
    return median(values) if values else None


def print_report(document: dict) -> None:
    print_table(document["calibration"], ["parameter", "value", "from"],
                title="\nCalibration (measured figures -> model parameters; none of these is predicted)")
    rows = [{"figure": row["figure"], "predicted": row["predicted"], "measured": row["measured"],
             "measured 90%": _interval_text(row.get("measured_interval")),
             "rel. error": row["relative_error"], "counted": "yes" if row["counted"] else "diagnostic"}
            for row in document["comparisons"]]
    print_table(rows, ["figure", "predicted", "measured", "measured 90%", "rel. error", "counted"],
                title="\nPredicted vs measured (seconds; 'measured 90%': bootstrap interval of the measured "
                      "median over its single changes)")
    summary = document["summary"]
    print(f"\nmax_relative_error (counted rows): {_fmt(summary['max_relative_error'])} "
          f"(goal {summary['goal']}): {'met' if summary['goal_met'] else 'NOT met'}; "
          f"all rows: {_fmt(summary['max_relative_error_all_rows'])}")
    for note in document["notes"]:
        print(f"- {note}")


def _fmt(value) -> str:
    return "-" if value is None else f"{value:.3g}"


def _interval_text(interval) -> str:
    return "-" if interval is None else f"{interval[0]:.3g}-{interval[1]:.3g}"


def _progress(message: str) -> None:
    sys.stdout.flush()
    print(f"sim_validation: {message}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------ main


def gather_inputs(options, scratch: str) -> tuple:
    """The two benchmarks' JSON (given, or run now) and balance.py's metrics folder, if any."""
    metrics_dir = options.balance_metrics
    if options.balance_json:
        balance = load_json(options.balance_json)
    else:
        metrics_dir = os.path.join(scratch, "balance-metrics")
        os.makedirs(metrics_dir, exist_ok=True)
        # The rounds the simulator predicts only: not the V=128 round or balancing by cost,
        # which it does not model (they more than double balance.py's time).
        balance = run_benchmark("balance.py", os.path.join(scratch, "balance.json"), options.quick,
                                ["--keep-metrics", metrics_dir, "--fine-virtual-workers", "0",
                                 "--variable-length", "skip"])
    if options.elastic_json:
        elastic = load_json(options.elastic_json)
    else:
        elastic = run_benchmark("elastic.py", os.path.join(scratch, "elastic.json"), options.quick)
    return balance, elastic, metrics_dir


def main(argv=None) -> dict:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--balance-json", metavar="PATH", help="balance.py's JSON (default: run it now)")
    parser.add_argument("--balance-metrics", metavar="DIR",
                        help="balance.py's --keep-metrics folder, for the noise (default: the run's own)")
    parser.add_argument("--elastic-json", metavar="PATH", help="elastic.py's JSON (default: run it now)")
    options = parser.parse_args(argv)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="flexpar-sim-validation-") as scratch:
        balance, elastic, metrics_dir = gather_inputs(options, scratch)
        probe = combine_probes([run_probe(world=balance["devices"], elastic_model=elastic["model"])
                                for _ in range(PROBE_RUNS)])
        balance_rounds = balance_step_records(metrics_dir)
        noise = balance_noise(balance, balance_rounds)
        balance_rows, balance_cal, balance_extra = compare_balance(balance, probe, noise)
    elastic_rows, elastic_cal, elastic_extra = compare_elastic(elastic, probe)
    comparisons = balance_rows + elastic_rows
    document = {
        **verdict(comparisons),
        "comparisons": [asdict(row) for row in comparisons],
        "calibration": calibration_rows(balance, elastic, probe, noise, balance_cal, elastic_cal, elastic_extra),
        "calibration_sources": {"balance": dict(balance_cal.sources), "elastic": dict(elastic_cal.sources)},
        "probe": probe,
        "noise_sigma": noise,
        "elastic_inputs": elastic_extra,
        "balance_predicted": balance_extra,
        "inputs": {"balance_json": options.balance_json or "(run now)", "elastic_json": options.elastic_json or "(run now)",
                   "balance_metrics": metrics_dir if options.balance_metrics else "(temporary, removed)", "quick": options.quick,
                   "balance_load_average_1min": balance.get("load_average_1min")},
        "notes": explanations(comparisons, balance, elastic, elastic_extra, balance_extra, probe),
        # The inputs themselves, so that a run can be re-checked with --balance-json / --elastic-json.
        "benchmark_results": {"balance": balance, "elastic": elastic},
        "wall_s": time.perf_counter() - started,
    }
    document["summary"] = {key: document[key] for key in verdict(comparisons)}
    print_report(document)
    write_json(options.json, document)
    return document


if __name__ == "__main__":
    main()
