"""Load balancing over devices of unequal speed: flexpar vs a uniform split vs the ideal.

Four local devices run at emulated relative speeds 1, 1, 0.5, 0.25 (a device
of speed s stretches each virtual worker's (VW's) compute to 1/s of it, by
sleeping after it). A step is V = 32 VWs. Each round runs, in turn (the last
two are the V = 128 round):

- **ideal**: a plain single-process loop (speed 1, the torch threads of one
  device process) over the same 32 VWs per step, twice per round. The ideal
  step time of the four devices is its step time / the sum of speeds (2.75).
- **uniform**: what DDP does, equal shares. flexpar has no option to hold its
  balancer fixed, so this is real torch DDP (`torch.multiprocessing`, gloo, one
  process per device), 8 VWs per rank accumulated under `no_sync()`, with the
  emulated speeds applied the same way in its loop.
- **flexpar**: `Job.fit(devices=4, emulate_speeds=...)` as is, balancer on.
  Steps [10, 100) measure the balanced state; then device local-0 drops to
  speed 0.5 (`speed_changes="100:0=0.5"`) and the run measures the recovery.
- **ideal at V = 128**, then **flexpar at V = 128** (no slowdown; steps [20,
  60) measured): the same comparison with 4x finer VWs, where whole VWs cost
  less (`--fine-virtual-workers`, 0 leaves the round out).

Figures (JSON keys; medians over rounds of per-round ratios):

- `efficiency_vs_ideal` = ideal step time / flexpar step time (goal >= 0.95)
- `speedup_vs_uniform` = DDP step time / flexpar step time (goal >= 2.6)
- `imbalance_over_floor` = `imbalance_median` (the median `imbalance` of
  flexpar's step records) minus `imbalance_floor_whole_vws`, the smallest
  imbalance any whole-VW split of the nominal speeds allows (goal <= 0.03)
- `rebalance_steps`: steps after the slowdown until the moving median of 3
  `step_time_s` is within 5% of the new ideal (goal <= 3); which ideal, and
  two stricter readings, in `slowdown_figures`.
- `efficiency_vs_ideal_v128`: the same as `efficiency_vs_ideal` in the V = 128
  round (goal >= 0.96; the whole-VW ceiling there is
  `efficiency_ceiling_whole_vws_v128` = 0.990); its details in `v128`.
- for the simulator's validation: `seconds_per_vw` (per device, local-0
  first, measured by flexpar in the balanced window), `step_time_s`,
  `virtual_workers`, `devices`; also `speeds` and `assignment`.

Whole VWs bound what any balancer can reach here, and the JSON says so:
the best split of 32 VWs takes 12 single-device VW times against
32 / 2.75 = 11.6, so efficiency <= 0.97 and speedup <= 2.67; no split of 32
VWs has an imbalance below 1/12 = 0.083. For the nominal times
`optimal_assignment` picks the most even of the fastest splits, (12, 11, 6,
3), which has exactly that 1/12; measured times decide in a run: a split
predicted faster by less than the measurement noise counts as a tie, and the
balancer takes the most even (flexpar/balance.py, "Near ties"), so (12, 12, 6,
2) (imbalance 0.33) comes when the slowest device is measurably slower than
4x, or stays after a burst of other load on it was taken for a change of speed
(the split never moves back for evenness alone). At V = 128 the best split (47, 47, 23, 11) takes 47 units against
46.5 (ceiling 0.990); the next more even one costs a whole fast VW (2.1%).
`--virtual-workers 64` shows the finer granularity: the floor there is 1/24
(23, 23, 12, 6 or equivalents).

The machine caveat: four device processes share two cores. So that the
emulated devices do not mostly measure CPU contention, each VW is a real
forward/backward of an MLP (about 2-5 ms on one thread) plus a fixed 20 ms
sleep inside the loss that stands for accelerator time (`--kernel-ms`). Slow
devices then mostly sleep, and the four devices need well under two cores.
All three contenders run the identical loss, so the ratios compare like with
like; the ideal is measured alone, so the contention that remains counts
against flexpar (`efficiency_vs_measured_rates` divides it out). Other load on
the machine moves every figure; the JSON records the load average.

The variable-length round (benchmarks/variable_length.py; JSON section
`variable_length`, headline keys `cost_balance_speedup` and
`cost_balance_imbalance`): the tiny language model on standard-library
paragraphs of every length, 2 devices at equal speeds and at 1, 0.5, balanced
by VW count against balanced by cost (`Job(sample_cost=...)`), side by side.

Run: `python benchmarks/balance.py [--quick] [--json PATH] [--keep-metrics DIR]
[--virtual-workers V] [--variable-length only|skip]`.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import time
from dataclasses import replace
from typing import List

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import harness
import variable_length
from balance_baselines import run_single_device, run_uniform_ddp
from balance_figures import balanced_figures, measured_rates_ideal_s, slowdown_figures
from balance_report import print_report, summarise
from balance_workload import QUICK, Config, fine_config, make_job
from harness import median, ratio

_progress = harness.progress("balance")

# ---------------------------------------------------------------- flexpar


def run_flexpar(
    config: Config, folder: str, round_index: int, slowdown: bool = True, name: str = "flexpar"
) -> List[dict]:
    """Step records of one balanced run, with the mid-run slowdown unless `slowdown` is False."""
    metrics = os.path.join(folder, f"{name}-{round_index}.jsonl")
    make_job(config).fit(
        steps=config.flexpar_steps,
        devices=config.devices,
        emulate_speeds=list(config.speeds),
        speed_changes=f"{config.change_step}:{config.changed_device}={config.changed_speed}" if slowdown else None,
        # gloo on CPU processes even where GPUs exist: the devices are emulated.
        backend="gloo",
        oversubscribe=True,
        metrics=metrics,
        display=False,
        quiet=True,
    )
    return harness.step_records(metrics)


# ---------------------------------------------------------------- one round, the report


def run_round(config: Config, folder: str, round_index: int) -> dict:
    """One round: ideal, uniform, ideal again, flexpar, then the V = 128 pair; returns its figures.

    The single-device loop runs twice per round (its step time drifts with the
    load of the machine) and the round's ideal is the median of both runs' steps.
    """
    single_times = []
    started = time.perf_counter()
    single_times += run_single_device(config)["step_times"]
    uniform = run_uniform_ddp(config)
    single_times += run_single_device(config)["step_times"]
    records = run_flexpar(config, folder, round_index)
    fine = run_fine_round(config, folder, round_index) if config.fine_virtual_workers else None
    _progress(f"round {round_index + 1}/{config.rounds} done in {time.perf_counter() - started:.0f} s")
    single = {"step_s": median(single_times), "seconds_per_vw": median(single_times) / config.virtual_workers}
    balanced = balanced_figures(records, config)
    ideal_step_s = single["step_s"] / sum(config.speeds)
    return {
        "single_step_s": single["step_s"],
        "single_seconds_per_vw": single["seconds_per_vw"],
        "ideal_step_s": ideal_step_s,
        "uniform_step_s": uniform["step_s"],
        "uniform_busy_s": uniform["busy_s"],
        "flexpar_step_s": balanced["step_s"],
        "efficiency_vs_ideal": ratio(ideal_step_s, balanced["step_s"]),
        # The same with each device's rate as measured in this run (host contention
        # included in the rates): what is left is balancing and per-step costs.
        "efficiency_vs_measured_rates": ratio(
            measured_rates_ideal_s(balanced["seconds_per_vw"], config.virtual_workers), balanced["step_s"]
        ),
        "speedup_vs_uniform": ratio(uniform["step_s"], balanced["step_s"]),
        "imbalance": balanced["imbalance"],
        "seconds_per_vw": balanced["seconds_per_vw"],
        "assignment": balanced["assignment"],
        **slowdown_figures(records, config, balanced["step_s"], single["seconds_per_vw"]),
        "v128": fine,
    }


def run_fine_round(config: Config, folder: str, round_index: int) -> dict:
    """The V = 128 pair of a round: the ideal (single device), then flexpar without a slowdown."""
    fine = fine_config(config)
    single_s = median(run_single_device(fine)["step_times"])
    records = run_flexpar(fine, folder, round_index, slowdown=False, name="flexpar-v128")
    balanced = balanced_figures(records, fine)
    ideal_step_s = single_s / sum(fine.speeds)
    final = records[-1]["assignment"] if records else None
    # The first step from which the split stayed what it ended as (the balancer settled).
    settled = next(
        (
            record["step"]
            for index, record in enumerate(records)
            if all(later["assignment"] == final for later in records[index:])
        ),
        None,
    )
    return {
        "virtual_workers": fine.virtual_workers,
        "single_step_s": single_s,
        "ideal_step_s": ideal_step_s,
        "flexpar_step_s": balanced["step_s"],
        "efficiency_vs_ideal": ratio(ideal_step_s, balanced["step_s"]),
        "efficiency_vs_measured_rates": ratio(
            measured_rates_ideal_s(balanced["seconds_per_vw"], fine.virtual_workers), balanced["step_s"]
        ),
        "imbalance": balanced["imbalance"],
        "seconds_per_vw": balanced["seconds_per_vw"],
        "assignment": balanced["assignment"],
        "final_assignment": final,
        "settled_step": settled,
        "measured_steps": [fine.warmup_steps, fine.change_step],
    }


def _preload_fork_server() -> None:
    """Have the fork server (used by flexpar's workers and by the DDP ranks) import torch once.

    flexpar's launcher asks for the same modules when it starts the server; the
    DDP baseline starts its ranks from the same server, so neither pays seconds
    of `import torch` per process. Start-up is outside every timed window.
    """
    multiprocessing.set_forkserver_preload(
        ["torch", "torch.distributed", "torch.optim", "torch.nn.parallel", "flexpar.worker.lifecycle"]
    )


def main(argv=None) -> dict:
    parser = harness.base_parser(__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=None, help="alternating rounds (default 3, quick 1)")
    parser.add_argument("--kernel-ms", type=float, default=None, help="emulated device time per VW (default 20)")
    parser.add_argument(
        "--virtual-workers",
        type=int,
        default=None,
        help="VWs per step (default 32; a multiple of the 4 devices, for the uniform split)",
    )
    parser.add_argument(
        "--keep-metrics", metavar="DIR", default=None, help="keep flexpar's metrics files (flexpar-ROUND.jsonl) in DIR"
    )
    parser.add_argument(
        "--fine-virtual-workers",
        type=int,
        default=None,
        help="VWs per step of the second round (default 128; 0 leaves it out)",
    )
    variable_length.add_arguments(parser)
    options = parser.parse_args(argv)
    config = replace(Config(), **QUICK) if options.quick else Config()
    if options.rounds is not None:
        config = replace(config, rounds=options.rounds)
    if options.kernel_ms is not None:
        config = replace(config, kernel_ms=options.kernel_ms)
    if options.virtual_workers is not None:
        if options.virtual_workers % config.devices:
            nearest = config.devices * max(1, options.virtual_workers // config.devices)
            parser.error(
                f"--virtual-workers {options.virtual_workers}: the uniform (DDP) split needs a multiple "
                f"of the {config.devices} devices, e.g. {nearest}"
            )
        config = replace(config, virtual_workers=options.virtual_workers)
    if options.fine_virtual_workers is not None:
        if options.fine_virtual_workers and options.fine_virtual_workers < config.devices:
            parser.error(
                f"--fine-virtual-workers {options.fine_virtual_workers}: at least the "
                f"{config.devices} devices (or 0 for no such round)"
            )
        config = replace(config, fine_virtual_workers=options.fine_virtual_workers)
    _preload_fork_server()
    started = time.perf_counter()
    # Other work on the machine moves every figure here; the load is recorded with them.
    load_before = os.getloadavg()[0]
    with harness.run_folder("flexpar-balance-", keep=options.keep_metrics) as folder:
        rounds = (
            []
            if options.variable_length == "only"
            else [run_round(config, folder, index) for index in range(config.rounds)]
        )
        section = (
            None
            if options.variable_length == "skip"
            else variable_length.run(variable_length.config_from(options), folder, _progress)
        )
    summary = summarise(config, rounds) if rounds else {}
    if section is not None:  # its own section; its two headline figures also at the top
        summary.update(
            cost_balance_speedup=section["cost_balance_speedup"],
            cost_balance_imbalance=section["cost_balance_imbalance"],
            variable_length=section,
        )
    summary["wall_s"] = time.perf_counter() - started
    summary["load_average_1min"] = {"before": load_before, "after": os.getloadavg()[0], "cores": harness.cpu_count()}
    if rounds:
        print_report(summary)
    variable_length.print_report(section)
    harness.write_json(options.json, summary)
    return summary


if __name__ == "__main__":
    harness.run(main)
