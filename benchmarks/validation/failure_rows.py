"""The failure stall's prediction: the step in flight lost, the survivors' notice, a new group."""

from __future__ import annotations

from collections.abc import Sequence

import elastic_plan
from harness import median

from flexpar.sim import failed_step_lost_seconds, failure_stall_seconds
from flexpar.worker import device_link as control


def failed_steps_inputs(records: Sequence[dict]) -> list[dict]:
    """`failed_step_inputs` of every failure in a run's records that has them."""
    failures = [r for r in records if r["kind"] == "event" and r["event"] == "failure"]
    found = [failed_step_inputs(records, failure) for failure in failures]
    return [inputs for inputs in found if inputs is not None and inputs["victim_vws"]]


def failed_step_inputs(records: Sequence[dict], failure: dict) -> dict | None:
    """The step `failure` killed, estimated from the steps before it: what the survivors had to do.

    flexpar's survivors learn of a failure when they reach the step's all-reduce,
    i.e. after their own VWs: the step in flight is lost up to there. Per step of
    the generation that failed (its first step left out when there are others:
    a new set's first step is slow), the slowest survivor's busy time; the median
    (``survivor_busy_s``). ``victim_vws``: the VWs the failed devices had per
    step (the most of them), which says how far into the step a fault in the
    victim's first VW lands.
    """
    steps = [r for r in records if r["kind"] == "step" and r["step"] < failure["step"]]
    if not steps:
        return None
    generation = steps[-1]["generation"]
    same = [r for r in steps if r["generation"] == generation]
    if len(same) > 1:
        same = same[1:]
    survivors = set(failure["devices"])
    values = []
    for record in same:
        busy = [b for device_id, b in zip(record["devices"], record["busy_s"]) if device_id in survivors]
        if busy:
            values.append(max(busy))
    if not values:
        return None
    last = same[-1]
    victims = [count for device_id, count in zip(last["devices"], last["assignment"]) if device_id not in survivors]
    return {
        "survivor_busy_s": median(values),
        "victim_vws": max(victims) if victims else None,
        "devices_before": len(last["devices"]),
    }


def recovery_notice_seconds() -> float:
    """Expected time from the survivors' failure reports to their seeing the rebuilt generation.

    The chain runs through two polls, each waited half its period on average:
    the device's follower thread (it reads the published generation), and the
    survivor's own wait loop (it reads what the follower saw). The driver's
    loop is woken by the reports themselves (driver/waker.py, DriverWaker), so it adds
    store round trips only, which (a fraction of a millisecond each) are left
    out. A planned change has no such chain: its generation rides in the
    step's all-reduce.
    """
    return 0.5 * (2 * control.DEVICE_POLL_S)


def fault_death_fraction(phase: str, victim_vws: int, backward_fraction: float) -> float:
    """How far into its step's compute a device dies at the fault point ``phase`` of its first VW.

    forward: at the start; backward: after the first VW's forward, taken as
    ``1 - backward_fraction`` of a VW; sync: after all of its VWs.
    """
    if phase == "forward":
        return 0.0
    if phase == "backward":
        return (1.0 - backward_fraction) / victim_vws
    if phase == "sync":
        return 1.0
    raise ValueError(f"fault phase {phase!r}: expected forward, backward or sync")


def predict_failure_stall(inputs: Sequence[dict], parameters) -> tuple:
    """elastic.py's failure stall (last commit -> survivors level) and the lost compute in it.

    The victim dies at elastic.py's fault point; the survivors run their VWs of
    the step to its all-reduce (one busy process fewer on the host from the
    death on), learn of it there, wait for the rebuilt generation and form a
    new group. Each failure of `inputs` (`failed_steps_inputs`) is predicted
    from its own generation's busy times; the medians over them.
    """
    phases = {fault.rsplit(":", 1)[1] for fault in elastic_plan.Settings(quick=False, rounds=1).faults.split(",")}
    if len(phases) != 1:
        raise ValueError(f"elastic.py's faults use phases {sorted(phases)}: expected one, to place every failure")
    phase = phases.pop()
    stalls, losses = [], []
    for value in inputs:
        busy, devices_before = value["survivor_busy_s"], value["devices_before"]
        fraction = fault_death_fraction(phase, value["victim_vws"], parameters.network.backward_fraction)
        lost = failed_step_lost_seconds(busy, devices_before, parameters.elastic, fraction)
        losses.append(lost)
        stalls.append(
            failure_stall_seconds(
                devices_before - 1, parameters.elastic, lost_compute_s=lost, death_at_s=fraction * busy
            )
        )
    return median(stalls), median(losses)
