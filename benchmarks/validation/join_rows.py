"""What the validation predicts of join_stream.py: a streamed join's boundary stall, its steps, the members' lost time.

The simulator (flexpar.sim, its join model: sim/joins.py, sim/stream_course.py
and core/join_choice.py) runs join_stream.py's job at each state size: two
devices whose seconds per VW are the members' measured compute per step over
their 2 VWs, the rest of their step (all-reduce and AdamW's update) as the
optimizer's time, the state that streamed, a join at the benchmark's step
with the way forced, the joiner sharing the host's cores. The stream's course
follows the engine's slice re-sizing (`stream_plan.resize_round`) on the
simulated steps. Calibrated apart from the figures predicted:

- the boundary: the probe's group formation (as for elastic.py's rows);
- the join link: elastic.py's transfer path (state bytes / its time);
- the members' step and its VW compute: join_stream.py's steps before the joiner started;
- the listener's work on the shared cores (`listener_work`): for each size,
  the median over join_stream.py's *other* sizes of the work that makes the
  model's members' slowdown equal the one measured there, less the slices'
  share (`core.join_choice.listener_work_for`); the engine's `LISTENER_WORK`
  where no other size was measured. A size's own measurement never
  calibrates its own prediction;
- where join_stream.py recorded them (runs after 2026-12-07): the step the
  engine's re-sizing took as its baseline over the undisturbed step
  (`baseline_ratio`), and the members' step-to-step spread before the join
  (`step_spread`), with which the stream's course is simulated: each
  figure is then the median over `SEEDS` simulated benchmark runs of the
  median of join_stream.py's `rounds` simulated streams, as it measures.

Predicted: the streamed join's boundary stall (the goal's unit: max(measured,
0.25 s)), its listening steps (a count: relative error), the members' lost time
(goal: within 25%). Diagnostic: the joiner's first VW, the members' slowdown,
and the blocking transfer at the same size (join_stream_mb=0).
"""

from __future__ import annotations

from dataclasses import replace
from statistics import median
from typing import Optional

from flexpar.core import join_choice
from flexpar.sim import (
    DeviceSpec,
    ElasticCosts,
    Event,
    JoinModel,
    ModelParameters,
    NetworkModel,
    Scenario,
    WorkloadModel,
    join_inputs,
    simulate,
)

from .comparison import Comparison

VIRTUAL_WORKERS = 4  # join_stream.py's job: 2 VWs on each of 2 members
JOIN_AT = 6
MEMBERS_LOST_GOAL = 0.25
SEEDS = 15  # simulations of a stream whose steps are noisy (the medians are predicted)


def join_scenario(
    figures: dict,
    size: str,
    calibrated: ModelParameters,
    mode: str,
    listener_work: float = join_choice.LISTENER_WORK,
    seed: int = 0,
) -> Scenario:
    """join_stream.py's job at `size` (GB, as its JSON labels it) as a simulator scenario."""
    # The members' step and its VW compute from the steps before the joiner started. Not from the steps just
    # before the boundary (`compute_at_join_s`): the joiner's start-up shares the cores then, and the
    # engine sizes the slices from its balancer's smoothed rate, which followed the undisturbed one (the
    # planned steps of two runs matched it; the slowest busy time of those steps would have planned 4
    # rounds where the engine planned 6).
    other = figures["step_before_s"][size] - figures["compute_before_s"][size]
    compute = figures["compute_before_s"][size]
    members = 2
    elastic: ElasticCosts = replace(calibrated.elastic, warmup_s=0.0)
    parameters = ModelParameters(
        network=NetworkModel(
            alpha_s=0.0,
            bandwidth_bytes_per_s=1e12,
            broadcast_bandwidth_bytes_per_s=calibrated.network.broadcast_bandwidth_bytes_per_s,
        ),
        workload=WorkloadModel(gradient_bytes=0.0, state_bytes=figures["state_bytes"][size], optimizer_s=other),
        elastic=elastic,
        join=JoinModel(
            mode=mode,
            joiner_shares_cores=elastic.host_cores is not None,
            listener_work=listener_work,
            baseline_ratio=(figures.get("baseline_ratio") or {}).get(size) or 1.0,
            step_noise=(figures.get("step_spread") or {}).get(size) or 0.0,
            tensors=streamed_tensors(figures, size),
        ),
    )
    seconds = compute / (VIRTUAL_WORKERS // members)
    devices = tuple(DeviceSpec(f"local-{index}", seconds) for index in range(members))
    joiner = Event("join", ("local-2",), at_step=JOIN_AT, devices=(DeviceSpec("local-2", seconds),))
    return Scenario(
        name=f"join_stream {size} GB",
        steps=JOIN_AT + 400,
        virtual_workers=VIRTUAL_WORKERS,
        devices=devices,
        events=(joiner,),
        parameters=parameters,
        policies=("flexpar",),
        seed=seed,
    )


ADAMW_STEP_BYTES = 4
"""AdamW's per-parameter step count, a float32 0-dim tensor that travels with every piece of its parameter:
the engine's plan counts a parameter's bytes per element as ceil((12 x elements + 4) / elements)
(flexpar/worker/streaming.py's `_begin`), 13 for join_stream's tensors."""


def streamed_tensors(figures: dict, size: str) -> tuple:
    """join_stream.py's model as the engine's plan sees it: each trainable tensor's (elements, bytes per
    element), in model order; () where they do not add up to the bytes the engine said it streamed (the
    simulator then plans one tensor of those bytes)."""
    import join_stream  # benchmarks/ is on the path of sim_validation.py and of its tests

    width = join_stream.width_for(float(size))
    layers = [(width * width, width)] * (join_stream.LAYERS - 1) + [(join_stream.CLASSES * width, join_stream.CLASSES)]
    elements = [count for layer in layers for count in layer]
    tensors = tuple(
        (count, -(-(count * join_stream.BYTES_PER_PARAMETER + ADAMW_STEP_BYTES) // count)) for count in elements
    )
    streamed = figures["state_bytes"].get(size)
    if streamed is None or sum(count * size for count, size in tensors) != int(streamed):
        return ()
    return tensors


def members_inputs(scenario: Scenario):
    """The join's inputs as the simulated members measure them before it (sim/joins.py)."""
    members = [device.device_id for device in scenario.devices]
    seconds = [device.seconds_per_vw for device in scenario.devices]
    counts = [VIRTUAL_WORKERS // len(members)] * len(members)
    return join_inputs(members, counts, seconds, len(members) + 1, scenario.parameters)


def size_listener_work(figures: dict, size: str, calibrated: ModelParameters) -> Optional[float]:
    """The listener work that gives join_stream.py's measured members' slowdown at `size` in the model,
    after the senders' share of the slices (the state over the measured steps, over the join link)."""
    slowdown = (figures.get("member_slowdown") or {}).get(size)
    steps = (figures.get("stream_steps") or {}).get(size)
    if not slowdown or not steps or figures["step_before_s"].get(size) is None:
        return None
    inputs = members_inputs(join_scenario(figures, size, calibrated, "stream"))
    slices = inputs.state_bytes / (inputs.senders * steps) / inputs.link_bytes_per_s / inputs.step_s
    return join_choice.listener_work_for(inputs, slowdown - slices)


def listener_work_calibration(figures: dict, calibrated: ModelParameters) -> dict:
    """By size: the listener work its prediction uses (the median of the other sizes' measured works, else
    the engine's LISTENER_WORK) and the sizes that gave it."""
    measured = {size: size_listener_work(figures, size, calibrated) for size in figures["sizes_gb"]}
    calibration = {}
    for size in figures["sizes_gb"]:
        others = {other: work for other, work in measured.items() if other != size and work is not None}
        work = median(others.values()) if others else join_choice.LISTENER_WORK
        calibration[size] = {"listener_work": work, "from_sizes": sorted(others), "measured_here": measured[size]}
    return calibration


def predict_join(
    figures: dict, size: str, calibrated: ModelParameters, mode: str, listener_work: float = join_choice.LISTENER_WORK
) -> dict:
    """The simulated join at `size`: its way, boundary stall, steps, members' lost time and first VW.

    Where the steps are noisy, a stream's length is not one figure (a halving that sticks doubles the
    rest of it), and join_stream.py reports the median of its `rounds` runs: so is each prediction here,
    the median over `SEEDS` simulated benchmark runs of the median of `rounds` simulated streams each.
    """
    noisy = bool((figures.get("step_spread") or {}).get(size))
    rounds = int(figures.get("rounds") or 1) if noisy else 1
    runs = [
        _simulated_join(figures, size, calibrated, mode, listener_work, seed)
        for seed in range(SEEDS * rounds if noisy else 1)
    ]
    groups = [runs[start : start + rounds] for start in range(0, len(runs), rounds)]
    predicted = {
        key: median(median(run[key] for run in group) for group in groups)
        for key in ("stream_steps", "members_lost_s", "first_vw_s")
    }
    predicted.update({key: runs[0][key] for key in ("way", "boundary_stall_s", "reason")})
    slowdowns = [run["member_slowdown"] for run in runs if run["member_slowdown"] is not None]
    predicted["member_slowdown"] = median(slowdowns) if slowdowns else None
    predicted["listener_work"] = listener_work
    return predicted


def _simulated_join(
    figures: dict, size: str, calibrated: ModelParameters, mode: str, listener_work: float, seed: int
) -> dict:
    scenario = join_scenario(figures, size, calibrated, mode, listener_work, seed)
    result = simulate(scenario, "flexpar")
    (join,) = [event for event in result.events if event.kind == "join"]
    final = result.joins()[0]
    steps = final.stream_steps
    slowdown = None
    if steps:
        step = scenario.devices[0].seconds_per_vw * 2 + scenario.parameters.workload.optimizer_s
        slowdown = 1.0 + (final.members_lost_s - join.stall_s) / steps / step
    return {
        "way": join.way,
        "boundary_stall_s": join.stall_s,
        "stream_steps": steps,
        "members_lost_s": final.members_lost_s,
        "first_vw_s": final.first_vw_s,
        "member_slowdown": slowdown,
        "reason": join.detail,
    }


def compare_joins(figures: dict | None, calibrated: ModelParameters) -> tuple:
    """Counted and diagnostic rows for join_stream.py's sizes, and the predictions by size."""
    if not figures:
        return [], {}
    rows, predicted = [], {}
    works = listener_work_calibration(figures, calibrated)
    for size in figures["sizes_gb"]:
        if figures["state_bytes"].get(size) is None or figures["step_before_s"].get(size) is None:
            continue
        stream = predict_join(figures, size, calibrated, "stream", works[size]["listener_work"])
        blocking = predict_join(figures, size, calibrated, "blocking")
        predicted[size] = {"stream": stream, "blocking": blocking}
        label = f"join_stream {size} GB"
        rows += [
            Comparison(
                f"{label}: streamed join's boundary stall (boundary_stall_s)",
                stream["boundary_stall_s"],
                figures["boundary_stall_s"][size],
                True,
                "group formation of 3 (probe) + the small state vs the join event's stall_s",
            ),
            Comparison(
                f"{label}: stream steps (stream_steps)",
                stream["stream_steps"],
                figures["stream_steps"][size],
                True,
                "the engine's plan (a tenth of the compute step at 1 GB/s a sender), re-sized round by round by "
                "the engine's rule on the simulated steps, vs the listening steps",
                floor=0.0,
            ),
            Comparison(
                f"{label}: members' lost time, streamed (members_lost_s)",
                stream["members_lost_s"],
                figures["members_lost_s"]["stream"][size],
                True,
                "boundary + each listening step's excess (listener's work on the shared cores, calibrated on the "
                "other sizes, + the senders' slices)",
                floor=0.0,
                goal=MEMBERS_LOST_GOAL,
            ),
            Comparison(
                f"{label}: joiner's first VW, streamed [diagnostic]",
                stream["first_vw_s"],
                figures["time_to_contribute_s"]["stream"][size],
                False,
                "boundary + the stream's steps at the members' slower step",
            ),
            Comparison(
                f"{label}: members' slowdown while streaming [diagnostic]",
                stream["member_slowdown"],
                figures["member_slowdown"][size],
                False,
                "1 + (listener's work share + slices) per step",
                floor=0.0,
            ),
            Comparison(
                f"{label}: blocking transfer's stall (join_stream_mb=0) [diagnostic]",
                blocking["boundary_stall_s"],
                figures["blocking_stall_s"][size],
                False,
                "group formation + the state over the join link (elastic.py's transfer path)",
            ),
        ]
    return rows, predicted


def why_join(row: Comparison, figures: dict | None) -> str:
    """What a join row's model is made of, and what the measurement holds."""
    if "stream steps" in row.figure:
        return (
            "The steps follow the engine's slice re-sizing (stream_plan.resize_round) on the simulated steps: "
            "on a shared host the listener's work passes twice the target share, the slices are halved at "
            "round 2 and, as halving does not help, doubled back at round 4 (one round more). A halving that "
            "sticks, or a baseline the joiner's start-up slowed, needs the step noise and the baseline that "
            "join_stream.py records from 2026-12-07 on (step_spread, baseline_ratio)."
        )
    if "boundary stall" in row.figure:
        return (
            "The model's streamed boundary is a group formation of 3 processes (probe) and the small "
            "state; the real one also plans the stream and levels the members (one small all-reduce)."
        )
    text = (
        "The members' lost time is the listener's work (all-reduce and update: listener_work of the step's "
        "non-VW part, calibrated on the other sizes' measured slowdowns) taken from the members' cores "
        "by processor sharing, plus the senders' slices, over the stream's steps."
    )
    if figures:
        text += f" Measured slowdown by size: {figures.get('member_slowdown')}."
    return text


def join_calibration_rows(figures: dict | None, calibrated: ModelParameters) -> list:
    """What calibrates the join rows, with the values used."""
    if not figures:
        return []
    return [
        {
            "parameter": "join link B/s",
            "value": calibrated.network.broadcast_bandwidth_bytes_per_s,
            "from": "elastic.py's transfer path (as the broadcast bandwidth)",
        },
        {
            "parameter": "join_stream members' step, compute before / at the join",
            "value": {
                size: [figures["step_before_s"].get(size), figures["compute_before_s"].get(size)]
                + [(figures.get("compute_at_join_s") or {}).get(size)]
                for size in figures["sizes_gb"]
            },
            "from": "join_stream.py's steps before the joiner started / the 5 before the boundary",
        },
        {
            "parameter": "listener work (share of the non-VW step), by size",
            "value": listener_work_calibration(figures, calibrated),
            "from": "the median over join_stream.py's other sizes of the work that gives their measured "
            "members' slowdown less the slices' share (core.join_choice.listener_work_for); the engine's "
            f"LISTENER_WORK ({join_choice.LISTENER_WORK}) where no other size was measured",
        },
        {
            "parameter": "re-sizing baseline ratio / step spread, by size",
            "value": [figures.get("baseline_ratio"), figures.get("step_spread")],
            "from": "join_stream.py: the members' last step before the boundary over their step before the "
            "joiner started; the spread of log step times before it (None: not recorded, taken as 1 / 0)",
        },
    ]
