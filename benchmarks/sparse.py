"""Sparse embedding gradients: flexpar's indices+values sum vs DDP's dense all-reduce.

The model: ``nn.Embedding(1_000_000, 64)`` (each sample looks up a few rows,
averaged) plus a small MLP. Each step touches well under 1% of the rows. Two
sides, alternating runs on 2 CPU devices, plain SGD on both:

- flexpar with ``sparse=True``: the embedding's gradient is detected as sparse
  and summed as indices and values (flexpar/sparse.py, flexpar/sync.py);
- torch ``DistributedDataParallel`` with ``sparse=False`` (the dense
  equivalent, the same model otherwise), started with
  ``torch.multiprocessing.spawn`` over gloo, ``DistributedSampler``, the
  standard loop.

Figures (JSON keys):

- ``bytes_ratio``: bytes one rank sends per step with flexpar over a dense
  all-reduce of the same gradients. flexpar's bytes are
  ``flexpar.sparse.sparse_wire_bytes`` of the embedding (with the real nnz of
  each rank, measured from its gradient at each timed step, median over
  steps) plus ``dense_all_reduce_wire_bytes`` of the MLP's gradient and the
  step's statistics vector; the dense side is ``dense_all_reduce_wire_bytes``
  of every parameter. Goal <= 0.1. ``embedding_bytes_ratio`` is the same for
  the embedding alone.
- ``speedup_vs_dense``: median steady-state step time of dense DDP over
  flexpar's (steps ``skip ..``; see benchmarks/overhead.py for how a step is
  timed), medians over rounds.

The nnz of a rank at a step is measured, not assumed: this process rebuilds
the step's data plan from the flexpar run's metrics (the assignment of VWs to
ranks), runs the sparse model's forward and backward on each rank's VWs, and
counts the rows of the coalesced gradient.

Run: ``python benchmarks/sparse.py [--quick] [--json PATH]``.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import tempfile
from pathlib import Path
from typing import List

import torch
import torch.multiprocessing as torch_multiprocessing
from torch import nn
from torch.utils.data import TensorDataset

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (  # noqa: E402
    ddp_training_rank,
    alternate, base_parser, cpu_count, free_port, median, print_table, ratio, step_durations, write_json,
)

import flexpar  # noqa: E402
from flexpar.core import batching  # noqa: E402
from flexpar.worker.loader import load_batch  # noqa: E402
from flexpar.observe.metrics import read_records  # noqa: E402
from flexpar.comm.sparse_sync import dense_all_reduce_wire_bytes, sparse_parameters, sparse_wire_bytes  # noqa: E402

DEVICES = 2


@dataclasses.dataclass(frozen=True)
class Config:
    """Sizes of one benchmark run; the full run and --quick differ only here."""

    rows: int  # embedding rows
    width: int  # embedding dimension
    lookups: int  # rows each sample reads
    hidden: int
    classes: int
    per_device_batch: int
    steps: int
    skip: int  # leading steps excluded from timing (start-up)
    repeats: int  # alternating rounds
    dataset_size: int

    def rows_touched_per_step_at_most(self) -> int:
        return self.per_device_batch * DEVICES * self.lookups


FULL = Config(rows=1_000_000, width=64, lookups=16, hidden=128, classes=10, per_device_batch=128,
              steps=10, skip=3, repeats=3, dataset_size=8192)
QUICK = Config(rows=100_000, width=64, lookups=8, hidden=128, classes=10, per_device_batch=32,
               steps=8, skip=3, repeats=1, dataset_size=2048)


# ---------------------------------------------------------------- shared pieces
# Module level, so that flexpar's workers and DDP's ranks find them by name.


class EmbeddingClassifier(nn.Module):
    """Embedding lookups averaged per sample, then Linear-ReLU-Linear."""

    def __init__(self, config: Config, sparse: bool):
        super().__init__()
        self.embedding = nn.Embedding(config.rows, config.width, sparse=sparse)
        self.head = nn.Sequential(
            nn.Linear(config.width, config.hidden), nn.ReLU(), nn.Linear(config.hidden, config.classes)
        )

    def forward(self, rows):
        return self.head(self.embedding(rows).mean(dim=1))


class ModelFactory:
    """Picklable factory of the benchmark model, sparse or dense."""

    def __init__(self, config: Config, sparse: bool):
        self.config, self.sparse = config, sparse

    def __call__(self) -> nn.Module:
        return EmbeddingClassifier(self.config, self.sparse)


def make_optimizer(parameters):
    # Plain SGD: accepts sparse gradients, and is the same update on both sides.
    return torch.optim.SGD(parameters, lr=0.1)


def classification_loss(model, batch):
    rows, labels = batch
    return nn.functional.cross_entropy(model(rows), labels)


def make_dataset(config: Config) -> TensorDataset:
    """Uniformly random rows per sample; labels from the first row (learnable, not trivial)."""
    generator = torch.Generator().manual_seed(0)
    rows = torch.randint(0, config.rows, (config.dataset_size, config.lookups), generator=generator)
    labels = rows[:, 0] % config.classes
    return TensorDataset(rows, labels)


def make_job(config: Config) -> flexpar.Job:
    return flexpar.Job(
        model=ModelFactory(config, sparse=True), optimizer=make_optimizer, loss=classification_loss,
        dataset=make_dataset(config), global_batch=config.per_device_batch * DEVICES,
        virtual_workers=DEVICES, seed=0,
    )


# ---------------------------------------------------------------- flexpar side


def flexpar_run(config: Config, work_dir: str) -> dict:
    """One flexpar fit() on 2 devices; median step seconds and the timed steps' records."""
    metrics_path = tempfile.mktemp(suffix=".jsonl", dir=work_dir)
    make_job(config).fit(steps=config.steps, devices=DEVICES, metrics=metrics_path, display=False,
                         quiet=True, run_dir=work_dir)
    steps = sorted((r for r in read_records(metrics_path) if r["kind"] == "step"), key=lambda r: r["step"])
    durations = step_durations([record["time"] for record in steps], config.skip)
    timed = steps[config.skip :]
    return {
        "step_s": median(durations),
        "plan": [{"step": record["step"], "assignment": record["assignment"]} for record in timed],
    }


def measured_nnz(config: Config, plan: List[dict]) -> List[List[int]]:
    """Rows in each rank's coalesced embedding gradient at each planned step.

    Replays each step's data for each rank, as a flexpar worker runs it: the
    rank's VWs one after another, ``loss / V`` backward, gradients accumulated.
    Only the gradient's sparsity pattern matters here, so the model is the
    freshly built one, not the trained one.
    """
    job = make_job(config)
    torch.manual_seed(job.seed)
    model = job.model()
    (embedding,) = sparse_parameters(model)
    per_step = []
    for entry in plan:
        counts = []
        for rank in range(len(entry["assignment"])):
            model.zero_grad(set_to_none=True)
            for virtual_worker in batching.virtual_workers_of(entry["assignment"], rank):
                indices = batching.virtual_worker_indices(
                    job.seed, entry["step"], virtual_worker, len(job.dataset), job.global_batch, job.virtual_workers
                )
                batch = load_batch(job, indices, batching.data_seed(job.seed, entry["step"], virtual_worker))
                (job.loss(model, batch) / job.virtual_workers).backward()
            counts.append(embedding.grad.coalesce()._nnz())
        per_step.append(counts)
    return per_step


def wire_bytes(config: Config, nnz_per_rank: List[int]) -> dict:
    """Bytes one rank sends per step: flexpar (sparse embedding + dense rest) and all-dense."""
    model = EmbeddingClassifier(config, sparse=True)
    embedding_elements = model.embedding.weight.numel()
    dense_elements = sum(parameter.numel() for parameter in model.head.parameters())
    statistics_elements = 3 * DEVICES + 1  # flexpar's per-step statistics vector rides in the last bucket
    world = len(nnz_per_rank)
    flexpar_embedding = sparse_wire_bytes(nnz_per_rank, config.width)
    flexpar_dense = dense_all_reduce_wire_bytes(dense_elements + statistics_elements, world)
    dense_embedding = dense_all_reduce_wire_bytes(embedding_elements, world)
    dense_total = dense_all_reduce_wire_bytes(embedding_elements + dense_elements, world)
    return {
        "flexpar_bytes": flexpar_embedding + flexpar_dense,
        "dense_bytes": dense_total,
        "flexpar_embedding_bytes": flexpar_embedding,
        "dense_embedding_bytes": dense_embedding,
    }


# ---------------------------------------------------------------- DDP side


def _ddp_rank(rank: int, world_size: int, port: int, config: Config, result_path: str) -> None:
    """One DDP rank with the dense model: the standard loop, timing each commit."""
    ddp_training_rank(rank, world_size, port, ModelFactory(config, sparse=False), make_optimizer, make_dataset(config),
                      config.per_device_batch, config.steps, result_path)


def ddp_dense_run(config: Config, work_dir: str) -> dict:
    result_path = tempfile.mktemp(suffix=".txt", dir=work_dir)
    torch_multiprocessing.spawn(
        _ddp_rank, args=(DEVICES, free_port(), config, result_path), nprocs=DEVICES, join=True
    )
    commit_times = [float(value) for value in Path(result_path).read_text().split()]
    return {"step_s": median(step_durations(commit_times, config.skip))}


# ---------------------------------------------------------------- main


def measure(config: Config, work_dir: str) -> dict:
    runs = alternate({
        "flexpar_sparse": lambda: flexpar_run(config, work_dir),
        "ddp_dense": lambda: ddp_dense_run(config, work_dir),
    }, config.repeats)
    flexpar_step_s = median([run["step_s"] for run in runs["flexpar_sparse"]])
    dense_step_s = median([run["step_s"] for run in runs["ddp_dense"]])
    # The data plan of the last flexpar run's timed steps (every run has the same data).
    nnz = measured_nnz(config, runs["flexpar_sparse"][-1]["plan"])
    per_step_bytes = [wire_bytes(config, counts) for counts in nnz]
    bytes_median = {key: median([entry[key] for entry in per_step_bytes]) for key in per_step_bytes[0]}
    return {
        "bytes_ratio": ratio(bytes_median["flexpar_bytes"], bytes_median["dense_bytes"]),
        "embedding_bytes_ratio": ratio(bytes_median["flexpar_embedding_bytes"], bytes_median["dense_embedding_bytes"]),
        "speedup_vs_dense": ratio(dense_step_s, flexpar_step_s),
        "flexpar_step_s": flexpar_step_s,
        "ddp_dense_step_s": dense_step_s,
        "nnz_per_rank_per_step": nnz,
        "max_rows_touched_fraction": max(sum(counts) for counts in nnz) / config.rows,
        **{f"{key}_per_step": value for key, value in bytes_median.items()},
        "runs": {
            "flexpar_sparse": [run["step_s"] for run in runs["flexpar_sparse"]],
            "ddp_dense": [run["step_s"] for run in runs["ddp_dense"]],
        },
    }


def report(figures: dict, config: Config) -> None:
    mib = 1 << 20
    rows = [
        {"figure": "bytes sent per rank per step (MiB)", "flexpar sparse": figures["flexpar_bytes_per_step"] / mib,
         "DDP dense": figures["dense_bytes_per_step"] / mib, "ratio": figures["bytes_ratio"],
         "goal": "bytes_ratio <= 0.1"},
        {"figure": "  of which the embedding (MiB)", "flexpar sparse": figures["flexpar_embedding_bytes_per_step"] / mib,
         "DDP dense": figures["dense_embedding_bytes_per_step"] / mib, "ratio": figures["embedding_bytes_ratio"],
         "goal": ""},
        {"figure": "median step time (s)", "flexpar sparse": figures["flexpar_step_s"],
         "DDP dense": figures["ddp_dense_step_s"], "ratio": figures["speedup_vs_dense"],
         "goal": "speedup_vs_dense (dense / flexpar)"},
    ]
    title = (f"sparse embedding {config.rows:,} x {config.width}, {DEVICES} devices, "
             f"{config.per_device_batch} samples x {config.lookups} lookups per device, "
             f"at most {figures['max_rows_touched_fraction']:.2%} of rows per step; "
             f"{config.repeats} alternating rounds, medians")
    print_table(rows, ["figure", "flexpar sparse", "DDP dense", "ratio", "goal"], title)


def main() -> None:
    arguments = base_parser(__doc__.split("\n\n")[0]).parse_args()
    config = QUICK if arguments.quick else FULL
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="flexpar-sparse-") as work_dir:
        figures = measure(config, work_dir)
    figures["load_average_before_after"] = [load_before, os.getloadavg()[0]]
    report(figures, config)
    print(f"load average (1 min) before/after: {load_before:.2f} / {os.getloadavg()[0]:.2f}")
    figures["config"] = dataclasses.asdict(config)
    figures["cores"] = cpu_count()
    write_json(arguments.json, figures)


if __name__ == "__main__":
    main()
