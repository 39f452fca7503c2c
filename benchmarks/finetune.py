"""Fine-tuning with frozen weights: what a join and a checkpoint cost when 99% of the model is frozen.

The same model twice, side by side in alternating rounds: a GPT-2 (15 layers x
768, byte vocabulary, 64 positions: 107M parameters) loaded from a local
"pretrained" folder with peft LoRA rank 8 on its attention, either as peft
leaves it (**frozen**: 0.37M trainable, 99.7% frozen) or with every parameter
made trainable (**full**: the same module, the same forward). Each fit: AdamW,
6 VWs of one 64-token window, fp32, 2 CPU devices, one more joins at step 2
(2 -> 3 devices); 3 steps after the join the job stops and writes a checkpoint.

Figures (JSON keys; medians over the rounds):

- `join_bytes_ratio`: bytes of training state sent to the joiner (the join
  event's `state_bytes_sent`), frozen / full. Goal <= 0.05.
- `join_stall_ratio`: the join's stall (the event's `stall_s`: from the last
  commit until every member is level, transfer and restore included), frozen / full. Goal <= 0.2.
- `checkpoint_bytes_ratio`: the checkpoint file's size, frozen / full. Goal <= 0.05.
- `checkpoint_stall_ratio`: the step loop's time in its checkpoint call
  (`Worker._write_checkpoint`: the in-memory copy; the file is written by a
  background thread), frozen / full.
- `digest_s`: the frozen digest of the frozen model (sha256 per tensor) timed
  here with one thread and with the worker's threads, and as each joiner
  reported it. Where it runs: in each worker right after the model factory
  returns, before the device announces itself (a joiner's own start, off the
  running devices' path); the driver hashes its own build in a background thread.

Run: `python benchmarks/finetune.py [--quick] [--rounds N] [--json PATH]` (needs flexpar[hf]).
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from dataclasses import dataclass

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness
from harness import median, ratio

from flexpar.core import frozen
from flexpar.worker import lifecycle as flexpar_worker

CONTEXT = 64
SIDES = ("full", "frozen")


def _calls_log(checkpoint_dir: str) -> str:
    return os.path.normpath(checkpoint_dir) + "-calls.jsonl"


def _instrument() -> None:
    """Time `Worker._write_checkpoint` (the step loop's part: the in-memory copy) in every process importing this."""
    original = flexpar_worker.Worker._write_checkpoint
    if getattr(original, "instrumented", False):
        return

    def timed(self, directory):
        started = time.perf_counter()
        path = original(self, directory)
        seconds = time.perf_counter() - started
        with open(_calls_log(directory), "a", encoding="utf-8") as handle:
            handle.write(json.dumps({"step": self.committed, "seconds": seconds}) + "\n")
        return path

    timed.instrumented = True
    flexpar_worker.Worker._write_checkpoint = timed


_instrument()


def write_pretrained(folder: str, layers: int, width: int, heads: int) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    if os.path.exists(os.path.join(folder, "config.json")):
        return
    torch.manual_seed(1234)
    config = GPT2Config(
        vocab_size=257, n_positions=CONTEXT, n_embd=width, n_layer=layers, n_head=heads, use_cache=False
    )
    GPT2LMHeadModel(config).save_pretrained(folder)


@dataclass(frozen=True)
class PretrainedLoRA:
    """The pretrained GPT-2 with LoRA rank 8 (peft's default targets); `everything_trainable`: the full side."""

    folder: str
    everything_trainable: bool = False

    def __call__(self):
        from peft import LoraConfig, get_peft_model
        from transformers import GPT2LMHeadModel
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
        config = LoraConfig(r=8, lora_alpha=16, task_type="CAUSAL_LM", fan_in_fan_out=True)
        model = get_peft_model(GPT2LMHeadModel.from_pretrained(self.folder), config)
        if self.everything_trainable:
            model.requires_grad_(True)
        return model


def adamw(parameters):
    return torch.optim.AdamW(parameters, lr=1e-4)


def loss_fn(model, batch):
    (tokens,) = batch
    return model(input_ids=tokens, labels=tokens).loss


class StopAfterJoin:
    """Stop the job (it writes its checkpoint then) `after` steps past the join: the joiner's start varies."""

    def __init__(self, after: int):
        self.after, self.joined_at = after, None

    def on_event(self, record):
        if record["event"] == "join" and self.joined_at is None:
            self.joined_at = record["step"]

    def on_step(self, record):
        import flexpar

        if self.joined_at is not None and record["step"] + 1 >= self.joined_at + self.after:
            return flexpar.STOP
        return None


@dataclass(frozen=True)
class Settings:
    layers: int
    width: int
    heads: int
    steps: int
    join_at: int
    rounds: int


def run_fit(settings: Settings, folder: str, workdir: str, side: str, index: int) -> dict:
    import flexpar

    tokens = torch.randint(0, 256, (240, CONTEXT), generator=torch.Generator().manual_seed(0))
    job = flexpar.Job(
        model=PretrainedLoRA(folder, everything_trainable=(side == "full")),
        optimizer=adamw,
        loss=loss_fn,
        dataset=torch.utils.data.TensorDataset(tokens),
        global_batch=6,
        virtual_workers=6,
        seed=0,
    )
    name = f"{side}-{index}"
    metrics, checkpoints = os.path.join(workdir, f"{name}.jsonl"), os.path.join(workdir, name)
    job.fit(
        steps=200,  # StopAfterJoin ends it `settings.steps` steps after the join
        devices=2,
        max_devices=3,
        schedule=f"{settings.join_at}:+1",
        oversubscribe=True,
        metrics=metrics,
        display=False,
        quiet=True,
        timeout_s=120.0,
        checkpoint_dir=checkpoints,  # written when StopAfterJoin stops the job
        callbacks=(StopAfterJoin(settings.steps),),
    )
    records = harness.metrics_records(metrics)
    join = next(record for record in records if record["kind"] == "event" and record["event"] == "join")
    calls = [json.loads(line) for line in open(_calls_log(checkpoints), encoding="utf-8")]
    files = [os.path.join(checkpoints, file) for file in os.listdir(checkpoints) if file.endswith(".pt")]
    digest = re.search(r"frozen digest ([0-9.]+) s", join["detail"])
    steps = [record["step_time_s"] for record in records if record["kind"] == "step"][1:]
    run = {
        "join_bytes": join["state_bytes_sent"],
        "join_stall_s": join["stall_s"],
        "checkpoint_bytes": max(os.path.getsize(file) for file in files),
        "checkpoint_stall_s": median([call["seconds"] for call in calls]),
        "joiner_digest_s": float(digest.group(1)) if digest else None,
        "step_s": median(steps),
    }
    harness.progress("finetune")(f"{name}: {json.dumps(run)}")
    return run


def measure_digest(folder: str) -> dict:
    """The frozen model's digest here, with one thread and with 2 (a worker's share of the 2 cores with 2 devices)."""
    from concurrent.futures import ThreadPoolExecutor

    model = PretrainedLoRA(folder)()
    one = median([harness.timed(lambda: frozen.frozen_digests(model))[1] for _ in range(3)])
    with ThreadPoolExecutor(2) as pool:
        two = median([harness.timed(lambda: frozen.frozen_digests(model, pool.map))[1] for _ in range(3)])
    parameters = sum(parameter.numel() for parameter in model.parameters())
    trainable = sum(parameter.numel() for parameter in model.parameters() if parameter.requires_grad)
    return {"digest_one_thread_s": one, "digest_two_threads_s": two, "parameters": parameters, "trainable": trainable}


def main() -> int:
    parser = harness.base_parser(__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=None, help="rounds of (full, frozen) fits (default 2; quick 1)")
    arguments = parser.parse_args()
    quick = arguments.quick
    settings = Settings(
        layers=2 if quick else 15,
        width=128 if quick else 768,
        heads=4 if quick else 12,
        steps=2 if quick else 3,
        join_at=1 if quick else 2,
        rounds=arguments.rounds or (1 if quick else 2),
    )
    say = harness.progress("finetune")
    with harness.run_folder("flexpar-finetune-") as workdir:
        folder = os.path.join(workdir, "pretrained")
        write_pretrained(folder, settings.layers, settings.width, settings.heads)
        digest = measure_digest(folder)
        say(f"{digest['parameters'] / 1e6:.1f}M parameters, {digest['trainable'] / 1e6:.2f}M trainable")
        runs = harness.alternate(
            {side: (lambda index, side=side: run_fit(settings, folder, workdir, side, index)) for side in SIDES},
            settings.rounds,
        )
    medians = {side: {key: harness.median_of(runs[side], key) for key in runs[side][0]} for side in SIDES}
    results = {
        "join_bytes_ratio": ratio(medians["frozen"]["join_bytes"], medians["full"]["join_bytes"]),
        "join_stall_ratio": ratio(medians["frozen"]["join_stall_s"], medians["full"]["join_stall_s"]),
        "checkpoint_bytes_ratio": ratio(medians["frozen"]["checkpoint_bytes"], medians["full"]["checkpoint_bytes"]),
        "checkpoint_stall_ratio": ratio(medians["frozen"]["checkpoint_stall_s"], medians["full"]["checkpoint_stall_s"]),
        "digest_s": digest["digest_two_threads_s"],
        "digest_one_thread_s": digest["digest_one_thread_s"],
        "joiner_digest_s": medians["frozen"]["joiner_digest_s"],
        "digest_where": "in each worker after the model factory returns, before it announces itself "
        "(a joiner's own start); the driver's reference in a background thread",
        "parameters": digest["parameters"],
        "trainable_parameters": digest["trainable"],
        "frozen_share": 1 - digest["trainable"] / digest["parameters"],
        "rounds": len(runs["full"]),
        "quick": quick,
        "sides": medians,
    }
    rows = [{"side": side, **medians[side]} for side in SIDES]
    harness.print_table(rows, ["side", *runs["full"][0]], title="medians per side")
    print()
    harness.print_table(
        [{"figure": key, "value": results[key]} for key in results if key not in ("sides", "digest_where")],
        ["figure", "value"],
    )
    print(f"digest_s runs {results['digest_where']}")
    harness.write_json(arguments.json, results)
    return 0


if __name__ == "__main__":
    harness.run(main)
