"""The cost model's parameters: what calibration fits and a scenario file sets (pure data, checked).

Each dataclass checks its own values on construction and raises ValueError
naming the field (``network.alpha_s: ...``), so a scenario file
(``scenario_file.py``) or a calibration (``calibration.py``) with a bad figure
stops before anything is simulated. The closed-form costs that read these
parameters are ``model.py``; DESIGN.md section 3 has the step they model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Optional

from flexpar.core import join_choice


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


JOIN_MODES = join_choice.MODES


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
    streamed joiner's first VW (default: the engine's, 60 s; None: none).
    ``listener_work``: what a listener on shared cores really takes from the
    members, as a share of their step's non-VW part (default: the engine's
    ``LISTENER_WORK``; a host's calibration may set it: the decision itself
    always uses the engine's). ``baseline_ratio``: the members' last step
    before the boundary, which the engine's slice re-sizing takes as its
    baseline, over their undisturbed step (1: the joiner's start-up did not
    slow it). ``step_noise``: the lognormal spread of the members' steps
    that the re-sizing reads (None: the scenario's ``noise``).
    ``tensors``: the streamed state's tensors in model order, each
    ``(elements, bytes_per_element)``, which the engine's plan packs and cuts
    (empty: one tensor of ``workload.state_bytes``).
    """

    mode: str = "auto"
    link_bytes_per_s: Optional[float] = None
    joiner_shares_cores: bool = False
    small_state_bytes: float = 0.0
    stream_share: float = 0.1
    slice_link_bytes_per_s: float = 1e9
    max_first_vw_s: Optional[float] = join_choice.MAX_FIRST_VW_S
    listener_work: float = join_choice.LISTENER_WORK
    baseline_ratio: float = 1.0
    step_noise: Optional[float] = None
    tensors: tuple = ()

    def __post_init__(self) -> None:
        _require(self.mode in JOIN_MODES, f"join.mode: expected one of {list(JOIN_MODES)}, got {self.mode!r}")
        _require(
            isinstance(self.joiner_shares_cores, bool),
            f"join.joiner_shares_cores: expected true or false, got {self.joiner_shares_cores!r}",
        )
        _check_non_negative("join", small_state_bytes=self.small_state_bytes)
        _check_positive(
            "join",
            slice_link_bytes_per_s=self.slice_link_bytes_per_s,
            listener_work=self.listener_work,
            baseline_ratio=self.baseline_ratio,
        )
        _require(
            self.step_noise is None
            or (isinstance(self.step_noise, (int, float)) and math.isfinite(self.step_noise) and self.step_noise >= 0),
            f"join.step_noise: expected a number >= 0, got {self.step_noise!r}",
        )
        _require(
            isinstance(self.tensors, tuple)
            and all(
                isinstance(pair, tuple)
                and len(pair) == 2
                and all(isinstance(value, int) and not isinstance(value, bool) for value in pair)
                and pair[0] >= 0
                and pair[1] >= 1
                for pair in self.tensors
            ),
            f"join.tensors: expected (elements >= 0, bytes_per_element >= 1) integer pairs, got {self.tensors!r}",
        )
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
