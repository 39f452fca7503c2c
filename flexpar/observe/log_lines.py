"""The plain log lines of a running job (the ``--no-display`` mode, and a live panel's summary lines).

Pure formatting of the job's records (flexpar/observe/metrics.py) into one
line each: a step every ``log_every`` steps, an event, an evaluation, a
summary of rebalances. ``LiveDisplay`` (display.py) logs them.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Optional, Sequence

from flexpar.observe.metrics import device_change, eval_means, format_split, rebalance_change


def estimate_remaining_s(
    first_step: int, first_elapsed_s: float, step: int, elapsed_s: float, total_steps: int
) -> Optional[float]:
    """Seconds until step `total_steps - 1` commits, at the mean pace since `first_step`.

    None while there is no pace yet (fewer than two observed steps). The pace
    includes stalls, which is what a user waiting for the job wants.
    """
    steps_done = step - first_step
    if steps_done <= 0 or elapsed_s <= first_elapsed_s:
        return None
    seconds_per_step = (elapsed_s - first_elapsed_s) / steps_done
    return max(0, total_steps - 1 - step) * seconds_per_step


def format_duration(seconds: Optional[float]) -> str:
    """ "0:01:05" style; "?" when unknown."""
    if seconds is None or not math.isfinite(seconds):
        return "?"
    whole = int(round(seconds))
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}"


def format_assignment(devices: Sequence[str], assignment: Sequence[int], limit: int = 8) -> str:
    """VWs per device for a log line, e.g. "local-0:9 local-1:7"; a range beyond `limit` devices."""
    # Beyond a handful of devices a per-device list makes the log line unreadable.
    if len(devices) > limit:
        return f"{len(devices)} devices, {min(assignment)}-{max(assignment)} VWs each"
    return " ".join(f"{device_id}:{count}" for device_id, count in zip(devices, assignment))


def format_megabytes(count: int) -> str:
    """Bytes as decimal megabytes for people, e.g. "201.3 MB" (the unit of the display's optimizer column)."""
    return f"{count / 1e6:.1f} MB"


def format_sharding(shard_optimizer, redundancy: Optional[int]) -> str:
    """How a job holds its optimizer state, for the banner and the display: "" when every device holds
    all of it, else e.g. "sharded by elements, redundancy 2" (each part on that many devices, at most
    one copy per device: fewer while the job has fewer devices)."""
    if not shard_optimizer:
        return ""
    by = "parameters" if shard_optimizer == "parameters" else "elements"
    return f"sharded by {by}, redundancy {2 if redundancy is None else redundancy}"


def format_optimizer_bytes(values: Sequence[int], sharding: str = "") -> str:
    """The devices' optimizer-state bytes in one phrase: "optimizer 201.3 MB per device" when every
    device holds the same, else the range, "optimizer 100.7-134.2 MB per device (sharded by elements,
    redundancy 2)" (a sharded job: `sharding` is `format_sharding`'s phrase)."""
    low, high = min(values), max(values)
    how = f" ({sharding})" if sharding else ""
    if low == high:
        return f"optimizer {format_megabytes(high)} per device{how}"
    return f"optimizer {low / 1e6:.1f}-{format_megabytes(high)} per device{how}"


def held_optimizer_bytes(record: Mapping[str, Any]) -> list:
    """The step record's `optimizer_bytes` of the devices that take part: a streamed joiner (the
    record's `joining`) reports the share it holds so far, which says nothing of the job's per-device
    size (records written before it did held the size of the state it was still receiving)."""
    joining = record.get("joining") or {}
    values = record.get("optimizer_bytes") or []
    return [value for device, value in zip(record["devices"], values) if device not in joining]


def format_step_line(
    record: Mapping[str, Any], total_steps: int, remaining_s: Optional[float], sharding: str = "", stream: str = ""
) -> str:
    """The plain log line of a step record (used without a terminal): "step 19 (20/60 done, 33%) ...".

    The step is numbered as in the metrics file, the CSV and the trackers (from 0); the count
    after it is the steps done, as the live panel's progress bar counts them.

    With the record's `optimizer_bytes` (every job's workers report it), the line
    ends with the optimizer-state sizes of the devices that take part (not a
    streamed joiner's: `held_optimizer_bytes`), and how a sharded job holds it
    (`sharding`, `format_sharding`'s phrase). A streaming job's `stream` phrase
    (`format_stream_progress`: its pass and items trained) follows the count.
    """
    done = record["step"] + 1
    percent = 100.0 * done / total_steps if total_steps else 0.0
    optimizer = held_optimizer_bytes(record)
    # The step as the metrics file numbers it (from 0), and how many of the run's steps are done.
    return (
        f"step {record['step']} ({done}/{total_steps} done, {percent:.0f}%{'; ' + stream if stream else ''}) "
        f"loss {record['loss']:.4g} | "
        f"{record['samples_per_s']:.1f} samples/s | step {record['step_time_s']:.3f} s | "
        f"generation {record['generation']}, VWs {format_assignment(record['devices'], record['assignment'])} | "
        f"imbalance {100.0 * record['imbalance']:.1f}% | ETA {format_duration(remaining_s)}"
        + (f" | {format_optimizer_bytes(optimizer, sharding)}" if optimizer else "")
    )


def format_event_line(record: Mapping[str, Any], previous_devices: Sequence[str]) -> str:
    """The plain log line of an event record."""
    added, removed = device_change(previous_devices, record["devices"])
    change = " ".join([f"+{device_id}" for device_id in added] + [f"-{device_id}" for device_id in removed])
    parts = [
        f"event {record['event']} at step {record['step']}",
        f"generation {record['generation']}",
        f"{len(record['devices'])} device{'s' if len(record['devices']) != 1 else ''}"
        + (f" ({change})" if change else ""),
    ]
    if record["stall_s"] > 0:
        parts.append(f"stall {record['stall_s']:.2f} s")
    if record["detail"]:
        parts.append(record["detail"])
    return ", ".join(parts)


def format_eval_line(record: Mapping[str, Any]) -> str:
    """The plain log line of an eval record: the means per `count` when there is one, else the sums.

    e.g. "eval at step 20: loss 0.4038, correct 0.8756 (997 samples) | 2 devices, 0.41 s". The
    count is the user's: samples, or tokens in a token-weighted evaluation. It is called samples
    only when it equals the evaluation set's size (the record's `samples`), else it is named as
    what it is: "(means per count; count 4882 over 997 samples)".
    """
    metrics = record["metrics"]
    means = eval_means(metrics)
    if means:
        shown = ", ".join(f"{name} {value:.4g}" for name, value in sorted(means.items()))
        count, samples = metrics["count"], record.get("samples")
        if count == samples:
            shown += f" ({samples} samples)"
        elif samples is not None:
            shown += f" (means per count; count {count:g} over {samples} samples)"
        else:  # a record of a flexpar before `samples`
            shown += f" (means per count; count {count:g})"
    else:
        shown = ", ".join(f"{name} {value:.6g}" for name, value in sorted(metrics.items()))
    devices = len(record["devices"])
    return (
        f"eval at step {record['step']}: {shown} | {devices} device{'s' if devices != 1 else ''}, "
        f"{record['eval_s']:.2f} s"
    )


def format_rebalance_line(count: int, since_step: int, devices: Sequence[str], assignment: Sequence[int]) -> str:
    """The plain log line that sums up rebalances, e.g. "3 rebalances since step 40, now local-0:9 local-1:7".

    `since_step` is the step count at the previous such line (or at the first
    step seen); `devices` and `assignment` are the split now in force.
    """
    noun = "rebalance" if count == 1 else "rebalances"
    return f"{count} {noun} since step {since_step}, now {format_assignment(devices, assignment)}"


def format_rebalance_summary(count: int, last: Optional[Mapping[str, Any]]) -> str:
    """The panel's rebalance line, e.g. "rebalances: 7 (last at step 812: 8,8 -> 9,7)"."""
    if last is None:
        return f"rebalances: {count}"
    change = rebalance_change(last)
    moved = f": {format_split(change[0])} -> {format_split(change[1])}" if change is not None else ""
    return f"rebalances: {count} (last at step {last['step']}{moved})"


def stream_progress(passes: dict, record: Mapping[str, Any], global_batch: int) -> dict:
    """A streaming dataset's progress after a step `record` (its length unknown, so no epoch count):
    the items trained, and the passes the stream groups ended, as the records since this driver
    started said (`passes`, group -> passes ended, is updated from the record's `pass_ends`; the
    figure is the furthest group's: groups of unequal shards drift apart). {} for a map-style job."""
    if "stream_items_read" not in record:
        return {}
    note_pass_ends(passes, record.get("pass_ends", []))
    return {
        "stream_items": (record["step"] + 1) * global_batch,
        "stream_passes_ended": max(passes.values()) if passes else 0,
    }


def note_pass_ends(passes: dict, pass_ends) -> dict:
    """`passes` (stream group -> passes ended) updated with `pass_ends` (a step record's, or a ledger's)."""
    for ended in pass_ends:
        passes[ended["group"]] = max(passes.get(ended["group"], 0), ended["pass"] + 1)
    return passes


def passes_ended(records) -> dict:
    """Stream group -> passes ended, as the step records given say (a restarted driver's metrics file): the
    pass a resumed or re-adopting driver shows from its first step, not from the next pass end it meets."""
    passes: dict = {}
    for record in records:
        if record.get("kind") == "step":
            note_pass_ends(passes, record.get("pass_ends", []))
    return passes


def format_stream_progress(progress: Mapping[str, Any], passes: Optional[int] = None) -> str:
    """A streaming job's progress (`stream_progress`) for people, as "pass 2, 12,480 items": the pass in
    hand counted from 1 (the passes ended + 1; "pass 2/3" where `passes`, the job's `epochs=`, is known),
    and the items trained. "" for a map-style job (an empty `progress`)."""
    if not progress:
        return ""
    current = progress["stream_passes_ended"] + 1
    if passes:
        current = min(current, passes)  # the steps after the last pass's end (uneven groups) are of it
    of = f"/{passes}" if passes else ""
    return f"pass {current}{of}, {progress['stream_items']:,} items"
