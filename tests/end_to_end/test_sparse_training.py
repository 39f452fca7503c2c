"""Training with a sparse embedding: the same parameters as a dense single-process run.

A model with `nn.Embedding(sparse=True)` plus dense layers trains on 1, 2 and 3
devices, and on an elastic schedule; after the run its parameters equal those
of the plain single-process reference (the same model with `sparse=False`, the
mean loss over the whole global batch, one optimizer step per global batch).
That checks the sparse path end to end: the sparse gradient is accumulated
over a device's VWs, summed across devices as indices and values, and applied
by the optimizer exactly as the dense gradient would be.
"""

import json

import pieces
import pytest
import torch
from torch import nn

import flexpar

ROWS = 500
WIDTH = 8
LOOKUPS = 4  # embedding rows read per sample
CLASSES = 3


class SparseNet(nn.Module):
    """Embedding lookups, averaged per sample, then a small MLP."""

    def __init__(self, sparse: bool):
        super().__init__()
        self.embedding = nn.Embedding(ROWS, WIDTH, sparse=sparse)
        self.head = nn.Sequential(nn.Linear(WIDTH, 16), nn.Tanh(), nn.Linear(16, CLASSES))

    def forward(self, rows):
        return self.head(self.embedding(rows).mean(dim=1))


def make_sparse_model():
    return SparseNet(sparse=True)


def make_dense_model():
    return SparseNet(sparse=False)


def plain_sgd(parameters):
    # SGD without momentum or weight decay accepts sparse gradients and applies
    # them exactly as their dense equivalent.
    return torch.optim.SGD(parameters, lr=0.5)


def make_dataset(size: int = 480, seed: int = 3):
    generator = torch.Generator().manual_seed(seed)
    rows = torch.randint(0, ROWS, (size, LOOKUPS), generator=generator)
    labels = rows[:, 0] % CLASSES
    return torch.utils.data.TensorDataset(rows, labels)


def make_job(model, delay_s=0.0, virtual_workers=6):
    return flexpar.Job(
        model=model,
        optimizer=plain_sgd,
        loss=pieces.Loss(delay_s),
        dataset=make_dataset(),
        global_batch=48,
        virtual_workers=virtual_workers,
        seed=11,
    )


def dense_reference(steps: int, virtual_workers=6) -> nn.Module:
    return pieces.reference(make_job(make_dense_model, virtual_workers=virtual_workers), steps)


def test_the_model_really_has_a_sparse_gradient():
    from flexpar.comm.sparse_sync import sparse_parameters

    model = make_sparse_model()
    assert sparse_parameters(model) == [model.embedding.weight]
    rows, labels = make_dataset()[:4]
    nn.functional.cross_entropy(model(rows), labels).backward()
    assert model.embedding.weight.grad.layout == torch.sparse_coo


@pytest.mark.parametrize("devices", [1, 2, 3])
def test_sparse_training_matches_dense_reference(train, devices):
    steps = 10
    model, _ = train(make_job(make_sparse_model), steps=steps, devices=devices)
    pieces.assert_same_parameters(model, dense_reference(steps))


def test_sparse_training_with_a_join_matches_dense_reference(train, metrics_file):
    # A slow loss keeps the job running while the joiner starts and warms up:
    # 70 steps of 3 VWs x 0.03 s on 2 devices leave it 6 s, though it normally
    # needs a few steps (a start can stall for seconds on a busy host).
    steps = 70
    job = make_job(make_sparse_model, delay_s=0.03)
    model, _ = train(job, steps=steps, devices=2, schedule="3:+1", max_devices=3)
    records = [json.loads(line) for line in open(metrics_file)]
    sizes = [len(record["devices"]) for record in records if record["kind"] == "step"]
    assert sizes[0] == 2 and sizes[-1] == 3, f"the joiner must be let in before the end: {sizes}"
    assert [r["step"] for r in records if r["kind"] == "step"] == list(range(steps))
    pieces.assert_same_parameters(model, dense_reference(steps))
