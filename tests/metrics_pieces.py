"""A synthetic recorded run shared by test_metrics, test_display and test_plot.

60 steps on a changing device set: two joins, a failure, a leave, five
rebalances (detail in the worker's "[before] -> [after]" form) and a schedule
entry that was refused. Built without a random generator, so every test sees
the same records.
"""

from __future__ import annotations

from flexpar.observe.metrics import EVENT_KEYS, STEP_KEYS, MetricsWriter

START_TIME = 1_700_000_000.0
GLOBAL_BATCH = 256
VIRTUAL_WORKERS = 16
TOTAL_STEPS = 60

# Compute seconds per VW of each device: hostB-1 is slow, local-2 fast.
SECONDS_PER_VW = {"local-0": 0.020, "local-1": 0.022, "local-2": 0.012, "hostB-1": 0.045}

# (step at which the change applies, event, device set after it, stall seconds)
CHANGES = [
    (15, "join", ["local-0", "local-1", "local-2"], 0.21),
    (16, "rebalance", ["local-0", "local-1", "local-2"], 0.0),
    (17, "rebalance", ["local-0", "local-1", "local-2"], 0.0),
    (18, "rebalance", ["local-0", "local-1", "local-2"], 0.0),
    (30, "join", ["local-0", "local-1", "local-2", "hostB-1"], 0.34),
    (33, "rebalance", ["local-0", "local-1", "local-2", "hostB-1"], 0.0),
    (38, "schedule", ["local-0", "local-1", "local-2", "hostB-1"], 0.0),
    (42, "failure", ["local-0", "local-2", "hostB-1"], 0.80),
    (47, "rebalance", ["local-0", "local-2", "hostB-1"], 0.0),
    (52, "leave", ["local-0", "local-2"], 0.05),
]
REBALANCE_STEPS = [step for step, event, _devices, _stall in CHANGES if event == "rebalance"]


def proportional_assignment(devices: list[str]) -> list[int]:
    """VWs inversely proportional to per-VW time, at least one each, summing to V."""
    speeds = [1.0 / SECONDS_PER_VW[device_id] for device_id in devices]
    shares = [max(1, int(VIRTUAL_WORKERS * speed / sum(speeds))) for speed in speeds]
    shares[shares.index(max(shares))] += VIRTUAL_WORKERS - sum(shares)
    return shares


def even_assignment(devices: list[str]) -> list[int]:
    base, extra = divmod(VIRTUAL_WORKERS, len(devices))
    return [base + (1 if rank < extra else 0) for rank in range(len(devices))]


def nudged(assignment: list[int]) -> list[int]:
    """One VW moved from the busiest-counted device to the least (a rebalance that wobbles)."""
    result = list(assignment)
    result[result.index(max(result))] -= 1
    result[result.index(min(result))] += 1
    return result


def step_record(step, clock, loss, generation, devices, assignment) -> dict:
    # Deterministic jitter keeps the series realistic without a random generator.
    jitter = 1.0 + 0.05 * ((step * 7919) % 11 - 5) / 5
    busy = [round(count * SECONDS_PER_VW[d] * jitter, 6) for d, count in zip(devices, assignment)]
    step_time = max(busy) + 0.004
    record = {
        "kind": "step",
        "step": step,
        "time": clock + step_time,
        "elapsed_s": clock + step_time - START_TIME,
        "loss": loss,
        "samples_per_s": GLOBAL_BATCH / step_time,
        "step_time_s": step_time,
        "generation": generation,
        "devices": list(devices),
        "assignment": list(assignment),
        "busy_s": busy,
        "imbalance": (max(busy) - min(busy)) / max(busy),
        "lr": 0.001,
    }
    if "grad_norm" in STEP_KEYS:  # the recipes' field (gradient clipping), where the schema has it
        record["grad_norm"] = 0.5
    return {key: record[key] for key in STEP_KEYS}


def synthetic_run() -> list[dict]:
    """The records of the run, in the order the driver writes them."""
    devices = ["local-0", "local-1"]
    assignment = even_assignment(devices)
    clock = START_TIME
    records = [event_record("start", 0, clock, 1, devices, 0.0, "2 local devices")]
    changes = {step: (event, members, stall) for step, event, members, stall in CHANGES}
    generation = 1
    loss = 2.3
    rebalances = 0
    for step in range(TOTAL_STEPS):
        if step in changes:
            event, members, stall = changes[step]
            clock += stall
            if event == "rebalance":
                before = assignment
                rebalances += 1
                proportional = proportional_assignment(devices)
                assignment = nudged(proportional) if rebalances % 2 == 0 else proportional
                detail = f"{before} -> {assignment}"
            elif event == "schedule":
                detail = "schedule entry 38:+1 was refused: over --max-devices 4"
            else:
                generation += 1
                devices = list(members)
                # A new device set starts from an even split until it is measured.
                assignment = even_assignment(devices)
                detail = f"{event} at step {step}"
            records.append(event_record(event, step, clock, generation, devices, stall, detail))
        loss = loss * 0.96 + 0.01
        record = step_record(step, clock, loss, generation, devices, assignment)
        clock = record["time"]
        records.append(record)
    records.append(event_record("end", TOTAL_STEPS, clock + 0.01, generation, devices, 0.0, "done"))
    return records


def event_record(event, step, clock, generation, devices, stall, detail) -> dict:
    record = {
        "kind": "event",
        "event": event,
        "step": step,
        "time": clock,
        "generation": generation,
        "devices": list(devices),
        "stall_s": stall,
        "detail": detail,
    }
    return {key: record[key] for key in EVENT_KEYS}


def write_run(path, records) -> None:
    with MetricsWriter(path) as writer:
        for record in records:
            writer.write(record)
