"""Overhead of flexpar against the real thing, measured side by side.

Three figures, each a ratio of medians over alternating runs in this one
invocation:

- ``ddp_ratio``: steady-state samples/s of flexpar on 2 CPU devices
  (``virtual_workers=2``: one VW per device, so the same per-device batch) over
  torch ``DistributedDataParallel`` on 2 ranks (``torch.multiprocessing.spawn``,
  gloo, ``DistributedSampler``, the standard loop). Goal >= 0.97.
- ``accumulation_ratio``: samples/s of flexpar on 1 device with
  ``virtual_workers=16`` over the textbook gradient-accumulation loop in one
  process (16 micro-batches, ``(loss / 16).backward()``, one step), run in a
  fresh process started like a DDP rank, as flexpar's worker is a process of
  its own. Goal >= 0.97.
- ``memory_ratio_16x``: peak RSS of the flexpar worker process at a 16x global
  batch over its peak RSS at 1x (the same micro-batch). Goal <= 1.05. For
  reference, ``loop_memory_ratio_16x`` is the same ratio for the plain loop
  (which reads its own VmHWM at the end).
- ``clip_ratio``: samples/s of flexpar on 2 devices (the DDP comparison's
  job) with ``max_grad_norm`` on over the same job with it off. The bound
  (``CLIP_NORM``) is below the gradient's norm, so every step clips (the
  fraction of clipped steps is in the JSON). Both sides measure the norm
  (every step record has ``grad_norm``); clipping adds one multiplication
  of the summed gradient. Goal >= 0.98.
- ``bf16_vs_reference``: samples/s of flexpar on 1 device with 16 VWs and
  ``mixed_precision="bf16"`` over the accumulation loop doing the same by
  hand (each micro-batch's forward and loss under
  ``torch.autocast("cpu", dtype=torch.bfloat16)``). Goal >= 0.97.

Steady state: start-up is excluded by timing only steps ``skip .. steps-1``.
A step's duration is the gap between its commit and the previous one, on
both sides (flexpar: the ``time`` of its step records; the baselines: the
wall clock right after ``optimizer.step()`` and ``zero_grad()``, the point at
which flexpar stamps a commit). A run's samples/s is samples per step over
its median step duration (the mean over the span is kept in the JSON too);
the figure is the median over rounds. The load average at start and end goes
into the JSON: on a shared machine, read the ratios with it, and with the
``*_best_rounds`` ratios (each side's best round), which other work on the
machine disturbs less.

Threads: flexpar gives each CPU device ``cores // devices`` torch threads; each
DDP rank and the accumulation loop get the same.

Peak RSS of a worker: a background thread in this (driver) process reads
every worker's ``VmHWM`` (the kernel's high-water mark of resident memory,
monotonic over a process's life) in /proc every 50 ms and keeps the largest;
it finds the workers by walking the driver's descendants every 0.5 s (a
mark read late is not lower). Workers are the descendants that are neither
the fork server (the driver's direct child that forks them) nor
multiprocessing's resource tracker. A high-water mark only rises, so the last
value read before a worker exits misses at most the growth of its last 50 ms,
in which it only sends the model back and exits.

Run: ``python benchmarks/overhead.py [--quick] [--recipes-only] [--json PATH]``
(``--recipes-only``: the last two comparisons alone).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Dict, List, Optional

import torch
import torch.multiprocessing as torch_multiprocessing
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (  # noqa: E402
    ddp_training_rank,
    alternate, base_parser, cpu_count, free_port, median, print_table, ratio, step_durations, write_json,
)

import flexpar  # noqa: E402
from flexpar.observe.metrics import read_records  # noqa: E402

ACCUMULATION = 16  # VWs (micro-batches) per step in the accumulation comparison
CLIP_NORM = 1e-3  # max_grad_norm of the clip comparison: below the gradient's norm, so every step clips


# ---------------------------------------------------------------- configuration


@dataclasses.dataclass(frozen=True)
class Config:
    """Sizes of one benchmark run; the full run and --quick differ only here."""

    features: int
    hidden: int
    hidden_layers: int
    classes: int
    per_device_batch: int  # DDP comparison: samples per device per step
    micro_batch: int  # accumulation comparison: samples per VW / micro-batch
    steps: int  # steps per run
    skip: int  # leading steps excluded from timing (start-up)
    repeats: int  # alternating rounds
    dataset_size: int

    def parameter_count(self) -> int:
        return sum(parameter.numel() for parameter in MLPFactory(self)().parameters())


# 20 timed steps a run and 5 rounds: with 10 and 3, one run's median moved by 10% between runs
# on this shared 2-core VM, more than the overhead being measured.
FULL = Config(features=1024, hidden=2048, hidden_layers=3, classes=10, per_device_batch=64,
              micro_batch=4, steps=24, skip=4, repeats=5, dataset_size=4096)
QUICK = Config(features=256, hidden=512, hidden_layers=2, classes=10, per_device_batch=32,
               micro_batch=4, steps=8, skip=3, repeats=1, dataset_size=1024)


# ---------------------------------------------------------------- shared training pieces
# Module level, so that flexpar's worker processes (which import this script)
# and DDP's spawned ranks find them by name.


class MLPFactory:
    """Builds the benchmark MLP: ``hidden_layers`` Linear+ReLU layers, then a classifier."""

    def __init__(self, config: Config):
        self.config = config

    def __call__(self) -> nn.Module:
        config = self.config
        layers: List[nn.Module] = []
        width = config.features
        for _ in range(config.hidden_layers):
            layers += [nn.Linear(width, config.hidden), nn.ReLU()]
            width = config.hidden
        layers.append(nn.Linear(width, config.classes))
        return nn.Sequential(*layers)


def make_optimizer(parameters):
    return torch.optim.SGD(parameters, lr=0.01, momentum=0.9)


def classification_loss(model, batch):
    inputs, labels = batch
    return nn.functional.cross_entropy(model(inputs), labels)


def make_dataset(config: Config) -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(config.dataset_size, config.features, generator=generator)
    labels = torch.randint(0, config.classes, (config.dataset_size,), generator=generator)
    return TensorDataset(inputs, labels)


def throughput(commit_times: List[float], skip: int, samples_per_step: int) -> dict:
    """Steady-state samples/s of one run, two ways.

    ``samples_per_s`` (the figure the ratios use): samples per step over the
    median step duration of steps ``skip ..``; a median, because this machine
    is shared and a step now and then is stretched by someone else's work.
    ``mean_samples_per_s``: over the whole span of those steps, for reference.
    """
    durations = step_durations(commit_times, skip)
    return {
        "samples_per_s": samples_per_step / median(durations),
        "mean_samples_per_s": samples_per_step * len(durations) / sum(durations),
    }


# ---------------------------------------------------------------- peak RSS of workers


def _children(pid: int) -> List[int]:
    """Child pids of ``pid``, from /proc/PID/task/TID/children (one small read per thread).

    Reading only the driver's own tree keeps the watcher cheap: it shares the
    machine with the processes it measures.
    """
    children: List[int] = []
    try:
        threads = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return children
    for thread in threads:
        try:
            with open(f"/proc/{pid}/task/{thread}/children") as handle:
                children += [int(child) for child in handle.read().split()]
        except (OSError, ValueError):
            continue
    return children


def _command_line(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            return handle.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _peak_rss_bytes(pid: int) -> Optional[int]:
    try:
        with open(f"/proc/{pid}/status") as handle:
            for line in handle:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def worker_pids(driver_pid: int) -> List[int]:
    """Descendants of the driver that are training workers (see the module docstring)."""
    found: List[int] = []
    pending = [(child, 1) for child in _children(driver_pid)]
    while pending:
        pid, depth = pending.pop()
        pending += [(child, depth + 1) for child in _children(pid)]
        command = _command_line(pid)
        if "resource_tracker" in command or (depth == 1 and "forkserver" in command):
            continue
        found.append(pid)
    return found


class PeakMemoryWatcher:
    """Context manager: ``peaks`` maps each worker pid seen to its largest VmHWM in bytes."""

    WALK_EVERY = 10  # reads of the workers' VmHWM per walk of the process tree

    def __init__(self, interval_s: float = 0.05):
        self.interval_s = interval_s
        self.peaks: Dict[int, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def _watch(self) -> None:
        # The process tree is walked every WALK_EVERY reads only (workers live for the whole
        # fit, and a high-water mark found late is not lower): walking it every 50 ms cost
        # about 1% of a core, taken from the flexpar side only, which computes on every core.
        driver = os.getpid()
        workers: List[int] = []
        reads = 0
        while not self._stop.is_set():
            if reads % self.WALK_EVERY == 0:
                workers = worker_pids(driver)
            reads += 1
            for pid in workers:
                peak = _peak_rss_bytes(pid)
                if peak is not None:
                    self.peaks[pid] = max(peak, self.peaks.get(pid, 0))
            self._stop.wait(self.interval_s)

    def __enter__(self) -> "PeakMemoryWatcher":
        self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._stop.set()
        self._thread.join()

    def largest(self) -> Optional[int]:
        return max(self.peaks.values()) if self.peaks else None


# ---------------------------------------------------------------- flexpar side


def flexpar_run(config: Config, devices: int, virtual_workers: int, global_batch: int, work_dir: str,
                **recipe) -> dict:
    """One flexpar fit(); returns steady samples/s and the largest worker peak RSS.

    `recipe`: Job fields such as max_grad_norm= or mixed_precision=; with
    max_grad_norm, the fraction of timed steps whose gradient was clipped.
    """
    job = flexpar.Job(
        model=MLPFactory(config), optimizer=make_optimizer, loss=classification_loss,
        dataset=make_dataset(config), global_batch=global_batch, virtual_workers=virtual_workers, seed=0,
        **recipe,
    )
    metrics_path = tempfile.mktemp(suffix=".jsonl", dir=work_dir)
    with PeakMemoryWatcher() as watcher:
        job.fit(steps=config.steps, devices=devices, metrics=metrics_path, display=False, quiet=True,
                run_dir=work_dir)
    steps = sorted((r for r in read_records(metrics_path) if r["kind"] == "step"), key=lambda r: r["step"])
    commit_times = [record["time"] for record in steps]
    result = {**throughput(commit_times, config.skip, global_batch), "peak_rss_bytes": watcher.largest()}
    if recipe.get("max_grad_norm"):
        timed = steps[config.skip:]
        result["clipped_fraction"] = sum(r["grad_norm"] > recipe["max_grad_norm"] for r in timed) / len(timed)
    return result


# ---------------------------------------------------------------- DDP side


def _ddp_rank(rank: int, world_size: int, port: int, config: Config, result_path: str) -> None:
    """One DDP rank: the standard loop of the torch DDP tutorial, timing each commit."""
    ddp_training_rank(rank, world_size, port, MLPFactory(config), make_optimizer, make_dataset(config),
                      config.per_device_batch, config.steps, result_path)


def ddp_run(config: Config, world_size: int, work_dir: str) -> dict:
    """One DDP job of ``world_size`` ranks started with torch.multiprocessing.spawn."""
    result_path = tempfile.mktemp(suffix=".txt", dir=work_dir)
    # The same memory watcher as flexpar's runs (a thread reading /proc every 50 ms beside the
    # training processes): both sides share the machine with it alike.
    with PeakMemoryWatcher():
        torch_multiprocessing.spawn(
            _ddp_rank, args=(world_size, free_port(), config, result_path), nprocs=world_size, join=True
        )
    commit_times = [float(value) for value in Path(result_path).read_text().split()]
    samples_per_step = config.per_device_batch * world_size
    return throughput(commit_times, config.skip, samples_per_step)


# ---------------------------------------------------------------- accumulation loop side


def _own_peak_rss_bytes() -> int:
    peak = _peak_rss_bytes(os.getpid())
    return -1 if peak is None else peak


def _accumulation_loop_process(_index: int, config: Config, accumulation: int, result_path: str,
                               bf16: bool = False) -> None:
    """The textbook gradient-accumulation loop, timing each commit; writes times and VmHWM.

    `bf16`: each micro-batch's forward and loss under torch.autocast (bfloat16), as one writes it by hand.
    """
    torch.set_num_threads(cpu_count())  # one device: flexpar gives its worker every core
    torch.manual_seed(0)
    model = MLPFactory(config)()
    optimizer = make_optimizer(model.parameters())
    loader = DataLoader(make_dataset(config), batch_size=config.micro_batch, shuffle=True, drop_last=True)
    commit_times: List[float] = []
    while len(commit_times) < config.steps:
        micro_batches = 0
        for inputs, labels in loader:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                loss = nn.functional.cross_entropy(model(inputs), labels)
            (loss / accumulation).backward()
            micro_batches += 1
            if micro_batches % accumulation == 0:
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                commit_times.append(time.time())
                if len(commit_times) == config.steps:
                    break
    Path(result_path).write_text(json.dumps({"commit_times": commit_times, "peak_rss_bytes": _own_peak_rss_bytes()}))


def accumulation_loop_run(config: Config, accumulation: int, work_dir: str, bf16: bool = False) -> dict:
    """The loop in a fresh process (started like a DDP rank), as flexpar's worker is one."""
    result_path = tempfile.mktemp(suffix=".json", dir=work_dir)
    with PeakMemoryWatcher():  # as beside flexpar's worker (the loop reads its own VmHWM for the figure)
        torch_multiprocessing.spawn(
            _accumulation_loop_process, args=(config, accumulation, result_path, bf16), nprocs=1, join=True
        )
    result = json.loads(Path(result_path).read_text())
    samples_per_step = config.micro_batch * accumulation
    return {**throughput(result["commit_times"], config.skip, samples_per_step),
            "peak_rss_bytes": result["peak_rss_bytes"]}


# ---------------------------------------------------------------- main


def measure(config: Config, work_dir: str) -> dict:
    """All runs, alternating ours and the baseline within each comparison; medians."""
    devices = 2
    ddp = alternate({
        "flexpar": lambda: flexpar_run(config, devices, devices, config.per_device_batch * devices, work_dir),
        "ddp": lambda: ddp_run(config, devices, work_dir),
    }, config.repeats)
    accumulation = alternate({
        "flexpar_16x": lambda: flexpar_run(config, 1, ACCUMULATION, config.micro_batch * ACCUMULATION, work_dir),
        "loop_16x": lambda: accumulation_loop_run(config, ACCUMULATION, work_dir),
        "flexpar_1x": lambda: flexpar_run(config, 1, 1, config.micro_batch, work_dir),
        "loop_1x": lambda: accumulation_loop_run(config, 1, work_dir),
    }, config.repeats)

    def median_of(runs, key):
        values = [run[key] for run in runs if run.get(key) is not None]
        return median(values) if values else None

    figures = {
        "flexpar_2dev_samples_per_s": median_of(ddp["flexpar"], "samples_per_s"),
        "ddp_2dev_samples_per_s": median_of(ddp["ddp"], "samples_per_s"),
        "flexpar_16x_samples_per_s": median_of(accumulation["flexpar_16x"], "samples_per_s"),
        "loop_16x_samples_per_s": median_of(accumulation["loop_16x"], "samples_per_s"),
        "flexpar_16x_peak_rss_bytes": median_of(accumulation["flexpar_16x"], "peak_rss_bytes"),
        "flexpar_1x_peak_rss_bytes": median_of(accumulation["flexpar_1x"], "peak_rss_bytes"),
        "loop_16x_peak_rss_bytes": median_of(accumulation["loop_16x"], "peak_rss_bytes"),
        "loop_1x_peak_rss_bytes": median_of(accumulation["loop_1x"], "peak_rss_bytes"),
    }
    figures["ddp_ratio"] = ratio(figures["flexpar_2dev_samples_per_s"], figures["ddp_2dev_samples_per_s"])
    figures["accumulation_ratio"] = ratio(figures["flexpar_16x_samples_per_s"], figures["loop_16x_samples_per_s"])
    figures["memory_ratio_16x"] = ratio(figures["flexpar_16x_peak_rss_bytes"], figures["flexpar_1x_peak_rss_bytes"])
    # For reference: the same ratio for the plain loop (accumulating into .grad costs a little anywhere).
    figures["loop_memory_ratio_16x"] = ratio(figures["loop_16x_peak_rss_bytes"], figures["loop_1x_peak_rss_bytes"])
    # A cross-check for shared machines, where other work only ever slows a run
    # down: the same ratios from each side's best round.
    best = {name: max(run["samples_per_s"] for run in runs) for name, runs in {**ddp, **accumulation}.items()}
    figures["ddp_ratio_best_rounds"] = ratio(best["flexpar"], best["ddp"])
    figures["accumulation_ratio_best_rounds"] = ratio(best["flexpar_16x"], best["loop_16x"])
    figures["runs"] = {"ddp_comparison": ddp, "accumulation_comparison": accumulation}
    return figures


def _median_of(runs, key):
    values = [run[key] for run in runs if run.get(key) is not None]
    return median(values) if values else None


def measure_recipes(config: Config, work_dir: str) -> dict:
    """clip_ratio and bf16_vs_reference (module docstring), each side by side, alternating; medians."""
    devices = 2
    global_batch = config.per_device_batch * devices
    clip = alternate({
        "clip_off": lambda: flexpar_run(config, devices, devices, global_batch, work_dir),
        "clip_on": lambda: flexpar_run(config, devices, devices, global_batch, work_dir, max_grad_norm=CLIP_NORM),
    }, config.repeats)
    bf16 = alternate({
        "flexpar_bf16_16x": lambda: flexpar_run(config, 1, ACCUMULATION, config.micro_batch * ACCUMULATION, work_dir,
                                                mixed_precision="bf16"),
        "loop_bf16_16x": lambda: accumulation_loop_run(config, ACCUMULATION, work_dir, bf16=True),
    }, config.repeats)
    figures = {
        "clip_off_2dev_samples_per_s": _median_of(clip["clip_off"], "samples_per_s"),
        "clip_on_2dev_samples_per_s": _median_of(clip["clip_on"], "samples_per_s"),
        "clipped_fraction": _median_of(clip["clip_on"], "clipped_fraction"),
        "flexpar_bf16_16x_samples_per_s": _median_of(bf16["flexpar_bf16_16x"], "samples_per_s"),
        "loop_bf16_16x_samples_per_s": _median_of(bf16["loop_bf16_16x"], "samples_per_s"),
    }
    figures["clip_ratio"] = ratio(figures["clip_on_2dev_samples_per_s"], figures["clip_off_2dev_samples_per_s"])
    figures["bf16_vs_reference"] = ratio(figures["flexpar_bf16_16x_samples_per_s"], figures["loop_bf16_16x_samples_per_s"])
    best = {name: max(run["samples_per_s"] for run in runs) for name, runs in {**clip, **bf16}.items()}
    figures["clip_ratio_best_rounds"] = ratio(best["clip_on"], best["clip_off"])
    figures["bf16_vs_reference_best_rounds"] = ratio(best["flexpar_bf16_16x"], best["loop_bf16_16x"])
    figures["recipe_runs"] = {"clip_comparison": clip, "bf16_comparison": bf16}
    return figures


def report(figures: dict, config: Config) -> None:
    mib = 1 << 20

    def in_mib(value):
        return None if value is None else value / mib

    rows = [] if "ddp_ratio" not in figures else [
        {"comparison": "samples/s: flexpar 2 devices / DDP 2 ranks", "flexpar": figures["flexpar_2dev_samples_per_s"],
         "baseline": figures["ddp_2dev_samples_per_s"], "ratio": figures["ddp_ratio"], "goal": ">= 0.97"},
        {"comparison": "samples/s: flexpar 1 device 16 VWs / accumulation loop",
         "flexpar": figures["flexpar_16x_samples_per_s"], "baseline": figures["loop_16x_samples_per_s"],
         "ratio": figures["accumulation_ratio"], "goal": ">= 0.97"},
        {"comparison": "peak RSS MiB: flexpar worker 16x / 1x global batch",
         "flexpar": in_mib(figures["flexpar_16x_peak_rss_bytes"]),
         "baseline": in_mib(figures["flexpar_1x_peak_rss_bytes"]),
         "ratio": figures["memory_ratio_16x"], "goal": "<= 1.05"},
        {"comparison": "  reference: peak RSS MiB: loop 16x / 1x",
         "flexpar": in_mib(figures["loop_16x_peak_rss_bytes"]),
         "baseline": in_mib(figures["loop_1x_peak_rss_bytes"]),
         "ratio": figures["loop_memory_ratio_16x"], "goal": ""},
    ]
    if "clip_ratio" in figures:
        rows += [
            {"comparison": f"samples/s: flexpar 2 devices, max_grad_norm={CLIP_NORM:g} on / off",
             "flexpar": figures["clip_on_2dev_samples_per_s"], "baseline": figures["clip_off_2dev_samples_per_s"],
             "ratio": figures["clip_ratio"], "goal": ">= 0.98"},
            {"comparison": "samples/s: flexpar bf16 1 device 16 VWs / bf16 accumulation loop",
             "flexpar": figures["flexpar_bf16_16x_samples_per_s"], "baseline": figures["loop_bf16_16x_samples_per_s"],
             "ratio": figures["bf16_vs_reference"], "goal": ">= 0.97"},
        ]
    title = (f"flexpar overhead: MLP of {config.parameter_count() / 1e6:.1f}M parameters, "
             f"{config.repeats} alternating rounds, medians, steps {config.skip}..{config.steps - 1} timed, "
             f"{cpu_count()} cores")
    for row in rows:  # numerator / denominator columns
        row["numerator"], row["denominator"] = row.pop("flexpar"), row.pop("baseline")
    print_table(rows, ["comparison", "numerator", "denominator", "ratio", "goal"], title)


def main() -> None:
    parser = base_parser(__doc__.split("\n\n")[0])
    parser.add_argument("--recipes-only", action="store_true",
                        help="only clip_ratio and bf16_vs_reference (skip the DDP, accumulation and memory runs)")
    arguments = parser.parse_args()
    config = QUICK if arguments.quick else FULL
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="flexpar-overhead-") as work_dir:
        figures = {} if arguments.recipes_only else measure(config, work_dir)
        figures.update(measure_recipes(config, work_dir))
    figures["load_average_before_after"] = [load_before[0], os.getloadavg()[0]]
    report(figures, config)
    best = [f"{name} {figures[key]:.3f}" for name, key in (
        ("ddp", "ddp_ratio_best_rounds"), ("accumulation", "accumulation_ratio_best_rounds"),
        ("clip", "clip_ratio_best_rounds"), ("bf16", "bf16_vs_reference_best_rounds")) if figures.get(key) is not None]
    print(f"load average (1 min) before/after: {load_before[0]:.2f} / {os.getloadavg()[0]:.2f}; "
          f"ratios of the best rounds: {', '.join(best)}; steps clipped with max_grad_norm on: "
          f"{figures['clipped_fraction']:.0%}")
    figures["config"] = dataclasses.asdict(config)
    figures["parameters"] = config.parameter_count()
    figures["cores"] = cpu_count()
    write_json(arguments.json, figures)


if __name__ == "__main__":
    main()
