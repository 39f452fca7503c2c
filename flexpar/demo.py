"""`flexpar demo`: a short real training that shows an elastic change.

It trains the digits CNN (data shipped with scikit-learn) on 2 CPU devices,
adds a third while training runs, later removes one, then prints the held-out
accuracy, the elastic events with their stalls, and draws the timeline.
"""

from __future__ import annotations

import os

from flexpar.examples import digits
from flexpar.observe.plot import plot_timeline


def main(steps: int = 160, output_dir: str = "runs/demo") -> int:
    train, held_out = digits.load_splits()
    job = digits.build_job(global_batch=512, virtual_workers=16, dataset=train)
    metrics_path = os.path.join(output_dir, "metrics.jsonl")
    join_step, leave_step = max(1, steps // 5), max(2, (steps * 3) // 4)
    print(
        f"flexpar demo: digits CNN, {steps} steps of {job.global_batch} samples in "
        f"{job.virtual_workers} virtual workers; 2 devices, +1 at step {join_step}, -1 at step {leave_step}"
    )
    model, summary = job.fit(
        steps=steps,
        devices=2,
        max_devices=3,
        schedule=f"{join_step}:+1,{leave_step}:-1",
        oversubscribe=True,
        metrics=metrics_path,
    )
    print(
        f"held-out accuracy: {digits.evaluate(model, held_out):.3f}  "
        f"(final loss {summary['final_loss']:.3f}, median {summary['samples_per_s']:.0f} samples/s)"
    )
    for event in summary["events"]:
        if event["event"] in ("join", "leave", "failure"):
            print(
                f"  step {event['step']:4d}: {event['event']:7s} {event['detail']:28s} "
                f"stall {event['stall_s'] * 1000:.0f} ms"
            )
    try:
        plot_path = os.path.join(output_dir, "timeline.png")
        plot_timeline(metrics_path, plot_path)
        print(f"timeline: {plot_path}   metrics: {metrics_path}")
    except ImportError:
        print(f'metrics: {metrics_path} (pip install -e ".[plot]" in flexpar\'s checkout to draw the timeline)')
    return 0
