"""What a checkpoint costs the step loop: flexpar's background write vs a plain `torch.save`.

The job: the elastic benchmark's 25.2M-parameter MLP with Adam (302 MB of
training state), one CPU device with all cores, a checkpoint every
`checkpoint_every` steps. Each round runs the same job three times, in turn:

- **background** (flexpar as it is): the step loop copies the state in
  memory (`checkpoints.cpu_copy`) and hands the copy to a thread that writes
  the file at the lowest CPU priority;
- **synchronous**: the step loop writes the checkpoint itself, as flexpar did
  before (`torch.save` to bytes, then the file): the baseline;
- **none**: no checkpoints, for the median step.

Each checkpoint call is timed inside the worker (this script's module is what
the workers import for the job's pieces, and it wraps
`Worker._maybe_checkpoint` with a clock; for the synchronous runs it also
swaps in the old `_write_checkpoint`). A plain `torch.save` of the same state
(the structure `flexpar.state.capture` returns) is timed in this process.

Figures (JSON keys; medians over every checkpoint of every round):

- `checkpoint_stall_s`: the step loop's stall per checkpoint with flexpar:
  how long the loop is held between a commit and the next step.
- `torch_save_s`: a plain `torch.save` of the same state to a file, timed here.
- `stall_ratio` = `checkpoint_stall_s / torch_save_s` (lower is better).
- `synchronous_stall_s`: the loop's stall per checkpoint when it writes the
  file itself (the same job, measured like `checkpoint_stall_s`).
- `copy_s`: `checkpoints.cpu_copy` of the state alone, timed here.
- `background_cost_s` and `synchronous_cost_s`: the whole cost of a checkpoint
  to training: the excess, over the median step of the run without
  checkpoints, of the `checkpoint_every` steps after it, summed. The
  background write is off the critical path, not free: on a 2-core machine
  it shares caches, memory bandwidth and the kernel's page-cache work with
  training. Sums over many steps are sensitive to the machine's drift
  between runs; read them with `load_average`.

Run: `python benchmarks/checkpoint.py [--quick] [--rounds N] [--json PATH]`.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import elastic_plan
import harness
import restart_worker
from harness import cpu_count, median, ratio
from restart_worker import make_dataset

from flexpar.comm import state_transfer as training_state
from flexpar.worker import checkpoints
from flexpar.worker import lifecycle as flexpar_worker

GLOBAL_BATCH = 32
VIRTUAL_WORKERS = 2
SKIP = 3  # start-up steps left out
MODES = ("background", "synchronous", "none")


def _calls_log(checkpoint_dir: str) -> str:
    """Where the workers append {"step", "seconds", "waited"} of each checkpoint call: beside the checkpoints."""
    return os.path.normpath(checkpoint_dir) + "-calls.jsonl"


def _synchronous_write(self, directory: str) -> str:
    """flexpar's checkpoint before the background writer: serialise and write in the step loop."""
    path = checkpoints.checkpoint_path(directory, self.committed)
    if not os.path.exists(path):
        checkpoints.write_checkpoint(directory, training_state.to_bytes(self._capture()), self.committed)
        checkpoints.prune(directory, self.settings.keep_checkpoints)
    return path


def _instrument() -> None:
    """Time `Worker._maybe_checkpoint` (the step loop's checkpoint call) in every process that imports this."""
    original = flexpar_worker.Worker._maybe_checkpoint
    if getattr(original, "instrumented", False):
        return
    background_write = flexpar_worker.Worker._write_checkpoint

    def timed(self):
        folder = self.settings.checkpoint_dir or ""
        synchronous = folder.endswith("-synchronous")
        type(self)._write_checkpoint = _synchronous_write if synchronous else background_write
        # A write still in flight from the previous checkpoint makes this one wait for it.
        waited = self._checkpoint_writer is not None and self._checkpoint_writer.busy
        existing = set(os.listdir(folder)) if os.path.isdir(folder) else set()
        started = time.perf_counter()
        original(self)
        seconds = time.perf_counter() - started
        wrote = (self._checkpoint_writer is not None and self._checkpoint_writer.pending) or (
            synchronous and os.path.isdir(folder) and set(os.listdir(folder)) - existing
        )
        if wrote:
            with open(_calls_log(folder), "a", encoding="utf-8") as handle:
                handle.write(json.dumps({"step": self.committed, "seconds": seconds, "waited": waited}) + "\n")

    timed.instrumented = True
    flexpar_worker.Worker._maybe_checkpoint = timed


_instrument()


def make_model():
    return restart_worker.make_model()


def make_small_model():
    return restart_worker.make_small_model()


MODELS = {"full": make_model, "small": make_small_model}


class Settings:
    def __init__(self, quick: bool, rounds: int):
        self.model_name = "small" if quick else "full"
        # At the lowest priority the write of 302 MB took 1.5-3.5 s beside training on 2 cores
        # (0.11 s alone): the interval leaves it time to finish, as a real one (minutes) does;
        # a checkpoint that comes while the previous is still being written waits for it.
        self.every = 30 if quick else 40
        self.checkpoints = 3
        # The last checkpointed step is followed by a full window, so every measured
        # checkpoint has its `every` steps after it (the job's final one is not measured).
        self.steps = SKIP + self.every * (self.checkpoints + 1)
        self.rounds = rounds
        self.save_repeats = 3 if quick else 5


def _job(settings: Settings):
    # The pieces are this module's: the workers import it (and its instrumentation).
    return elastic_plan.make_job(MODELS[settings.model_name], GLOBAL_BATCH, VIRTUAL_WORKERS)


def _durations(metrics: str) -> dict:
    """step index -> seconds since the previous commit."""
    times = {record["step"]: record["time"] for record in harness.step_records(metrics)}
    return {step: times[step] - times[step - 1] for step in sorted(times) if step - 1 in times}


def run_job(settings: Settings, workdir: str, name: str, mode: str) -> tuple:
    """(step durations, the step loop's checkpoint calls as {committed step: call})."""
    metrics = os.path.join(workdir, f"{name}-{mode}.jsonl")
    folder = os.path.join(workdir, f"{name}-{mode}")
    options = {} if mode == "none" else dict(checkpoint_every=settings.every, checkpoint_dir=folder, keep_checkpoints=2)
    _job(settings).fit(
        steps=settings.steps, devices=1, metrics=metrics, display=False, quiet=True, timeout_s=60.0, **options
    )
    shutil.rmtree(folder, ignore_errors=True)
    calls = {}
    if os.path.exists(_calls_log(folder)):
        for line in open(_calls_log(folder), encoding="utf-8"):
            call = json.loads(line)
            calls[call["step"]] = call
    return _durations(metrics), calls


def analyse(settings: Settings, durations: dict, calls: dict, baseline: float) -> dict:
    """Per checkpoint (after committed step counts every, 2*every, ...): the loop's stall and the cost."""
    stalls, costs, waits = [], [], 0
    for count in range(settings.every, settings.steps, settings.every):
        if count < SKIP or count + settings.every > settings.steps:
            continue
        if count not in calls:
            raise RuntimeError(f"no timing of the checkpoint after step {count} came back from the worker: {calls}")
        stalls.append(calls[count]["seconds"])
        waits += calls[count]["waited"]
        # The checkpoint of `count` committed steps is taken right after step index count - 1
        # commits: step index `count` holds the stall, and the write overlaps the steps after.
        costs.append(sum(durations[count + k] - baseline for k in range(settings.every)))
    return {"stalls_s": stalls, "costs_s": costs, "waited_for_previous_write": waits}


def measure_save(settings: Settings, workdir: str) -> dict:
    """torch.save and cpu_copy of the job's training state after one step, in this process."""
    job = _job(settings)
    torch.manual_seed(0)
    model = job.model()  # the same model the job trains
    optimizer = job.optimizer(model.parameters())
    inputs, labels = make_dataset()[:GLOBAL_BATCH]
    job.loss(model, (inputs, labels)).backward()
    optimizer.step()
    state = training_state.capture(model, optimizer, None, 1, {"note": "as flexpar's extra"})
    path = os.path.join(workdir, "plain.pt")
    saves, copies = [], []
    for _ in range(settings.save_repeats):
        started = time.perf_counter()
        torch.save(state, path)
        saves.append(time.perf_counter() - started)
        os.remove(path)
        started = time.perf_counter()
        copy = checkpoints.cpu_copy(state)
        copies.append(time.perf_counter() - started)
        del copy
    size = sum(tensor.numel() * tensor.element_size() for tensor in _tensors(state))
    parameters = sum(parameter.numel() for parameter in model.parameters())
    return {
        "torch_save_s": median(saves),
        "copy_s": median(copies),
        "saves_s": saves,
        "copies_s": copies,
        "state_mb": size / 1e6,
        "parameters": parameters,
    }


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)


def main() -> int:
    parser = harness.base_parser(__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=None, help="rounds of (background, synchronous, none)")
    arguments = parser.parse_args()
    settings = Settings(arguments.quick, arguments.rounds or (1 if arguments.quick else 2))
    torch.set_num_threads(cpu_count())  # what flexpar gives one CPU device on this host
    load_before = os.getloadavg()
    with harness.run_folder("flexpar-checkpoint-bench-") as workdir:
        rounds = []
        for index in range(settings.rounds):
            runs = {mode: run_job(settings, workdir, f"round{index}", mode) for mode in MODES}
            baseline = median([seconds for step, seconds in runs["none"][0].items() if step >= SKIP])
            rounds.append(
                {"baseline_step_s": baseline, **{mode: analyse(settings, *runs[mode], baseline) for mode in MODES[:2]}}
            )
        saved = measure_save(settings, workdir)

    def pooled(mode, key):
        return median([value for result in rounds for value in result[mode][key]])

    stall = pooled("background", "stalls_s")
    results = {
        "checkpoint_stall_s": stall,
        "torch_save_s": saved["torch_save_s"],
        "stall_ratio": ratio(stall, saved["torch_save_s"]),
        "synchronous_stall_s": pooled("synchronous", "stalls_s"),
        "copy_s": saved["copy_s"],
        "background_cost_s": pooled("background", "costs_s"),
        "synchronous_cost_s": pooled("synchronous", "costs_s"),
        "baseline_step_s": median([result["baseline_step_s"] for result in rounds]),
        "state_mb": saved["state_mb"],
        "parameters": saved["parameters"],
        "checkpoint_every": settings.every,
        "checkpoints_measured": sum(len(result["background"]["stalls_s"]) for result in rounds),
        # Checkpoints that found the previous write still in flight (their stall includes the wait).
        "waited_for_previous_write": sum(result["background"]["waited_for_previous_write"] for result in rounds),
        "rounds": rounds,
        "saves_s": saved["saves_s"],
        "copies_s": saved["copies_s"],
        "cores": cpu_count(),
        "load_average": {"before": load_before, "after": os.getloadavg()},
        "quick": arguments.quick,
    }
    harness.print_table(
        [
            {
                "what": "step loop stall per checkpoint",
                "flexpar (background)": stall,
                "synchronous write": results["synchronous_stall_s"],
            },
            {"what": "plain torch.save of the same state", "synchronous write": saved["torch_save_s"]},
            {"what": "in-memory copy of the state alone", "flexpar (background)": saved["copy_s"]},
            {
                "what": f"cost to the {settings.every} steps after a checkpoint",
                "flexpar (background)": results["background_cost_s"],
                "synchronous write": results["synchronous_cost_s"],
            },
            {"what": "median step without checkpoints", "flexpar (background)": results["baseline_step_s"]},
        ],
        ["what", "flexpar (background)", "synchronous write"],
        title=f"checkpoint of {saved['state_mb']:.0f} MB ({saved['parameters'] / 1e6:.1f}M parameters, Adam), "
        f"seconds, medians of {results['checkpoints_measured']} checkpoints each; checkpoint_stall_s / "
        f"torch_save_s = {results['stall_ratio']:.3f}; {results['waited_for_previous_write']} waited for "
        "the previous write",
    )
    harness.write_json(arguments.json, results)
    return 0


if __name__ == "__main__":
    harness.run(main)
