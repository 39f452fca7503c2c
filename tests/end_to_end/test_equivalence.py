"""The promise: parameters after N steps equal the single-process reference for any device set."""

import pieces
import pytest

CASES = [(1, 1), (1, 4), (1, 6), (2, 4), (2, 6), (3, 6)]


@pytest.mark.parametrize("optimizer", [pieces.sgd, pieces.adamw], ids=["sgd-momentum", "adamw"])
@pytest.mark.parametrize("devices,virtual_workers", CASES, ids=[f"{d}dev-{v}vw" for d, v in CASES])
def test_matches_single_process_reference(train, optimizer, devices, virtual_workers):
    job = pieces.make_job(optimizer=optimizer, virtual_workers=virtual_workers)
    model, summary = train(job, steps=10, devices=devices)
    assert summary["steps"] == 10
    pieces.assert_same_parameters(model, pieces.reference(job, 10))


def test_scheduler_steps_once_per_step(train):
    job = pieces.make_job(lr_scheduler=pieces.step_decay, virtual_workers=4)
    model, _ = train(job, steps=9, devices=2)
    pieces.assert_same_parameters(model, pieces.reference(job, 9))


def test_dataloader_workers_keep_the_result(train):
    """num_workers passes through to torch's DataLoader; prefetching along the plan changes nothing."""
    job = pieces.make_job(virtual_workers=6, num_workers=1)
    model, _ = train(job, steps=6, devices=2)
    pieces.assert_same_parameters(model, pieces.reference(job, 6))
