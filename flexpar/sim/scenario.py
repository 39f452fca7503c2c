"""Scenarios: a cluster, its cost model and its elastic events, validated on construction.

``Scenario`` is everything one simulation needs: the devices (``DeviceSpec``),
the elastic events (``Event``), the cost model, the balancer's settings and the
scalability sweep (``ScalabilitySpec``). Each class checks its own fields and
raises a ``ValueError`` that names the field. Reading one from a TOML file, and
the file's format, is scenario_file.py's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Tuple

from .parameters import ModelParameters
from .policies import POLICY_NAMES, BalanceSettings

EVENT_KINDS: Tuple[str, ...] = ("join", "leave", "failure", "slowdown")
DEFAULT_DEVICE_COUNTS: Tuple[int, ...] = (8, 16, 32, 64, 128, 256, 512, 1024)


# --------------------------------------------------------------------------
# the validated scenario
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class DeviceSpec:
    """One device: its id, its compute seconds per VW, and its type's name (for tables)."""

    device_id: str
    seconds_per_vw: float
    kind: str = "device"

    def __post_init__(self) -> None:
        if not isinstance(self.device_id, str) or not self.device_id:
            raise ValueError(f"device id: expected a non-empty string, got {self.device_id!r}")
        if not (
            isinstance(self.seconds_per_vw, (int, float))
            and math.isfinite(self.seconds_per_vw)
            and self.seconds_per_vw > 0
        ):
            raise ValueError(
                f"device {self.device_id!r}: seconds_per_vw expected a positive number, got {self.seconds_per_vw!r}"
            )


@dataclass(frozen=True)
class Event:
    """One elastic event, at a wall-clock time (``at_s``) or at a step (``at_step``).

    - join: ``devices`` appear (they are new; ids are never reused);
    - leave: planned departure of ``device_ids`` (e.g. a spot notice);
    - failure: ``device_ids`` die without notice;
    - slowdown: the compute time per VW of ``device_ids`` is multiplied by ``factor``.

    Time events take effect at the first step boundary at or after ``at_s``,
    except failures, which interrupt the step in flight. A step event takes
    effect before step ``at_step`` runs; a failure ``at_step`` kills that step
    in its all-reduce (the whole step is lost).
    """

    kind: str
    device_ids: Tuple[str, ...]
    at_s: Optional[float] = None
    at_step: Optional[int] = None
    devices: Tuple[DeviceSpec, ...] = ()
    factor: float = 1.0

    def __post_init__(self) -> None:
        if self.kind not in EVENT_KINDS:
            raise ValueError(f"event kind: expected one of {list(EVENT_KINDS)}, got {self.kind!r}")
        if (self.at_s is None) == (self.at_step is None):
            raise ValueError(f"{self.kind} event: give exactly one of at_s and at_step")
        if not self.device_ids:
            raise ValueError(f"{self.kind} event: expected at least one device id")


@dataclass(frozen=True)
class ScalabilitySpec:
    """The throughput-versus-device-count sweep (``scalability.py``).

    Each point is a cluster of ``n`` devices with the scenario's device mix (in
    proportion), ``virtual_workers_per_device * n`` VWs (the global batch grows
    with the cluster: weak scaling), ``steps`` steps, compute noise ``noise``
    (0 by default: a noise-free run lets the simulator skip identical steps, so
    1024 devices cost about as much as 8), and optionally random failures at
    ``failures_per_device_hour``, each failed device replaced after
    ``replacement_s`` by a fresh one of the same type.
    """

    device_counts: Tuple[int, ...] = DEFAULT_DEVICE_COUNTS
    virtual_workers_per_device: int = 4
    steps: int = 1000
    noise: float = 0.0
    failures_per_device_hour: float = 0.0
    replacement_s: float = 600.0
    seed: int = 0


@dataclass(frozen=True)
class Scenario:
    """Everything one simulation needs. Validated on construction."""

    name: str
    steps: int
    virtual_workers: int
    devices: Tuple[DeviceSpec, ...]
    events: Tuple[Event, ...] = ()
    parameters: ModelParameters = ModelParameters()
    balance: BalanceSettings = BalanceSettings()
    policies: Tuple[str, ...] = POLICY_NAMES
    seed: int = 0
    noise: float = 0.0
    description: str = ""
    scalability: ScalabilitySpec = ScalabilitySpec()
    source: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.steps, int) or self.steps < 1:
            raise ValueError(f"scenario.steps: expected an integer >= 1, got {self.steps!r}")
        if not self.devices:
            raise ValueError("scenario.devices: expected at least one device")
        if not isinstance(self.virtual_workers, int) or self.virtual_workers < len(self.devices):
            raise ValueError(
                f"scenario.virtual_workers: expected an integer >= the {len(self.devices)} initial devices "
                f"(every device needs one VW), got {self.virtual_workers!r}"
            )
        if not (isinstance(self.noise, (int, float)) and 0.0 <= self.noise <= 1.0):
            raise ValueError(f"scenario.noise: expected a number in [0, 1], got {self.noise!r}")
        ids = [device.device_id for device in self.devices]
        repeated = sorted({device_id for device_id in ids if ids.count(device_id) > 1})
        if repeated:
            raise ValueError(f"scenario.devices: device ids must be unique, repeated: {repeated}")
        for name in self.policies:
            if name not in POLICY_NAMES:
                raise ValueError(f"scenario.policies: expected names from {list(POLICY_NAMES)}, got {name!r}")

    @property
    def global_batch(self) -> int:
        return self.virtual_workers * self.parameters.workload.samples_per_vw
