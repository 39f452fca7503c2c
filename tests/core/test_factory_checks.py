"""flexpar/core/factory_checks.py: the start digest, what differs, and the words for a factory that is not
deterministic."""

import torch
from torch import nn

from flexpar.core import device_digest, factory_checks


def _state(seed: int) -> dict:
    torch.manual_seed(seed)
    return nn.Linear(4, 3).state_dict()


def test_start_digest_is_equal_for_equal_values_and_differs_for_others():
    one, same, other = _state(0), _state(0), _state(1)
    assert factory_checks.start_digest(one) == factory_checks.start_digest(same)
    assert factory_checks.start_digest(one) != factory_checks.start_digest(other)
    digest = factory_checks.start_digest(one)
    assert digest == int(digest) and 1 <= digest <= 2**48  # 0 means "reports nothing"; float64 holds it exactly


def test_start_digest_is_the_device_digest_of_the_trainable_part():
    one = _state(0)
    assert factory_checks.start_digest(one) == int(device_digest.values_digest(one)[:12], 16) + 1


def test_differing_names_lists_what_another_factory_built_otherwise():
    own, received = _state(0), _state(0)
    received["bias"] = received["bias"] + 1
    assert factory_checks.differing_names(own, received) == ["bias"]
    assert factory_checks.differing_names(own, _state(0)) == []


def test_the_warning_names_the_devices_the_tensors_and_the_cause():
    text = factory_checks.start_values_warning(
        "local-0", ["local-1", "local-2"], ["a.weight", "a.bias", "b.weight", "b.bias", "c.weight"]
    )
    assert text.startswith("warning: the model factory built other trainable values on local-1 and local-2")
    assert "(a.weight, a.bias, b.weight and 2 more differ on local-1)" in text
    assert "every device now starts from local-0's" in text and "torch.Generator().manual_seed(0)" in text


def _shapes(width: int, dtype=torch.float32) -> list:
    return factory_checks.model_shapes(nn.Sequential(nn.Linear(4, width, dtype=dtype), nn.Linear(width, 2)))


def test_shape_problem_names_the_first_tensor_with_both_shapes():
    problem = factory_checks.shape_problem(_shapes(8), _shapes(6), "device local-1")
    assert problem.startswith(
        "the model differs from the job's: 0.weight is [6, 4] on device local-1 but [8, 4] as the driver built it "
        "(2 more differ). The model factory builds other shapes in other processes"
    )
    assert factory_checks.shape_problem(_shapes(8), _shapes(8), "device local-1") == ""


def test_shape_problem_names_a_dtype_and_a_missing_or_extra_tensor():
    dtype = factory_checks.shape_problem(_shapes(8), _shapes(8, torch.float64), "device d")
    assert "0.weight is float64 on device d but float32 as the driver built it (1 more differ)" in dtype
    fewer = factory_checks.shape_problem(_shapes(8), _shapes(8)[:3], "device d")
    assert "1.bias is missing on device d (the driver's build has it)" in fewer
    more = factory_checks.shape_problem(_shapes(8)[:3], _shapes(8), "device d")
    assert "device d has 1.bias, which the driver's build lacks" in more


def test_shape_problem_leaves_malformed_rows_out():
    assert "0.weight is missing" in factory_checks.shape_problem(_shapes(8), [["0.weight"], 5], "device d")
