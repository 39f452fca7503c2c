"""The torch DDP baseline of the overhead and sparse benchmarks: the standard loop, as torch's tutorial has it."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Callable, List

from .folders import unique_path
from .processes import cpu_count, free_port


def ddp_training_rank(
    rank: int,
    world_size: int,
    port: int,
    build_model: Callable,
    make_optimizer: Callable,
    make_dataset: Callable,
    per_device_batch: int,
    steps: int,
    result_path: str,
) -> None:
    """One torch DDP rank running the standard loop of the DDP tutorial, timing each commit.

    gloo, `DistributedSampler`, `cores // world_size` threads (what flexpar
    gives each CPU device). The model, optimizer and dataset are built here,
    in the rank, from the factories. Rank 0 writes the wall-clock time of
    each commit (right after `optimizer.step()` and `zero_grad()`, where
    flexpar stamps its commits) to `result_path`.
    """
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader, DistributedSampler

    dataset = make_dataset()
    torch.set_num_threads(max(1, cpu_count() // world_size))
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    torch.manual_seed(0)
    model = DistributedDataParallel(build_model())
    optimizer = make_optimizer(model.parameters())
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=per_device_batch, sampler=sampler, drop_last=True)
    commit_times = []
    epoch = 0
    while len(commit_times) < steps:
        sampler.set_epoch(epoch)
        for inputs, labels in loader:
            loss = nn.functional.cross_entropy(model(inputs), labels)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            commit_times.append(time.time())
            if len(commit_times) == steps:
                break
        epoch += 1
    if rank == 0:
        Path(result_path).write_text(" ".join(repr(value) for value in commit_times))
    dist.destroy_process_group()


def run_ddp(
    build_model: Callable,
    make_optimizer: Callable,
    make_dataset: Callable,
    per_device_batch: int,
    steps: int,
    world_size: int,
    folder: str,
) -> List[float]:
    """One DDP job of `world_size` ranks started with `torch.multiprocessing.spawn`; its commit times.

    The factories go to the ranks by pickle: module-level functions and
    classes (or `functools.partial` of them) of the benchmark's script.
    """
    import torch.multiprocessing as torch_multiprocessing

    result_path = unique_path(folder, ".txt")
    torch_multiprocessing.spawn(
        ddp_training_rank,
        args=(world_size, free_port(), build_model, make_optimizer, make_dataset, per_device_batch, steps, result_path),
        nprocs=world_size,
        join=True,
    )
    return [float(value) for value in Path(result_path).read_text().split()]
