"""Streaming (iterable) datasets: what they cost against map-style data and a plain DataLoader loop,
what moving a stream costs, how often each item is read, and whether any is lost or repeated.

Figures (the JSON keys; the pieces are benchmarks/streaming_data_job.py's, an MLP over rows of 64
features, hidden width 512):

- `throughput_ratio`: steady samples/s of a streaming job (4 shards, 4 VWs, global batch 512) on 2
  CPU devices over the same rows as a map-style `TensorDataset`, the same job otherwise. Goal >= 0.95.
- `loader_ratio`: steady samples/s of flexpar on 1 device over a stream with no shards (4 VWs,
  `num_workers=2`, global batch 512) over the plain loop over `DataLoader(the same IterableDataset, batch_size=128,
  num_workers=2)` accumulating 4 micro-batches a step, in a fresh process with every core's threads
  as flexpar's worker has. Goal >= 0.95.
- `move_cost_s`: `{"state": {position: s}, "skip": {position: s}}`: the stall of a blocking join
  (1 -> 2 devices, 2 shards, 2 VWs) that moves VW 1's stream, positioned about 10^3 and 10^5 items in
  (the key is the position the join found, `step * micro-batch`), with a dataset that has a complete
  `state_dict()` and with one that has none (reached by skipping). Goal: the stateful cost flat in the
  position. `move_skip_s` has the part the join event names as reaching the positions.
- `read_amplification`: items read per item trained (the step records' `stream_items_read` over the
  items the steps trained), for a sharded stream (6 shards, 6 VWs) and a round-robin one, on 1 and 3
  devices. Goal 1.0 for the sharded one.
- `lost`, `repeated`: items the sample ledger finds lost or trained twice (ledger.audit_stream)
  over a job with a join, a leave and a kill -9, and one whose driver is killed -9 and restarted
  (re-adoption). Goal 0 and 0. `left_out`: the items pass ends left out (recorded, not lost).

Throughput figures are ratios of medians over rounds that alternate the two sides; a run's samples/s
is the global batch over its median step time (steps `SKIP ..`). The load average at the start and
end is in the JSON: this machine is shared.

Run: ``python benchmarks/streaming_data.py [--quick] [--json PATH] [--rounds N]``.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import harness  # noqa: E402
import streaming_data_job as pieces  # noqa: E402
import torch  # noqa: E402
import torch.multiprocessing as torch_multiprocessing  # noqa: E402
from harness import cpu_count, median, ratio_of_medians  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from flexpar.core import ledger  # noqa: E402
from flexpar.core.stream_split import split_stream  # noqa: E402

SKIP = 4  # steps of start-up left out of a run's samples/s
FIT = {"display": False, "quiet": True, "oversubscribe": True}


def _throughput(metrics: str, global_batch: int) -> dict:
    times = [record["time"] for record in harness.step_records(metrics)]
    durations = harness.step_durations(times, SKIP)
    return {"samples_per_s": global_batch / median(durations)}


def _fit(job, folder: str, name: str, **options) -> str:
    metrics = harness.unique_path(folder, ".jsonl") if name is None else os.path.join(folder, name)
    job.fit(metrics=metrics, run_dir=folder, **FIT, **options)
    return metrics


# ---------------------------------------------------------------- throughput_ratio


def throughput_ratio(folder: str, steps: int, rounds: int) -> dict:
    shards, batch = 4, 512
    per_shard = steps * batch // shards + 1
    stream = pieces.sharded(shards, per_shard)
    mapped = TensorDataset(stream.inputs, stream.labels)

    def side(dataset):
        def run(_round):
            job = pieces.make_job(dataset, 4, batch)
            return _throughput(_fit(job, folder, None, steps=steps, devices=2), batch)

        return run

    runs = harness.alternate({"stream": side(stream), "map": side(mapped)}, rounds)
    return ratio_of_medians(
        runs, "samples_per_s", ("stream", "stream_samples_per_s"), ("map", "map_samples_per_s"), "throughput_ratio"
    )


# ---------------------------------------------------------------- loader_ratio

LOADER_VWS, LOADER_MICRO, LOADER_WORKERS = 4, 128, 2


def _plain_loop(_index: int, rows: int, steps: int, result_path: str) -> None:
    """The plain loop: DataLoader(the IterableDataset, batch_size, num_workers), 4 micro-batches a step."""
    torch.set_num_threads(cpu_count())  # one device: flexpar gives its worker every core
    torch.manual_seed(3)
    model, dataset = pieces.make_model(), pieces.PlainRows(rows)
    optimizer = pieces.make_optimizer(model.parameters())
    commit_times, epoch = [], 0
    while len(commit_times) < steps:
        dataset.set_epoch(epoch)
        loader = DataLoader(dataset, batch_size=LOADER_MICRO, num_workers=LOADER_WORKERS, drop_last=True)
        micro = 0
        for batch in loader:
            (pieces.loss(model, batch) / LOADER_VWS).backward()
            micro += 1
            if micro % LOADER_VWS == 0:
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                commit_times.append(time.time())
                if len(commit_times) == steps:
                    break
        epoch += 1
    Path(result_path).write_text(json.dumps(commit_times))


def loader_ratio(folder: str, steps: int, rounds: int) -> dict:
    batch = LOADER_VWS * LOADER_MICRO
    rows = steps * batch + 1

    def flexpar_side(_round):
        job = pieces.make_job(pieces.PlainRows(rows), LOADER_VWS, batch, num_workers=LOADER_WORKERS)
        return _throughput(_fit(job, folder, None, steps=steps, devices=1), batch)

    def loop_side(_round):
        path = harness.unique_path(folder, ".json")
        torch_multiprocessing.spawn(_plain_loop, args=(rows, steps, path), nprocs=1, join=True)
        durations = harness.step_durations(json.loads(Path(path).read_text()), SKIP)
        return {"samples_per_s": batch / median(durations)}

    runs = harness.alternate({"flexpar": flexpar_side, "loop": loop_side}, rounds)
    return ratio_of_medians(
        runs, "samples_per_s", ("flexpar", "flexpar_samples_per_s"), ("loop", "loop_samples_per_s"), "loader_ratio"
    )


# ---------------------------------------------------------------- move_cost_s


MOVE_ROWS = 150_000  # per shard, at every position: the datasets' sizes (and copies) are the same


def move_once(folder: str, position: int, stateful: bool) -> dict:
    """A blocking join 1 -> 2 devices that moves VW 1's stream (its group) near `position` items in."""
    micro = max(10, position // 50)
    hold_at = max(2, position // micro - 2)  # the joiner starts here; it joins a step or two after its warm-up
    run = os.path.join(folder, f"move-{'state' if stateful else 'skip'}-{position}")
    os.makedirs(run)
    dataset = pieces.sharded(2, MOVE_ROWS, stateful)
    job = pieces.make_job(dataset, 2, 2 * micro, loss=pieces.WaitForJoiner(hold_at, per_step=2))
    metrics = _fit(
        job, run, "m.jsonl", steps=hold_at + 20, devices=1, schedule=f"{hold_at}:+1", join_stream_mb=0, max_devices=2
    )
    joins = [r for r in harness.metrics_records(metrics) if r["kind"] == "event" and r["event"] == "join"]
    join = joins[0]
    return {
        "position": join["step"] * micro,
        "stall_s": join["stall_s"],
        "skip_s": join.get("stream_skip_s", 0.0),
        "skipped": join.get("stream_skipped_items", 0),
    }


def move_cost(folder: str, positions) -> tuple:
    costs, skips = {"state": {}, "skip": {}}, {"state": {}, "skip": {}}
    for position in positions:
        for kind in ("state", "skip"):
            moved = move_once(folder, position, kind == "state")
            costs[kind][str(moved["position"])] = round(moved["stall_s"], 4)
            skips[kind][str(moved["position"])] = {"skip_s": moved["skip_s"], "items": moved["skipped"]}
    return costs, skips


# ---------------------------------------------------------------- read_amplification


def read_amplification(folder: str, steps: int) -> dict:
    batch, figures = 96, {"sharded": {}, "round_robin": {}}
    for kind in figures:
        for devices in (1, 3):
            dataset = pieces.sharded(6, steps * 16 + 1) if kind == "sharded" else pieces.PlainRows(steps * batch + 1)
            metrics = _fit(pieces.make_job(dataset, 6, batch), folder, None, steps=steps, devices=devices)
            records = harness.step_records(metrics)
            read = sum(record["stream_items_read"] for record in records)
            figures[kind][str(devices)] = round(read / (batch * len(records)), 4)
    return figures


# ---------------------------------------------------------------- lost, repeated


def _audit(folder: str, job, steps: int, shards) -> ledger.StreamAudit:
    paths = sorted(Path(folder).rglob("ledger.jsonl"))
    entries = {step: items for path in paths for step, items in ledger.read(path).items()}
    ends = {(e["group"], e["pass"]): e for path in paths for e in ledger.read_pass_ends(path)}
    split = split_stream(job.virtual_workers, shards)
    return ledger.audit_stream(entries, list(ends.values()), split, job.micro_batch_size, steps)


def ledger_elastic(folder: str) -> dict:
    """2 devices, +1 at step 3, local-1 killed -9 in step 8, -1 at step 12; 16 steps of 4 shards."""
    run = os.path.join(folder, "elastic")
    os.makedirs(run)
    steps = 16
    job = pieces.make_job(pieces.sharded(4, 200), 4, 64, loss=pieces.SlowLoss())
    options = {"schedule": "3:+1,12:-1", "faults": "8:local-1:forward", "max_devices": 3, "sample_ledger": True}
    _fit(job, run, "m.jsonl", steps=steps, devices=2, **options)
    return vars(_audit(run, job, steps, 4))


def ledger_driver_kill(folder: str, steps: int = 16, kill_at: int = 6) -> dict:
    """The job of streaming_data_job.py under `flexpar run`, its driver killed -9 after step `kill_at`
    and restarted with the command the devices print (re-adoption)."""
    run = os.path.join(folder, "driver-kill")
    os.makedirs(run)
    metrics = os.path.join(run, "m.jsonl")
    environment = dict(os.environ, STREAMING_STEPS=str(steps), STREAMING_FINAL=os.path.join(run, "final.pt"))
    flags = ["--devices", "2", "--oversubscribe", "--no-display", "--port", str(harness.free_port())]
    flags += ["--metrics", metrics, "--driver-grace", "60"]
    drivers = []

    def start(arguments, name):
        out, err = open(os.path.join(run, f"{name}.out"), "w"), open(os.path.join(run, f"{name}.err"), "w")
        process = subprocess.Popen(
            [sys.executable, "-m", "flexpar", *arguments],
            stdout=out,
            stderr=err,
            cwd=run,
            env=environment,
            start_new_session=True,
        )
        drivers.append(process)
        return process

    def wait_for(predicate, what):
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            value = predicate()
            if value:
                return value
            time.sleep(0.01)
        raise RuntimeError(f"timed out waiting for {what}")

    def steps_done():
        return [r for r in harness.json_lines(metrics) if r.get("kind") == "step"]

    try:
        first = start(["run", *flags, os.path.join(HERE, "streaming_data_job.py")], "driver-1")
        wait_for(lambda: len(steps_done()) > kill_at, f"step {kill_at}")
        os.kill(first.pid, signal.SIGKILL)
        first.wait()
        said = wait_for(
            lambda: harness.commands_said(os.path.join(run, "driver-1.err"), "restart it with: "), "the resume command"
        )
        second = start(shlex.split(said[-1])[1:], "driver-2")
        if second.wait(timeout=600) != 0:
            raise RuntimeError(open(os.path.join(run, "driver-2.err")).read()[-3000:])
    finally:
        for process in drivers:
            harness.kill_group(process.pid)
    adopted = any(r.get("event") == "adopt" for r in harness.json_lines(metrics))
    return {**vars(_audit(run, pieces.driver_kill_job(), steps, pieces.KILL_SHARDS)), "adopted": adopted}


# ---------------------------------------------------------------- main


def main() -> None:
    parser = harness.base_parser(__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=None, help="alternating rounds (default 5; 2 with --quick)")
    args = parser.parse_args()
    rounds = args.rounds or (2 if args.quick else 5)
    steps = 16 if args.quick else 40
    say = harness.progress("streaming_data")
    load_before = os.getloadavg()[0]
    figures: dict = {"quick": args.quick, "rounds": rounds, "cores": cpu_count()}
    with harness.run_folder("flexpar-streaming-") as folder:
        say("throughput_ratio (2 devices, stream vs map-style)")
        figures.update(throughput_ratio(folder, steps, rounds))
        say("loader_ratio (1 device vs the plain DataLoader loop)")
        figures.update(loader_ratio(folder, steps, rounds))
        say("read_amplification (sharded and round-robin, 1 and 3 devices)")
        figures["read_amplification"] = read_amplification(folder, 8 if args.quick else 16)
        say("move_cost_s (a join moving a stream 10^3 and 10^5 items in)")
        figures["move_cost_s"], figures["move_skip_s"] = move_cost(folder, (1000, 100000))
        say("lost / repeated (the ledger under a join, a leave, a kill -9 and a driver kill)")
        elastic, driver_kill = ledger_elastic(folder), ledger_driver_kill(folder)
    figures["ledger"] = {"join_leave_kill": elastic, "driver_kill": driver_kill}
    figures["lost"] = elastic["samples_lost"] + driver_kill["samples_lost"]
    figures["repeated"] = elastic["samples_repeated"] + driver_kill["samples_repeated"]
    figures["steps_missing"] = elastic["steps_missing"] + driver_kill["steps_missing"]
    figures["left_out"] = elastic["items_left_out"] + driver_kill["items_left_out"]
    figures["load_average_before_after"] = [load_before, os.getloadavg()[0]]
    keys = ("throughput_ratio", "loader_ratio", "move_cost_s", "read_amplification", "lost", "repeated")
    for key in keys:
        print(f"{key}: {json.dumps(figures[key])}")
    print(f"load average (1 min) before/after: {load_before:.2f} / {os.getloadavg()[0]:.2f}")
    harness.write_json(args.json, figures)


if __name__ == "__main__":
    harness.run(main)
