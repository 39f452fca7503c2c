"""Streamed joins against the blocking transfer, by the size of the training state.

A 2 -> 3 CPU-device AdamW job on an MLP whose width sets the training state's
size (parameters + AdamW's two moments, 12 bytes a parameter: about 0.1, 0.5, 1
and 2 GB; ``--quick``: 0.1 and 0.5), the same global batch and VWs at every
size. Each size runs with streaming forced (``join_mode="stream"``), with the
blocking transfer forced (``join_mode="blocking"``) and with the default
(``join_mode="auto"``: the engine predicts both and takes the cheaper,
flexpar/core/join_choice.py), in turn (the order rotates by round), ``--rounds``
times; the figures are medians over rounds, read from each run's metrics file.
The full form runs 3 rounds: each way takes each place in the order once, and
where two ways run the same code (``auto`` taking the blocking transfer) a median
of three is what keeps their ratio from reading one round's spread (two rounds
put it at 1.11 once, 1.03 at three).
Every run is finished: it runs until the joiner has taken VWs for
``CONTRIBUTING_STEPS`` steps (a callback then stops it), however many steps its
stream needs, up to ``MAX_STEPS_AFTER_JOIN`` (a run that reaches them is ended
there and listed in ``unfinished``, not ``failed``).

- ``boundary_stall_s``: the join event's ``stall_s`` with streaming, by size
  (GB, as a string); ``blocking_stall_s`` the same for the blocking transfer.
- ``boundary_stall_growth``: streaming's stall at the largest size / at the
  smallest; ``blocking_stall_growth`` the blocking transfer's.
- ``members_lost_s``: ``{"stream": {size: s}, "blocking": {size: s}}``, the
  members' training time lost to the join: the boundary stall plus, while
  streaming, each step's time beyond the median step before the join.
- ``member_slowdown``: by size, the members' median step time while streaming
  / before the join (2 devices both times); ``member_slowdown_max`` the worst.
- ``time_to_contribute_s``: ``{"stream": {size: s}, "blocking": {size: s}}``,
  from the join boundary's start to the start of the joiner's first step with
  VWs.
- ``stream_steps``: by size, the steps the stream took; ``stream_planned_steps`` the steps its first
  plan had (the join event's detail).
- ``state_bytes``: by size, the bytes that streamed (trainable parameters and AdamW's moments).
- ``baseline_ratio``: by size, the members' last step before the join's boundary (the baseline of the
  engine's slice re-sizing) / ``step_before_s``; ``step_spread``: the lognormal sigma of the members'
  steps before the joiner started; ``stream_shares``: by size, each streamed run's listener share of the
  state after each listening step (how the slices were re-sized). flexpar.sim's inputs too.
- ``step_before_s``, ``compute_before_s``: by size, the members' median step and the slowest member's
  VW compute (``busy_s``) per step before the joiner started; ``compute_at_join_s`` the same over the 5
  steps before the join's boundary (what the engine sizes a stream's slices from): flexpar.sim's inputs.
- ``members_lost_s["auto"]``, ``time_to_contribute_s["auto"]``: the same for the default.
- ``auto_lost_ratio``: by size, the default's members' lost time / the smaller of streaming's and the
  blocking transfer's (medians, measured side by side in one run of the benchmark); goal <= 1.1.
- ``auto_choice``: by size, the way the default took (``stream`` or ``blocking``; both, with counts,
  where rounds differed); ``auto_predicted_lost_s``: by size, the default's join event's predictions
  (``{"stream": s, "blocking": s}``), beside what each way really lost.
- ``unfinished``: the runs ended at ``MAX_STEPS_AFTER_JOIN`` before the joiner took VWs (empty: none).
- ``bitwise_equal``: every streamed run (forced, or the default where it
  streamed) ended with its ``stream`` event, which flexpar publishes only after
  every device checked the joiner's copy of each tensor (with its optimizer
  state) against its senders' bit for bit (a mismatch stops the job); ``false``
  if any run failed or never finished.
- a PNG (``--plot PATH``): the members' lost time against the state's size.

On this 2-core machine three devices share two cores: the transfer and the
compute compete for them, so ``member_slowdown`` includes the senders' share
of the copy work that a separate link (RDMA, NVLink) would do beside the
compute.

The devices are CPU processes over gloo on any host, a host with GPUs too.

Run: ``python benchmarks/join_stream.py [--quick] [--rounds N] [--sizes GB,GB] [--json PATH] [--plot PATH]``
(``--sizes``: the training states' sizes instead of the defaults, e.g. ``0.01`` for a smoke test)
"""

from __future__ import annotations

import math
import os
import re
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness
import torch
from harness import median
from torch import nn
from torch.utils.data import TensorDataset

import flexpar

progress = harness.progress("join_stream")

LAYERS = 4
CLASSES = 10
BYTES_PER_PARAMETER = 12  # float32 parameter + AdamW's exp_avg and exp_avg_sq
SIZES_GB = (0.1, 0.5, 1.0, 2.0)
QUICK_SIZES_GB = (0.1, 0.5)
VIRTUAL_WORKERS = 4
JOIN_AT = 6  # the joiner is started after this step; the steps before it time the members alone
CONTRIBUTING_STEPS = 4  # a run stops once the joiner has taken VWs for this many steps
MAX_STEPS_AFTER_JOIN = 200  # the joiner's warm-up and any stream: a run that reaches it ends there (`unfinished`)
MODES = ("stream", "blocking", "auto")
GLOBAL_BATCH = 16


def width_for(size_gb: float) -> int:
    """The MLP width whose training state is about `size_gb` GB (LAYERS square layers)."""
    return int(math.sqrt(size_gb * 1e9 / BYTES_PER_PARAMETER / LAYERS))


class WideMLP:
    """The model factory (module level: worker processes import it by name)."""

    def __init__(self, width: int):
        self.width = width

    def __call__(self) -> nn.Module:
        layers = []
        for _ in range(LAYERS - 1):
            layers += [nn.Linear(self.width, self.width), nn.ReLU()]
        layers.append(nn.Linear(self.width, CLASSES))
        return nn.Sequential(*layers)


def adamw(parameters):
    return torch.optim.AdamW(parameters, lr=1e-4)


def loss(model, batch):
    inputs, targets = batch
    return nn.functional.cross_entropy(model(inputs), targets)


def make_job(width: int) -> flexpar.Job:
    generator = torch.Generator().manual_seed(0)
    dataset = TensorDataset(
        torch.randn(256, width, generator=generator), torch.randint(0, CLASSES, (256,), generator=generator)
    )
    return flexpar.Job(
        model=WideMLP(width),
        optimizer=adamw,
        loss=loss,
        dataset=dataset,
        global_batch=GLOBAL_BATCH,
        virtual_workers=VIRTUAL_WORKERS,
        seed=0,
    )


class StopOnceContributing:
    """Stops the job once the joiner has taken VWs for CONTRIBUTING_STEPS steps (its stream ended)."""

    def __init__(self):
        self.contributing = 0

    def on_step(self, record):
        if len(record["devices"]) == 3 and not record.get("joining"):
            self.contributing += 1
            if self.contributing >= CONTRIBUTING_STEPS:
                return flexpar.STOP
        return None


def run_once(size_gb: float, mode: str, work_dir: str) -> dict:
    """One 2 -> 3 fit with `join_mode=mode`; its figures (or `failed` with the reason)."""
    job = make_job(width_for(size_gb))
    steps = JOIN_AT + MAX_STEPS_AFTER_JOIN
    metrics = harness.unique_path(work_dir, ".jsonl")
    try:
        job.fit(
            steps=steps,
            callbacks=[StopOnceContributing()],
            devices=2,
            max_devices=3,
            schedule=f"{JOIN_AT}:+1",
            metrics=metrics,
            display=False,
            quiet=True,
            oversubscribe=True,
            run_dir=work_dir,
            timeout_s=120.0,
            join_mode=mode,
            backend="gloo",  # CPU devices, also on a host with GPUs
        )
    except Exception as error:  # a run that fails is reported, not hidden
        return {"failed": f"{type(error).__name__}: {str(error)[:300]}"}
    records = harness.metrics_records(metrics)
    joins = [r for r in records if r["kind"] == "event" and r["event"] == "join"]
    way = joins[0].get("join_way", mode) if joins else mode
    result = figures_of_run(records, way == "stream")
    if joins:
        result["way"] = way
        result["predicted"] = {
            "stream": joins[0].get("predicted_stream_lost_s"),
            "blocking": joins[0].get("predicted_blocking_lost_s"),
        }
    return result


def figures_of_run(records: list, streaming: bool) -> dict:
    """The figures of one run from its metrics records (pure); `unfinished` where it ended before the
    joiner took VWs (at MAX_STEPS_AFTER_JOIN)."""
    steps = [r for r in records if r["kind"] == "step"]
    events = [r for r in records if r["kind"] == "event"]
    joins = [e for e in events if e["event"] == "join"]
    if not joins:
        return {"failed": "the joiner never joined (the job ended first)"}
    join = joins[0]
    # Before the joiner was started (its start-up shares the two cores with the members after that).
    before = [r["step_time_s"] for r in steps if 1 <= r["step"] < JOIN_AT]
    listening = [r for r in steps if r.get("joining")]
    contributing = [r for r in steps if len(r["devices"]) == 3 and not r.get("joining")]
    if not contributing:
        return {"unfinished": f"the joiner had not taken VWs by step {steps[-1]['step'] if steps else 0}"}
    first = contributing[0]
    step_before = median(before) if before else float("nan")
    # The first step after the boundary is timed from the commit before it: its time holds the stall.
    during = [r["step_time_s"] - (join["stall_s"] if r["step"] == join["step"] else 0.0) for r in listening]
    extra = sum(max(0.0, time - step_before) for time in during) if before else float("nan")
    boundary_start = join["time"] - join["stall_s"]
    busy_before = [max(r["busy_s"]) for r in steps if 1 <= r["step"] < JOIN_AT and r.get("busy_s")]
    # The 5 steps before the join's boundary: what the engine sizes the slices from (its balancer's compute).
    busy_at_join = [max(r["busy_s"]) for r in steps if r["step"] < join["step"] and r.get("busy_s")][-5:]
    planned = re.search(r"in (\d+) steps? from", join["detail"])
    # The step the engine's slice re-sizing takes as its baseline: the members' last step before the
    # boundary (the joiner's start-up may have slowed it), against the undisturbed step.
    baseline = [r["step_time_s"] for r in steps if r["step"] == join["step"] - 1]
    result = {
        "stall_s": join["stall_s"],
        # What a simulator needs to predict the join: the members' step and its compute before the joiner
        # started, and the stream's planned steps (the join event's detail).
        "step_before_s": step_before,
        "compute_before_s": median(busy_before) if busy_before else float("nan"),
        "compute_at_join_s": median(busy_at_join) if busy_at_join else float("nan"),
        "lost_s": join["stall_s"] + extra,
        # The joiner's first step with VWs starts at the previous commit, or at the join's end.
        "time_to_contribute_s": max(first["time"] - first["step_time_s"], join["time"]) - boundary_start,
        "detail": join["detail"],
    }
    if baseline and before:
        result["baseline_ratio"] = baseline[0] / step_before
    if len(before) >= 2:  # the members' step-to-step spread (lognormal sigma), which the re-sizing reads
        result["step_spread"] = statistics.stdev(math.log(value) for value in before if value > 0)
    if streaming:
        # The listener's share of the state after each listening step: how the slices were re-sized.
        result["shares"] = [round(max(r["joining"].values()), 4) for r in listening]
        result["planned_steps"] = int(planned.group(1)) if planned else float("nan")
        streamed_bytes = re.search(r"listeners?: (\d+) bytes", join["detail"])
        result["state_bytes"] = int(streamed_bytes.group(1)) if streamed_bytes else float("nan")
        result["streamed"] = "streaming to" in join["detail"] and any(e["event"] == "stream" for e in events)
        result["stream_steps"] = len(listening)
        result["slowdown"] = median(during) / step_before if during and before else float("nan")
    return result


def measure(sizes, rounds: int, work_dir: str) -> dict:
    runs = {(size, mode): [] for size in sizes for mode in MODES}
    for round_number in range(rounds):
        for size in sizes:
            shift = round_number % len(MODES)
            for mode in MODES[shift:] + MODES[:shift]:
                result = run_once(size, mode, work_dir)
                runs[(size, mode)].append(result)
                progress(f"round {round_number + 1}, {size} GB, {mode}: {result}")
    return runs


def figures(runs: dict, sizes) -> dict:
    def med(size, mode, key):
        values = [run[key] for run in runs[(size, mode)] if key in run and not math.isnan(run[key])]
        return median(values) if values else None

    label = {size: f"{size:g}" for size in sizes}
    result = {
        "sizes_gb": [label[size] for size in sizes],
        "boundary_stall_s": {label[s]: med(s, "stream", "stall_s") for s in sizes},
        "blocking_stall_s": {label[s]: med(s, "blocking", "stall_s") for s in sizes},
        "members_lost_s": {mode: {label[s]: med(s, mode, "lost_s") for s in sizes} for mode in MODES},
        "member_slowdown": {label[s]: med(s, "stream", "slowdown") for s in sizes},
        "time_to_contribute_s": {
            mode: {label[s]: med(s, mode, "time_to_contribute_s") for s in sizes} for mode in MODES
        },
        "stream_steps": {label[s]: med(s, "stream", "stream_steps") for s in sizes},
        "stream_planned_steps": {label[s]: med(s, "stream", "planned_steps") for s in sizes},
        "state_bytes": {label[s]: med(s, "stream", "state_bytes") for s in sizes},
        "step_before_s": {label[s]: med(s, "stream", "step_before_s") for s in sizes},
        "compute_before_s": {label[s]: med(s, "stream", "compute_before_s") for s in sizes},
        "compute_at_join_s": {label[s]: med(s, "stream", "compute_at_join_s") for s in sizes},
        "baseline_ratio": {label[s]: med(s, "stream", "baseline_ratio") for s in sizes},
        "step_spread": {label[s]: med(s, "stream", "step_spread") for s in sizes},
        "stream_shares": {label[s]: [run["shares"] for run in runs[(s, "stream")] if "shares" in run] for s in sizes},
        "bitwise_equal": all(
            run.get("streamed") is True
            for s in sizes
            for mode in ("stream", "auto")
            for run in runs[(s, mode)]
            if mode == "stream" or run.get("way") == "stream"
        )
        and not any("failed" in run or "unfinished" in run for items in runs.values() for run in items),
        "failed": [
            f"{s} GB {mode}: {run['failed']}" for (s, mode), items in runs.items() for run in items if "failed" in run
        ],
        "unfinished": [
            f"{s} GB {mode}: {run['unfinished']}"
            for (s, mode), items in runs.items()
            for run in items
            if "unfinished" in run
        ],
        "auto_choice": {label[s]: choice_of(runs[(s, "auto")]) for s in sizes},
        "auto_predicted_lost_s": {
            label[s]: {
                way: _median_or_none([run["predicted"][way] for run in runs[(s, "auto")] if "predicted" in run])
                for way in ("stream", "blocking")
            }
            for s in sizes
        },
    }
    result["auto_lost_ratio"] = {}
    for s in sizes:
        auto = result["members_lost_s"]["auto"][label[s]]
        others = [result["members_lost_s"][mode][label[s]] for mode in ("stream", "blocking")]
        best = min((value for value in others if value is not None), default=None)
        result["auto_lost_ratio"][label[s]] = auto / best if auto is not None and best else None
    small, large = label[sizes[0]], label[sizes[-1]]
    for key, stalls in (("boundary_stall_growth", "boundary_stall_s"), ("blocking_stall_growth", "blocking_stall_s")):
        low, high = result[stalls][small], result[stalls][large]
        result[key] = high / low if low and high is not None else None
    slowdowns = [value for value in result["member_slowdown"].values() if value is not None]
    result["member_slowdown_max"] = max(slowdowns) if slowdowns else None
    stream_lost, blocking_lost = result["members_lost_s"]["stream"][large], result["members_lost_s"]["blocking"][large]
    result["lost_ratio_largest"] = stream_lost / blocking_lost if stream_lost is not None and blocking_lost else None
    return result


def _median_or_none(values):
    values = [value for value in values if value is not None]
    return median(values) if values else None


def choice_of(runs: list) -> str:
    """The way the default took over its rounds: one word, or each way with its count."""
    ways = [run["way"] for run in runs if "way" in run]
    if not ways:
        return None
    if len(set(ways)) == 1:
        return ways[0]
    return ", ".join(f"{way} x{ways.count(way)}" for way in sorted(set(ways)))


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = [float(size) for size in result["sizes_gb"]]
    figure, axes = plt.subplots(figsize=(6, 4))
    for mode, style in (("blocking", "o-"), ("stream", "s-"), ("auto", "^--")):
        values = [result["members_lost_s"][mode][label] for label in result["sizes_gb"]]
        axes.plot(sizes, [v if v is not None else float("nan") for v in values], style, label=mode)
    axes.set_xlabel("training state (GB)")
    axes.set_ylabel("members' time lost to the join (s)")
    axes.set_title("2 -> 3 CPU devices, AdamW")
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def parse_arguments(argv=None):
    """The command line, with `sizes` (GB) resolved (argv: None for sys.argv; gpu_check.py checks its commands)."""
    parser = harness.base_parser(__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=None, help="alternating rounds (default: 1 quick, 3 full)")
    parser.add_argument("--plot", default=None, help="write the PNG of lost time against size here")
    parser.add_argument(
        "--sizes",
        default=None,
        help="training states' sizes in GB, comma-separated (default 0.1,0.5,1,2; quick 0.1,0.5)",
    )
    args = parser.parse_args(argv)
    args.sizes_gb = QUICK_SIZES_GB if args.quick else SIZES_GB
    if args.sizes:
        try:
            args.sizes_gb = tuple(float(size) for size in args.sizes.split(","))
        except ValueError:
            parser.error(f"--sizes {args.sizes}: give sizes in GB separated by commas, e.g. 0.1,0.5")
        if not all(size > 0 for size in args.sizes_gb):
            parser.error(f"--sizes {args.sizes}: every size must be positive")
    return args


def main() -> int:
    args = parse_arguments()
    sizes = args.sizes_gb
    rounds = args.rounds or (1 if args.quick else 3)
    with tempfile.TemporaryDirectory(prefix="flexpar-join-stream-") as work_dir:
        result = figures(measure(sizes, rounds, work_dir), sizes)
    result.update({"quick": args.quick, "rounds": rounds, "cores": harness.cpu_count()})
    harness.write_json(args.json, result)
    if args.plot:
        plot(result, args.plot)
    for key, value in result.items():
        print(f"{key}: {value}")
    return 0 if result["bitwise_equal"] and not result["failed"] and not result["unfinished"] else 1


if __name__ == "__main__":
    harness.run(main)
