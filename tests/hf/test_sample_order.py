"""flexpar's steps take transformers.Trainer's samples in its order (its seeded sampler, its epochs)."""

import pytest
import torch

pytest.importorskip("transformers")

from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments  # noqa: E402

from flexpar.core import batching  # noqa: E402
from flexpar.hf.order import TrainerOrder, trainer_order  # noqa: E402
from flexpar.hf.plan import plan_run  # noqa: E402


class Indices(torch.utils.data.Dataset):
    def __init__(self, size):
        self.size = size

    def __len__(self):
        return self.size

    def __getitem__(self, index):
        return {"index": index}


def _indices(features):
    return [feature["index"] for feature in features]


def _trainer_batches(tmp_path, size, seed, data_seed, epochs, drop_last=False):
    """The index batches of the real Trainer's training dataloader, epoch after epoch."""
    model = GPT2LMHeadModel(GPT2Config(vocab_size=8, n_positions=4, n_embd=8, n_layer=1, n_head=1))
    args = TrainingArguments(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        seed=seed,
        data_seed=data_seed,
        report_to=[],
        remove_unused_columns=False,
        dataloader_drop_last=drop_last,
        use_cpu=True,
    )
    trainer = Trainer(model=model, args=args, train_dataset=Indices(size), data_collator=_indices)
    loader = trainer.get_train_dataloader()
    batches = []
    for epoch in range(epochs):
        if hasattr(loader, "set_epoch"):
            loader.set_epoch(epoch)
        batches.extend(list(batch) for batch in loader)
    return batches


@pytest.mark.parametrize("seed, data_seed", [(7, None), (7, 123)])
def test_the_order_is_the_trainers_over_epochs(tmp_path, seed, data_seed):
    batches = _trainer_batches(tmp_path, 24, seed, data_seed, epochs=3)
    expected = [index for batch in batches for index in batch]
    assert trainer_order(24, data_seed if data_seed is not None else seed, len(expected)).tolist() == expected


def test_with_drop_last_each_epoch_loses_its_partial_micro_batch(tmp_path):
    batches = _trainer_batches(tmp_path, 22, 7, None, epochs=2, drop_last=True)
    expected = [index for batch in batches for index in batch]
    assert len(expected) == 40
    assert trainer_order(22, 7, 40, epoch_samples=20).tolist() == expected


def test_flexpar_steps_take_the_trainers_accumulated_batches(tmp_path):
    """Step s of flexpar over TrainerOrder trains the samples of the Trainer's micro-batches 2s and 2s+1."""
    batches = _trainer_batches(tmp_path, 24, 7, None, epochs=2)
    args = TrainingArguments(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        num_train_epochs=2,
        report_to=[],
        use_cpu=True,
    )
    plan = plan_run(args, 24, world_size=1, virtual_workers=None, counts_items=True, devices=3)
    assert (plan.steps, plan.global_batch, plan.steps_per_epoch, plan.virtual_workers) == (6, 8, 3, 4)
    dataset = TrainerOrder(Indices(24), data_seed=7, flexpar_seed=7, steps=plan.steps, global_batch=plan.global_batch)
    for step in range(plan.steps):
        positions = batching.global_batch_indices(7, step, len(dataset), plan.global_batch).tolist()
        assert [dataset[position]["index"] for position in positions] == batches[2 * step] + batches[2 * step + 1]
