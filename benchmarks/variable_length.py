"""The variable-length round of benchmarks/balance.py: balancing by cost against balancing by count.

Workload: the tiny language model (`flexpar.examples.tiny_lm_variable`) on
paragraphs of the standard library's source, lengths as they come (a few bytes
to `max_length`, median about 140), each sample run at its own length, so a
virtual worker's (VW's) compute follows its summed length. Two devices, first
at equal speeds, then at emulated speeds 1, 0.5 (the slower device stretches
each VW's compute to twice its time).

The machine caveat, as in the other rounds: the two device processes share two
cores with whatever else runs, and measured on real compute alone their speeds
swing by 2-3x from step to step (a run next to a test suite: equal token counts
took 0.14 s on one step and 0.52 s on another), which buries what the balancer
does. Real compute also makes the two contenders unequal in a way no accelerator is:
a device that finishes early hands its core to the other. So each sample's
forward and backward is real but small (a one-layer model, width 16: about
1-5 ms for most lengths, up to about 40 ms at 1,024 bytes, where attention's
quadratic cost shows) and is followed by `token_us` microseconds of sleep per
predicted token standing for accelerator time (`--token-us`, default 200:
about 40 ms for a typical sample; 0 runs real compute only). Both contenders
run the identical loss, and the cost function is the plain token count.

For each speed setting, `pairs` times, two runs of the same job over the same
steps and samples, side by side in one benchmark run, the order alternating
from pair to pair: *count*, as flexpar balances without `sample_cost` (equal
VW counts for equal devices), and *cost*, with `sample_cost=token_count`.
Steps [warmup_steps, steps) are measured.

Figures (JSON section `variable_length`; per speed setting, and the two
headline keys of the equal-speed setting at the top of the document):

- `cost_balance_speedup` = median step time by count / by cost, the median over
  the pairs of the per-pair ratio (goal >= 1.15 at equal speeds);
- `cost_balance_imbalance`: the median `imbalance` (busy time) of the cost runs;
  `count_imbalance` that of the count runs;
- `token_imbalance_count` / `token_imbalance_cost`: the median `(max - min) /
  max` of the tokens each device ran, what the balancer aims at, free of timing.

How much a balancer can gain is set by the data: with 16 samples per step on 2
devices, each device of the count split runs 8 samples, whose summed length
varies by about 27% (standard deviation over mean), so the slower of the two
finishes about 15% after the mean; per-sample and per-step costs that do not
grow with length (kernel launches, the all-reduce, the optimizer) dilute it.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from dataclasses import asdict, dataclass, replace
from typing import Dict, List, Optional, Sequence

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from harness import median, print_table, ratio, step_records

from flexpar.core import batching, cost_balance
from flexpar.examples import tiny_lm_variable


@dataclass(frozen=True)
class VariableLengthConfig:
    speed_settings: tuple = ((1.0, 1.0), (1.0, 0.5))
    global_batch: int = 16
    virtual_workers: int = 16
    max_length: int = tiny_lm_variable.DEFAULT_MAX_LENGTH
    max_bytes: int = tiny_lm_variable.DEFAULT_MAX_BYTES
    steps: int = 32
    warmup_steps: int = 6
    pairs: int = 3
    token_us: float = 200.0
    width: int = 16
    heads: int = 2
    layers: int = 1


QUICK = dict(steps=16, warmup_steps=4, pairs=1)


def add_arguments(parser) -> None:
    parser.add_argument(
        "--variable-length",
        choices=("only", "skip"),
        default=None,
        help="run only the variable-length round (balancing by cost), or skip it",
    )
    parser.add_argument(
        "--variable-length-pairs",
        type=int,
        default=None,
        help="alternating count/cost pairs per speed setting (default 3, quick 1)",
    )
    parser.add_argument(
        "--token-us",
        type=float,
        default=None,
        help="emulated device time per predicted token, microseconds (default 200; 0: none)",
    )


def config_from(options) -> VariableLengthConfig:
    config = replace(VariableLengthConfig(), **QUICK) if options.quick else VariableLengthConfig()
    if options.variable_length_pairs is not None:
        config = replace(config, pairs=options.variable_length_pairs)
    if options.token_us is not None:
        config = replace(config, token_us=options.token_us)
    return config


class DeviceTimeLoss:
    """`tiny_lm_variable.loss_fn`, then `seconds_per_token` of sleep per predicted token (device time)."""

    def __init__(self, seconds_per_token: float):
        self.seconds_per_token = seconds_per_token

    def __call__(self, model, batch):
        total, count = tiny_lm_variable.loss_fn(model, batch)
        if self.seconds_per_token:
            time.sleep(self.seconds_per_token * count)
        return total, count


def make_jobs(config: VariableLengthConfig, dataset) -> Dict[str, object]:
    """The two contenders: the same job, without and with sample_cost."""
    longest = max(dataset.length(index) for index in range(len(dataset)))
    model = tiny_lm_variable.ModelFactory(
        context=longest - 1, width=config.width, heads=config.heads, layers=config.layers
    )
    jobs = {}
    for mode in ("count", "cost"):
        job = tiny_lm_variable.build_job(
            dataset,
            by_cost=(mode == "cost"),
            global_batch=config.global_batch,
            virtual_workers=config.virtual_workers,
            model=model,
        )
        jobs[mode] = dataclasses.replace(job, loss=DeviceTimeLoss(config.token_us / 1e6))
    return jobs


def _fit(job, config: VariableLengthConfig, speeds: Sequence[float], metrics: str) -> List[dict]:
    equal = len(set(speeds)) == 1
    job.fit(
        steps=config.steps,
        devices=len(speeds),
        emulate_speeds=None if equal else list(speeds),
        backend="gloo",
        oversubscribe=True,
        metrics=metrics,
        display=False,
        quiet=True,
    )
    return step_records(metrics)


def _token_imbalance(record: dict, job) -> float:
    """(max - min) / max of the tokens each device ran at the record's step."""
    if "cost" in record:
        tokens = record["cost"]
    else:  # by count: contiguous ranges of the record's counts
        indices = batching.split_global_batch(
            batching.global_batch_indices(job.seed, record["step"], len(job.dataset), job.global_batch),
            job.virtual_workers,
        )
        costs = [sum(job.dataset.token_count(index) for index in vw) for vw in indices]
        sets, start = [], 0
        for count in record["assignment"]:
            sets.append(range(start, start + count))
            start += count
        tokens = cost_balance.device_costs(sets, costs)
    return (max(tokens) - min(tokens)) / max(tokens) if max(tokens) > 0 else 0.0


def _figures(records: List[dict], config: VariableLengthConfig, job) -> dict:
    window = [record for record in records if config.warmup_steps <= record["step"] < config.steps]
    return {
        "step_s": median([record["step_time_s"] for record in window]),
        "imbalance": median([record["imbalance"] for record in window]),
        "token_imbalance": median([_token_imbalance(record, job) for record in window]),
        "assignments": [record["assignment"] for record in window[:5]],
    }


def run(config: VariableLengthConfig, folder: str, progress=print) -> dict:
    """Every speed setting's pairs of runs; returns the JSON section."""
    dataset = tiny_lm_variable.load_units(config.max_bytes, config.max_length)
    jobs = make_jobs(config, dataset)
    settings = []
    for speeds in config.speed_settings:
        pairs = []
        for pair in range(config.pairs):
            order = ("count", "cost") if pair % 2 == 0 else ("cost", "count")
            result: Dict[str, dict] = {}
            for mode in order:
                metrics = os.path.join(folder, f"variable-{'-'.join(map(str, speeds))}-{pair}-{mode}.jsonl")
                result[mode] = _figures(_fit(jobs[mode], config, speeds, metrics), config, jobs[mode])
            result["speedup"] = ratio(result["count"]["step_s"], result["cost"]["step_s"])
            pairs.append(result)
            progress(
                f"variable length, speeds {list(speeds)}, pair {pair + 1}/{config.pairs}: "
                f"count {result['count']['step_s']:.3f} s, cost {result['cost']['step_s']:.3f} s"
            )
        settings.append(_setting_summary(speeds, pairs))
    equal = settings[0]
    return {
        "cost_balance_speedup": equal["cost_balance_speedup"],
        "cost_balance_imbalance": equal["cost_balance_imbalance"],
        "goals": {"cost_balance_speedup": ">= 1.15 (equal speeds)"},
        "samples": len(dataset),
        "mean_sample_tokens": sum(dataset.token_count(index) for index in range(len(dataset))) / len(dataset),
        "settings": settings,
        "config": asdict(config),
    }


def _setting_summary(speeds, pairs: List[dict]) -> dict:
    def of(mode, key):
        return median([pair[mode][key] for pair in pairs])

    return {
        "speeds": list(speeds),
        "cost_balance_speedup": median([pair["speedup"] for pair in pairs]),
        "cost_balance_imbalance": of("cost", "imbalance"),
        "count_imbalance": of("count", "imbalance"),
        "count_step_s": of("count", "step_s"),
        "cost_step_s": of("cost", "step_s"),
        "token_imbalance_count": of("count", "token_imbalance"),
        "token_imbalance_cost": of("cost", "token_imbalance"),
        "pairs": pairs,
    }


def print_report(section: Optional[dict]) -> None:
    if not section:
        return
    rows = [
        {
            "speeds": setting["speeds"],
            "count_s": setting["count_step_s"],
            "cost_s": setting["cost_step_s"],
            "speedup": setting["cost_balance_speedup"],
            "imbalance_count": setting["count_imbalance"],
            "imbalance_cost": setting["cost_balance_imbalance"],
            "token_imbalance_count": setting["token_imbalance_count"],
            "token_imbalance_cost": setting["token_imbalance_cost"],
        }
        for setting in section["settings"]
    ]
    config = section["config"]
    print_table(
        rows,
        list(rows[0]),
        title=(
            f"variable-length round: tiny LM on {section['samples']} stdlib paragraphs (mean "
            f"{section['mean_sample_tokens']:.0f} tokens), global batch {config['global_batch']}, "
            f"V={config['virtual_workers']}; median step seconds by count vs by cost (sample_cost)"
        ),
    )
    print(
        f"cost_balance_speedup {section['cost_balance_speedup']:.3f} (goal >= 1.15), "
        f"cost_balance_imbalance {section['cost_balance_imbalance']:.3f}"
    )
