"""Small, stable helpers shared by the flexpar benchmarks.

Every benchmark measures "ours vs baseline" side by side in one invocation,
alternating the runs, and reports medians. The helpers here promise:

- ``median(values)``: the median of a non-empty sequence of numbers.
- ``Timer``: a context manager measuring wall-clock seconds (``perf_counter``).
- ``alternate(runners, repeats)``: calls each runner in turn, ``repeats`` rounds,
  and returns ``{name: [result, ...]}`` in call order.
- ``ratio(numerator, denominator)``: a float, or ``None`` when undefined.
- ``write_json(path, data)``: writes ``data`` as indented JSON, creating folders;
  does nothing when ``path`` is ``None``.
- ``print_table(rows, columns, title)``: prints a plain aligned text table.
- ``free_port()``: a TCP port on 127.0.0.1 that was free at the time of asking.
- ``base_parser(description)``: an argparse parser with ``--json`` and ``--quick``.
- ``cpu_count()``: the number of cores this process may run on.
- ``step_durations(commit_times, skip)``: seconds of steps ``skip ..`` from the
  wall-clock times at which each step committed (steady state: start-up excluded).

Keep this module small: other benchmarks import it.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence


def median(values: Sequence[float]) -> float:
    """Return the median of a non-empty sequence of numbers."""
    if not values:
        raise ValueError("median of an empty sequence")
    return float(statistics.median(values))


class Timer:
    """Context manager measuring elapsed wall-clock seconds in ``seconds``."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._start = 0.0

    def __enter__(self) -> "Timer":
        self._start = time.perf_counter()
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.seconds = time.perf_counter() - self._start


def alternate(runners: Mapping[str, Callable[[], Any]], repeats: int) -> Dict[str, List[Any]]:
    """Run each runner once per round, in the mapping's order, for ``repeats`` rounds.

    Alternating (A, B, A, B, ...) rather than (A, A, B, B) spreads slow drifts
    of the machine (thermal, background load) over both sides evenly.
    """
    results: Dict[str, List[Any]] = {name: [] for name in runners}
    for _ in range(repeats):
        for name, runner in runners.items():
            results[name].append(runner())
    return results


def ratio(numerator: Optional[float], denominator: Optional[float]) -> Optional[float]:
    """Return numerator / denominator, or None when either is missing or the denominator is 0."""
    if numerator is None or denominator is None or denominator == 0:
        return None
    return float(numerator) / float(denominator)


def write_json(path: Optional[str], data: Any) -> None:
    """Write ``data`` as indented JSON to ``path`` (folders created); no-op when path is None."""
    if path is None:
        return
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(data, indent=2, sort_keys=True, default=str) + "\n")


def _format_cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def print_table(rows: Sequence[Mapping[str, Any]], columns: Sequence[str], title: str = "") -> None:
    """Print ``rows`` (mappings) as an aligned text table with the given column order."""
    cells = [[_format_cell(row.get(column)) for column in columns] for row in rows]
    widths = [max([len(column)] + [len(line[index]) for line in cells]) for index, column in enumerate(columns)]
    if title:
        print(title)
    print("  ".join(column.ljust(width) for column, width in zip(columns, widths)))
    print("  ".join("-" * width for width in widths))
    for line in cells:
        print("  ".join(cell.ljust(width) for cell, width in zip(line, widths)))


def free_port() -> int:
    """Return a TCP port on 127.0.0.1 that was free when asked (another process may take it later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def base_parser(description: str) -> argparse.ArgumentParser:
    """Return an argparse parser that already has ``--json PATH`` and ``--quick``."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--json", metavar="PATH", default=None, help="write the results as JSON here")
    parser.add_argument("--quick", action="store_true", help="small, fast version for smoke testing")
    return parser


def cpu_count() -> int:
    """Return the number of cores this process may run on (at least 1)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


def step_durations(commit_times: Sequence[float], skip: int) -> List[float]:
    """Seconds of steps ``skip .. len-1``: gaps between consecutive commit times.

    ``commit_times[i]`` is when step ``i`` committed; step ``i`` lasted
    ``commit_times[i] - commit_times[i - 1]``. Steps before ``skip`` (start-up)
    are left out; ``skip`` must be at least 1 and below ``len(commit_times)``.
    """
    if skip < 1 or len(commit_times) <= skip:
        raise ValueError(
            f"{len(commit_times)} steps committed; need skip >= 1 and more steps than skip={skip}"
        )
    return [later - earlier for earlier, later in zip(commit_times[skip - 1 :], commit_times[skip:])]


def ddp_training_rank(rank: int, world_size: int, port: int, build_model, make_optimizer, dataset,
                      per_device_batch: int, steps: int, result_path: str) -> None:
    """One torch DDP rank running the standard loop of the DDP tutorial, timing each commit.

    The baseline of the overhead and sparse benchmarks: gloo, DistributedSampler,
    `cores // world_size` threads (what flexpar gives each CPU device). Rank 0
    writes the commit times to `result_path`.
    """
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader, DistributedSampler

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
