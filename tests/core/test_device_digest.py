"""flexpar/core/device_digest.py: the digest reduced where the tensor lives, checked against its definition
computed with Python integers; equal tensors give equal digests, one changed element another."""

import hypothesis.strategies as st
import torch
from hypothesis import given, settings

from flexpar.core import device_digest, factory_checks

DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.uint8, torch.bool)


def _by_definition(tensor: torch.Tensor, base: int) -> int:
    """The module doc's sum over little-endian signed 16-bit words, in Python integers."""
    data = bytes(tensor.detach().contiguous().reshape(-1).view(torch.uint8).tolist())
    data += b"\0" * (len(data) % 2)
    total, power = 0, 1
    for position in range(0, len(data), 2):
        word = int.from_bytes(data[position : position + 2], "little", signed=True)
        total = (total + word * power) % device_digest.PRIME
        power = power * base % device_digest.PRIME
    return total


@st.composite
def tensors(draw, max_size=300):
    dtype = draw(st.sampled_from(DTYPES))
    size = draw(st.integers(0, max_size))
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    raw = torch.randint(0, 256, (size * torch.empty(0, dtype=dtype).element_size(),), generator=generator)
    values = raw.to(torch.uint8).view(dtype) if dtype != torch.bool else raw.to(torch.uint8).remainder(2).bool()
    return values.reshape(draw(st.sampled_from([(size,), (1, size)])))


@given(tensors())
@settings(max_examples=60, deadline=None)
def test_the_lanes_are_the_documented_sum_of_words_times_powers(tensor):
    assert device_digest.tensor_lanes(tensor) == tuple(_by_definition(tensor, b) for b in device_digest.LANE_BASES)


def test_rows_and_blocks_sum_as_one_polynomial(monkeypatch):
    """Blocks of two rows, the last block short and its last row padded: the row shifts and the blocks'
    bounds are exact, and extreme words (every bit set, the sign bit alone) stay exact."""
    monkeypatch.setattr(device_digest, "BLOCK", 2 * device_digest.CHUNK)
    tensor = torch.randn(7 * device_digest.CHUNK // 2 + 5, generator=torch.Generator().manual_seed(3))
    assert device_digest.tensor_lanes(tensor) == tuple(_by_definition(tensor, b) for b in device_digest.LANE_BASES)
    for word in (-1, -32768, 32767):
        tensor = torch.full((5 * device_digest.CHUNK + 3,), word, dtype=torch.int16)
        assert device_digest.tensor_lanes(tensor) == tuple(_by_definition(tensor, b) for b in device_digest.LANE_BASES)


@given(tensors(max_size=200), st.data())
@settings(max_examples=80, deadline=None)
def test_equal_tensors_give_equal_digests_and_one_changed_element_another(tensor, data):
    same = tensor.clone()
    if tensor.dim() == 2:  # the same values, laid out otherwise (a transposed copy's transpose)
        same = tensor.t().contiguous().t()
    assert device_digest.values_digest({"x": tensor}) == device_digest.values_digest({"x": same})
    if tensor.numel() == 0:
        return
    changed = tensor.clone().reshape(-1)
    raw = changed.view(torch.uint8) if tensor.dtype != torch.bool else None
    position = data.draw(st.integers(0, changed.numel() - 1))
    if raw is None:
        changed[position] = not changed[position]
    else:
        byte = data.draw(st.integers(0, raw.numel() - 1))
        raw[byte] = (int(raw[byte]) + data.draw(st.integers(1, 255))) % 256
    lanes, other = device_digest.tensor_lanes(tensor), device_digest.tensor_lanes(changed)
    assert all(one != two for one, two in zip(lanes, other)), "one changed element changes every lane"


def test_the_digest_names_dtype_shape_and_name():
    values = torch.arange(6, dtype=torch.float32)
    digest = device_digest.values_digest
    assert digest({"a": values}) != digest({"a": values.reshape(2, 3)})
    assert digest({"a": values}) != digest({"a": values.view(torch.int32)})
    assert digest({"a": values}) != digest({"b": values})


def test_the_start_digest_never_moves_a_tensor_to_the_host(monkeypatch):
    """The trainable part is hashed where it lives: no copy to the CPU (on main, sha256 copied it there)."""
    state = torch.nn.Linear(4, 3).state_dict()
    expected = factory_checks.start_digest(state)

    def refuse(*args, **kwargs):
        raise AssertionError("the start digest copied a tensor to the host")

    for name in ("cpu", "numpy"):
        monkeypatch.setattr(torch.Tensor, name, refuse)
    original_to = torch.Tensor.to
    monkeypatch.setattr(
        torch.Tensor,
        "to",
        lambda self, *args, **kwargs: (
            refuse()
            if "cpu" in [str(a) for a in args] + [str(kwargs.get("device"))]
            else original_to(self, *args, **kwargs)
        ),
    )
    assert factory_checks.start_digest(state) == expected


def test_lanes_by_name_are_each_tensors_lanes_in_order():
    tensors = {"b": torch.arange(300, dtype=torch.float32), "a": torch.ones(7, dtype=torch.int8), "c": torch.zeros(0)}
    lanes = device_digest.lanes_by_name(tensors)
    assert list(lanes) == ["b", "a", "c"]
    assert lanes == {name: device_digest.tensor_lanes(tensor) for name, tensor in tensors.items()}
