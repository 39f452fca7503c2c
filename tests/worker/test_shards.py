"""ShardedOptimizer on several simulated devices in one process: bitwise equal to the plain optimizer.

Each simulated device builds the model, the user's optimizer (a factory that
sorts parameters into groups by shape) and scheduler, as a worker does; the
partition and the levelling plan (the real pure functions) decide who holds
what; a change of device set moves state with the real `pieces_of`, `add` and
`install`; a step gives every device the same summed gradient, each steps what
it holds, and each chunk's primary "broadcasts" its parameters (a copy). The
state is then assembled into torch.optim's plain format (as a checkpoint of a
sharded job is read by an unsharded one) and a plain optimizer continues from
it, and the plain state is cut again into a sharded resume.
"""

import pytest
import torch
from torch import nn

from flexpar.core.shard_partition import partition
from flexpar.core.shard_plan import Report, plan_levelling
from flexpar.core.shard_state import join_states, shaped, slice_state
from flexpar.worker.shards import ShardedOptimizer


@pytest.fixture(autouse=True)
def one_thread():
    """Bitwise comparisons on one thread: torch 2.13's CPU Adagrad step (2 threads, a 2257-element
    parameter) gave the plain optimizer another value for half the tensor in about 1 of 40 fresh
    processes (0x1.0b40ccp-5 for 0x1.0b34ecp-5); with one thread it never did in 60 runs."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


FACTORIES = {
    "sgd-momentum": lambda groups: torch.optim.SGD(groups, lr=0.1, momentum=0.9),
    "adam": lambda groups: torch.optim.Adam(groups, lr=1e-2),
    "adamw": lambda groups: torch.optim.AdamW(groups, lr=1e-2),
    "adagrad": lambda groups: torch.optim.Adagrad(groups, lr=0.1),
    "rmsprop": lambda groups: torch.optim.RMSprop(groups, lr=1e-2, momentum=0.5),
    "nadam": lambda groups: torch.optim.NAdam(groups, lr=1e-2),
    "asgd": lambda groups: torch.optim.ASGD(groups, lr=1e-2, t0=3),
}


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(37, 61), nn.LayerNorm(61), nn.Tanh(), nn.Linear(61, 13))


def factory(name):
    def build(parameters):
        parameters = list(parameters)
        return FACTORIES[name](
            [
                {"params": [p for p in parameters if p.ndim >= 2], "weight_decay": 0.01},
                {"params": [p for p in parameters if p.ndim < 2], "weight_decay": 0.0},
            ]
        )

    return build


def scheduler_of(optimizer):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.9**step)


class Device:
    """What a worker holds: model, the user's optimizer and scheduler, and the sharded optimizer."""

    def __init__(self, name, by="elements", build=None):
        self.model = make_model()
        self.optimizer = (build or factory(name))(self.model.parameters())
        self.scheduler = scheduler_of(self.optimizer)
        self.shards = ShardedOptimizer(self.model, self.optimizer, by=by)
        self.committed = -1


def level(old, new, redundancy, committed):
    """Move to `new` devices (a device of `old` keeps its objects; leavers are departing sources)."""
    shards = new[0].shards
    target = partition(shards.spaces, len(new), redundancy, by=shards.by)
    group = list(new) + [device for device in old if device not in new]
    reports = []
    for device in group:
        if device.committed < 0:
            reports.append(Report(-1, complete=False, training=device in new))
            continue
        holdings = device.shards.everything() if device.shards.pristine else device.shards.holdings()
        reports.append(Report(device.committed, holdings=holdings, training=device in new))
    plan = plan_levelling(reports, target)
    assert not plan.lost
    source = group[plan.state_source]
    for rank in plan.state_receivers:
        receiver = group[rank]
        receiver.shards.load_replicated(source.shards.replicated_state())
        receiver.scheduler.load_state_dict(source.scheduler.state_dict())
        receiver.committed = plan.latest
    received = {rank: [] for rank in range(len(group))}
    for transfer in plan.transfers:
        interval = [(transfer.space, transfer.start, transfer.stop)]
        sender, receiver = group[transfer.source], group[transfer.destination]
        if transfer.state:
            received[transfer.destination] += sender.shards.pieces_of(interval)
        if transfer.destination in plan.parameter_receivers or not transfer.state:
            receiver.shards.values(*interval[0]).copy_(sender.shards.values(*interval[0]))
    for rank, device in enumerate(group):
        device.shards.add(received[rank])
    for rank, device in enumerate(group):
        device.shards.install(target if device in new else None, rank)
    return target


def broadcast(devices, target):
    for chunk in target.chunks:
        source = devices[chunk.holders[0]].shards.values(chunk.space, chunk.start, chunk.stop)
        for device in devices:
            device.shards.values(chunk.space, chunk.start, chunk.stop).copy_(source)


def plain_state_dict(devices, target):
    """The plain optimizer.state_dict(), assembled from each chunk's primary (as a checkpoint's parts are)."""
    shards = devices[0].shards
    state = {}
    for k, index in enumerate(shards.sharded):
        space = shards.spaces[shards.space_of[k]]
        offset, length = space.offset_of(k), shards.parameters[index].numel()
        parts, lengths = [], []
        for chunk in target.chunks:
            low, high = max(chunk.start, offset), min(chunk.stop, offset + length)
            if chunk.space == shards.space_of[k] and low < high:
                parts.append(devices[chunk.holders[0]].shards.piece(k, low - offset, high - offset))
                lengths.append(high - low)
        joined = join_states(parts, lengths)
        if joined:
            state[shards.number_of(k)] = shaped(joined, shards.parameters[index].shape)
    state.update(devices[0].shards.replicated_state()["optimizer"]["state"])
    return {"state": state, "param_groups": shards.plain_param_groups()}


def gradients(step):
    generator = torch.Generator().manual_seed(100 + step)
    return [torch.randn(p.shape, generator=generator) for p in make_model().parameters()]


def apply(model, optimizer, scheduler, grads, shards=None):
    for parameter, grad in zip(model.parameters(), grads):
        parameter.grad = grad.clone()
    (shards or optimizer).step()
    if scheduler is not None:
        scheduler.step()
    if shards is not None:
        shards.zero_grad()


@pytest.mark.parametrize("redundancy", [1, 2])
@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_sharded_steps_through_joins_and_leaves_equal_the_plain_optimizer(name, redundancy):
    plain_model = make_model()
    plain = factory(name)(plain_model.parameters())
    plain_scheduler = scheduler_of(plain)
    devices = [Device(name) for _ in range(4)]
    for device in devices:
        device.committed = 0
    target = level([], devices, redundancy, 0)  # a fresh job: every member holds the (empty) state
    resumed = None
    for step in range(9):
        if step == 3:  # one joins
            grown = devices + [Device(name)]
            target = level(devices, grown, redundancy, step)
            devices = grown
        if step == 6:  # two leave, handing their state over (departing sources)
            shrunk = [devices[0], devices[2], devices[4]]
            target = level(devices, shrunk, redundancy, step)
            for leaver in (devices[1], devices[3]):
                assert not leaver.optimizer.state and not leaver.shards.slices
            devices = shrunk
        grads = gradients(step)
        apply(plain_model, plain, plain_scheduler, grads)
        for device in devices:
            apply(device.model, device.optimizer, device.scheduler, grads, device.shards)
            device.committed = step + 1
        broadcast(devices, target)
        if step == 6:  # a checkpoint in the plain format, resumed by a plain optimizer
            resumed_model = make_model()
            resumed_model.load_state_dict(devices[0].model.state_dict())
            resumed = factory(name)(resumed_model.parameters())
            resumed_scheduler = scheduler_of(resumed)
            resumed.load_state_dict(plain_state_dict(devices, target))
            resumed_scheduler.load_state_dict(devices[0].scheduler.state_dict())
        elif resumed is not None:
            apply(resumed_model, resumed, resumed_scheduler, grads)
    bytes_held = [device.shards.state_bytes() for device in devices]
    plain_bytes = sum(v.nbytes for s in plain.state.values() for v in s.values() if isinstance(v, torch.Tensor))
    assert max(bytes_held) < plain_bytes or redundancy >= len(devices)
    for label, model in (("sharded", devices[-1].model), ("resumed", resumed_model)):
        for number, (mine, theirs) in enumerate(zip(model.parameters(), plain_model.parameters())):
            assert torch.equal(mine, theirs), (label, number, float((mine - theirs).abs().max()))


def test_a_plain_state_cut_into_a_sharded_resume_continues_bitwise():
    """An unsharded job's checkpoint resumed sharded: each device takes its slices of the plain state."""
    plain_model = make_model()
    plain = factory("adamw")(plain_model.parameters())
    for step in range(3):
        apply(plain_model, plain, None, gradients(step))
    saved = plain.state_dict()
    devices = [Device("adamw") for _ in range(3)]
    target = partition(devices[0].shards.spaces, 3, 2)
    for rank, device in enumerate(devices):
        device.model.load_state_dict(plain_model.state_dict())
        device.shards.load_optimizer_plain(saved)
        pieces = []
        for k, start, stop in device.shards.segments(target.holdings(rank)):
            whole = saved["state"][device.shards.number_of(k)]
            length = device.shards.parameters[device.shards.sharded[k]].numel()
            pieces.append(((k, start, stop), slice_state(whole, start, stop, length)))
        device.shards.pristine = False
        device.shards.add(pieces)
        device.shards.install(target, rank)
    for step in range(3, 6):
        grads = gradients(step)
        apply(plain_model, plain, None, grads)
        for device in devices:
            apply(device.model, device.optimizer, None, grads, device.shards)
        broadcast(devices, target)
    for mine, theirs in zip(devices[1].model.parameters(), plain_model.parameters()):
        assert torch.equal(mine, theirs)


def test_parameters_mode_moves_whole_state_of_a_non_elementwise_optimizer():
    """Adafactor reads whole tensors: by="parameters" keeps each parameter's state whole, and equals it."""
    build = lambda parameters: torch.optim.Adafactor(parameters, lr=1e-2)  # noqa: E731
    devices = [Device("", by="parameters", build=build) for _ in range(3)]
    for device in devices:
        device.committed = 0
    plain_model = make_model()
    plain = build(plain_model.parameters())
    target = level([], devices, 2, 0)
    for step in range(6):
        if step == 3:
            target = level(devices, devices[:2], 2, step)
            devices = devices[:2]
        grads = gradients(step)
        apply(plain_model, plain, None, grads)
        for device in devices:
            apply(device.model, device.optimizer, None, grads, device.shards)
            device.committed = step + 1
        broadcast(devices, target)
    for mine, theirs in zip(devices[1].model.parameters(), plain_model.parameters()):
        assert torch.equal(mine, theirs)
