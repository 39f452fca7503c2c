"""A loader process's run of items arrives as the dataset yielded it (flexpar/data/loader_handover.py)."""

from __future__ import annotations

import pickle

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flexpar.data.loader_handover import pack, unpack

_DTYPES = (torch.float32, torch.float64, torch.int64, torch.uint8, torch.bool, torch.float16)


def _same(left, right) -> bool:
    """Equal in type, structure, and for tensors in dtype, shape and elements."""
    if type(left) is not type(right):
        return False
    if isinstance(left, torch.Tensor):
        return left.dtype == right.dtype and left.shape == right.shape and torch.equal(left, right)
    if isinstance(left, np.ndarray):
        return left.dtype == right.dtype and np.array_equal(left, right)
    if isinstance(left, (tuple, list)):
        return len(left) == len(right) and all(_same(a, b) for a, b in zip(left, right))
    if isinstance(left, dict):
        return list(left) == list(right) and all(_same(left[key], right[key]) for key in left)
    return left == right


@st.composite
def _tensors(draw, shape=None, dtype=None):
    shape = shape if shape is not None else tuple(draw(st.lists(st.integers(0, 4), max_size=3)))
    dtype = dtype or draw(st.sampled_from(_DTYPES))
    seed = draw(st.integers(0, 1000))
    values = torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 5
    return values.to(dtype)


@st.composite
def _runs(draw):
    """Runs of items sharing a structure (with leaves that may or may not share shapes), or not."""
    count = draw(st.integers(1, 6))
    if draw(st.booleans()):  # anything: ints, strings, tensors and containers mixed
        leaf = st.one_of(st.integers(), st.text(max_size=3), _tensors())
        item = st.recursive(leaf, lambda inner: st.tuples(inner, inner) | st.lists(inner, max_size=2), max_leaves=4)
        return draw(st.lists(item, min_size=count, max_size=count))
    shape = tuple(draw(st.lists(st.integers(0, 3), max_size=2)))
    dtype = draw(st.sampled_from(_DTYPES))
    ragged = draw(st.booleans())
    items = []
    for index in range(count):
        tokens = draw(_tensors(None if ragged else shape, dtype))
        label = draw(_tensors((), torch.int64))
        items.append({"tokens": tokens, "label": label, "name": f"item {index}", "extra": (index, [label])})
    return items


@settings(max_examples=150, deadline=None)
@given(_runs())
def test_a_run_of_items_comes_back_equal_to_what_the_dataset_yielded(items):
    assert _same(unpack(pack(items)), items)


def test_items_of_one_structure_travel_in_columns_and_come_back_as_views_of_them():
    inputs = torch.randn(50, 8)
    items = [(inputs[k], inputs[k, :3].argmax()) for k in range(0, 50, 3)]
    message = pack(items)
    kind, count, _, columns = pickle.loads(message)
    assert (kind, count) == ("columns", len(items))
    assert [column.shape for column in columns] == [(len(items), 8), (len(items),)]
    back = unpack(message)
    assert _same(back, items)
    # One array per leaf: the items' tensors share it (no copy per item on the receiving side).
    assert back[0][0].untyped_storage().data_ptr() == back[1][0].untyped_storage().data_ptr()


def test_tensors_numpy_cannot_hold_and_grad_carrying_tensors_travel_as_they_are():
    items = [(torch.ones(2, requires_grad=True), torch.zeros(2).to_sparse()) for _ in range(3)]
    back = unpack(pack(items))
    assert all(a.requires_grad and b.layout == torch.sparse_coo for a, b in back)
    assert all(torch.equal(a.detach(), torch.ones(2)) and torch.equal(b.to_dense(), torch.zeros(2)) for a, b in back)
