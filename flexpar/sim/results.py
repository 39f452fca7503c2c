"""What a simulated run produces: its events and its result (the figures tables, plots and JSON read)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Tuple

import numpy as np


@dataclass(frozen=True)
class SimulationEvent:
    """What happened at one point of a simulated run (for tables, plots, JSON).

    ``kind``: start, join, stream (a streamed join's joiner takes VWs),
    leave, failure, slowdown, refused (a join past V devices), cancelled (a
    joiner left during its warm-up or its stream), ignored (an event naming a
    device that is not there), checkpoint, rollback, idle, lost (the job
    cannot go on). ``stall_s``: the stall this event caused.

    A join (flexpar's in-place policies) also says which way it took
    (``way``: ``stream`` or ``blocking``), the members' training time lost to
    it (``members_lost_s``: the boundary stall plus, while the state streams,
    each step's time beyond the step before; on the join as predicted, on its
    ``stream`` event as simulated) and ``first_vw_s`` (from the boundary's
    start to the joiner's first step with VWs). ``detail`` holds the
    decision's reason.
    """

    time_s: float
    step: int
    kind: str
    device_ids: Tuple[str, ...] = ()
    stall_s: float = 0.0
    devices_after: int = 0
    detail: str = ""
    way: str = ""
    members_lost_s: float = 0.0
    first_vw_s: float = 0.0
    stream_steps: int = 0

    def to_dict(self) -> dict:
        data = {
            "time_s": self.time_s,
            "step": self.step,
            "kind": self.kind,
            "device_ids": list(self.device_ids),
            "stall_s": self.stall_s,
            "devices_after": self.devices_after,
            "detail": self.detail,
        }
        if self.way:
            data.update(
                way=self.way,
                members_lost_s=self.members_lost_s,
                first_vw_s=self.first_vw_s,
                stream_steps=self.stream_steps,
            )
        return data


@dataclass(frozen=True)
class SimulationResult:
    """One policy's run of one scenario.

    Per committed segment (one step, or a run of identical skipped steps):
    ``segment_end_s`` (clock after it), ``segment_committed`` (committed steps
    after it; drops at a rollback), ``segment_steps``, ``segment_step_s``
    (seconds per step), ``segment_imbalance`` and ``segment_devices``.
    """

    scenario: str
    policy: str
    label: str
    target_steps: int
    completed_steps: int
    total_time_s: float
    global_batch: int
    stall_s: float
    lost_work_s: float
    checkpoint_s: float
    events: Tuple[SimulationEvent, ...]
    segment_end_s: np.ndarray
    segment_committed: np.ndarray
    segment_steps: np.ndarray
    segment_step_s: np.ndarray
    segment_imbalance: np.ndarray
    segment_devices: np.ndarray

    @property
    def completed(self) -> bool:
        return self.completed_steps >= self.target_steps

    @property
    def samples_per_s(self) -> float:
        """Committed samples over the whole run's wall time (stalls included)."""
        if self.total_time_s <= 0:
            return 0.0
        return self.completed_steps * self.global_batch / self.total_time_s

    @property
    def imbalance_median(self) -> float:
        return weighted_median(self.segment_imbalance, self.segment_steps)

    @property
    def step_time_median_s(self) -> float:
        return weighted_median(self.segment_step_s, self.segment_steps)

    @property
    def kept_step_seconds(self) -> float:
        """Time of the executed steps that were not later lost to a rollback."""
        return float(np.dot(self.segment_steps, self.segment_step_s)) - self.lost_work_s

    def count(self, kind: str) -> int:
        """How many devices the events of ``kind`` named (events themselves for start, rollback...)."""
        return sum(len(event.device_ids) or 1 for event in self.events if event.kind == kind)

    def joins(self) -> Tuple[SimulationEvent, ...]:
        """Each join's final record: a streamed join's ``stream`` event (its simulated cost), else the join."""
        joins, open_streams = [], {}
        for event in self.events:
            if event.kind == "join" and event.way:
                if event.way == "stream":
                    open_streams[event.device_ids] = len(joins)
                joins.append(event)
            elif event.kind == "stream" and event.device_ids in open_streams:
                joins[open_streams.pop(event.device_ids)] = event
        return tuple(joins)

    @property
    def join_lost_s(self) -> float:
        """The members' training time lost to joins, in all (boundary stalls and streams)."""
        return sum(event.members_lost_s for event in self.joins())

    def summary(self) -> dict:
        """Plain-type summary (JSON-ready)."""
        return {
            "scenario": self.scenario,
            "policy": self.policy,
            "label": self.label,
            "target_steps": self.target_steps,
            "completed_steps": self.completed_steps,
            "completed": self.completed,
            "total_time_s": self.total_time_s,
            "samples_per_s": self.samples_per_s,
            "global_batch": self.global_batch,
            "stall_s": self.stall_s,
            "lost_work_s": self.lost_work_s,
            "checkpoint_s": self.checkpoint_s,
            "imbalance_median": self.imbalance_median,
            "step_time_median_s": self.step_time_median_s,
            "joins": self.count("join"),
            "leaves": self.count("leave"),
            "failures": self.count("failure"),
            "refused_joins": self.count("refused"),
            "join_lost_s": self.join_lost_s,
            "streamed_joins": sum(1 for event in self.joins() if event.way == "stream"),
        }


def weighted_median(values: np.ndarray, weights: np.ndarray) -> float:
    """The median of ``values`` where value i occurs ``weights[i]`` times; nan when empty."""
    values = np.asarray(values, dtype=float)
    weights = np.asarray(weights, dtype=float)
    if values.size == 0 or weights.sum() <= 0:
        return math.nan
    order = np.argsort(values, kind="stable")
    ordered = values[order]
    cumulative = np.cumsum(weights[order])
    total = int(round(cumulative[-1]))
    # 1-based ranks of the middle value(s); two of them for an even total,
    # averaged like statistics.median does.
    low_rank = (total + 1) // 2
    high_rank = total // 2 + 1
    low = ordered[np.searchsorted(cumulative, low_rank, side="left")]
    high = ordered[np.searchsorted(cumulative, high_rank, side="left")]
    return float((low + high) / 2.0)
