"""flexpar.hf.Trainer refuses, in one line naming the argument and the fix, what flexpar cannot honour.

Each refusal comes before any model file is written or any process starts (fast tests).
"""

import pytest
import torch

pytest.importorskip("transformers")

from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments  # noqa: E402

from flexpar.errors import ArgumentError  # noqa: E402
from flexpar.hf import Trainer  # noqa: E402


class Items(torch.utils.data.Dataset):
    def __len__(self):
        return 16

    def __getitem__(self, index):
        tokens = torch.arange(8) + index
        return {"input_ids": tokens % 50, "labels": tokens % 50}


class Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        return iter(Items()[index] for index in range(16))


@pytest.fixture(scope="module")
def model():
    return GPT2LMHeadModel(GPT2Config(vocab_size=50, n_positions=8, n_embd=16, n_layer=1, n_head=2))


def _arguments(tmp_path, **changes):
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=2, report_to=[], use_cpu=True)
    for name, value in changes.items():  # after construction: some would need their packages installed
        setattr(args, name, value)
    return args


def _refusal(build) -> str:
    with pytest.raises(ArgumentError) as caught:
        build()
    message = str(caught.value)
    assert message.startswith("flexpar.hf.Trainer: ") and "\n" not in message, message
    return message


@pytest.mark.parametrize(
    "changes, named",
    [
        ({"deepspeed": "ds_config.json"}, "deepspeed="),
        ({"fsdp": ["full_shard"]}, "fsdp="),
        ({"train_sampling_strategy": "group_by_length"}, "group_by_length"),
        ({"label_smoothing_factor": 0.1}, "label_smoothing_factor=0.1"),
        ({"auto_find_batch_size": True}, "auto_find_batch_size"),
        ({"load_best_model_at_end": True}, "load_best_model_at_end"),
        ({"lr_scheduler_type": "reduce_lr_on_plateau"}, "reduce_lr_on_plateau"),
        ({"report_to": ["comet_ml"]}, "comet_ml"),
        ({"push_to_hub": True}, "push_to_hub=True"),
        ({"eval_delay": 2}, "eval_delay=2"),
    ],
)
def test_training_arguments_flexpar_cannot_honour_are_refused(model, tmp_path, changes, named):
    message = _refusal(lambda: Trainer(model=model, args=_arguments(tmp_path, **changes), train_dataset=Items()))
    assert named in message


def test_optimizer_instances_are_refused_with_the_arguments_to_use(model, tmp_path):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    message = _refusal(
        lambda: Trainer(model=model, args=_arguments(tmp_path), train_dataset=Items(), optimizers=(optimizer, None))
    )
    assert "optimizers=" in message and "optimizer_cls_and_kwargs" in message


def test_a_subclass_overriding_compute_loss_is_refused(model, tmp_path):
    class MyTrainer(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    message = _refusal(lambda: MyTrainer(model=model, args=_arguments(tmp_path), train_dataset=Items()))
    assert "MyTrainer overrides Trainer.compute_loss" in message and "compute_loss_func" in message


def test_an_iterable_train_dataset_and_a_dict_eval_set_evaluated_in_training_are_refused(model, tmp_path):
    assert "train_dataset=" in _refusal(lambda: Trainer(model=model, args=_arguments(tmp_path), train_dataset=Stream()))
    args = _arguments(tmp_path, eval_strategy="steps", eval_steps=1)
    message = _refusal(
        lambda: Trainer(model=model, args=args, train_dataset=Items(), eval_dataset={"a": Items(), "b": Items()})
    )
    assert "eval_dataset=" in message


def test_an_unknown_flexpar_option_and_a_non_torch_optimizer_are_refused(model, tmp_path):
    message = _refusal(lambda: Trainer(model=model, args=_arguments(tmp_path), train_dataset=Items(), flexpar={"x": 1}))
    assert "flexpar={'x'" in message
    trainer = Trainer(model=model, args=_arguments(tmp_path, optim="adafactor"), train_dataset=Items())
    assert "optim=" in _refusal(trainer.train)
    assert "trial=" in _refusal(lambda: trainer.train(trial={"learning_rate": 1e-3}))
