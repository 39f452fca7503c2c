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

import itertools
import json
import math
import multiprocessing
import os
import sys
import tempfile
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, replace
from typing import List, Optional, Sequence

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as torch_mp  # noqa: E402
from torch import nn  # noqa: E402

import flexpar  # noqa: E402
from common import base_parser, cpu_count, free_port, median, print_table, ratio, write_json  # noqa: E402
import variable_length  # noqa: E402
from flexpar.core.balance import optimal_assignment, predicted_step_seconds  # noqa: E402
from flexpar.observe.metrics import read_records  # noqa: E402

# ---------------------------------------------------------------- workload
# Module level, so flexpar workers and DDP ranks import them by reference.

INPUTS = 256
HIDDEN = 512
CLASSES = 10
MICRO_BATCH = 16
DATASET_SIZE = 4096
SEED = 0


def make_dataset(size: int = DATASET_SIZE, seed: int = SEED):
    """Synthetic classification data: labels are the argmax of a fixed projection."""
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(size, INPUTS, generator=generator)
    projection = torch.randn(INPUTS, CLASSES, generator=generator)
    return torch.utils.data.TensorDataset(inputs, (inputs @ projection).argmax(dim=1))


def make_model() -> nn.Module:
    return nn.Sequential(
        nn.Linear(INPUTS, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, CLASSES)
    )


def make_optimizer(parameters):
    return torch.optim.SGD(parameters, lr=0.05, momentum=0.9)


class EmulatedKernelLoss:
    """Cross-entropy of a real forward pass, plus `kernel_s` of sleep standing for device time."""

    def __init__(self, kernel_s: float):
        self.kernel_s = kernel_s

    def __call__(self, model, batch):
        inputs, labels = batch
        loss = nn.functional.cross_entropy(model(inputs), labels)
        time.sleep(self.kernel_s)
        return loss


def stretch_to_speed(elapsed_s: float, speed: float) -> float:
    """Emulate a device of relative `speed`: sleep so that `elapsed_s` of work takes elapsed_s / speed.

    The same rule as flexpar's worker (sleep (1/speed - 1) x the VW's measured
    compute, after it); returns the stretched duration.
    """
    if speed >= 1.0:
        return elapsed_s
    pause = elapsed_s * (1.0 / speed - 1.0)
    time.sleep(pause)
    return elapsed_s + pause


# ---------------------------------------------------------------- configuration


@dataclass(frozen=True)
class Config:
    speeds: tuple = (1.0, 1.0, 0.5, 0.25)
    virtual_workers: int = 32
    kernel_ms: float = 20.0
    rounds: int = 3
    flexpar_steps: int = 140  # steps [warmup_steps, change_step) measure the balanced state
    warmup_steps: int = 10
    change_step: int = 100
    changed_device: int = 0
    changed_speed: float = 0.5
    ddp_steps: int = 12
    single_steps: int = 6
    moving_window: int = 3
    tolerance: float = 0.05
    fine_virtual_workers: int = 128  # the second round's V (0: no such round)
    fine_steps: int = 60  # steps [fine_warmup_steps, fine_steps) measure it
    fine_warmup_steps: int = 20
    fine_single_steps: int = 3

    @property
    def global_batch(self) -> int:
        return self.virtual_workers * MICRO_BATCH

    @property
    def devices(self) -> int:
        return len(self.speeds)

    @property
    def changed_speeds(self) -> tuple:
        speeds = list(self.speeds)
        speeds[self.changed_device] = self.changed_speed
        return tuple(speeds)


QUICK = dict(rounds=1, flexpar_steps=36, warmup_steps=5, change_step=20, ddp_steps=5, single_steps=3,
             fine_steps=30, fine_warmup_steps=15, fine_single_steps=2)


def fine_config(config: Config) -> Config:
    """The V = 128 round as a Config of its own: no slowdown, steps [fine_warmup_steps, fine_steps) measured.

    The balancer settles in steps, not seconds, and after its first move at
    the fourth step it may need a dozen or two more to resolve a one-VW
    difference of 2% (flexpar/balance.py), so the window starts at step 20.
    """
    return replace(config, virtual_workers=config.fine_virtual_workers, flexpar_steps=config.fine_steps,
                   warmup_steps=config.fine_warmup_steps, change_step=config.fine_steps,
                   single_steps=config.fine_single_steps)


def threads_per_device(config: Config) -> int:
    """Torch threads of one device process: what flexpar's launcher gives each CPU worker
    (cores // devices, at least 1); the single-device loop and the DDP ranks use the same."""
    return max(1, cpu_count() // config.devices)


def make_job(config: Config) -> flexpar.Job:
    return flexpar.Job(
        model=make_model, optimizer=make_optimizer, loss=EmulatedKernelLoss(config.kernel_ms / 1000.0),
        dataset=make_dataset(), global_batch=config.global_batch, virtual_workers=config.virtual_workers,
        seed=SEED,
    )


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
    with tempfile.TemporaryDirectory() as folder:
        result_path = os.path.join(folder, "ddp.json")
        # start_processes is what mp.spawn calls; a fork server imports torch once
        # instead of once per rank (start-up is not timed, this only saves wall time).
        torch_mp.start_processes(_ddp_rank, args=(config, free_port(), result_path), nprocs=config.devices,
                                 join=True, start_method="forkserver")
        with open(result_path) as handle:
            result = json.load(handle)
    skip = min(2, config.ddp_steps - 1)
    busy_per_rank = [median(times[skip:]) for times in result["busy_times"]]
    return {"step_s": median(result["step_times"][skip:]), "busy_s": busy_per_rank}


# ---------------------------------------------------------------- flexpar


def run_flexpar(config: Config, folder: str, round_index: int, slowdown: bool = True,
                name: str = "flexpar") -> List[dict]:
    """Step records of one balanced run, with the mid-run slowdown unless `slowdown` is False."""
    metrics = os.path.join(folder, f"{name}-{round_index}.jsonl")
    make_job(config).fit(
        steps=config.flexpar_steps, devices=config.devices, emulate_speeds=list(config.speeds),
        speed_changes=f"{config.change_step}:{config.changed_device}={config.changed_speed}" if slowdown else None,
        # gloo on CPU processes even where GPUs exist: the devices are emulated.
        backend="gloo", oversubscribe=True, metrics=metrics, display=False, quiet=True,
    )
    return [record for record in read_records(metrics) if record["kind"] == "step"]


def _device_index(device_id: str) -> int:
    return int(device_id.rsplit("-", 1)[1])


def balanced_figures(records: Sequence[dict], config: Config) -> dict:
    """Medians over the balanced window [warmup_steps, change_step): step time, imbalance,
    per-device seconds per VW and VWs (both by device index local-0, local-1, ...)."""
    window = [record for record in records if config.warmup_steps <= record["step"] < config.change_step]
    per_vw = [[] for _ in range(config.devices)]
    counts = [[] for _ in range(config.devices)]
    for record in window:
        for device_id, count, busy in zip(record["devices"], record["assignment"], record["busy_s"]):
            per_vw[_device_index(device_id)].append(busy / count)
            counts[_device_index(device_id)].append(count)
    return {
        "step_s": median([record["step_time_s"] for record in window]),
        "imbalance": median([record["imbalance"] for record in window]),
        "seconds_per_vw": [median(values) for values in per_vw],
        "assignment": [median(values) for values in counts],
    }


# ---------------------------------------------------------------- ideals and the slowdown


def whole_vw_optimum_units(speeds: Sequence[float], virtual_workers: int) -> float:
    """Best step time, in single-device VW times, of any split into whole VWs."""
    seconds = [1.0 / speed for speed in speeds]
    return predicted_step_seconds(optimal_assignment(seconds, virtual_workers), seconds)


def imbalance_floor(speeds: Sequence[float], virtual_workers: int) -> float:
    """Smallest `(max - min) / max` of exact busy times that any whole-VW split can have."""
    best = 1.0
    for cuts in itertools.combinations(range(1, virtual_workers), len(speeds) - 1):
        counts = [b - a for a, b in zip((0,) + cuts, cuts + (virtual_workers,))]
        busy = [count / speed for count, speed in zip(counts, speeds)]
        best = min(best, (max(busy) - min(busy)) / max(busy))
    return best


def rebalance_steps_for(step_times: Sequence[float], change_step: int, target_s: float, window: int,
                        tolerance: float) -> Optional[int]:
    """Steps from `change_step` until the moving median of `window` step times, starting
    at that step, is within `tolerance` of `target_s`; None if it never is."""
    for step in range(change_step, len(step_times) - window + 1):
        if median(step_times[step:step + window]) <= (1.0 + tolerance) * target_s:
            return step - change_step
    return None


def slowdown_figures(records: Sequence[dict], config: Config, balanced_step_s: float,
                     single_seconds_per_vw: float) -> dict:
    """Steps to re-balance after the slowdown, against three readings of "the new ideal".

    - `rebalance_steps` (the headline): the new ideal is this run's own balanced
      step time before the change, scaled by how much the best whole-VW split
      slows down with the new speeds (12 -> 15 single-device VW times for
      V = 32, speeds 1, 1, 0.5, 0.25 -> 0.5, 1, 0.5, 0.25). It carries the same
      per-step costs (all-reduce, optimizer, host contention) as the steps it is
      compared with, so the 5% measures re-balancing and not constant costs.
    - `rebalance_steps_vs_single_device_ideal`: the best whole-VW split priced
      with the single-device VW time measured alone (no per-step costs at all).
    - `rebalance_steps_vs_continuous_ideal`: sum of the new speeds x the
      single-device rate, as in efficiency_vs_ideal. Whole VWs cannot get
      within 5% of it at this V (15 vs 14.2 units), so it is reported only.
    """
    step_times = [record["step_time_s"] for record in sorted(records, key=lambda record: record["step"])]
    old_units = whole_vw_optimum_units(config.speeds, config.virtual_workers)
    new_units = whole_vw_optimum_units(config.changed_speeds, config.virtual_workers)
    targets = {
        "rebalance_steps": balanced_step_s * new_units / old_units,
        "rebalance_steps_vs_single_device_ideal": new_units * single_seconds_per_vw,
        "rebalance_steps_vs_continuous_ideal":
            config.virtual_workers * single_seconds_per_vw / sum(config.changed_speeds),
    }
    figures = {
        name: rebalance_steps_for(step_times, config.change_step, target_s, config.moving_window,
                                  config.tolerance)
        for name, target_s in targets.items()
    }
    after = step_times[config.change_step:]
    settled = after[len(after) // 2:]
    return {
        **figures,
        "new_ideal_s": targets,
        "settled_step_s": median(settled) if settled else None,
        "step_times_after_change": after[:20],
        "assignments_after_change": [dict(zip(record["devices"], record["assignment"])) for record in records
                                     if config.change_step <= record["step"] < config.change_step + 20],
    }


def measured_rates_ideal_s(seconds_per_vw: Sequence[float], virtual_workers: int) -> float:
    """Continuous ideal step time from the devices' own measured per-VW times: V / sum of rates."""
    return virtual_workers / sum(1.0 / seconds for seconds in seconds_per_vw)


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
            measured_rates_ideal_s(balanced["seconds_per_vw"], config.virtual_workers), balanced["step_s"]),
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
    settled = next((record["step"] for index, record in enumerate(records)
                    if all(later["assignment"] == final for later in records[index:])), None)
    return {
        "virtual_workers": fine.virtual_workers,
        "single_step_s": single_s,
        "ideal_step_s": ideal_step_s,
        "flexpar_step_s": balanced["step_s"],
        "efficiency_vs_ideal": ratio(ideal_step_s, balanced["step_s"]),
        "efficiency_vs_measured_rates": ratio(
            measured_rates_ideal_s(balanced["seconds_per_vw"], fine.virtual_workers), balanced["step_s"]),
        "imbalance": balanced["imbalance"],
        "seconds_per_vw": balanced["seconds_per_vw"],
        "assignment": balanced["assignment"],
        "final_assignment": final,
        "settled_step": settled,
        "measured_steps": [fine.warmup_steps, fine.change_step],
    }


def summarise(config: Config, rounds: List[dict]) -> dict:
    """The JSON document: headline medians, goals, simulator inputs, and every round."""
    def median_of(key):
        values = [result[key] for result in rounds if result[key] is not None]
        return median(values) if values else None

    def median_steps(key):
        # A round that never got within the target counts as "never" (infinitely
        # many steps), not as a missing value: the median is then None if most did not.
        middle = median([math.inf if result[key] is None else result[key] for result in rounds])
        return None if math.isinf(middle) else middle

    floor = imbalance_floor(config.speeds, config.virtual_workers)
    imbalance_median = median_of("imbalance")
    fine_rounds = [result["v128"] for result in rounds if result.get("v128")]
    fine_efficiencies = [result["efficiency_vs_ideal"] for result in fine_rounds
                         if result["efficiency_vs_ideal"] is not None]
    figures = {
        "efficiency_vs_ideal": median_of("efficiency_vs_ideal"),
        "speedup_vs_uniform": median_of("speedup_vs_uniform"),
        "imbalance_over_floor": None if imbalance_median is None else imbalance_median - floor,
        "rebalance_steps": median_steps("rebalance_steps"),
        "efficiency_vs_ideal_v128": median(fine_efficiencies) if fine_efficiencies else None,
        "imbalance_median": imbalance_median,
    }
    ceiling_units = whole_vw_optimum_units(config.speeds, config.virtual_workers)
    fine = fine_config(config)
    fine_ceiling = None if not fine_rounds else (
        fine.virtual_workers / sum(fine.speeds) / whole_vw_optimum_units(fine.speeds, fine.virtual_workers))
    return {
        **figures,
        "goals": dict(GOALS),
        # Inputs for the simulator's validation: per device (local-0, local-1, ...).
        "devices": config.devices,
        "virtual_workers": config.virtual_workers,
        "speeds": list(config.speeds),
        "seconds_per_vw": [median([result["seconds_per_vw"][index] for result in rounds])
                           for index in range(config.devices)],
        "step_time_s": median_of("flexpar_step_s"),
        "assignment": [median([result["assignment"][index] for result in rounds])
                       for index in range(config.devices)],
        # What whole VWs allow at all, with exact speeds: the ceilings of the goals.
        "efficiency_ceiling_whole_vws": config.virtual_workers / sum(config.speeds) / ceiling_units,
        "speedup_ceiling_whole_vws": (config.virtual_workers / config.devices / min(config.speeds)) / ceiling_units,
        "imbalance_floor_whole_vws": floor,
        "imbalance_of_optimal_assignment": _imbalance_of_optimum(config.speeds, config.virtual_workers),
        "rebalance_steps_vs_single_device_ideal": median_steps("rebalance_steps_vs_single_device_ideal"),
        "rebalance_steps_vs_continuous_ideal": median_steps("rebalance_steps_vs_continuous_ideal"),
        "efficiency_vs_measured_rates": median_of("efficiency_vs_measured_rates"),
        "single_device_seconds_per_vw": median_of("single_seconds_per_vw"),
        "ideal_step_s": median_of("ideal_step_s"),
        "uniform_step_s": median_of("uniform_step_s"),
        "v128": None if not fine_rounds else {
            "virtual_workers": fine.virtual_workers,
            "efficiency_vs_measured_rates": median([result["efficiency_vs_measured_rates"] for result in fine_rounds]),
            "imbalance_median": median([result["imbalance"] for result in fine_rounds]),
            "ideal_step_s": median([result["ideal_step_s"] for result in fine_rounds]),
            "step_time_s": median([result["flexpar_step_s"] for result in fine_rounds]),
            "final_assignments": [result["final_assignment"] for result in fine_rounds],
            "settled_steps": [result["settled_step"] for result in fine_rounds],
        },
        "efficiency_ceiling_whole_vws_v128": fine_ceiling,
        "config": asdict(config),
        "rounds": rounds,
    }


# Issue 20's goals, measured side by side in one run.
GOALS = (("efficiency_vs_ideal", ">= 0.95"), ("speedup_vs_uniform", ">= 2.6"), ("imbalance_over_floor", "<= 0.03"),
         ("rebalance_steps", "<= 3"), ("efficiency_vs_ideal_v128", ">= 0.96"))


def _imbalance_of_optimum(speeds, virtual_workers) -> float:
    """Imbalance of flexpar's `optimal_assignment` for the exact speeds (its tie-break included)."""
    counts = optimal_assignment([1.0 / speed for speed in speeds], virtual_workers)
    busy = [count / speed for count, speed in zip(counts, speeds)]
    return (max(busy) - min(busy)) / max(busy)


def print_report(summary: dict) -> None:
    columns = ["round", "ideal_s", "flexpar_s", "uniform_s", "efficiency", "speedup", "imbalance",
               "rebalance_steps"]
    rows = [
        {"round": index + 1, "ideal_s": result["ideal_step_s"], "flexpar_s": result["flexpar_step_s"],
         "uniform_s": result["uniform_step_s"], "efficiency": result["efficiency_vs_ideal"],
         "speedup": result["speedup_vs_uniform"], "imbalance": result["imbalance"],
         "rebalance_steps": result["rebalance_steps"]}
        for index, result in enumerate(summary["rounds"])
    ]
    rows.append({"round": "median", "ideal_s": summary["ideal_step_s"], "flexpar_s": summary["step_time_s"],
                 "uniform_s": summary["uniform_step_s"], "efficiency": summary["efficiency_vs_ideal"],
                 "speedup": summary["speedup_vs_uniform"], "imbalance": summary["imbalance_median"],
                 "rebalance_steps": summary["rebalance_steps"]})
    config = summary["config"]
    print_table(rows, columns, title=(
        f"load balancing: speeds {config['speeds']}, V={config['virtual_workers']}, step times in seconds "
        f"(ideal = single device / {sum(config['speeds'])}; uniform = torch DDP, equal shares)"))
    print()
    limits = {"efficiency_vs_ideal": summary["efficiency_ceiling_whole_vws"],
              "speedup_vs_uniform": summary["speedup_ceiling_whole_vws"], "imbalance_over_floor": 0.0,
              "efficiency_vs_ideal_v128": summary["efficiency_ceiling_whole_vws_v128"]}
    goals = [
        {"figure": key, "measured": summary[key], "goal": goal, "whole-VW limit": limit}
        for key, goal, limit in [(key, goal, limits.get(key)) for key, goal in GOALS] + [
            ("imbalance_median", "(no goal)", summary["imbalance_floor_whole_vws"]),
            ("efficiency_vs_measured_rates", "(no goal)", summary["efficiency_ceiling_whole_vws"]),
            ("rebalance_steps_vs_single_device_ideal", "(no goal)", None),
            ("rebalance_steps_vs_continuous_ideal", "(no goal)", None),
        ]
    ]
    print_table(goals, ["figure", "measured", "goal", "whole-VW limit"])
    print("('-' for rebalance steps: the moving median never got within 5% of that ideal)")
    print(f"per-device seconds per VW (local-0..): {[round(value, 4) for value in summary['seconds_per_vw']]}; "
          f"median assignment {summary['assignment']}; imbalance of the exact optimum "
          f"{summary['imbalance_of_optimal_assignment']:.3f}")
    if summary["v128"]:
        fine = summary["v128"]
        print(f"V={fine['virtual_workers']} round: ideal {fine['ideal_step_s']:.4g} s, flexpar "
              f"{fine['step_time_s']:.4g} s, imbalance {fine['imbalance_median']:.3f}; final splits "
              f"{fine['final_assignments']}, settled at steps {fine['settled_steps']}")


def _progress(message: str) -> None:
    print(f"balance: {message}", file=sys.stderr, flush=True)


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
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=None, help="alternating rounds (default 3, quick 1)")
    parser.add_argument("--kernel-ms", type=float, default=None, help="emulated device time per VW (default 20)")
    parser.add_argument("--virtual-workers", type=int, default=None,
                        help="VWs per step (default 32; a multiple of the 4 devices, for the uniform split)")
    parser.add_argument("--keep-metrics", metavar="DIR", default=None,
                        help="keep flexpar's metrics files (flexpar-ROUND.jsonl) in DIR")
    parser.add_argument("--fine-virtual-workers", type=int, default=None,
                        help="VWs per step of the second round (default 128; 0 leaves it out)")
    variable_length.add_arguments(parser)
    options = parser.parse_args(argv)
    config = replace(Config(), **QUICK) if options.quick else Config()
    if options.rounds is not None:
        config = replace(config, rounds=options.rounds)
    if options.kernel_ms is not None:
        config = replace(config, kernel_ms=options.kernel_ms)
    if options.virtual_workers is not None:
        if options.virtual_workers % config.devices:
            parser.error(f"--virtual-workers {options.virtual_workers}: the uniform (DDP) split needs a multiple "
                         f"of the {config.devices} devices, e.g. {config.devices * max(1, options.virtual_workers // config.devices)}")
        config = replace(config, virtual_workers=options.virtual_workers)
    if options.fine_virtual_workers is not None:
        if options.fine_virtual_workers and options.fine_virtual_workers < config.devices:
            parser.error(f"--fine-virtual-workers {options.fine_virtual_workers}: at least the "
                         f"{config.devices} devices (or 0 for no such round)")
        config = replace(config, fine_virtual_workers=options.fine_virtual_workers)
    _preload_fork_server()
    started = time.perf_counter()
    # Other work on the machine moves every figure here; the load is recorded with them.
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as scratch:
        folder = options.keep_metrics or scratch
        os.makedirs(folder, exist_ok=True)
        rounds = [] if options.variable_length == "only" else [
            run_round(config, folder, index) for index in range(config.rounds)]
        section = None if options.variable_length == "skip" else variable_length.run(
            variable_length.config_from(options), folder, _progress)
    summary = summarise(config, rounds) if rounds else {}
    if section is not None:  # its own section; its two headline figures also at the top
        summary.update(cost_balance_speedup=section["cost_balance_speedup"],
                       cost_balance_imbalance=section["cost_balance_imbalance"], variable_length=section)
    summary["wall_s"] = time.perf_counter() - started
    summary["load_average_1min"] = {"before": load_before, "after": os.getloadavg()[0], "cores": cpu_count()}
    if rounds:
        print_report(summary)
    variable_length.print_report(section)
    write_json(options.json, summary)
    return summary


if __name__ == "__main__":
    main()
