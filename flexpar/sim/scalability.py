"""Throughput versus device count (8 to 1024 by default) for each policy.

Each point is the scenario's device mix scaled to ``n`` devices (by the
largest-remainder method, so a 1:1:1 mix of three types stays as even as
``n`` allows), with ``virtual_workers_per_device * n`` VWs: the global batch
grows with the cluster (weak scaling), which is how a data-parallel job is
usually scaled and what keeps every device at least one VW. The scenario's own
events name particular devices and so are not carried over; instead
``failures_per_device_hour`` can add random failures (a Poisson process over
the live devices, the same trace for every policy), each failed device
replaced by a fresh one of the same type ``replacement_s`` later.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from .engine import simulate
from .model import step_seconds, uniform_assignment
from .results import SimulationResult
from .scenario import DeviceSpec, Event, ScalabilitySpec, Scenario

# The failure trace must outlast the slowest policy's run; it is drawn for
# this many times the noise-free uniform-split run time, plus an hour.
_TRACE_HORIZON_FACTOR = 5.0


@dataclass(frozen=True)
class ScalabilityResult:
    """``results[policy][k]`` is the run with ``device_counts[k]`` devices."""

    scenario: str
    device_counts: Tuple[int, ...]
    policies: Tuple[str, ...]
    labels: Dict[str, str]
    results: Dict[str, Tuple[SimulationResult, ...]]

    def samples_per_s(self, policy: str) -> List[float]:
        return [result.samples_per_s for result in self.results[policy]]

    def summary(self) -> dict:
        return {
            "scenario": self.scenario,
            "device_counts": list(self.device_counts),
            "samples_per_s": {policy: self.samples_per_s(policy) for policy in self.policies},
            "runs": {policy: [result.summary() for result in self.results[policy]] for policy in self.policies},
        }


def device_mix(devices: Sequence[DeviceSpec]) -> List[Tuple[str, float, int]]:
    """The distinct device kinds of ``devices``: (kind, seconds per VW, how many), in first-seen order."""
    mix: Dict[Tuple[str, float], int] = {}
    for device in devices:
        key = (device.kind, device.seconds_per_vw)
        mix[key] = mix.get(key, 0) + 1
    return [(kind, seconds, count) for (kind, seconds), count in mix.items()]


def scaled_devices(devices: Sequence[DeviceSpec], count: int) -> Tuple[DeviceSpec, ...]:
    """``count`` devices in the proportions of ``devices`` (largest remainder, ties to the first kind)."""
    if count < 1:
        raise ValueError(f"device count: expected an integer >= 1, got {count}")
    mix = device_mix(devices)
    total = sum(number for _, _, number in mix)
    quotas = [count * number / total for _, _, number in mix]
    shares = [math.floor(quota) for quota in quotas]
    by_remainder = sorted(range(len(mix)), key=lambda index: (-(quotas[index] - shares[index]), index))
    for index in by_remainder[: count - sum(shares)]:
        shares[index] += 1
    scaled: List[DeviceSpec] = []
    for (kind, seconds, _), share in zip(mix, shares):
        prefix = _id_prefix(kind)
        scaled.extend(DeviceSpec(f"{prefix}-{index}", seconds, kind) for index in range(share))
    # Interleave the kinds so that rank order does not group them (it does not
    # change any figure, but makes per-rank plots readable).
    return tuple(sorted(scaled, key=lambda device: int(device.device_id.rsplit("-", 1)[1])))


def _id_prefix(kind: str) -> str:
    return "".join(character if character.isalnum() else "_" for character in kind.lower()) or "device"


def failure_trace(
    devices: Sequence[DeviceSpec],
    failures_per_device_hour: float,
    replacement_s: float,
    horizon_s: float,
    seed: int,
) -> Tuple[Event, ...]:
    """Random failures of live devices, each followed by a replacement join.

    Failures form a Poisson process of rate ``failures_per_device_hour`` per
    live device; the failed device is drawn uniformly from the live ones; its
    replacement (same seconds per VW, a new id) joins ``replacement_s`` later.
    The trace depends only on its arguments, so every policy sees the same one.
    """
    if failures_per_device_hour <= 0:
        return ()
    rng = np.random.default_rng(seed)
    live: List[DeviceSpec] = list(devices)
    arrivals: List[Tuple[float, DeviceSpec]] = []
    events: List[Event] = []
    clock = 0.0
    replacements = 0
    while True:
        rate = failures_per_device_hour * len(live) / 3600.0
        next_failure = clock + rng.exponential(1.0 / rate) if rate > 0 else math.inf
        next_arrival = min((time for time, _ in arrivals), default=math.inf)
        clock = min(next_failure, next_arrival)
        if clock > horizon_s:
            return tuple(events)
        if next_arrival <= next_failure:
            arrival = min(arrivals, key=lambda item: item[0])
            arrivals.remove(arrival)
            live.append(arrival[1])
            continue
        victim = live.pop(int(rng.integers(len(live))))
        events.append(Event("failure", (victim.device_id,), at_s=clock))
        replacement = DeviceSpec(f"{_id_prefix(victim.kind)}-r{replacements}", victim.seconds_per_vw, victim.kind)
        replacements += 1
        events.append(Event("join", (replacement.device_id,), at_s=clock + replacement_s, devices=(replacement,)))
        arrivals.append((clock + replacement_s, replacement))


def scaled_scenario(scenario: Scenario, count: int, spec: Optional[ScalabilitySpec] = None) -> Scenario:
    """The scenario's device mix at ``count`` devices, as one scalability point."""
    spec = spec or scenario.scalability
    devices = scaled_devices(scenario.devices, count)
    virtual_workers = spec.virtual_workers_per_device * count
    base = replace(
        scenario,
        name=f"{scenario.name}@{count}",
        steps=spec.steps,
        virtual_workers=virtual_workers,
        devices=devices,
        events=(),
        noise=spec.noise,
        seed=spec.seed,
    )
    if spec.failures_per_device_hour <= 0:
        return base
    uniform_seconds = step_seconds(
        uniform_assignment(count, virtual_workers), [device.seconds_per_vw for device in devices], base.parameters
    )
    horizon = _TRACE_HORIZON_FACTOR * spec.steps * uniform_seconds + 3600.0
    events = failure_trace(devices, spec.failures_per_device_hour, spec.replacement_s, horizon, spec.seed)
    return replace(base, events=events)


def scalability(
    scenario: Scenario,
    device_counts: Optional[Sequence[int]] = None,
    policies: Optional[Sequence[str]] = None,
    spec: Optional[ScalabilitySpec] = None,
) -> ScalabilityResult:
    """Simulate every policy at every device count (defaults from ``scenario.scalability``)."""
    spec = spec or scenario.scalability
    counts = tuple(device_counts) if device_counts is not None else spec.device_counts
    names = tuple(policies) if policies is not None else scenario.policies
    results: Dict[str, List[SimulationResult]] = {name: [] for name in names}
    labels: Dict[str, str] = {}
    for count in counts:
        point = scaled_scenario(scenario, count, spec)
        for name in names:
            result = simulate(point, name)
            labels[name] = result.label
            results[name].append(result)
    return ScalabilityResult(
        scenario=scenario.name,
        device_counts=counts,
        policies=names,
        labels=labels,
        results={name: tuple(runs) for name, runs in results.items()},
    )
