"""Job(deterministic=True): bit-for-bit equality on any device set, and what it costs (exact gradient sums).

Figures (``--json PATH``):

- ``bitwise_equal``: configuration -> whether the digests of every step and
  the final parameters (``torch.equal``) of benchmarks/sharding_job.py's AdamW
  job with ``deterministic=True`` equal those of the one-device run of the same
  recipe: 2 devices, 3 devices, 4 devices with a +1, a -1 and a kill -9,
  sharded at redundancy 2 on 3 devices, and bf16 with clipping on 3 devices
  (against its own one-device run).
- ``max_rel_err_default``: the same job with today's float sums, one device
  against the 4-device schedule: the largest element difference relative to
  its tensor's largest value, over all tensors.
- ``step_time_ratio``: median step time of float sums / exact sums on
  benchmarks/overhead.py's job (1.0: free), the worse of 2 devices with 2 VWs
  and 1 device with 16 VWs, alternating rounds (``step_time_ratios`` has both).
- ``peak_memory_ratio``: peak RSS of the largest worker, exact / float, the
  worse of the same runs.
- ``redo_steps``: steps redone for the scale, per run of the first part (the
  sum of its records' ``redone``); ``redo_steps_max`` the most of any run.
- ``fp32_agreement``: one step's gradient of the sharding job's model (16
  VWs, in this process): the largest error relative to each tensor's largest
  value of the exact sum and of the float32 sum (summed VW by VW, as one device
  does) against a float64 sum of the same VW gradients; ``exact_closer``.

The full job is 25.2M parameters and 60 steps a run (``--quick``: the 3.2M
model, fewer steps). CPU devices: a deterministic job's devices run one
intra-op thread each, the float job's ``cores // devices``; the step time
ratio includes that difference.

On a GPU (``--device cuda``): the cost part's one-device comparison (16
VWs) with flexpar on the first GPU over NCCL (a deterministic job's worker sets
``torch.use_deterministic_algorithms`` and the cuBLAS workspace there); the
2-device comparison takes two GPUs and stays on CPU devices.
``--cost-only`` runs the cost part alone (benchmarks/gpu_check.py: the
figure that decides whether ``deterministic=True`` can be the default).

Run: ``python benchmarks/determinism.py [--quick] [--cost-only] [--device cpu|cuda] [--rounds N] [--json PATH]``
(``--rounds``: the cost part's alternating rounds instead of overhead.py's 5, 1 with ``--quick``)
"""

from __future__ import annotations

import dataclasses
import os
import sys
import tempfile
from typing import Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness
import overhead
import sharding_job
import torch
from harness import alternate
from overhead_workload import FULL, QUICK

from flexpar.core import batching, exact_sum
from flexpar.worker.loader import load_batch

progress = harness.progress("determinism")


def _fit(job, name: str, work_dir: str, steps: int, **options) -> dict:
    metrics = os.path.join(work_dir, f"{name}.jsonl")
    model, _ = job.fit(steps=steps, metrics=metrics, display=False, quiet=True, run_dir=work_dir, **options)
    records = harness.step_records(metrics)
    state = {key: value.detach().clone() for key, value in model.state_dict().items()}
    return {
        "state": state,
        "digests": [r.get("digest") for r in records],
        "redone": sum(r.get("redone", 0) for r in records),
    }


def _bitwise(first: dict, second: dict) -> bool:
    same_state = all(torch.equal(first["state"][key], second["state"][key]) for key in first["state"])
    return same_state and first["digests"] == second["digests"]


def _max_rel_err(first: dict, second: dict) -> float:
    worst = 0.0
    for key, value in first["state"].items():
        scale = float(value.abs().max()) or 1.0
        worst = max(worst, float((value - second["state"][key]).abs().max()) / scale)
    return worst


def measure_equality(quick: bool, work_dir: str) -> dict:
    steps, join_at, leave_at, kill_at = (32, 2, 24, 28) if quick else (60, 2, 30, 40)
    global_batch = 64 if quick else 256
    plain = dataclasses.replace(sharding_job.make_job(quick, global_batch), deterministic=True)
    sharded = dataclasses.replace(sharding_job.make_job(quick, global_batch, shard_redundancy=2), deterministic=True)
    bf16 = dataclasses.replace(plain, mixed_precision="bf16", max_grad_norm=1.0)
    elastic = {"devices": 4, "max_devices": 5, "schedule": f"{join_at}:+1,{leave_at}:-1"}
    elastic["faults"] = f"{kill_at}:local-1:backward"
    runs = {}
    for name, job, options in [
        ("one_device", plain, {"devices": 1}),
        ("2_devices", plain, {"devices": 2}),
        ("3_devices", plain, {"devices": 3}),
        ("4_devices_join_leave_kill", plain, elastic),
        ("sharded_r2_3_devices", sharded, {"devices": 3}),
        ("bf16_clip_one_device", bf16, {"devices": 1}),
        ("bf16_clip_3_devices", bf16, {"devices": 3}),
    ]:
        runs[name] = _fit(job, name, work_dir, steps, oversubscribe=True, **options)
        progress(f"{name}: redone {runs[name]['redone']}")
    reference = runs["one_device"]
    equal = {
        name: _bitwise(reference, runs[name]) for name in runs if name not in ("one_device", "bf16_clip_one_device")
    }
    equal["bf16_clip_3_devices"] = _bitwise(runs["bf16_clip_one_device"], runs["bf16_clip_3_devices"])
    default = dataclasses.replace(plain, deterministic=False)
    float_one = _fit(default, "float_one_device", work_dir, steps, devices=1, oversubscribe=True)
    float_elastic = _fit(default, "float_elastic", work_dir, steps, oversubscribe=True, **elastic)
    redo = {name: run["redone"] for name, run in runs.items()}
    return {
        "bitwise_equal": equal,
        "max_rel_err_default": _max_rel_err(float_one, float_elastic),
        "max_rel_err_exact": _max_rel_err(reference, runs["4_devices_join_leave_kill"]),
        "redo_steps": redo,
        "redo_steps_max": max(redo.values()),
        "steps": steps,
    }


def measure_cost(quick: bool, work_dir: str, device: str = "cpu", rounds: Optional[int] = None) -> dict:
    """Float against exact sums on overhead.py's job: 2 devices with 2 VWs (CPU only) and 1 device with 16 VWs."""
    config = QUICK if quick else FULL
    rounds = rounds or config.repeats
    sides = {
        "float_16vw": lambda _: overhead.flexpar_run(config, 1, 16, config.micro_batch * 16, work_dir, device=device),
        "exact_16vw": lambda _: overhead.flexpar_run(
            config, 1, 16, config.micro_batch * 16, work_dir, device=device, deterministic=True
        ),
    }
    kinds = ("16vw",)
    if device == "cpu":
        kinds = ("2dev", "16vw")
        sides = {
            "float_2dev": lambda _: overhead.flexpar_run(config, 2, 2, config.per_device_batch * 2, work_dir),
            "exact_2dev": lambda _: overhead.flexpar_run(
                config, 2, 2, config.per_device_batch * 2, work_dir, deterministic=True
            ),
            **sides,
        }
    results = alternate(sides, rounds)
    figures = {"step_time_ratios": {}, "peak_memory_ratios": {}, "device": device}
    for kind in kinds:
        float_rate = harness.median_of(results[f"float_{kind}"], "samples_per_s")
        exact_rate = harness.median_of(results[f"exact_{kind}"], "samples_per_s")
        figures["step_time_ratios"][kind] = harness.ratio(exact_rate, float_rate)  # = float step time / exact's
        float_peak = max(run["peak_rss_bytes"] for run in results[f"float_{kind}"])
        exact_peak = max(run["peak_rss_bytes"] for run in results[f"exact_{kind}"])
        figures["peak_memory_ratios"][kind] = harness.ratio(exact_peak, float_peak)
    figures["samples_per_s"] = {name: harness.median_of(runs, "samples_per_s") for name, runs in results.items()}
    figures["step_time_ratio"] = min(figures["step_time_ratios"].values())
    figures["peak_memory_ratio"] = max(figures["peak_memory_ratios"].values())
    figures["rounds"] = rounds
    return figures


def measure_agreement(quick: bool) -> dict:
    """One step's summed gradient: exact and float32 VW-by-VW sums against a float64 sum."""
    global_batch = 64 if quick else 256
    job = sharding_job.make_job(quick, global_batch)
    torch.manual_seed(job.seed)
    model = job.model()
    contributions = []
    for virtual_worker in range(job.virtual_workers):
        indices = batching.virtual_worker_indices(
            job.seed, 0, virtual_worker, len(job.dataset), job.global_batch, job.virtual_workers
        )
        batch = load_batch(job, indices, batching.data_seed(job.seed, 0, virtual_worker))
        model.zero_grad(set_to_none=True)
        (job.loss(model, batch) / job.virtual_workers).backward()
        contributions.append([parameter.grad.clone() for parameter in model.parameters()])
    exact_worst = float32_worst = 0.0
    for index in range(len(contributions[0])):
        parts = [vw[index] for vw in contributions]
        reference = sum(part.double() for part in parts)
        float32 = parts[0].clone()
        for part in parts[1:]:
            float32 += part
        exponent = exact_sum.exponent_for(max(float(part.abs().max()) for part in parts), len(parts))
        accumulator = torch.zeros(parts[0].shape, dtype=torch.int64)
        for part in parts:
            exact_sum.add_fixed(accumulator, part, exponent)
        exact = exact_sum.to_float(accumulator, exponent, torch.float32)
        scale = float(reference.abs().max()) or 1.0
        exact_worst = max(exact_worst, float((exact.double() - reference).abs().max()) / scale)
        float32_worst = max(float32_worst, float((float32.double() - reference).abs().max()) / scale)
    return {
        "exact_max_rel_err": exact_worst,
        "float32_max_rel_err": float32_worst,
        "exact_closer": exact_worst <= float32_worst,
    }


def parse_arguments(argv=None):
    """The command line (argv: None for sys.argv; benchmarks/gpu_check.py checks its commands with it)."""
    parser = harness.base_parser(__doc__.splitlines()[0])
    parts = parser.add_mutually_exclusive_group()
    parts.add_argument("--skip-cost", action="store_true", help="leave out the step time and memory comparison")
    parts.add_argument("--cost-only", action="store_true", help="only the step time and memory comparison")
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="the cost part's devices: cpu (default) or cuda (flexpar on the first GPU, the 16-VW comparison alone)",
    )
    parser.add_argument("--rounds", type=int, default=None, help="the cost part's alternating rounds (default: 5)")
    args = parser.parse_args(argv)
    if args.device == "cuda" and args.skip_cost:
        parser.error("--device cuda applies to the cost part, which --skip-cost leaves out")
    if args.rounds is not None and args.rounds < 1:
        parser.error(f"--rounds {args.rounds}: at least 1")
    return args


def main() -> int:
    args = parse_arguments()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("determinism.py --device cuda: no CUDA GPU is visible to torch", file=sys.stderr)
        return 2
    result = {"quick": args.quick}
    if not args.cost_only:
        result["fp32_agreement"] = measure_agreement(args.quick)
        progress(f"fp32_agreement: {result['fp32_agreement']}")
    with tempfile.TemporaryDirectory(prefix="flexpar-determinism-") as work_dir:
        if not args.cost_only:
            result.update(measure_equality(args.quick, work_dir))
            progress(f"bitwise_equal: {result['bitwise_equal']}, default {result['max_rel_err_default']:.3g}")
        if not args.skip_cost:
            result.update(measure_cost(args.quick, work_dir, args.device, args.rounds))
    if args.device == "cuda":
        result["gpu"] = torch.cuda.get_device_name(0)
    harness.write_json(args.json, result)
    for key, value in result.items():
        print(f"{key}: {value}")
    return 0 if all(result.get("bitwise_equal", {}).values()) else 1


if __name__ == "__main__":
    harness.run(main)
