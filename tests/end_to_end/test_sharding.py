"""Sharded optimizer state (Job(shard_optimizer=True)): the same parameters as the plain loop.

One real job over gloo per optimizer (3 devices, redundancy 2: each device holds
two thirds of the state and steps it; the owners' updated ranges reach every
device by broadcast), compared with the single-process reference; an optimizer
whose update is not element-wise is refused before any worker starts.
"""

import json

import pieces
import pytest
import torch

import flexpar


def _adam(parameters):
    return torch.optim.Adam(parameters, lr=0.01)


def _adagrad(parameters):
    return torch.optim.Adagrad(parameters, lr=0.05)


def _rmsprop(parameters):
    # eps 1e-3: with the default 1e-8, the first steps divide by the root of near-zero squared
    # gradients, which turns the summation-order difference of any data-parallel run (unsharded
    # too: 1.2e-5 absolute here, identical sharded) into more than the tolerance.
    return torch.optim.RMSprop(parameters, lr=0.01, momentum=0.5, eps=1e-3)


def _lbfgs(parameters):
    return torch.optim.LBFGS(parameters, lr=0.1)


OPTIMIZERS = [pieces.sgd, _adam, pieces.adamw, _adagrad, _rmsprop]


@pytest.mark.parametrize("optimizer", OPTIMIZERS, ids=["sgd-momentum", "adam", "adamw", "adagrad", "rmsprop"])
def test_sharded_matches_single_process_reference(train, metrics_file, optimizer):
    job = pieces.make_job(optimizer=optimizer, virtual_workers=6, shard_optimizer=True)
    model, summary = train(job, steps=6, devices=3)
    assert summary["steps"] == 6
    pieces.assert_same_parameters(model, pieces.reference(job, 6))
    steps = [json.loads(line) for line in open(metrics_file) if '"kind":"step"' in line]
    assert [record["step"] for record in steps] == list(range(6))
    # Each device reports its own optimizer-state bytes; once the state exists, none is empty.
    assert all(len(record["optimizer_bytes"]) == 3 for record in steps)
    assert all(value > 0 for value in steps[-1]["optimizer_bytes"])


def test_optimizer_that_is_not_element_wise_is_refused(train):
    job = pieces.make_job(optimizer=_lbfgs, virtual_workers=2, shard_optimizer=True)
    with pytest.raises(flexpar.UserCodeError, match="LBFGS.*shard_optimizer=False"):
        train(job, steps=2, devices=2)


def test_checkpoints_resume_across_device_counts_sharded_and_not(train, tmp_path):
    """Sharded on 3 -> resumed unsharded on 2 -> resumed sharded on 3: the uninterrupted result."""
    directory = str(tmp_path / "checkpoints")
    sharded = pieces.make_job(optimizer=pieces.adamw, virtual_workers=6, shard_optimizer=True)
    unsharded = pieces.make_job(optimizer=pieces.adamw, virtual_workers=6)
    train(sharded, steps=3, devices=3, checkpoint_every=3, checkpoint_dir=directory)
    train(unsharded, steps=6, devices=2, checkpoint_every=3, checkpoint_dir=directory, resume=True)
    model, summary = train(sharded, steps=9, devices=3, checkpoint_dir=directory, resume=True)
    assert summary["steps"] == 9
    pieces.assert_same_parameters(model, pieces.reference(sharded, 9))
