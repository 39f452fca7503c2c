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

Peak RSS of a worker (``harness.PeakMemoryWatcher``): a background thread in
this (driver) process reads every worker's ``VmHWM`` (the kernel's high-water
mark of resident memory, monotonic over a process's life) in /proc every 50 ms
and keeps the largest; it finds the workers by walking the driver's descendants
every 50 ms until it has found some, then every 0.5 s (a mark read late is not
lower). Workers are the descendants that are neither the fork server (the
driver's direct child that forks them) nor multiprocessing's resource tracker.
A high-water mark only rises, so the last value read before a worker exits
misses at most the growth of its last 50 ms, in which it only sends the model
back and exits.

On a GPU (``--device cuda``): the one-device comparison alone,
``accumulation_ratio`` (flexpar on the first GPU, NCCL, 16 VWs, against the
same loop on that GPU: the model and each micro-batch moved to it, a commit
stamped after ``torch.cuda.synchronize()``, as flexpar's worker waits for its
device before it commits). The others stay on CPU devices: DDP and clipping
take two devices, the memory ratio reads host RSS, and bf16 is left out to
keep a one-GPU check short (benchmarks/gpu_check.py runs this).

Run: ``python benchmarks/overhead.py [--quick] [--recipes-only] [--device cpu|cuda] [--rounds N] [--json PATH]``
(``--recipes-only``: the last two comparisons alone; ``--rounds``: alternating
rounds instead of the configuration's 5, 1 with ``--quick``).

The pieces: overhead_workload.py (the MLP job and the sizes of a run),
overhead_baselines.py (torch DDP, the accumulation loop).
"""

from __future__ import annotations

import dataclasses
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness
import torch
from harness import PeakMemoryWatcher, alternate, cpu_count, median_of, ratio_of_medians
from overhead_baselines import accumulation_loop_run, ddp_run
from overhead_workload import (
    FULL,
    QUICK,
    Config,
    MLPFactory,
    classification_loss,
    make_dataset,
    make_optimizer,
    throughput,
)

import flexpar

ACCUMULATION = 16  # VWs (micro-batches) per step in the accumulation comparison
BACKENDS = {"cpu": "gloo", "cuda": "nccl"}  # --device: flexpar's backend (CPU processes or GPUs)
CLIP_NORM = 1e-3  # max_grad_norm of the clip comparison: below the gradient's norm, so every step clips


# ---------------------------------------------------------------- flexpar side


def flexpar_run(
    config: Config,
    devices: int,
    virtual_workers: int,
    global_batch: int,
    work_dir: str,
    device: str = "cpu",
    **recipe,
) -> dict:
    """One flexpar fit(); returns steady samples/s and the largest worker peak RSS.

    `device`: "cpu" (CPU processes over gloo) or "cuda" (GPUs over NCCL).
    `recipe`: Job fields such as max_grad_norm= or mixed_precision=; with
    max_grad_norm, the fraction of timed steps whose gradient was clipped.
    """
    job = flexpar.Job(
        model=MLPFactory(config),
        optimizer=make_optimizer,
        loss=classification_loss,
        dataset=make_dataset(config),
        global_batch=global_batch,
        virtual_workers=virtual_workers,
        seed=0,
        **recipe,
    )
    metrics_path = harness.unique_path(work_dir, ".jsonl")
    with PeakMemoryWatcher() as watcher:
        job.fit(
            steps=config.steps,
            devices=devices,
            metrics=metrics_path,
            display=False,
            quiet=True,
            run_dir=work_dir,
            backend=BACKENDS[device],
        )
    steps = harness.step_records(metrics_path)
    commit_times = [record["time"] for record in steps]
    result = {**throughput(commit_times, config.skip, global_batch), "peak_rss_bytes": watcher.largest()}
    if recipe.get("max_grad_norm"):
        timed = steps[config.skip :]
        result["clipped_fraction"] = sum(r["grad_norm"] > recipe["max_grad_norm"] for r in timed) / len(timed)
    return result


# ---------------------------------------------------------------- main


def _accumulation_ratio(accumulation: dict) -> dict:
    """accumulation_ratio (and its best rounds): flexpar's 16 VWs over the accumulation loop, from the runs."""
    return ratio_of_medians(
        accumulation,
        "samples_per_s",
        ("flexpar_16x", "flexpar_16x_samples_per_s"),
        ("loop_16x", "loop_16x_samples_per_s"),
        "accumulation_ratio",
        best_rounds=True,
    )


def measure(config: Config, work_dir: str) -> dict:
    """All runs, alternating ours and the baseline within each comparison; medians."""
    devices = 2
    ddp = alternate(
        {
            "flexpar": lambda _: flexpar_run(config, devices, devices, config.per_device_batch * devices, work_dir),
            "ddp": lambda _: ddp_run(config, devices, work_dir),
        },
        config.repeats,
    )
    accumulation = alternate(
        {
            "flexpar_16x": lambda _: flexpar_run(config, 1, ACCUMULATION, config.micro_batch * ACCUMULATION, work_dir),
            "loop_16x": lambda _: accumulation_loop_run(config, ACCUMULATION, work_dir),
            "flexpar_1x": lambda _: flexpar_run(config, 1, 1, config.micro_batch, work_dir),
            "loop_1x": lambda _: accumulation_loop_run(config, 1, work_dir),
        },
        config.repeats,
    )
    figures = {
        **ratio_of_medians(
            ddp,
            "samples_per_s",
            ("flexpar", "flexpar_2dev_samples_per_s"),
            ("ddp", "ddp_2dev_samples_per_s"),
            "ddp_ratio",
            best_rounds=True,
        ),
        **_accumulation_ratio(accumulation),
        **ratio_of_medians(
            accumulation,
            "peak_rss_bytes",
            ("flexpar_16x", "flexpar_16x_peak_rss_bytes"),
            ("flexpar_1x", "flexpar_1x_peak_rss_bytes"),
            "memory_ratio_16x",
        ),
        # For reference: the same ratio for the plain loop (accumulating into .grad costs a little anywhere).
        **ratio_of_medians(
            accumulation,
            "peak_rss_bytes",
            ("loop_16x", "loop_16x_peak_rss_bytes"),
            ("loop_1x", "loop_1x_peak_rss_bytes"),
            "loop_memory_ratio_16x",
        ),
    }
    figures["runs"] = {"ddp_comparison": ddp, "accumulation_comparison": accumulation}
    return figures


def measure_on_gpu(config: Config, work_dir: str) -> dict:
    """accumulation_ratio on the first GPU: flexpar's 16 VWs against the loop on the same GPU, alternating."""
    accumulation = alternate(
        {
            "flexpar_16x": lambda _: flexpar_run(
                config, 1, ACCUMULATION, config.micro_batch * ACCUMULATION, work_dir, device="cuda"
            ),
            "loop_16x": lambda _: accumulation_loop_run(config, ACCUMULATION, work_dir, device="cuda"),
        },
        config.repeats,
    )
    figures = _accumulation_ratio(accumulation)
    figures["runs"] = {"accumulation_comparison": accumulation}
    return figures


def measure_recipes(config: Config, work_dir: str) -> dict:
    """clip_ratio and bf16_vs_reference (module docstring), each side by side, alternating; medians."""
    devices = 2
    global_batch = config.per_device_batch * devices
    clip = alternate(
        {
            "clip_off": lambda _: flexpar_run(config, devices, devices, global_batch, work_dir),
            "clip_on": lambda _: flexpar_run(config, devices, devices, global_batch, work_dir, max_grad_norm=CLIP_NORM),
        },
        config.repeats,
    )
    bf16 = alternate(
        {
            "flexpar_bf16_16x": lambda _: flexpar_run(
                config, 1, ACCUMULATION, config.micro_batch * ACCUMULATION, work_dir, mixed_precision="bf16"
            ),
            "loop_bf16_16x": lambda _: accumulation_loop_run(config, ACCUMULATION, work_dir, bf16=True),
        },
        config.repeats,
    )
    figures = {
        **ratio_of_medians(
            clip,
            "samples_per_s",
            ("clip_on", "clip_on_2dev_samples_per_s"),
            ("clip_off", "clip_off_2dev_samples_per_s"),
            "clip_ratio",
            best_rounds=True,
        ),
        "clipped_fraction": median_of(clip["clip_on"], "clipped_fraction"),
        **ratio_of_medians(
            bf16,
            "samples_per_s",
            ("flexpar_bf16_16x", "flexpar_bf16_16x_samples_per_s"),
            ("loop_bf16_16x", "loop_bf16_16x_samples_per_s"),
            "bf16_vs_reference",
            best_rounds=True,
        ),
    }
    figures["recipe_runs"] = {"clip_comparison": clip, "bf16_comparison": bf16}
    return figures


def report(figures: dict, config: Config, device: str = "cpu") -> None:
    mib = 1 << 20

    def in_mib(value):
        return None if value is None else value / mib

    rows = []
    if "ddp_ratio" in figures:
        rows.append(
            {
                "comparison": "samples/s: flexpar 2 devices / DDP 2 ranks",
                "flexpar": figures["flexpar_2dev_samples_per_s"],
                "baseline": figures["ddp_2dev_samples_per_s"],
                "ratio": figures["ddp_ratio"],
                "goal": ">= 0.97",
            }
        )
    if "accumulation_ratio" in figures:
        on = " (on the GPU)" if device == "cuda" else ""
        rows.append(
            {
                "comparison": f"samples/s: flexpar 1 device 16 VWs / accumulation loop{on}",
                "flexpar": figures["flexpar_16x_samples_per_s"],
                "baseline": figures["loop_16x_samples_per_s"],
                "ratio": figures["accumulation_ratio"],
                "goal": ">= 0.97",
            }
        )
    if "memory_ratio_16x" in figures:
        rows += [
            {
                "comparison": "peak RSS MiB: flexpar worker 16x / 1x global batch",
                "flexpar": in_mib(figures["flexpar_16x_peak_rss_bytes"]),
                "baseline": in_mib(figures["flexpar_1x_peak_rss_bytes"]),
                "ratio": figures["memory_ratio_16x"],
                "goal": "<= 1.05",
            },
            {
                "comparison": "  reference: peak RSS MiB: loop 16x / 1x",
                "flexpar": in_mib(figures["loop_16x_peak_rss_bytes"]),
                "baseline": in_mib(figures["loop_1x_peak_rss_bytes"]),
                "ratio": figures["loop_memory_ratio_16x"],
                "goal": "",
            },
        ]
    if "clip_ratio" in figures:
        rows += [
            {
                "comparison": f"samples/s: flexpar 2 devices, max_grad_norm={CLIP_NORM:g} on / off",
                "flexpar": figures["clip_on_2dev_samples_per_s"],
                "baseline": figures["clip_off_2dev_samples_per_s"],
                "ratio": figures["clip_ratio"],
                "goal": ">= 0.98",
            },
            {
                "comparison": "samples/s: flexpar bf16 1 device 16 VWs / bf16 accumulation loop",
                "flexpar": figures["flexpar_bf16_16x_samples_per_s"],
                "baseline": figures["loop_bf16_16x_samples_per_s"],
                "ratio": figures["bf16_vs_reference"],
                "goal": ">= 0.97",
            },
        ]
    title = (
        f"flexpar overhead: MLP of {config.parameter_count() / 1e6:.1f}M parameters, "
        f"{config.repeats} alternating rounds, medians, steps {config.skip}..{config.steps - 1} timed, "
        f"{cpu_count()} cores" + (f", {figures['gpu']}" if device == "cuda" else "")
    )
    for row in rows:  # numerator / denominator columns
        row["numerator"], row["denominator"] = row.pop("flexpar"), row.pop("baseline")
    harness.print_table(rows, ["comparison", "numerator", "denominator", "ratio", "goal"], title)


def parse_arguments(argv=None):
    """The command line (argv: None for sys.argv; benchmarks/gpu_check.py checks its commands with it)."""
    parser = harness.base_parser(__doc__.split("\n\n")[0])
    parser.add_argument(
        "--recipes-only",
        action="store_true",
        help="only clip_ratio and bf16_vs_reference (skip the DDP, accumulation and memory runs)",
    )
    parser.add_argument(
        "--device",
        choices=sorted(BACKENDS),
        default="cpu",
        help="cpu (default: every comparison, CPU processes over gloo) or cuda (the one-device accumulation "
        "comparison alone, flexpar and the loop on the first GPU)",
    )
    parser.add_argument("--rounds", type=int, default=None, help="alternating rounds (default: 5, 1 with --quick)")
    arguments = parser.parse_args(argv)
    if arguments.device == "cuda" and arguments.recipes_only:
        parser.error("--recipes-only runs on CPU devices (clipping takes 2 devices); leave out --device cuda")
    if arguments.rounds is not None and arguments.rounds < 1:
        parser.error(f"--rounds {arguments.rounds}: at least 1")
    return arguments


def main() -> int:
    arguments = parse_arguments()
    config = QUICK if arguments.quick else FULL
    if arguments.rounds is not None:
        config = dataclasses.replace(config, repeats=arguments.rounds)
    if arguments.device == "cuda" and not torch.cuda.is_available():
        print("overhead.py --device cuda: no CUDA GPU is visible to torch", file=sys.stderr)
        return 2
    load_before = os.getloadavg()
    with harness.run_folder("flexpar-overhead-") as work_dir:
        if arguments.device == "cuda":
            figures = measure_on_gpu(config, work_dir)
        else:
            figures = {} if arguments.recipes_only else measure(config, work_dir)
            figures.update(measure_recipes(config, work_dir))
    figures["load_average_before_after"] = [load_before[0], os.getloadavg()[0]]
    figures["device"] = arguments.device
    if arguments.device == "cuda":  # asked only now: this process holds no CUDA context while the runs are timed
        figures["gpu"] = torch.cuda.get_device_name(0)
    report(figures, config, arguments.device)
    best = [
        f"{name} {figures[key]:.3f}"
        for name, key in (
            ("ddp", "ddp_ratio_best_rounds"),
            ("accumulation", "accumulation_ratio_best_rounds"),
            ("clip", "clip_ratio_best_rounds"),
            ("bf16", "bf16_vs_reference_best_rounds"),
        )
        if figures.get(key) is not None
    ]
    clipped = (
        f"; steps clipped with max_grad_norm on: {figures['clipped_fraction']:.0%}"
        if figures.get("clipped_fraction") is not None
        else ""
    )
    print(
        f"load average (1 min) before/after: {load_before[0]:.2f} / {os.getloadavg()[0]:.2f}; "
        f"ratios of the best rounds: {', '.join(best)}{clipped}"
    )
    figures["config"] = dataclasses.asdict(config)
    figures["parameters"] = config.parameter_count()
    figures["cores"] = cpu_count()
    harness.write_json(arguments.json, figures)
    return 0


if __name__ == "__main__":
    harness.run(main)
