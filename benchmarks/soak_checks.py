"""The soak's checks of a run's outcome beyond its parameters and sample ledger (pure).

`check_evaluations`: every evaluation there once, each evaluation sample seen
once, the metrics of the failure-free run. `lost_state_stop_allowed`: the one
stop a sharded soak (soak.py --shard, `Job(shard_optimizer=True)`, each part
of the optimizer state on 2 devices) allows: where two devices failed at once
(signals at one step, or one in the recovery from the other), both holders of
some part may be gone, and the run must then stop with flexpar's one-line
"optimizer state lost" error naming the latest checkpoint. The same line after
a single failure, or a planned leave, is a failed run. `driver_overrun`: how many
steps the devices committed past the step of the run's driver fault before they
stopped for the restarted driver to re-adopt them.
"""

from __future__ import annotations


def check_evaluations(result, records: list, expected: dict) -> None:
    """One record per evaluation step, each sample evaluated once, metrics as the failure-free run's
    (counted into `result`, soak.RunResult)."""
    import soak_job

    by_step = {}
    for record in records:
        by_step.setdefault(record["step"], record["metrics"])  # the driver keeps one per step
    for step, reference in expected.items():
        metrics = by_step.get(step)
        if metrics is None:
            result.eval_missing += 1
            continue
        for index in range(soak_job.EVAL_SAMPLES):
            seen = metrics[soak_job.sample_key(index)]
            result.eval_samples_lost += max(0, 1 - seen)
            result.eval_samples_repeated += max(0, seen - 1)
        if metrics["count"] != reference["count"] or abs(
            metrics["loss_sum"] - reference["loss_sum"]
        ) > 1e-6 + 1e-5 * abs(reference["loss_sum"]):
            result.eval_divergent += 1
    # An evaluation at a step the failure-free run has none at differs from it.
    result.eval_divergent += sum(1 for step in by_step if step not in expected)


STATE_LOST = "optimizer state lost: "


def lost_state_stop_allowed(stderr: str, simultaneous: int, during_recovery: int) -> bool:
    """Whether a sharded run's stop (soak.py --shard) is the state-lost line that two failures at once
    may cause, which the soak counts in `lost_state_stops`, not as a failed run.

    The line must name the latest checkpoint and the command that resumes it
    (or say that none was written), and two signals must have fired at one
    step (`simultaneous`) or one in the recovery from the other
    (`during_recovery`): after a single failure every part still has a copy
    (redundancy 2), and the run must go on.
    """
    lines = [line for line in stderr.splitlines() if STATE_LOST in line]
    if not lines or not (simultaneous or during_recovery):
        return False
    line = lines[-1]
    return ("the latest checkpoint is" in line and "resume with:" in line) or "no checkpoint was written" in line


def driver_overrun(fired: list, events: list):
    """Steps the devices committed after the step in flight when the run's driver fault killed its driver
    (the re-adopted job's first step, its `adopt` event's, less that step + 1); None without both.

    The devices look at their driver at every step (flexpar DeviceLink.driver_gone_now): 0 or 1, plus
    the steps of the driver process's own teardown; a fault aimed at a later step hits the restarted driver.
    """
    killed = [fault["step"] for fault in fired if fault["kind"] == "driver"]
    adopted = [event["step"] for event in events if event["event"] == "adopt"]
    if not killed or not adopted:
        return None
    return min(adopted) - (min(killed) + 1)
