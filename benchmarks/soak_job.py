"""The fault soak's job: a small model whose run is told its schedule and faults on the command line.

`python benchmarks/soak_job.py SPEC.json` trains the job as the spec says (devices,
schedule, faults, steps, timeouts, evaluations) with the sample ledger on, and
writes `model.pt` and `summary.json` into the spec's output folder; with the spec's
`shard`, the job's optimizer state is sharded (soak.py --shard); with its `streaming`, the job
trains the same samples as a stream of 6 shards (`ShardStream`). Worker
processes import this file for its pieces, so everything they need is at module
level. `reference(steps, eval_every)` is the plain single-process loop the soak
compares with, and its evaluations.

The evaluation set says which samples each evaluation saw: `evaluate` returns,
besides the loss sum and count, one count per evaluation sample
(`sample_NN`), summed over the devices like any metric, so an evaluation in
which a sample was skipped or evaluated twice (a chunk lost or redone in a
device-set change) shows a count other than 1.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from soak_plan import VIRTUAL_WORKERS

import flexpar
from flexpar.core import batching, ledger
from flexpar.core.stream_split import split_stream
from flexpar.data import VirtualWorkerStreams
from flexpar.worker import evaluator
from flexpar.worker.loader import load_batch
from flexpar.worker.user_code import build_model, build_optimizer

FEATURES, CLASSES, SAMPLES = 12, 3, 480
GLOBAL_BATCH = 48
EVAL_SAMPLES, EVAL_BATCH = 30, 4  # 8 chunks, the last one short
# Each VW sleeps this long: steps of ~0.1 s on two devices, long enough that a
# scheduled fault lands inside a step and joins apply within a run.
VW_DELAY_S = 0.015


def make_dataset():
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(SAMPLES, FEATURES, generator=generator)
    return torch.utils.data.TensorDataset(inputs, inputs[:, :CLASSES].argmax(dim=1))


def make_eval_dataset():
    generator = torch.Generator().manual_seed(1)
    inputs = torch.randn(EVAL_SAMPLES, FEATURES, generator=generator)
    return torch.utils.data.TensorDataset(inputs, inputs[:, :CLASSES].argmax(dim=1), torch.arange(EVAL_SAMPLES))


def sample_key(index: int) -> str:
    return f"sample_{index:02d}"


def evaluate(model, batch):
    inputs, labels, indices = batch
    sums = {"loss_sum": nn.functional.cross_entropy(model(inputs), labels, reduction="sum"), "count": len(labels)}
    sums.update({sample_key(index): int((indices == index).sum()) for index in range(EVAL_SAMPLES)})
    return sums


def make_model():
    return nn.Sequential(nn.Linear(FEATURES, 32), nn.Tanh(), nn.Dropout(0.1), nn.Linear(32, CLASSES))


def make_optimizer(parameters):
    return torch.optim.SGD(parameters, lr=0.1, momentum=0.9)


def loss(model, batch):
    time.sleep(VW_DELAY_S)
    inputs, labels = batch
    return nn.functional.cross_entropy(model(inputs), labels)


class ShardStream(torch.utils.data.IterableDataset):
    """The dataset's samples as a stream of 6 shards of 80 (flexpar's shard protocol: one shard per VW);
    odd passes read a shard backwards. 80 = 10 steps of 8 a pass, so a run crosses pass ends."""

    def __init__(self, chosen=tuple(range(6))):
        self.inputs, self.labels = make_dataset().tensors
        self.chosen, self.epoch = list(chosen), 0

    @property
    def n_shards(self):
        return len(self.chosen)

    def shard(self, num_shards, index):
        per = len(self.chosen) // num_shards
        return ShardStream(self.chosen[index * per : (index + 1) * per])

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        per_shard = SAMPLES // 6
        for shard in self.chosen:
            order = range(shard * per_shard, (shard + 1) * per_shard)
            for index in reversed(order) if self.epoch % 2 else order:
                yield self.inputs[index], self.labels[index]


def make_job(shard: bool = False, streaming: bool = False):
    """The soak's job; `shard`: its optimizer state sharded (Job(shard_optimizer=True), the default
    redundancy: 2 copies of each part, every device holding everything on 2 devices); `streaming`:
    the same samples as a stream (ShardStream) instead of the map-style dataset."""
    return flexpar.Job(
        model=make_model,
        optimizer=make_optimizer,
        loss=loss,
        dataset=ShardStream() if streaming else make_dataset(),
        global_batch=GLOBAL_BATCH,
        virtual_workers=VIRTUAL_WORKERS,
        seed=3,
        eval_dataset=make_eval_dataset(),
        evaluate=evaluate,
        eval_batch=EVAL_BATCH,
        shard_optimizer=shard,
    )


def reference(steps: int, eval_every: int, streaming: bool = False):
    """The failure-free single-process loop over the same global batches: (model, {step: metrics})
    with the whole evaluation set evaluated after every `eval_every` steps and the last.

    On one thread: this model's matrices are too small to gain from more, and on a host
    busy with the soak's workers extra threads only wait for cores (seconds per reference)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _reference(steps, eval_every, streaming)
    finally:
        torch.set_num_threads(threads)


def _reference(steps: int, eval_every: int, streaming: bool = False):
    job = make_job(streaming=streaming)
    model = build_model(job)
    optimizer, _ = build_optimizer(job, model)
    evaluations = {}
    # A stream's batches from one reader holding every VW (the data layer's promise: the same items and
    # collation on any device set; tests/data check it against the split's spec).
    stream = None
    if streaming:
        stream = VirtualWorkerStreams(job.dataset, job.virtual_workers, job.micro_batch_size, seed=job.seed)
        stream.hold(range(job.virtual_workers), 0)
    for step in range(steps):
        losses = []
        for virtual_worker in range(job.virtual_workers):
            if streaming:
                batch = stream.batch(step, virtual_worker)
            else:
                indices = batching.virtual_worker_indices(
                    job.seed, step, virtual_worker, len(job.dataset), job.global_batch, job.virtual_workers
                )
                batch = load_batch(job, indices, batching.data_seed(job.seed, step, virtual_worker))
            torch.manual_seed(batching.virtual_worker_seed(job.seed, step, virtual_worker))
            inputs, labels = batch
            losses.append(nn.functional.cross_entropy(model(inputs), labels))
        torch.stack(losses).mean().backward()
        if stream is not None:
            stream.commit(step + 1)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if (step + 1) % eval_every == 0 or step + 1 == steps:
            evaluations[step + 1] = evaluator.evaluate_all(job, model)
    return model, evaluations


def audit(ledger_path: str, steps: int, streaming: bool):
    """The run's sample ledger against what its steps should train (a stream's: by the split and the
    pass ends recorded; a map-style one's: by the batching order)."""
    job = make_job(streaming=streaming)
    entries = ledger.read(ledger_path)
    if streaming:
        split = split_stream(job.virtual_workers, job.dataset.n_shards)
        return ledger.audit_stream(entries, ledger.read_pass_ends(ledger_path), split, job.micro_batch_size, steps)
    return ledger.audit(entries, job.seed, len(job.dataset), job.global_batch, steps)


if __name__ == "__main__":
    spec = json.load(open(sys.argv[1]))
    output = spec["output"]
    model, summary = make_job(spec.get("shard", False), spec.get("streaming", False)).fit(
        steps=spec["steps"],
        devices=spec["devices"],
        max_devices=spec["max_devices"],
        schedule=spec["schedule"],
        faults=spec["faults"],
        oversubscribe=True,
        display=False,
        quiet=True,
        timeout_s=spec["timeout_s"],
        heartbeat_timeout_s=spec["heartbeat_timeout_s"],
        checkpoint_every=spec["checkpoint_every"],
        checkpoint_dir=os.path.join(output, "checkpoints"),
        metrics=os.path.join(output, "metrics.jsonl"),
        sample_ledger=True,
        eval_every=spec["eval_every"],
        # About 1 kB per sender per step: a join's state streams over several steps, so the faults drawn
        # for those steps hit a stream in flight. A sharded job streams only the optimizer state of the
        # joiner's chunks (about 1 kB here, from every holder at once): 200 bytes, to last as long.
        join_stream_mb=0.0002 if spec.get("shard", False) else 0.001,
    )
    torch.save(model.state_dict(), os.path.join(output, "model.pt"))
    with open(os.path.join(output, "summary.json"), "w") as handle:
        json.dump(summary, handle)
