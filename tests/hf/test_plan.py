"""The run's numbers as transformers.Trainer computes them, and the VWs flexpar cuts the batch into."""

import pytest

pytest.importorskip("transformers")

from transformers import TrainingArguments  # noqa: E402

from flexpar.hf.plan import devices_wanted, plan_run  # noqa: E402


def _arguments(tmp_path, **values):
    return TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True, **values)


def test_steps_follow_the_trainer_epochs_and_accumulation(tmp_path):
    args = _arguments(tmp_path, per_device_train_batch_size=4, gradient_accumulation_steps=3, num_train_epochs=2)
    plan = plan_run(args, 50, world_size=1, virtual_workers=None, counts_items=True)
    # 13 micro-batches an epoch, 5 steps (the last one short, in the Trainer), 2 epochs.
    assert (plan.steps_per_epoch, plan.steps, plan.global_batch, plan.virtual_workers) == (5, 10, 12, 3)
    args = _arguments(tmp_path, per_device_train_batch_size=4, gradient_accumulation_steps=2, max_steps=7)
    assert plan_run(args, 50, world_size=4, virtual_workers=None, counts_items=True).global_batch == 32


def test_more_virtual_workers_only_where_more_devices_and_an_item_normalised_loss(tmp_path):
    args = _arguments(tmp_path, per_device_train_batch_size=8, gradient_accumulation_steps=2, max_steps=5)
    assert plan_run(args, 64, 1, None, counts_items=True, devices=1).virtual_workers == 2
    assert plan_run(args, 64, 1, None, counts_items=True, devices=3).virtual_workers == 4
    assert plan_run(args, 64, 1, None, counts_items=False, devices=3).virtual_workers == 2
    assert plan_run(args, 64, 1, 16, counts_items=False, devices=3).virtual_workers == 16
    assert devices_wanted({}, {"devices": 2, "schedule": "3:+2,9:-1"}) == 4
    assert devices_wanted({"devices": 1}, {"max_devices": 3}) == 3
