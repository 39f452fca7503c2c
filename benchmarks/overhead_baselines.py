"""The baselines of benchmarks/overhead.py: torch DDP and the textbook gradient-accumulation loop."""

from __future__ import annotations

import functools
import json
import os
import time
from pathlib import Path
from typing import List

import harness
import torch
import torch.multiprocessing as torch_multiprocessing
from harness import PeakMemoryWatcher, cpu_count
from overhead_workload import Config, MLPFactory, make_dataset, make_optimizer, throughput
from torch import nn
from torch.utils.data import DataLoader

# ---------------------------------------------------------------- DDP side


def ddp_run(config: Config, world_size: int, work_dir: str) -> dict:
    """One DDP job of ``world_size`` ranks (the standard loop; harness.ddp_training_rank)."""
    # The same memory watcher as flexpar's runs (a thread reading /proc every 50 ms beside the
    # training processes): both sides share the machine with it alike.
    with PeakMemoryWatcher():
        commit_times = harness.run_ddp(
            MLPFactory(config),
            make_optimizer,
            functools.partial(make_dataset, config),
            config.per_device_batch,
            config.steps,
            world_size,
            work_dir,
        )
    samples_per_step = config.per_device_batch * world_size
    return throughput(commit_times, config.skip, samples_per_step)


# ---------------------------------------------------------------- accumulation loop side


def _accumulation_loop_process(
    _index: int, config: Config, accumulation: int, result_path: str, bf16: bool = False, device: str = "cpu"
) -> None:
    """The textbook gradient-accumulation loop, timing each commit; writes times and VmHWM.

    `bf16`: each micro-batch's forward and loss under torch.autocast (bfloat16), as one writes it by hand.
    `device`: "cpu", or "cuda" (the model and each micro-batch on the first GPU; a commit is stamped
    after torch.cuda.synchronize(), when the step's kernels have run, as flexpar's worker waits for
    its device before it commits).
    """
    torch.set_num_threads(cpu_count())  # one device: flexpar gives its worker every core
    torch.manual_seed(0)
    target = torch.device(device)
    model = MLPFactory(config)().to(target)
    optimizer = make_optimizer(model.parameters())
    loader = DataLoader(make_dataset(config), batch_size=config.micro_batch, shuffle=True, drop_last=True)
    commit_times: List[float] = []
    while len(commit_times) < config.steps:
        micro_batches = 0
        for inputs, labels in loader:
            inputs, labels = inputs.to(target), labels.to(target)
            with torch.autocast(target.type, dtype=torch.bfloat16, enabled=bf16):
                loss = nn.functional.cross_entropy(model(inputs), labels)
            (loss / accumulation).backward()
            micro_batches += 1
            if micro_batches % accumulation == 0:
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                if target.type == "cuda":
                    torch.cuda.synchronize(target)
                commit_times.append(time.time())
                if len(commit_times) == config.steps:
                    break
    peak = harness.peak_rss_bytes(os.getpid())
    Path(result_path).write_text(
        json.dumps({"commit_times": commit_times, "peak_rss_bytes": -1 if peak is None else peak})
    )


def accumulation_loop_run(
    config: Config, accumulation: int, work_dir: str, bf16: bool = False, device: str = "cpu"
) -> dict:
    """The loop in a fresh process (started like a DDP rank), as flexpar's worker is one; on `device`."""
    result_path = harness.unique_path(work_dir, ".json")
    with PeakMemoryWatcher():  # as beside flexpar's worker (the loop reads its own VmHWM for the figure)
        torch_multiprocessing.spawn(
            _accumulation_loop_process, args=(config, accumulation, result_path, bf16, device), nprocs=1, join=True
        )
    result = json.loads(Path(result_path).read_text())
    samples_per_step = config.micro_batch * accumulation
    return {
        **throughput(result["commit_times"], config.skip, samples_per_step),
        "peak_rss_bytes": result["peak_rss_bytes"],
    }
