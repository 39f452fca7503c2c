"""The cost model of one training step and of elastic changes (pure, closed form).

Everything the simulator charges for time comes from the functions here, so
that a reader can check every figure by hand and so that calibration
(``calibration.py``) has one place to fit; the parameters they read (one
dataclass per group, checked on construction) are ``parameters.py``. The model follows the real step loop
of DESIGN.md section 3:

1. each device runs its assigned virtual workers (VWs) one after another:
   ``busy_i = count_i * seconds_per_vw_i``;
2. one bucketed ring all-reduce of the gradient bytes, alpha-beta model::

       all_reduce = buckets * 2 (n - 1) alpha + 2 (n - 1) / n * bytes / bandwidth

   of which a fraction (``overlap_fraction``) can run while the device's last
   VW is still in its backward pass, hidden up to that backward's length;
3. one optimizer step (a fixed cost per step).

``step = max_i(busy_i + all_reduce - hidden_i) + optimizer``: the all-reduce is
a collective, so the step ends when the last device's share of it ends.

Elastic costs: a process group formed in running processes costs
``pg_formation_s + pg_formation_per_device_s * n`` (a rendezvous on one store
grows with the members), stretched by ``host_contention`` when more busy
processes than cores share a host (CPU workers; a GPU worker has its own
device and needs no such term); a state broadcast costs
``ceil(log2 n) * alpha + bytes / broadcast_bandwidth`` (a pipelined tree: the
latency grows with the depth, the bytes cross each link once).
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import numpy as np

# The parameters (parameters.py), importable from here as before.
from .parameters import (  # noqa: F401
    JOIN_MODES,
    ElasticCosts,
    JoinModel,
    ModelParameters,
    NetworkModel,
    RestartCosts,
    WorkloadModel,
)

# --------------------------------------------------------------------------
# closed-form costs
# --------------------------------------------------------------------------


def ring_all_reduce_seconds(devices: int, payload_bytes: float, network: NetworkModel) -> float:
    """Alpha-beta time of a bucketed ring all-reduce over ``devices`` members.

    Zero for one device (nothing to exchange). Each of the
    ``ceil(bytes / bucket_bytes)`` buckets pays ``2 (n - 1)`` latencies; the
    bytes pay the ring's ``2 (n - 1) / n`` factor once in total.
    """
    if devices <= 1 or payload_bytes <= 0:
        return 0.0
    buckets = max(1, math.ceil(payload_bytes / network.bucket_bytes))
    latency = buckets * 2 * (devices - 1) * network.alpha_s
    transfer = 2 * (devices - 1) / devices * payload_bytes / network.bandwidth_bytes_per_s
    return latency + transfer


def broadcast_seconds(devices: int, payload_bytes: float, network: NetworkModel) -> float:
    """Time to broadcast ``payload_bytes`` from one member to the other ``devices - 1``."""
    if devices <= 1 or payload_bytes <= 0:
        return 0.0
    depth = math.ceil(math.log2(devices))
    return depth * network.alpha_s + payload_bytes / network.broadcast_bandwidth_bytes_per_s


def host_contention(busy_processes: int, host_cores: Optional[float]) -> float:
    """How many times longer CPU work takes when ``busy_processes`` share ``host_cores`` cores.

    Processor sharing of single-threaded processes: each gets
    ``min(1, cores / processes)`` of a core. 1 when cores are not shared (None).
    """
    if host_cores is None or busy_processes <= host_cores:
        return 1.0
    return busy_processes / host_cores


def pg_formation_seconds(devices: int, elastic: ElasticCosts) -> float:
    """Forming a fresh process group of ``devices`` members in running processes.

    The members are the host's busy processes: a planned leaver skips its last
    update and exits at the lowest priority (`flexpar.worker`).
    """
    base = elastic.pg_formation_s + elastic.pg_formation_per_device_s * devices
    return base * host_contention(devices, elastic.host_cores)


def failure_noticed_seconds(lost_compute_s: float, death_at_s: float, elastic: ElasticCosts) -> float:
    """When, from the start of the step, flexpar's survivors learn of a peer's death.

    In the step's all-reduce, after ``lost_compute_s`` of their own compute, or
    ``detection_s`` after the death (at ``death_at_s``) if that is later.
    """
    return max(lost_compute_s, death_at_s + elastic.detection_s)


def failure_stall_seconds(
    survivors: int, elastic: ElasticCosts, lost_compute_s: float = 0.0, death_at_s: float = 0.0
) -> float:
    """From the last commit before a failure until the survivors stand in a new group.

    ``failure_noticed_seconds``, then the recovery notice and a new group of
    ``survivors``. With the defaults: a peer that dies while the others
    already wait in the collective.
    """
    noticed = failure_noticed_seconds(lost_compute_s, death_at_s, elastic)
    return noticed + elastic.recovery_notice_s + pg_formation_seconds(survivors, elastic)


def failed_step_lost_seconds(
    survivor_busy_s: float, devices_before: int, elastic: ElasticCosts, death_fraction: float
) -> float:
    """Compute the survivors do in a step whose peer dies, before they can learn of it.

    flexpar's survivors notice a failure in the step's all-reduce, after their
    own VWs, so those are lost. ``survivor_busy_s``: the slowest survivor's
    busy time per step while all ``devices_before`` ran. The peer dies
    ``death_fraction`` of the way into it; from then on the host has one busy
    process fewer, so on shared cores the rest runs faster.
    """
    before = host_contention(devices_before, elastic.host_cores)
    after = host_contention(devices_before - 1, elastic.host_cores)
    return survivor_busy_s * (death_fraction + (1.0 - death_fraction) * after / before)


def planned_restart_seconds(devices: int, parameters: ModelParameters) -> float:
    """Stall of a planned checkpoint-restart (join or leave) into ``devices`` members."""
    restart = parameters.restart
    return (
        restart.relaunch_s()
        + restart.checkpoint_save_s
        + restart.checkpoint_load_s
        + pg_formation_seconds(devices, parameters.elastic)
    )


def failure_restart_seconds(devices: int, parameters: ModelParameters) -> float:
    """Restart after a failure (no final save; detection and lost work come on top)."""
    restart = parameters.restart
    return restart.relaunch_s() + restart.checkpoint_load_s + pg_formation_seconds(devices, parameters.elastic)


def join_stall_seconds(devices_after: int, parameters: ModelParameters) -> float:
    """Stall of flexpar's in-place scale-out: a new group, then the state broadcast."""
    return pg_formation_seconds(devices_after, parameters.elastic) + broadcast_seconds(
        devices_after, parameters.workload.state_bytes, parameters.network
    )


def hidden_communication_seconds(all_reduce_s: float, last_vw_seconds: np.ndarray, network: NetworkModel) -> np.ndarray:
    """Per device: how much of the all-reduce hides behind its last VW's backward."""
    return np.minimum(network.overlap_fraction * all_reduce_s, network.backward_fraction * last_vw_seconds)


def device_critical_paths(
    assignment: Sequence[int],
    busy_seconds: np.ndarray,
    devices_all_reduce_s: float,
    parameters: ModelParameters,
) -> np.ndarray:
    """Per device: compute + exposed communication + optimizer, in seconds.

    ``busy_seconds`` is each device's compute for its ``assignment`` VWs; its
    last VW is taken to last ``busy / count`` (VWs of one device cost the same).
    """
    counts = np.asarray(assignment, dtype=float)
    last_vw = busy_seconds / counts
    hidden = hidden_communication_seconds(devices_all_reduce_s, last_vw, parameters.network)
    return busy_seconds + devices_all_reduce_s - hidden + parameters.workload.optimizer_s


def step_seconds(assignment: Sequence[int], seconds_per_vw: Sequence[float], parameters: ModelParameters) -> float:
    """Closed-form, noise-free time of one step: the slowest device's critical path."""
    counts = np.asarray(assignment, dtype=float)
    busy = counts * np.asarray(seconds_per_vw, dtype=float)
    all_reduce = ring_all_reduce_seconds(len(counts), parameters.workload.gradient_bytes, parameters.network)
    return float(np.max(device_critical_paths(assignment, busy, all_reduce, parameters)))


def uniform_assignment(devices: int, virtual_workers: int) -> tuple:
    """DDP-style equal split: ``V // n`` each, the remainder one each to the first ranks."""
    if devices < 1:
        raise ValueError(f"uniform split needs at least one device, got {devices}")
    if virtual_workers < devices:
        raise ValueError(
            f"virtual_workers={virtual_workers} is fewer than the {devices} devices; every device needs one"
        )
    base, remainder = divmod(virtual_workers, devices)
    return tuple(base + 1 if rank < remainder else base for rank in range(devices))
