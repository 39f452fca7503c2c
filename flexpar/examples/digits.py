"""Handwritten digits (scikit-learn's 8x8 `load_digits`) with a small CNN.

The data ships inside scikit-learn, so this demo needs no download. Every piece
a flexpar job needs is defined at module level, because worker processes import
the pieces by reference (``flexpar.examples.digits.make_model`` and so on):

- `load_splits()`      train / held-out TensorDatasets (images 1x8x8 in [0, 1])
- `make_model()`       a small CNN with dropout and no BatchNorm, so the trained
                       parameters do not depend on the device set
- `make_optimizer()`   SGD with Nesterov momentum
- `loss_fn()`          mean cross-entropy of one batch
- `evaluate()`         accuracy of a model on a dataset
- `build_job()`        the `flexpar.Job` that puts them together

Run it with ``python -m flexpar.examples.digits`` or
``flexpar run --devices 2 examples/digits.py`` (flexpar's flags before the script).
"""

from __future__ import annotations

import argparse
from typing import Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

CLASSES = 10
IMAGE_SIDE = 8
# load_digits pixels are integers 0..16; dividing by this maps them onto [0, 1].
PIXEL_MAX = 16.0
# The held-out split is drawn with its own fixed seed, not the job's seed, so
# that changing the training seed never changes which images are held out.
SPLIT_SEED = 1234


def _load_digits_arrays():
    """(images, labels) as numpy arrays; scikit-learn is imported only here."""
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise ImportError(
            'the digits example needs scikit-learn, which provides the data set: pip install -e ".[examples]" '
            "in flexpar's checkout"
        ) from None
    digits = load_digits()
    return digits.images, digits.target


def load_splits(held_out_fraction: float = 0.2) -> Tuple[TensorDataset, TensorDataset]:
    """Train and held-out datasets of (image float32 [1, 8, 8] in [0, 1], label int64).

    The split is a fixed random permutation (`SPLIT_SEED`), so it is the same in
    every process and every run. TensorDatasets pickle by value and are small
    (about 370 kB), so they travel to worker processes cheaply.
    """
    if not 0.0 < held_out_fraction < 1.0:
        raise ValueError(f"held_out_fraction={held_out_fraction} must be strictly between 0 and 1")
    images, labels = _load_digits_arrays()
    images = torch.as_tensor(images, dtype=torch.float32).unsqueeze(1) / PIXEL_MAX
    labels = torch.as_tensor(labels, dtype=torch.int64)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(SPLIT_SEED))
    held_out_count = max(1, round(len(labels) * held_out_fraction))
    held_out, train = order[:held_out_count], order[held_out_count:]
    return TensorDataset(images[train], labels[train]), TensorDataset(images[held_out], labels[held_out])


class DigitsNet(nn.Module):
    """Two 3x3 convolutions, one 2x2 pooling, then a two-layer classifier.

    Dropout (not BatchNorm) regularises it: dropout draws from the virtual
    worker's random stream, so it keeps results independent of the device set,
    whereas BatchNorm's running statistics would depend on the micro-batch.
    """

    def __init__(self, channels: int = 16, hidden: int = 64, dropout: float = 0.25):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, channels, kernel_size=3, padding=1),
            nn.ReLU(),
            nn.Conv2d(channels, 2 * channels, kernel_size=3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),  # 8x8 -> 4x4
            nn.Dropout(dropout),
        )
        pooled_side = IMAGE_SIDE // 2
        self.classifier = nn.Sequential(
            nn.Flatten(),
            nn.Linear(2 * channels * pooled_side * pooled_side, hidden),
            nn.ReLU(),
            nn.Dropout(dropout),
            nn.Linear(hidden, CLASSES),
        )

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """Logits [batch, 10] of images [batch, 1, 8, 8]."""
        return self.classifier(self.features(images))


def make_model() -> nn.Module:
    """The model factory: flexpar calls it under the job's seed on every device."""
    return DigitsNet()


def make_optimizer(parameters) -> torch.optim.Optimizer:
    """SGD with Nesterov momentum, tuned for global batches of about 128-512 samples."""
    return torch.optim.SGD(parameters, lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-4)


def loss_fn(model: nn.Module, batch) -> torch.Tensor:
    """Mean cross-entropy of one batch (a scalar), as flexpar expects."""
    images, labels = batch
    return F.cross_entropy(model(images), labels)


def evaluate(model: nn.Module, dataset, batch_size: int = 512) -> float:
    """Fraction of `dataset` (any map-style dataset of (image, label)) classified correctly.

    Runs in eval mode (no dropout) without gradients and restores the model's
    previous mode, so it can be called in the middle of training.
    """
    if len(dataset) == 0:
        raise ValueError("cannot evaluate on an empty dataset")
    was_training = model.training
    model.eval()
    correct = 0
    try:
        with torch.no_grad():
            for images, labels in DataLoader(dataset, batch_size=batch_size):
                correct += int((model(images).argmax(dim=1) == labels).sum())
    finally:
        model.train(was_training)
    return correct / len(dataset)


def build_job(
    global_batch: int = 256,
    virtual_workers: Optional[int] = 8,
    seed: int = 0,
    dataset=None,
):
    """The flexpar job of this demo; `dataset` defaults to the training split."""
    import flexpar

    return flexpar.Job(
        model=make_model,
        optimizer=make_optimizer,
        loss=loss_fn,
        dataset=load_splits()[0] if dataset is None else dataset,
        global_batch=global_batch,
        virtual_workers=virtual_workers,
        seed=seed,
    )


def parse_arguments(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """The demo's command line (shared with examples/digits.py)."""
    parser = argparse.ArgumentParser(description="Train a small CNN on scikit-learn's digits with flexpar.")
    parser.add_argument("--steps", type=int, default=200, help="optimizer steps (default 200)")
    parser.add_argument("--devices", type=int, default=None, help="devices to start with (default: all local)")
    parser.add_argument("--schedule", default=None, help="device changes, e.g. '50:+1,120:-1'")
    parser.add_argument("--global-batch", type=int, default=256, help="samples per step (default 256)")
    parser.add_argument("--virtual-workers", type=int, default=8, help="virtual workers per step (default 8)")
    parser.add_argument("--seed", type=int, default=0, help="training seed (default 0)")
    return parser.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> float:
    """Train, print the held-out accuracy and return it."""
    arguments = parse_arguments(argv)
    train, held_out = load_splits()
    job = build_job(
        global_batch=arguments.global_batch,
        virtual_workers=arguments.virtual_workers,
        seed=arguments.seed,
        dataset=train,
    )
    model, summary = job.fit(steps=arguments.steps, devices=arguments.devices, schedule=arguments.schedule)
    accuracy = evaluate(model, held_out)
    print(f"held-out accuracy: {accuracy:.3f} on {len(held_out)} images ({len(train)} trained on)")
    return accuracy


if __name__ == "__main__":
    # Under `python -m`, this file runs as `__main__`; call main() of the module
    # imported under its real name, so the pieces pickle as
    # `flexpar.examples.digits.*`, a name worker processes can import.
    from flexpar.examples import digits

    digits.main()
