"""What the validation predicts of join_stream.py: a streamed join's boundary stall, its steps, the members' lost time.

The simulator (flexpar.sim, its join model: sim/joins.py and core/join_choice.py)
runs join_stream.py's job at one state size: two devices whose seconds per VW
are the members' measured compute per step over their 2 VWs, the rest of their
step (all-reduce and AdamW's update) as the optimizer's time, the state that
streamed, a join at the benchmark's step with the way forced to `stream` (the
engine streams every join it may today: the choice is not wired in yet), the
joiner sharing the host's cores. Calibrated apart from the figures predicted:

- the boundary: the probe's group formation (as for elastic.py's rows);
- the join link: elastic.py's transfer path (state bytes / its time);
- the members' step and its VW compute: join_stream.py's steps before the joiner started;
- the listener's work: flexpar.core.join_choice.LISTENER_WORK (calibrated on
  docs/benchmarks.md's join_stream table, an earlier run).

Predicted: the streamed join's boundary stall (the goal's unit: max(measured,
0.25 s)), its listening steps (a count: relative error), the members' lost time
(goal: within 25%). Diagnostic: the joiner's first VW, the members' slowdown,
and the blocking transfer at the same size (join_stream_mb=0).
"""

from __future__ import annotations

from dataclasses import replace

from flexpar.sim import (
    DeviceSpec,
    ElasticCosts,
    Event,
    JoinModel,
    ModelParameters,
    NetworkModel,
    Scenario,
    WorkloadModel,
    simulate,
)

from .comparison import Comparison

VIRTUAL_WORKERS = 4  # join_stream.py's job: 2 VWs on each of 2 members
JOIN_AT = 6
MEMBERS_LOST_GOAL = 0.25


def join_scenario(figures: dict, size: str, calibrated: ModelParameters, mode: str) -> Scenario:
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
        join=JoinModel(mode=mode, joiner_shares_cores=elastic.host_cores is not None),
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
    )


def predict_join(figures: dict, size: str, calibrated: ModelParameters, mode: str) -> dict:
    """The simulated join at `size`: its way, boundary stall, steps, members' lost time and first VW."""
    scenario = join_scenario(figures, size, calibrated, mode)
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
    for size in figures["sizes_gb"]:
        if figures["state_bytes"].get(size) is None or figures["step_before_s"].get(size) is None:
            continue
        stream = predict_join(figures, size, calibrated, "stream")
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
                "the engine's plan (a tenth of the compute step at 1 GB/s a sender) + 1 vs the listening steps",
                floor=0.0,
            ),
            Comparison(
                f"{label}: members' lost time, streamed (members_lost_s)",
                stream["members_lost_s"],
                figures["members_lost_s"]["stream"][size],
                True,
                "boundary + steps x (listener's work on the shared cores + the senders' slices)",
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
            "The steps are the engine's first plan + 1; the engine halves the slices when the members' "
            "steps run more than twice the target share longer (once at most) and doubles them back, so a "
            "stream runs longer than planned where a halving sticks."
        )
    if "boundary stall" in row.figure:
        return (
            "The model's streamed boundary is a group formation of 3 processes (probe) and the small "
            "state; the real one also plans the stream and levels the members (one small all-reduce)."
        )
    text = (
        "The members' lost time is the listener's work (all-reduce and update, "
        "flexpar.core.join_choice.LISTENER_WORK of the step's non-VW part) taken from the members' cores "
        "by processor sharing, over the stream's steps; on a host other processes also load, the "
        "listener's thread takes a smaller share of the cores than the model's 3 processes on 2 cores."
    )
    if figures:
        text += f" Measured slowdown by size: {figures.get('member_slowdown')}."
    return text


def join_calibration_rows(figures: dict | None, calibrated: ModelParameters) -> list:
    """What calibrates the join rows, with the values used."""
    if not figures:
        return []
    from flexpar.core.join_choice import LISTENER_WORK

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
            "parameter": "listener work (share of the non-VW step)",
            "value": LISTENER_WORK,
            "from": "flexpar.core.join_choice, calibrated on docs/benchmarks.md's join_stream table",
        },
    ]
