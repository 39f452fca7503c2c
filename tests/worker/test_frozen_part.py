"""flexpar/worker/frozen_part.py: which buffers travel, what loads, a requires_grad change named; sync skips frozen."""

import pytest
import torch
from torch import nn

from flexpar.comm.gradient_sync import GradientSync
from flexpar.errors import UserCodeError
from flexpar.worker import checkpoints
from flexpar.worker.frozen_part import FrozenPart


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 4))  # fixed, persistent
        self.trunk = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8))  # frozen trunk, BN in train mode
        self.head = nn.Linear(8, 2)
        self.trunk.requires_grad_(False)

    def forward(self, inputs):
        return self.head(self.trunk(inputs * self.scale))


def test_warm_up_changed_buffers_travel_and_a_later_change_does_too():
    torch.manual_seed(0)
    model = Net()
    part = FrozenPart(model, threads=2)
    assert part.digest_s >= 0 and "trunk.0.weight" in part.digests and "head.weight" not in part.digests
    saved = {name: buffer.clone() for name, buffer in model.named_buffers()}
    model(torch.randn(5, 4)).sum().backward()
    part.note_warm_up(name for name, buffer in model.named_buffers() if not torch.equal(buffer, saved[name]))
    moved = {"trunk.1.running_mean", "trunk.1.running_var", "trunk.1.num_batches_tracked"}
    assert part.warm_changed == moved
    assert set(part.travelling(model)) == {"head.weight", "head.bias"} | moved
    with torch.no_grad():
        model.scale[0] = 9.0
    travelling = part.travelling(model)
    assert "scale" in travelling and travelling._metadata is not None
    whole = part.complete(model, checkpoints.cpu_copy(travelling))
    assert list(whole) == list(model.state_dict())
    # The frozen weight is the live tensor (never copied); the trainable one is the copy.
    assert whole["trunk.0.weight"].data_ptr() == model.trunk[0].weight.data_ptr()
    assert whole["head.weight"].data_ptr() != model.head.weight.data_ptr()
    assert all(torch.equal(whole[name], value) for name, value in model.state_dict().items())


def test_a_trainable_only_state_restores_the_trained_model():
    torch.manual_seed(0)
    trained = Net()
    part = FrozenPart(trained)
    with torch.no_grad():
        trained.head.weight.add_(1.0)
    state = part.travelling(trained)
    torch.manual_seed(0)
    fresh = Net()
    FrozenPart(fresh).load(fresh, state)
    for name, value in trained.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], value), name
    with pytest.raises(ValueError, match="head.bias"):
        part.load(fresh, {"head.weight": state["head.weight"]})


def test_a_requires_grad_change_is_named():
    model = Net()
    part = FrozenPart(model)
    part.check_flags(0)
    model.trunk[0].weight.requires_grad_(True)
    with pytest.raises(UserCodeError, match=r"trunk\.0\.weight became trainable .* at step 3"):
        part.check_flags(3)


def test_gradient_sync_and_clipping_hold_the_trainable_parameters_only():
    model = Net()
    sync = GradientSync(model, torch.device("cpu"), 1.0)
    held = {id(parameter) for parameter in sync.dense + sync.sparse}
    assert held == {id(model.head.weight), id(model.head.bias)}
