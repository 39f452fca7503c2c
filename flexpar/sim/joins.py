"""Which way a simulated join takes, and what it costs: flexpar/core/join_choice.py fed with the simulated cluster.

The engine's decision (``flexpar.core.join_choice.choose``, imported, not
copied) gets what the real members would have measured: the step time and
its compute from the closed-form model (the current assignment, noise-free),
the state's bytes, the join link (``[join] link_bytes_per_s``, else the
broadcast bandwidth), whether the joiner shares a member's cores
(``[join] joiner_shares_cores`` with ``[elastic] host_cores``), and the
stream's planned steps as the engine computes them for its choice
(flexpar/worker/join_way.py): each member sends ``stream_share`` x the
predicted compute step x the assumed slice link per step.

What a stream then does is simulated apart (``simulate_stream``, sim/stream_course.py):
the engine re-sizes the slices round by round from the members' step times
(``flexpar.core.stream_plan.resize_round``), so a stream may take more or
fewer steps than its first plan; the members' steps follow the listener's
work on shared cores at ``[join] listener_work`` (default: the engine's
``LISTENER_WORK``) and the slices over the join link.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import numpy as np

from flexpar.core import join_choice, stream_plan
from flexpar.core.join_choice import JoinChoice, JoinInputs, SharedCores

from .model import ModelParameters, device_critical_paths, pg_formation_seconds, ring_all_reduce_seconds
from .stream_course import CourseInputs, StreamCourse, course


def first_sender_bytes(compute_s: float, parameters: ModelParameters) -> int:
    """A sender's first slice per step, as the engine sizes it (flexpar/worker/stream_rules.py's `sender_bytes`)."""
    join = parameters.join
    return stream_plan.first_sender_bytes(join.slice_link_bytes_per_s, compute_s, join.stream_share)


def planned_steps(state_bytes: float, senders: int, compute_s: float, parameters: ModelParameters) -> int:
    """The stream's steps as the engine's choice plans them: `state_bytes` from `senders` at the first slice."""
    return join_choice.planned_stream_steps(state_bytes, senders, first_sender_bytes(compute_s, parameters))


def simulate_stream(
    inputs: JoinInputs, parameters: ModelParameters, noise_sigma: float = 0.0, seed: int = 0
) -> StreamCourse:
    """What a stream of the join `inputs` describes does: its rounds as the engine re-sizes them, the members'
    steps (sim/stream_course.py)."""
    join = parameters.join
    slowdown = join_choice.listener_slowdown(inputs, join.listener_work)
    return course(
        CourseInputs(
            state_bytes=int(round(inputs.state_bytes)),
            senders=inputs.senders,
            first_sender_bytes=first_sender_bytes(inputs.compute_s, parameters),
            step_s=inputs.step_s,
            slowdown=slowdown,
            link_bytes_per_s=inputs.link_bytes_per_s,
            share=join.stream_share,
            baseline_ratio=join.baseline_ratio,
            noise_sigma=noise_sigma,
            seed=seed,
            tensors=tuple(
                stream_plan.Tensor(f"tensor-{index}", elements, size)
                for index, (elements, size) in enumerate(join.tensors)
            ),
        )
    )


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
        stream_steps=planned_steps(state_bytes, len(members), compute_s, parameters),
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
