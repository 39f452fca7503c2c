"""State transfer (flexpar.comm.state_transfer): a tensor's bytes go straight into a fresh tensor; the rest is a
small skeleton.

The wire is faked here (a FIFO standing in for gloo's send/recv, which keeps
the order of messages between two ranks); the real path runs in every join
test (tests/test_join.py), whose parameters must equal the reference.
"""

import collections

import pytest
import torch
from torch import nn

from flexpar.comm import state_transfer as training_state


class _Wire:
    """dist.send / dist.recv between two ranks: each message is copied in order."""

    def __init__(self):
        self.messages = collections.deque()

    def send(self, tensor, destination):
        self.messages.append(tensor.clone())

    def recv(self, tensor, source):
        message = self.messages.popleft()
        assert message.shape == tensor.shape and message.dtype == tensor.dtype, "messages out of order"
        tensor.copy_(message)


@pytest.fixture
def wire(monkeypatch):
    fake = _Wire()
    monkeypatch.setattr(training_state.dist, "send", fake.send)
    monkeypatch.setattr(training_state.dist, "recv", fake.recv)
    return fake


def _trained_state():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3), nn.Linear(3, 2))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    for _ in range(2):
        model(torch.randn(8, 4)).square().mean().backward()
        optimizer.step()
        scheduler.step()
    extra = {
        "balance": {"device_ids": ["a", "b"], "seconds_per_vw": [0.1, 0.2]},
        "committed_wall": 12.5,
        "odd": {
            "flags": torch.tensor([True, False]),
            "half": torch.ones(2, 2, dtype=torch.bfloat16),
            "scalar": torch.tensor(7, dtype=torch.int64),
            "empty": torch.zeros(0, 5),
            "strided": torch.arange(12.0).reshape(3, 4).t(),
            "pair": (1, torch.ones(1)),
        },
    }
    return model, optimizer, scheduler, training_state.capture(model, optimizer, scheduler, 2, extra)


def _assert_equal(received, sent):
    assert type(received) is type(sent)
    if isinstance(sent, torch.Tensor):
        assert received.dtype == sent.dtype and received.shape == sent.shape
        assert torch.equal(received, sent)
        if sent.numel():
            assert received.data_ptr() != sent.data_ptr()  # a fresh tensor, not shared memory
    elif isinstance(sent, dict):
        assert list(received) == list(sent)
        for key in sent:
            _assert_equal(received[key], sent[key])
    elif isinstance(sent, (list, tuple)):
        assert len(received) == len(sent)
        for a, b in zip(received, sent):
            _assert_equal(a, b)
    else:
        assert received == sent


def test_state_arrives_whole_with_every_dtype_and_shape(wire):
    _, _, _, state = _trained_state()
    training_state.send_state(state, [1], "cpu")
    received = training_state.receive_state(0, "cpu")
    assert not wire.messages  # everything sent was read
    _assert_equal(received, state)
    # load_state_dict reads the module versions a state_dict carries.
    assert received["model"]._metadata == state["model"]._metadata


def test_received_state_restores_an_untrained_copy(wire):
    model, optimizer, scheduler, state = _trained_state()
    torch.manual_seed(1)
    fresh = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3), nn.Linear(3, 2))
    fresh_optimizer = torch.optim.Adam(fresh.parameters(), lr=0.1)
    fresh_scheduler = torch.optim.lr_scheduler.StepLR(fresh_optimizer, step_size=1, gamma=0.5)
    training_state.send_state(state, [1], "cpu")
    training_state.restore(fresh, fresh_optimizer, fresh_scheduler, training_state.receive_state(0, "cpu"))
    batch = torch.randn(8, 4)
    for network, opt in ((model, optimizer), (fresh, fresh_optimizer)):
        opt.zero_grad()
        network(batch).square().mean().backward()
        opt.step()
    for a, b in zip(model.state_dict().values(), fresh.state_dict().values()):
        assert torch.equal(a, b)
    assert fresh_scheduler.get_last_lr() == scheduler.get_last_lr()


def test_a_joiner_receives_the_model_into_its_own_tensors(wire):
    model, optimizer, scheduler, state = _trained_state()
    torch.manual_seed(1)
    joiner = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3), nn.Linear(3, 2))
    joiner_optimizer = torch.optim.Adam(joiner.parameters(), lr=0.1)
    own = joiner.state_dict()
    own["2.bias"] = torch.zeros(5)  # a shape that does not match: received into a fresh tensor
    training_state.send_state(state, [1], "cpu")
    received = training_state.receive_state(0, "cpu", own)
    _assert_equal(received, state)
    assert received["model"]["0.weight"].data_ptr() == joiner[0].weight.data_ptr()
    assert torch.equal(joiner[0].weight, model[0].weight)  # in place, before any restore
    assert received["model"]["2.bias"].data_ptr() != own["2.bias"].data_ptr()
    # The optimizer's state has no counterpart on a joiner: fresh tensors.
    training_state.restore(joiner, joiner_optimizer, None, received)
    for a, b in zip(joiner.state_dict().values(), model.state_dict().values()):
        assert torch.equal(a, b)


def test_a_non_contiguous_own_tensor_is_not_received_into(wire):
    _, _, _, state = _trained_state()
    weight = state["model"]["0.weight"]
    own = {"0.weight": torch.zeros(weight.shape[1], weight.shape[0]).t()}  # right shape, not contiguous
    training_state.send_state(state, [1], "cpu")
    received = training_state.receive_state(0, "cpu", own)
    assert torch.equal(received["model"]["0.weight"], weight)
    assert not own["0.weight"].any()


def test_each_receiver_gets_its_own_copy(wire):
    _, _, _, state = _trained_state()
    calls = []
    training_state.send_state(state, [1, 2], "cpu", after_size=lambda: calls.append(len(wire.messages)))
    assert calls == [1, len(wire.messages) // 2 + 1]  # the fault hook fires right after each size
    first, second = training_state.receive_state(0, "cpu"), training_state.receive_state(0, "cpu")
    _assert_equal(first, state)
    _assert_equal(second, state)


def test_a_corrupt_dtype_name_is_refused():
    with pytest.raises(ValueError, match="'Tensor' is not a torch dtype"):
        training_state.dtype_named("Tensor")


def test_split_and_join_are_inverse_and_leave_other_values_alone():
    sparse = torch.sparse_coo_tensor([[0, 2]], [1.0, 2.0], (3,), check_invariants=True)
    value = {"a": [torch.ones(2), 3, "x"], "b": (torch.zeros(1), None), "sparse": sparse}
    tensors = []
    skeleton = training_state.split_tensors(value, tensors)
    assert len(tensors) == 2 and skeleton["sparse"] is sparse and skeleton["a"][1:] == [3, "x"]
    joined = training_state.join_tensors(skeleton, tensors)
    assert joined["a"][0] is tensors[0] and joined["b"][0] is tensors[1] and joined["sparse"] is sparse


def test_only_a_tensor_that_sits_where_the_sender_s_did_is_received_into():
    own = torch.zeros(2, 3)
    cpu = torch.device("cpu")
    assert training_state._fits(own, torch.float32, [2, 3], False, cpu)
    assert not training_state._fits(own, torch.float32, [2, 3], True, cpu)  # the sender's lived on a GPU
    assert not training_state._fits(own, torch.float64, [2, 3], False, cpu)
    assert not training_state._fits(own, torch.float32, [3, 2], False, cpu)
    assert not training_state._fits(own.t(), torch.float32, [3, 2], False, cpu)  # not contiguous
    assert not training_state._fits(own, torch.float32, [2, 3], True, torch.device("cuda"))  # own is on the CPU
    assert not training_state._fits(None, torch.float32, [2, 3], False, cpu)
