"""Which way a simulated join takes, and what it costs: flexpar/core/join_choice.py fed with the simulated cluster.

The engine's decision (``flexpar.core.join_choice.choose``, imported, not
copied) gets what the real members would have measured: the step time and
its compute from the closed-form model (the current assignment, noise-free),
the state's bytes, the join link (``[join] link_bytes_per_s``, else the
broadcast bandwidth), whether the joiner shares a member's cores
(``[join] joiner_shares_cores`` with ``[elastic] host_cores``), and the
stream's steps as flexpar/core/stream_plan.py would plan them: each member
sends ``stream_share`` x the predicted compute step x the assumed slice link
per step, and the joiner listens for the plan's rounds and one step more
(benchmarks/join_stream.py's planned -> listened steps: 18 -> 19, 7 -> 8,
9 -> 8, 6 -> 5 and 6, 6 and 7 -> 7; the engine's resizing of the slices moves
a stream by a step or two either way, and is not modelled).
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import numpy as np

from flexpar.core import join_choice, stream_plan
from flexpar.core.join_choice import JoinChoice, JoinInputs, SharedCores

from .model import ModelParameters, device_critical_paths, pg_formation_seconds, ring_all_reduce_seconds

LISTENING_STEPS_AFTER_PLAN = 1
"""A listener takes VWs from the step after the one whose round completes the stream."""


def listening_steps(state_bytes: float, senders: int, compute_s: float, parameters: ModelParameters) -> int:
    """The steps a joiner listens: the engine's plan of `state_bytes` from `senders`, plus one."""
    join = parameters.join
    if compute_s > 0:
        per_sender = stream_plan.sender_bytes(join.slice_link_bytes_per_s, compute_s, join.stream_share)
    else:
        per_sender = 64 << 20  # flexpar/worker/streaming.py's DEFAULT_SENDER_BYTES: no step measured yet
    return join_choice.planned_stream_steps(state_bytes, senders, per_sender) + LISTENING_STEPS_AFTER_PLAN


def join_inputs(
    members: Sequence[str],
    counts: Sequence[int],
    seconds_per_vw: Sequence[float],
    devices_after: int,
    parameters: ModelParameters,
) -> JoinInputs:
    """What the members measure before a join: their step and its compute, noise-free, and the join's figures."""
    busy = np.asarray(counts, dtype=float) * np.asarray(seconds_per_vw, dtype=float)
    all_reduce = ring_all_reduce_seconds(len(members), parameters.workload.gradient_bytes, parameters.network)
    step_s = float(np.max(device_critical_paths(counts, busy, all_reduce, parameters)))
    compute_s = min(step_s, float(np.max(busy)))
    join, network, elastic = parameters.join, parameters.network, parameters.elastic
    link = join.link_bytes_per_s if join.link_bytes_per_s is not None else network.broadcast_bandwidth_bytes_per_s
    shared: Optional[SharedCores] = None
    if join.joiner_shares_cores and elastic.host_cores is not None:
        shared = SharedCores(members[0], elastic.host_cores, len(members))
    # The boundary: a new group of everyone (the tree broadcast's latency on top, as the blocking transfer pays it).
    boundary_s = pg_formation_seconds(devices_after, elastic) + math.ceil(math.log2(max(2, devices_after))) * (
        network.alpha_s
    )
    state_bytes = parameters.workload.state_bytes
    return JoinInputs(
        step_s=step_s,
        compute_s=compute_s,
        state_bytes=state_bytes,
        link_bytes_per_s=link,
        boundary_s=boundary_s,
        stream_steps=listening_steps(state_bytes, len(members), compute_s, parameters),
        senders=len(members),
        small_state_bytes=join.small_state_bytes,
        shared=shared,
    )


def choose_join(
    members: Sequence[str],
    counts: Sequence[int],
    seconds_per_vw: Sequence[float],
    devices_after: int,
    parameters: ModelParameters,
) -> JoinChoice:
    """The way a join of ``devices_after - len(members)`` devices takes, as flexpar's decision would choose."""
    inputs = join_inputs(members, counts, seconds_per_vw, devices_after, parameters)
    return join_choice.choose(inputs, parameters.join.mode, parameters.join.max_first_vw_s)
