"""The cost model of one training step and of elastic changes (pure, closed form).

Everything the simulator charges for time comes from the functions here, so
that a reader can check every figure by hand and so that calibration
(``calibration.py``) has one place to fit. The model follows the real step loop
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
from dataclasses import dataclass, fields
from typing import Optional, Sequence

import numpy as np


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def _check_non_negative(owner: str, **values: float) -> None:
    for name, value in values.items():
        _require(
            isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0,
            f"{owner}.{name}: expected a finite number >= 0, got {value!r}",
        )


def _check_positive(owner: str, **values: float) -> None:
    for name, value in values.items():
        _require(
            isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0,
            f"{owner}.{name}: expected a finite positive number, got {value!r}",
        )


@dataclass(frozen=True)
class NetworkModel:
    """Alpha-beta parameters of the collectives.

    ``alpha_s``: latency of one message hop. ``bandwidth_bytes_per_s``: the
    per-link bandwidth a ring all-reduce sees. ``broadcast_bandwidth_bytes_per_s``:
    the same for the state broadcast to a joiner (kept separate because the
    measured figures differ: a broadcast of a whole state in one call versus
    many bucketed all-reduces). ``bucket_bytes``: gradient bucket size (each
    bucket pays the latency term once). ``overlap_fraction`` in [0, 1]: the part
    of the all-reduce that can run during the last VW's backward pass.
    ``backward_fraction`` in [0, 1]: the share of a VW's compute time that is
    backward (about 2/3 for the usual 1:2 forward:backward cost ratio), which
    bounds how much communication can hide.
    """

    alpha_s: float = 20e-6
    bandwidth_bytes_per_s: float = 10e9
    broadcast_bandwidth_bytes_per_s: float = 10e9
    bucket_bytes: float = 25e6
    overlap_fraction: float = 0.0
    backward_fraction: float = 2.0 / 3.0

    def __post_init__(self) -> None:
        _check_non_negative("network", alpha_s=self.alpha_s)
        _check_positive(
            "network",
            bandwidth_bytes_per_s=self.bandwidth_bytes_per_s,
            broadcast_bandwidth_bytes_per_s=self.broadcast_bandwidth_bytes_per_s,
            bucket_bytes=self.bucket_bytes,
        )
        for name in ("overlap_fraction", "backward_fraction"):
            value = getattr(self, name)
            _require(
                isinstance(value, (int, float)) and not isinstance(value, bool) and 0.0 <= value <= 1.0,
                f"network.{name}: expected a number in [0, 1], got {value!r}",
            )


@dataclass(frozen=True)
class WorkloadModel:
    """What one step moves and costs besides compute.

    ``gradient_bytes``: bytes all-reduced per step (dense gradients).
    ``state_bytes``: full training state a joiner receives (parameters,
    buffers, optimizer state). ``optimizer_s``: the optimizer step, same on
    every device. ``samples_per_vw``: samples in one VW (global batch / V), used
    only to turn steps into samples per second.
    """

    gradient_bytes: float = 100e6
    state_bytes: float = 300e6
    optimizer_s: float = 0.0
    samples_per_vw: int = 32

    def __post_init__(self) -> None:
        _check_non_negative(
            "model", gradient_bytes=self.gradient_bytes, state_bytes=self.state_bytes, optimizer_s=self.optimizer_s
        )
        _require(
            isinstance(self.samples_per_vw, int)
            and not isinstance(self.samples_per_vw, bool)
            and self.samples_per_vw >= 1,
            f"model.samples_per_vw: expected an integer >= 1, got {self.samples_per_vw!r}",
        )


@dataclass(frozen=True)
class ElasticCosts:
    """Costs of flexpar's in-place elasticity (DESIGN.md section 4).

    ``warmup_s``: a joiner's start, model build and warm-up step, off the
    running devices' critical path. ``pg_formation_s`` (+ ``per_device`` times
    the group size): forming a fresh process group in running processes.
    ``detection_s``: from a peer's death to the survivors' error in the
    collective, when they are already waiting in it. ``recovery_notice_s``:
    from the survivors' failure reports to their seeing the rebuilt
    generation (the coordinator's and the devices' polls; a planned change
    needs none, its new generation rides in the step's all-reduce).
    ``host_cores``: the cores that a host's worker processes share, when
    they do (CPU workers); None when each device computes on its own.
    """

    warmup_s: float = 30.0
    pg_formation_s: float = 0.01
    pg_formation_per_device_s: float = 0.0
    detection_s: float = 0.1
    recovery_notice_s: float = 0.0
    host_cores: Optional[float] = None

    def __post_init__(self) -> None:
        _check_non_negative(
            "elastic", **{field.name: getattr(self, field.name) for field in fields(self) if field.name != "host_cores"}
        )
        if self.host_cores is not None:
            _check_positive("elastic", host_cores=self.host_cores)


@dataclass(frozen=True)
class RestartCosts:
    """Costs of checkpoint-restart elasticity (torchrun-like).

    On any membership change every worker process is stopped and started
    again: ``process_start_s`` + ``import_s`` + ``rebuild_s`` (model, optimizer,
    data) + checkpoint save (planned changes only) + ``checkpoint_load_s`` +
    process group formation. The job also saves a checkpoint every
    ``checkpoint_every_steps`` steps (``checkpoint_save_s`` each, blocking),
    because after a failure it resumes from the last one and redoes the steps
    since.
    """

    process_start_s: float = 5.0
    import_s: float = 2.0
    rebuild_s: float = 10.0
    checkpoint_save_s: float = 5.0
    checkpoint_load_s: float = 5.0
    checkpoint_every_steps: int = 500

    def __post_init__(self) -> None:
        _check_non_negative(
            "restart",
            process_start_s=self.process_start_s,
            import_s=self.import_s,
            rebuild_s=self.rebuild_s,
            checkpoint_save_s=self.checkpoint_save_s,
            checkpoint_load_s=self.checkpoint_load_s,
        )
        _require(
            isinstance(self.checkpoint_every_steps, int)
            and not isinstance(self.checkpoint_every_steps, bool)
            and self.checkpoint_every_steps >= 1,
            f"restart.checkpoint_every_steps: expected an integer >= 1, got {self.checkpoint_every_steps!r}",
        )

    def relaunch_s(self) -> float:
        """Process start, import and rebuild: what every restart pays before loading."""
        return self.process_start_s + self.import_s + self.rebuild_s


JOIN_MODES = ("auto", "stream", "blocking")


@dataclass(frozen=True)
class JoinModel:
    """How flexpar's joins come in (flexpar/core/join_choice.py decides; sim/joins.py feeds it).

    ``mode``: ``auto`` (the cheaper way for the members), or ``stream`` /
    ``blocking`` forced. ``link_bytes_per_s``: the link a joiner's state
    crosses (None: the network's broadcast bandwidth). ``joiner_shares_cores``:
    a joiner runs on a member's host and shares its ``elastic.host_cores``
    (CPU workers on one host). ``small_state_bytes``: what crosses the
    boundary either way. ``stream_share`` and ``slice_link_bytes_per_s``: the
    engine's slice sizing (a sender's slice per step is ``stream_share`` x
    the predicted compute step x this assumed link rate; flexpar/worker/streaming.py's
    STREAM_SHARE and its gloo link). ``max_first_vw_s``: the bound on a
    streamed joiner's first VW (None: none).
    """

    mode: str = "auto"
    link_bytes_per_s: Optional[float] = None
    joiner_shares_cores: bool = False
    small_state_bytes: float = 0.0
    stream_share: float = 0.1
    slice_link_bytes_per_s: float = 1e9
    max_first_vw_s: Optional[float] = None

    def __post_init__(self) -> None:
        _require(self.mode in JOIN_MODES, f"join.mode: expected one of {list(JOIN_MODES)}, got {self.mode!r}")
        _require(
            isinstance(self.joiner_shares_cores, bool),
            f"join.joiner_shares_cores: expected true or false, got {self.joiner_shares_cores!r}",
        )
        _check_non_negative("join", small_state_bytes=self.small_state_bytes)
        _check_positive("join", slice_link_bytes_per_s=self.slice_link_bytes_per_s)
        for name in ("link_bytes_per_s", "max_first_vw_s"):
            if getattr(self, name) is not None:
                _check_positive("join", **{name: getattr(self, name)})
        _require(
            isinstance(self.stream_share, (int, float)) and 0 < self.stream_share <= 1,
            f"join.stream_share: expected a number in (0, 1], got {self.stream_share!r}",
        )


@dataclass(frozen=True)
class ModelParameters:
    """All cost-model parameters of a scenario; what calibration returns."""

    network: NetworkModel = NetworkModel()
    workload: WorkloadModel = WorkloadModel()
    elastic: ElasticCosts = ElasticCosts()
    restart: RestartCosts = RestartCosts()
    join: JoinModel = JoinModel()


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
    _require(devices >= 1, f"uniform split needs at least one device, got {devices}")
    _require(
        virtual_workers >= devices,
        f"virtual_workers={virtual_workers} is fewer than the {devices} devices; every device needs one",
    )
    base, remainder = divmod(virtual_workers, devices)
    return tuple(base + 1 if rank < remainder else base for rank in range(devices))
