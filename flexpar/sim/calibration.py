"""Calibration: measured figures in, cost-model parameters out; and the predictions to check.

``calibrate(measured)`` takes a flat dict of whatever was measured (typically
merged from the JSON of ``benchmarks/balance.py`` and
``benchmarks/elastic.py``, plus per-device seconds per VW) and returns the
model parameters, with a note of where each came from. Every key is optional;
a parameter with no measurement keeps its default (or the ``base`` given).

Accepted keys (seconds unless said otherwise):

=============================  ==============================================
key                            gives
=============================  ==============================================
seconds_per_vw                 device table: ``{device_id: s}``, a list (ids
                               ``device-0``...), or one number for ``devices``
devices                        device count (for the per-collective fits)
virtual_workers                V (for step-time predictions)
gradient_bytes / parameter_count   bytes all-reduced per step (float32: 4 B
                               per parameter)
state_bytes                    bytes a joiner receives (default: 3 x gradient
                               bytes, i.e. parameters + two Adam moments)
alpha_s                        per-hop latency
all_reduce_bandwidth_bytes_per_s   directly, or from ``all_reduce_s`` (one
                               all-reduce of gradient_bytes over ``devices``)
overlap_fraction, backward_fraction, bucket_bytes   directly
optimizer_s                    directly, or fitted from ``step_time_s`` as
                               the residual over compute + all-reduce (only
                               when not given: a step time you want to
                               predict must not also be the calibration)
pg_formation_s                 directly, or from ``scale_in_stall_s`` (an
                               in-place leave costs one group formation of
                               the survivors; the leaver skips its last
                               update and exits at the lowest priority)
broadcast_bandwidth_bytes_per_s    directly, or from ``broadcast_s`` (of
                               ``broadcast_bytes``, default state_bytes), or
                               from ``scale_out_stall_s`` - pg formation
detection_s                    directly, or ``failure_resume_s`` - pg
                               formation - recovery notice (resume measured
                               from the kill to the survivors' next step start)
warmup_s, pg_formation_per_device_s, recovery_notice_s, host_cores   directly
process_start_s, import_s, rebuild_s, checkpoint_save_s,
checkpoint_load_s, checkpoint_every_steps   restart costs, directly
=============================  ==============================================
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import Any, Dict, Mapping, Optional, Tuple

from flexpar.core import balance

from .engine import simulate
from .model import (
    ElasticCosts,
    ModelParameters,
    NetworkModel,
    RestartCosts,
    WorkloadModel,
    broadcast_seconds,
    failure_stall_seconds,
    host_contention,
    join_stall_seconds,
    pg_formation_seconds,
    step_seconds,
)
from .scenario import DeviceSpec, Scenario

# Adam keeps two moments per parameter: parameters + 2 moments = 3x the gradient.
DEFAULT_STATE_TO_GRADIENT_RATIO = 3.0
BYTES_PER_FLOAT32 = 4


@dataclass(frozen=True)
class Calibration:
    """Fitted parameters, the device table, and where each figure came from.

    ``sources`` maps a parameter name (``network.bandwidth_bytes_per_s``, ...)
    to the measured key it was derived from, or ``"default"``.
    """

    parameters: ModelParameters
    seconds_per_vw: Mapping[str, float]
    virtual_workers: Optional[int]
    sources: Mapping[str, str]


def _number(measured: Mapping[str, Any], key: str) -> Optional[float]:
    """``measured[key]`` as a finite float, None when absent; ValueError naming the key otherwise."""
    if key not in measured or measured[key] is None:
        return None
    value = measured[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"measured[{key!r}]: expected a finite number, got {value!r}")
    return float(value)


def _positive(measured: Mapping[str, Any], key: str) -> Optional[float]:
    value = _number(measured, key)
    if value is not None and value <= 0:
        raise ValueError(f"measured[{key!r}]: expected a positive number, got {value!r}")
    return value


def _device_table(measured: Mapping[str, Any]) -> Dict[str, float]:
    table = measured.get("seconds_per_vw")
    if table is None:
        return {}
    if isinstance(table, Mapping):
        items = list(table.items())
    elif isinstance(table, (list, tuple)):
        items = [(f"device-{index}", value) for index, value in enumerate(table)]
    else:
        count = measured.get("devices")
        if not isinstance(count, int) or count < 1:
            raise ValueError("measured['seconds_per_vw'] is one number, so measured['devices'] must give the count")
        items = [(f"device-{index}", table) for index in range(count)]
    result: Dict[str, float] = {}
    for device_id, value in items:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise ValueError(f"measured['seconds_per_vw'][{device_id!r}]: expected a positive number, got {value!r}")
        result[str(device_id)] = float(value)
    return result


def _overrides(
    measured: Mapping[str, Any], cls: type, section: str, sources: Dict[str, str], integers: Tuple[str, ...] = ()
) -> Dict[str, Any]:
    """Fields of ``cls`` given directly under their own names in ``measured``."""
    values: Dict[str, Any] = {}
    for item in fields(cls):
        if item.name in measured and measured[item.name] is not None:
            if item.name in integers:
                value = measured[item.name]
                if isinstance(value, bool) or not isinstance(value, int):
                    raise ValueError(f"measured[{item.name!r}]: expected an integer, got {value!r}")
                values[item.name] = value
            else:
                values[item.name] = _number(measured, item.name)
            sources[f"{section}.{item.name}"] = item.name
        else:
            sources.setdefault(f"{section}.{item.name}", "default")
    return values


_DEFAULT_PARAMETERS = ModelParameters()  # frozen: one shared default is safe


def calibrate(measured: Mapping[str, Any], base: ModelParameters = _DEFAULT_PARAMETERS) -> Calibration:
    """Model parameters from measured figures (see the module docstring for the keys)."""
    sources: Dict[str, str] = {}
    table = _device_table(measured)
    devices = measured.get("devices", len(table) or None)
    if devices is not None and (isinstance(devices, bool) or not isinstance(devices, int) or devices < 1):
        raise ValueError(f"measured['devices']: expected an integer >= 1, got {devices!r}")
    virtual_workers = measured.get("virtual_workers")
    if virtual_workers is not None and (not isinstance(virtual_workers, int) or virtual_workers < 1):
        raise ValueError(f"measured['virtual_workers']: expected an integer >= 1, got {virtual_workers!r}")

    # Workload: bytes first, everything else depends on them.
    workload = replace(
        base.workload, **_overrides(measured, WorkloadModel, "model", sources, integers=("samples_per_vw",))
    )
    if "gradient_bytes" not in measured and _positive(measured, "parameter_count") is not None:
        workload = replace(workload, gradient_bytes=BYTES_PER_FLOAT32 * _positive(measured, "parameter_count"))
        sources["model.gradient_bytes"] = "parameter_count"
    if "state_bytes" not in measured and sources.get("model.gradient_bytes") != "default":
        workload = replace(workload, state_bytes=DEFAULT_STATE_TO_GRADIENT_RATIO * workload.gradient_bytes)
        sources["model.state_bytes"] = f"{DEFAULT_STATE_TO_GRADIENT_RATIO:g} x gradient_bytes"

    network = replace(base.network, **_overrides(measured, NetworkModel, "network", sources))
    all_reduce_s = _positive(measured, "all_reduce_s")
    if "bandwidth_bytes_per_s" not in measured and _positive(measured, "all_reduce_bandwidth_bytes_per_s"):
        network = replace(network, bandwidth_bytes_per_s=_positive(measured, "all_reduce_bandwidth_bytes_per_s"))
        sources["network.bandwidth_bytes_per_s"] = "all_reduce_bandwidth_bytes_per_s"
    elif sources["network.bandwidth_bytes_per_s"] == "default" and all_reduce_s is not None and devices and devices > 1:
        network = replace(
            network,
            bandwidth_bytes_per_s=_bandwidth_from_all_reduce(all_reduce_s, devices, workload.gradient_bytes, network),
        )
        sources["network.bandwidth_bytes_per_s"] = "all_reduce_s"

    elastic = replace(base.elastic, **_overrides(measured, ElasticCosts, "elastic", sources))
    if sources["elastic.pg_formation_s"] == "default" and _number(measured, "scale_in_stall_s") is not None:
        leave_group = (devices - 1) if devices else 1
        formation = _number(measured, "scale_in_stall_s") / host_contention(leave_group, elastic.host_cores)
        elastic = replace(elastic, pg_formation_s=max(0.0, formation - elastic.pg_formation_per_device_s * leave_group))
        sources["elastic.pg_formation_s"] = "scale_in_stall_s"

    join_group = (devices + 1) if devices else 2
    if "broadcast_bandwidth_bytes_per_s" not in measured:
        broadcast_bytes = _positive(measured, "broadcast_bytes") or workload.state_bytes
        broadcast_s = _positive(measured, "broadcast_s")
        source = "broadcast_s"
        if broadcast_s is None and _number(measured, "scale_out_stall_s") is not None:
            broadcast_s = _number(measured, "scale_out_stall_s") - pg_formation_seconds(join_group, elastic)
            source = "scale_out_stall_s - pg formation"
        if broadcast_s is not None:
            latency = math.ceil(math.log2(max(join_group, 2))) * network.alpha_s
            if broadcast_s - latency <= 0:
                raise ValueError(
                    f"measured broadcast time {broadcast_s:.6f} s (from {source}) leaves nothing for "
                    f"{broadcast_bytes:.3g} bytes after {latency:.6f} s of latency"
                )
            network = replace(network, broadcast_bandwidth_bytes_per_s=broadcast_bytes / (broadcast_s - latency))
            sources["network.broadcast_bandwidth_bytes_per_s"] = source

    if sources["elastic.detection_s"] == "default" and _number(measured, "failure_resume_s") is not None:
        survivors = (devices - 1) if devices else 1
        elastic = replace(
            elastic,
            detection_s=max(
                0.0,
                _number(measured, "failure_resume_s")
                - pg_formation_seconds(survivors, elastic)
                - elastic.recovery_notice_s,
            ),
        )
        sources["elastic.detection_s"] = "failure_resume_s - pg formation - recovery notice"

    restart = replace(
        base.restart, **_overrides(measured, RestartCosts, "restart", sources, integers=("checkpoint_every_steps",))
    )
    parameters = ModelParameters(network=network, workload=workload, elastic=elastic, restart=restart)

    if (
        sources["model.optimizer_s"] == "default"
        and _number(measured, "step_time_s") is not None
        and table
        and virtual_workers
    ):
        parameters = _fit_optimizer(parameters, measured, table, virtual_workers)
        sources["model.optimizer_s"] = "step_time_s residual"
    return Calibration(parameters=parameters, seconds_per_vw=table, virtual_workers=virtual_workers, sources=sources)


def _bandwidth_from_all_reduce(all_reduce_s: float, devices: int, payload_bytes: float, network: NetworkModel) -> float:
    """Invert the alpha-beta formula for the bandwidth, given one measured all-reduce."""
    buckets = max(1, math.ceil(payload_bytes / network.bucket_bytes))
    latency = buckets * 2 * (devices - 1) * network.alpha_s
    if all_reduce_s <= latency:
        raise ValueError(
            f"measured all_reduce_s={all_reduce_s:.6f} is not above the latency term {latency:.6f} s "
            f"({buckets} buckets x 2 x {devices - 1} hops x alpha {network.alpha_s:g} s)"
        )
    return 2 * (devices - 1) / devices * payload_bytes / (all_reduce_s - latency)


def _fit_optimizer(
    parameters: ModelParameters, measured: Mapping[str, Any], table: Mapping[str, float], virtual_workers: int
) -> ModelParameters:
    """optimizer_s = measured step time - predicted compute and exposed all-reduce (>= 0)."""
    seconds = list(table.values())
    assignment = measured.get("assignment") or balance.optimal_assignment(seconds, virtual_workers)
    without_optimizer = step_seconds(
        assignment, seconds, replace(parameters, workload=replace(parameters.workload, optimizer_s=0.0))
    )
    residual = max(0.0, _number(measured, "step_time_s") - without_optimizer)
    return replace(parameters, workload=replace(parameters.workload, optimizer_s=residual))


# --------------------------------------------------------------------------
# predictions of benchmark figures
# --------------------------------------------------------------------------


def predict_step_seconds(
    calibration: Calibration,
    policy: str = "flexpar",
    virtual_workers: Optional[int] = None,
    seconds_per_vw: Optional[Mapping[str, float]] = None,
    steps: int = 50,
) -> float:
    """Steady-state step time of ``policy`` on the calibrated devices (a noise-free simulation).

    Runs the real balancer for ``flexpar``; returns the last step's time, i.e.
    after the balancer has settled.
    """
    table = dict(seconds_per_vw if seconds_per_vw is not None else calibration.seconds_per_vw)
    if not table:
        raise ValueError("predict_step_seconds needs a device table (seconds_per_vw)")
    virtual_workers = virtual_workers or calibration.virtual_workers
    if not virtual_workers:
        raise ValueError("predict_step_seconds needs virtual_workers (give it or calibrate with it)")
    scenario = Scenario(
        name="prediction",
        steps=steps,
        virtual_workers=virtual_workers,
        devices=tuple(DeviceSpec(device_id, seconds) for device_id, seconds in table.items()),
        parameters=calibration.parameters,
        policies=(policy,),
    )
    result = simulate(scenario, policy)
    return float(result.segment_step_s[-1])


def predict_elastic_stalls(calibration: Calibration, devices_before: int) -> Dict[str, float]:
    """The in-place stalls of a job with ``devices_before`` devices, as benchmarks/elastic.py names them.

    scale-out to ``devices_before + 1``; scale-in to ``devices_before - 1``
    (the survivors are the busy processes: the leaver skips its last update
    and exits at the lowest CPU priority, see `flexpar.worker`); failure
    resume of the ``devices_before - 1`` survivors (detection, the recovery
    notice and a new group; the lost step in flight is not part of it: see
    ``failure_stall_seconds``); the state broadcast alone.
    """
    if devices_before < 2:
        raise ValueError(f"devices_before: expected an integer >= 2 (scale-in needs a survivor), got {devices_before}")
    parameters = calibration.parameters
    return {
        "scale_out_stall_s": join_stall_seconds(devices_before + 1, parameters),
        "scale_in_stall_s": pg_formation_seconds(devices_before - 1, parameters.elastic),
        "failure_resume_s": failure_stall_seconds(devices_before - 1, parameters.elastic),
        "broadcast_s": broadcast_seconds(devices_before + 1, parameters.workload.state_bytes, parameters.network),
    }


def relative_error(predicted: float, measured: float) -> float:
    """|predicted - measured| / |measured| (inf when measured is 0 and predicted is not)."""
    if measured == 0:
        return 0.0 if predicted == 0 else math.inf
    return abs(predicted - measured) / abs(measured)
