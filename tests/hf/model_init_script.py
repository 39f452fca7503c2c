"""model_init= and compute_loss_func= with transformers.Trainer and flexpar.hf.Trainer, then predict().

Run as a script: writes both trained states and prediction shapes to argv[1] (torch.save).
"""

import sys

import torch
import torch.nn.functional as F
import trainer_script
import transformers
from transformers import TrainingArguments

from flexpar.hf import Trainer


def summed_loss(outputs, labels, num_items_in_batch=None):
    """A custom loss as transformers expects one: summed, divided by the items it is given."""
    logits = outputs.logits[:, :-1].float()
    target = labels[:, 1:]
    total = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), target.reshape(-1), ignore_index=-100, reduction="sum"
    )
    return total / num_items_in_batch


def train(trainer_class, output):
    args = TrainingArguments(
        output_dir=output,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        max_steps=6,
        learning_rate=3e-3,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        seed=3,
        disable_tqdm=True,
    )
    trainer = trainer_class(
        model_init=trainer_script.build_model,
        args=args,
        train_dataset=trainer_script.Sequences(64),
        compute_loss_func=summed_loss,
    )
    trainer.train()
    return trainer.model.state_dict(), tuple(trainer.predict(trainer_script.Sequences(8, seed=2)).predictions.shape)


if __name__ == "__main__":
    baseline = train(transformers.Trainer, "baseline")
    mine = train(Trainer, "flexpar")
    torch.save({"baseline": baseline, "flexpar": mine}, sys.argv[1])
