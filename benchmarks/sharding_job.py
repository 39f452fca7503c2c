"""The job of benchmarks/sharding.py, and one fit of it in a process of its own.

The job: restart_worker.py's MLP (1024 -> 4096 -> 4096 -> 1024 -> 16, 25.2M
parameters; the quick form 3.2M), AdamW, cross-entropy, V=16, seed 0, sharded
(`Job(shard_optimizer=True, shard_redundancy=R)`) or not. Worker processes
import this file for its pieces, so everything they need is at module level.

`python benchmarks/sharding_job.py SPEC.json` runs one fit as the spec says
(sizes, sharding, devices, schedule, faults) and writes, into the spec's output
folder, `metrics.jsonl` (the fit's records), `model.pt` (the trained parameters)
and `summary.json` (what fit() returned). sharding.py runs the fits whose
device set changes this way, under a wall-clock bound, so that a fit that hangs
(a join that never completes) is killed and reported, never waited for.
"""

from __future__ import annotations

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from restart_worker import MODELS, cross_entropy, make_dataset

VIRTUAL_WORKERS = 16


def adamw(parameters):
    return torch.optim.AdamW(parameters, lr=1e-4, weight_decay=0.01)


def make_job(quick: bool, global_batch: int, shard_redundancy=None):
    """The benchmark's job; `shard_redundancy` None: unsharded, else sharded with that many copies."""
    import flexpar

    sharding = {} if shard_redundancy is None else {"shard_optimizer": True, "shard_redundancy": shard_redundancy}
    return flexpar.Job(
        model=MODELS["small" if quick else "full"],
        optimizer=adamw,
        loss=cross_entropy,
        dataset=make_dataset(size=max(512, 2 * global_batch)),
        global_batch=global_batch,
        virtual_workers=VIRTUAL_WORKERS,
        seed=0,
        **sharding,
    )


def fit(spec: dict, metrics: str):
    """One fit of the spec's job on its devices, schedule and faults: what fit() returns."""
    job = make_job(spec["quick"], spec["global_batch"], spec["shard_redundancy"])
    return job.fit(
        steps=spec["steps"],
        devices=spec["devices"],
        max_devices=spec.get("max_devices"),
        schedule=spec.get("schedule") or None,
        faults=spec.get("faults") or None,
        oversubscribe=True,
        metrics=metrics,
        display=False,
        quiet=True,
        timeout_s=spec.get("timeout_s", 60.0),
    )


if __name__ == "__main__":
    spec = json.load(open(sys.argv[1]))
    output = spec["output"]
    model, summary = fit(spec, os.path.join(output, "metrics.jsonl"))
    torch.save(model.state_dict(), os.path.join(output, "model.pt"))
    with open(os.path.join(output, "summary.json"), "w") as handle:
        json.dump(summary, handle, default=str)
