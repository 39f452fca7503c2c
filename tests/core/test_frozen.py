"""flexpar/core/frozen.py: the frozen part's digests, the refusal's words, what travels, what loads."""

import functools

import hypothesis.strategies as st
import torch
from hypothesis import given, settings
from torch import nn

from flexpar.core import frozen

names = st.text("abcdefgh.", min_size=1, max_size=6)
digests = st.dictionaries(names, st.sampled_from(["a", "b", "c"]), max_size=8)


@given(digests, digests)
def test_differing_is_empty_exactly_when_equal_and_symmetric(reference, reported):
    assert (frozen.differing(reference, reported) == []) == (reference == reported)
    assert set(frozen.differing(reference, reported)) == set(frozen.differing(reported, reference))
    assert (frozen.combined_digest(reference) == frozen.combined_digest(reported)) == (
        list(reference.items()) == list(reported.items())
    )


@given(digests, digests)
def test_the_problem_names_the_first_differing_tensors_and_which_side_lacks_one(reference, reported):
    problem = frozen.frozen_problem(reference, reported, where="device d")
    names = frozen.differing(reference, reported)
    assert bool(problem) == bool(names)
    for name in names[: frozen.SHOWN]:
        assert name in problem
        if name not in reported:
            assert f"{name} (frozen in the job, trainable or missing on device d)" in problem
    if len(names) > frozen.SHOWN:
        assert f"and {len(names) - frozen.SHOWN} more" in problem
    if problem:
        assert "deterministic" in problem and "pretrained files" in problem


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.trunk = nn.Linear(4, 4)
        self.norm = nn.BatchNorm1d(4)
        self.head = nn.Linear(4, 4)
        self.out = nn.Linear(4, 4, bias=False)
        self.out.weight = self.trunk.weight  # tied, frozen
        self.register_buffer("table", torch.arange(4.0), persistent=False)
        self.trunk.requires_grad_(False)


def _threaded_map(function, values):
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(2) as pool:
        return list(pool.map(function, values))


def test_digests_of_a_tied_frozen_model_name_the_one_changed_tensor():
    torch.manual_seed(0)
    model = Net()
    table = frozen.frozen_digests(model)
    assert list(table) == ["trunk.weight", "trunk.bias", "table", "norm.running_mean", "norm.running_var"] + [
        "norm.num_batches_tracked"
    ]
    assert frozen.frozen_digests(model, _threaded_map) == table
    torch.manual_seed(0)
    other = Net()
    with torch.no_grad():
        other.trunk.bias[0] = torch.nextafter(other.trunk.bias[0], torch.tensor(1.0))  # one ulp
    assert frozen.differing(table, frozen.frozen_digests(other)) == ["trunk.bias"]


def test_dtype_and_shape_are_part_of_a_digest():
    values = torch.arange(6.0)
    assert frozen.tensor_digest(values) != frozen.tensor_digest(values.reshape(2, 3))
    assert frozen.tensor_digest(values) != frozen.tensor_digest(values.view(torch.int32))
    assert frozen.tensor_digest(values.reshape(2, 3).t()) == frozen.tensor_digest(values.reshape(2, 3).t().clone())


def test_layout_lists_every_alias():
    layout = frozen.model_layout(Net())
    assert layout.frozen == {"trunk.weight", "trunk.bias", "out.weight"}
    assert layout.trainable == {"norm.weight", "norm.bias", "head.weight", "head.bias"}
    assert layout.buffers == {"norm.running_mean", "norm.running_var", "norm.num_batches_tracked"}


@settings(max_examples=50, deadline=None)
@given(st.sets(st.sampled_from(["norm.running_mean", "norm.running_var", "norm.num_batches_tracked", "x"])))
def test_what_travels_always_loads_and_a_gap_is_named(changed):
    layout = frozen.model_layout(Net())
    keys = frozen.travelling_keys(layout, changed)
    assert frozen.load_problem(layout, keys) == ""
    assert not keys & layout.frozen and layout.trainable <= keys and "x" not in keys
    assert "head.weight" in frozen.load_problem(layout, keys - {"head.weight"})
    assert "nope" in frozen.load_problem(layout, keys | {"nope"})


def test_a_flip_is_named_with_its_direction_and_step():
    model = Net()
    flags = [(name, parameter, parameter.requires_grad) for name, parameter in model.named_parameters()]
    assert frozen.flipped(flags) == []
    model.trunk.bias.requires_grad_(True)
    model.head.weight.requires_grad_(False)
    assert frozen.flipped(flags) == ["trunk.bias", "head.weight"]
    assert "trunk.bias became trainable (requires_grad=True) at step 3" in frozen.flip_message("trunk.bias", True, 3)
    assert "it was trainable" in frozen.flip_message("head.weight", False, 3)


class Factory:
    def __call__(self):
        return Net()


def make():
    return Net()


def test_factory_reference_names_what_export_can_rebuild():
    import dataclasses

    Folder = dataclasses.make_dataclass("Folder", [("folder", str), ("rank", int, 8)], frozen=True)
    Folder.__module__, Folder.__qualname__ = __name__, "Folder"
    assert frozen.factory_reference(make) == {"name": f"{__name__}:make"}
    assert frozen.factory_reference(Net) == {"name": f"{__name__}:Net"}
    assert frozen.factory_reference(Folder("/x")) == {
        "name": f"{__name__}:Folder",
        "fields": {"folder": "/x", "rank": 8},
    }
    assert frozen.factory_reference(Folder(object())) is None  # not a plain value
    assert frozen.factory_reference(functools.partial(make)) is None
    assert frozen.factory_reference(lambda: Net()) is None
