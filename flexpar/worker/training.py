"""What a device trains, built from the job: the model, optimizer and scheduler, the gradient sums, the recipes."""

from __future__ import annotations

import time
from typing import NamedTuple, Optional

import torch

from flexpar import recipes
from flexpar.comm.exact_sync import ExactSync
from flexpar.comm.gradient_sync import GradientSync
from flexpar.comm.sparse_sync import sparse_parameters
from flexpar.worker.determinism import make_deterministic
from flexpar.worker.frozen_part import FrozenPart
from flexpar.worker.host import process_age_s
from flexpar.worker.shards import ShardedOptimizer, sharding_by
from flexpar.worker.user_code import build_model, build_optimizer


class Training(NamedTuple):
    """The pieces one device trains with; built once, never replaced (their state changes in place)."""

    model: torch.nn.Module
    frozen: FrozenPart
    optimizer: torch.optim.Optimizer
    scheduler: object
    shards: Optional[ShardedOptimizer]  # Job(shard_optimizer=...): this device's chunks of the optimizer state
    sync: GradientSync
    exact: Optional[ExactSync]  # Job(deterministic=True): exact int64 sums
    forward_model: object  # what the VWs' forward calls: compiled, or the model itself
    scaler: object  # fp16 only; part of the training state
    # What this device's start took before its warm-up, for a join event: its process's start-up (imports,
    # the job's payload) until the build began, and the model's and optimizer's build (less the frozen digest).
    ready_s: dict = {}


def build_training(job, device: torch.device, bucket_mb: float, peer_lost) -> Training:
    """Build what this device trains with, on `device`, from the job's factories and recipes."""
    startup_s, started = process_age_s(), time.perf_counter()
    if job.deterministic:  # before any kernel runs: one thread count (CPU), deterministic kernels (CUDA)
        make_deterministic(device)
    model = build_model(job)
    # The frozen part's digests, on the CPU as built, before this device announces itself:
    # a joiner's hashing delays its own admission only, never the running devices.
    frozen = FrozenPart(model, torch.get_num_threads())
    model = model.to(device)
    optimizer, scheduler = build_optimizer(job, model)
    # Job(shard_optimizer=...): this device holds and steps its chunks of the optimizer state only
    # (flexpar/worker/shards.py); the boundaries move them (flexpar/worker/shard_levelling.py).
    shards = (
        ShardedOptimizer(model, optimizer, sparse_parameters(model), sharding_by(job)) if job.shard_optimizer else None
    )
    sync = GradientSync(model, device, bucket_mb, peer_lost=peer_lost)
    # Job(deterministic=True): exact int64 sums instead of the float buckets (flexpar/comm/exact_sync.py).
    exact = None
    if job.deterministic:
        buckets = [bucket.parameters for bucket in sync.buckets]
        exact = ExactSync(sync.dense, sync.sparse, job.virtual_workers, buckets)
        sync.companion = exact  # its collectives in flight are released with the float path's
    # Recipes (flexpar/recipes.py): checked for this device's type before anything runs.
    recipes.check_mixed_precision(job, device.type)
    recipes.check_compile(job, device.type)
    forward_model = recipes.compiled(job, model)
    scaler = recipes.make_scaler(job)
    build_s = max(0.0, time.perf_counter() - started - (frozen.digest_s or 0.0))
    ready_s = {"startup_s": startup_s, "build_s": build_s}
    return Training(model, frozen, optimizer, scheduler, shards, sync, exact, forward_model, scaler, ready_s)
