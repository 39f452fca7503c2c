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
import functools
import os
import sys
from typing import List

import torch
from torch import nn
from torch.utils.data import TensorDataset

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness
from harness import alternate, median, ratio

import flexpar
from flexpar.comm.sparse_sync import dense_all_reduce_wire_bytes, sparse_parameters, sparse_wire_bytes
from flexpar.core import batching
from flexpar.worker.loader import load_batch

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


FULL = Config(
    rows=1_000_000,
    width=64,
    lookups=16,
    hidden=128,
    classes=10,
    per_device_batch=128,
    steps=10,
    skip=3,
    repeats=3,
    dataset_size=8192,
)
QUICK = dataclasses.replace(FULL, rows=100_000, lookups=8, per_device_batch=32, steps=8, repeats=1, dataset_size=2048)


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
        model=ModelFactory(config, sparse=True),
        optimizer=make_optimizer,
        loss=classification_loss,
        dataset=make_dataset(config),
        global_batch=config.per_device_batch * DEVICES,
        virtual_workers=DEVICES,
        seed=0,
    )


# ---------------------------------------------------------------- flexpar side


def flexpar_run(config: Config, work_dir: str) -> dict:
    """One flexpar fit() on 2 devices; median step seconds and the timed steps' records."""
    metrics_path = harness.unique_path(work_dir, ".jsonl")
    make_job(config).fit(
        steps=config.steps, devices=DEVICES, metrics=metrics_path, display=False, quiet=True, run_dir=work_dir
    )
    steps = harness.step_records(metrics_path)
    durations = harness.step_durations([record["time"] for record in steps], config.skip)
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


def ddp_dense_run(config: Config, work_dir: str) -> dict:
    """One DDP job with the dense model: the standard loop (harness.ddp_training_rank), timing each commit."""
    commit_times = harness.run_ddp(
        ModelFactory(config, sparse=False),
        make_optimizer,
        functools.partial(make_dataset, config),
        config.per_device_batch,
        config.steps,
        DEVICES,
        work_dir,
    )
    return {"step_s": median(harness.step_durations(commit_times, config.skip))}


# ---------------------------------------------------------------- main


def measure(config: Config, work_dir: str) -> dict:
    runs = alternate(
        {
            "flexpar_sparse": lambda _: flexpar_run(config, work_dir),
            "ddp_dense": lambda _: ddp_dense_run(config, work_dir),
        },
        config.repeats,
    )
    # The data plan of the last flexpar run's timed steps (every run has the same data).
    nnz = measured_nnz(config, runs["flexpar_sparse"][-1]["plan"])
    per_step_bytes = [wire_bytes(config, counts) for counts in nnz]
    bytes_median = {key: median([entry[key] for entry in per_step_bytes]) for key in per_step_bytes[0]}
    return {
        "bytes_ratio": ratio(bytes_median["flexpar_bytes"], bytes_median["dense_bytes"]),
        "embedding_bytes_ratio": ratio(bytes_median["flexpar_embedding_bytes"], bytes_median["dense_embedding_bytes"]),
        **harness.ratio_of_medians(
            runs, "step_s", ("ddp_dense", "ddp_dense_step_s"), ("flexpar_sparse", "flexpar_step_s"), "speedup_vs_dense"
        ),
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
        {
            "figure": "bytes sent per rank per step (MiB)",
            "flexpar sparse": figures["flexpar_bytes_per_step"] / mib,
            "DDP dense": figures["dense_bytes_per_step"] / mib,
            "ratio": figures["bytes_ratio"],
            "goal": "bytes_ratio <= 0.1",
        },
        {
            "figure": "  of which the embedding (MiB)",
            "flexpar sparse": figures["flexpar_embedding_bytes_per_step"] / mib,
            "DDP dense": figures["dense_embedding_bytes_per_step"] / mib,
            "ratio": figures["embedding_bytes_ratio"],
            "goal": "",
        },
        {
            "figure": "median step time (s)",
            "flexpar sparse": figures["flexpar_step_s"],
            "DDP dense": figures["ddp_dense_step_s"],
            "ratio": figures["speedup_vs_dense"],
            "goal": "speedup_vs_dense (dense / flexpar)",
        },
    ]
    title = (
        f"sparse embedding {config.rows:,} x {config.width}, {DEVICES} devices, "
        f"{config.per_device_batch} samples x {config.lookups} lookups per device, "
        f"at most {figures['max_rows_touched_fraction']:.2%} of rows per step; "
        f"{config.repeats} alternating rounds, medians"
    )
    harness.print_table(rows, ["figure", "flexpar sparse", "DDP dense", "ratio", "goal"], title)


def main() -> None:
    arguments = harness.base_parser(__doc__.split("\n\n")[0]).parse_args()
    config = QUICK if arguments.quick else FULL
    load_before = os.getloadavg()[0]
    with harness.run_folder("flexpar-sparse-") as work_dir:
        figures = measure(config, work_dir)
    figures["load_average_before_after"] = [load_before, os.getloadavg()[0]]
    report(figures, config)
    print(f"load average (1 min) before/after: {load_before:.2f} / {os.getloadavg()[0]:.2f}")
    figures["config"] = dataclasses.asdict(config)
    figures["cores"] = harness.cpu_count()
    harness.write_json(arguments.json, figures)


if __name__ == "__main__":
    harness.run(main)
