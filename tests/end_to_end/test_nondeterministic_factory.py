"""A model factory that builds other things in other processes: other values, other shapes."""

import dataclasses
import functools
import os

import pieces
import pytest
import torch

from flexpar.errors import TrainingError


def test_a_factory_that_is_not_deterministic_starts_every_device_from_rank_0s_values(train, tmp_path, capfd):
    """A factory drawing from torch.Generator().seed() built other values on each device, which
    then trained different models in silence. Every device now starts from one device's values (as DDP
    broadcasts rank 0's), and one warning names the difference."""
    built = tmp_path / "built"
    built.mkdir()
    job = pieces.make_job(model=pieces.UnseededModel(str(built)), virtual_workers=4)
    model, summary = train(job, steps=6, devices=2)
    assert summary["steps"] == 6
    # The driver builds the model for its checks (this process); each device builds its own.
    starts = [torch.load(path) for path in sorted(built.glob("*.pt")) if path.stem != str(os.getpid())]
    assert len(starts) == 2 and not torch.equal(starts[0]["0.weight"], starts[1]["0.weight"])
    # The job's result is the plain loop's from one device's start: had the other device trained
    # from its own values, the summed gradients would have mixed two models, matching neither.
    matches = []
    for start in starts:
        expected = pieces.reference(dataclasses.replace(job, model=functools.partial(_built_from, start)), 6)
        try:
            pieces.assert_same_parameters(model, expected)
            matches.append(start)
        except AssertionError:
            pass
    assert len(matches) == 1
    warnings = [line for line in capfd.readouterr().err.splitlines() if "other trainable values" in line]
    assert len(warnings) == 1, warnings
    assert "0.weight" in warnings[0] and "torch.manual_seed(seed)" in warnings[0]


def _built_from(state):
    model = pieces.make_model()
    model.load_state_dict(state)
    return model


def test_a_factory_whose_shapes_differ_by_process_is_refused_naming_the_tensor_in_one_line_each(train, capfd):
    """Shapes that differ by process: five lines said to join with the same script and named the
    `__main__` guard; the refusal names the first differing tensor with its two shapes and the likely
    cause, once per device."""
    job = pieces.make_job(model=pieces.ShapeByProcess(os.getpid()))
    with pytest.raises(TrainingError, match=r"no device could start \(local-0 and local-1 refused, above\)"):
        train(job, steps=2, devices=2)
    lines = [line for line in capfd.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 2, lines
    for device, line in zip(("local-0", "local-1"), sorted(lines)):
        assert line.startswith(f"flexpar: refused device {device}: the model differs from the job's: ")
        assert f"0.weight is [24, 12] on device {device} but [16, 12] as the driver built it" in line
        assert "make them depend only on the script and its arguments" in line
