"""The two references of benchmarks/balance.py: the ideal (one device alone) and the uniform split (torch DDP)."""

from __future__ import annotations

import itertools
import json
import os
import time
from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.multiprocessing as torch_mp
from balance_workload import (
    MICRO_BATCH,
    SEED,
    Config,
    EmulatedKernelLoss,
    make_dataset,
    make_model,
    make_optimizer,
    stretch_to_speed,
    threads_per_device,
)
from harness import free_port, median, run_folder
from torch import nn

# ---------------------------------------------------------------- the ideal: one device alone


def run_single_device(config: Config) -> dict:
    """Step times (warm-up dropped) of a plain loop at speed 1 over all V VWs of each step,
    with the torch threads one device process gets."""
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(threads_per_device(config))
    try:
        torch.manual_seed(SEED)
        model = make_model()
        optimizer = make_optimizer(model.parameters())
        loss_of = EmulatedKernelLoss(config.kernel_ms / 1000.0)
        loader = torch.utils.data.DataLoader(make_dataset(), batch_size=MICRO_BATCH, shuffle=True, drop_last=True)
        batches = _endless(loader)
        step_times = []
        for _ in range(config.single_steps + 1):  # the first step warms up and is dropped
            started = time.perf_counter()
            for _ in range(config.virtual_workers):
                (loss_of(model, next(batches)) / config.virtual_workers).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step_times.append(time.perf_counter() - started)
    finally:
        torch.set_num_threads(previous_threads)
    return {"step_times": step_times[1:]}


def _endless(loader):
    """Batches of `loader`, epoch after epoch (DistributedSampler needs set_epoch)."""
    for epoch in itertools.count():
        sampler = getattr(loader, "sampler", None)
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(epoch)
        yield from loader


# ---------------------------------------------------------------- uniform: torch DDP


def _ddp_rank(rank: int, config: Config, port: int, result_path: str) -> None:
    """One DDP process: V / world VWs per step, the first ones under no_sync()."""
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(threads_per_device(config))
    world = config.devices
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.manual_seed(SEED)
        model = nn.parallel.DistributedDataParallel(make_model())
        optimizer = make_optimizer(model.parameters())
        loss_of = EmulatedKernelLoss(config.kernel_ms / 1000.0)
        dataset = make_dataset()
        sampler = torch.utils.data.distributed.DistributedSampler(
            dataset, num_replicas=world, rank=rank, shuffle=True, seed=SEED, drop_last=True
        )
        loader = torch.utils.data.DataLoader(dataset, batch_size=MICRO_BATCH, sampler=sampler, drop_last=True)
        batches = _endless(loader)
        speed = config.speeds[rank]
        per_rank = config.virtual_workers // world
        step_times, busy_times = [], []
        dist.barrier()
        last = time.perf_counter()
        for _ in range(config.ddp_steps):
            busy = 0.0
            compute = 0.0  # this step's measured VW times before stretching
            for index in range(per_rank):
                final = index == per_rank - 1
                if final and index:
                    # The last VW's backward also waits for the all-reduce, so its
                    # measured time includes other ranks' time: stretch it by the
                    # mean of this step's earlier VWs instead, before it runs.
                    typical = compute / index
                    busy += stretch_to_speed(typical, speed) - typical
                started = time.perf_counter()
                with nullcontext() if final else model.no_sync():
                    (loss_of(model, next(batches)) / per_rank).backward()
                elapsed = time.perf_counter() - started
                compute += elapsed
                busy += elapsed if final else stretch_to_speed(elapsed, speed)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            now = time.perf_counter()
            step_times.append(now - last)
            busy_times.append(busy)
            last = now
        gathered = [None] * world
        dist.all_gather_object(gathered, busy_times)
        if rank == 0:
            with open(result_path, "w") as handle:
                json.dump({"step_times": step_times, "busy_times": gathered}, handle)
    finally:
        dist.destroy_process_group()


def run_uniform_ddp(config: Config) -> dict:
    """Median step time of torch DDP over the emulated devices (equal shares), warm-up dropped."""
    with run_folder("flexpar-balance-ddp-") as folder:
        result_path = os.path.join(folder, "ddp.json")
        # start_processes is what mp.spawn calls; a fork server imports torch once
        # instead of once per rank (start-up is not timed, this only saves wall time).
        torch_mp.start_processes(
            _ddp_rank,
            args=(config, free_port(), result_path),
            nprocs=config.devices,
            join=True,
            start_method="forkserver",
        )
        with open(result_path) as handle:
            result = json.load(handle)
    skip = min(2, config.ddp_steps - 1)
    busy_per_rank = [median(times[skip:]) for times in result["busy_times"]]
    return {"step_s": median(result["step_times"][skip:]), "busy_s": busy_per_rank}
