"""`flexpar export`: a checkpoint's weights as safetensors, loadable with load_state_dict."""

import os
import stat
import subprocess
import sys

import pytest
import torch
from torch import nn

from flexpar import export
from flexpar.comm import state_transfer as training_state
from flexpar.worker import checkpoints

safetensors_torch = pytest.importorskip(
    "safetensors.torch", reason="the safetensors package is not installed (flexpar[safetensors])"
)


class Tied(nn.Module):
    """Tied weights (shared memory) and a buffer: what safetensors is strict about."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(7, 4)
        self.norm = nn.BatchNorm1d(4)
        self.out = nn.Linear(4, 7, bias=False)
        self.out.weight = self.embed.weight


def _checkpoint(folder):
    torch.manual_seed(3)
    model = Tied()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model.norm(torch.randn(5, 4))  # moves the running statistics
    state = training_state.capture(model, optimizer, None, 12, {})
    return model, checkpoints.write(str(folder), 12, checkpoints.cpu_copy(state))


def _export_command(checkpoint, output, **options):
    """`flexpar export CHECKPOINT -o OUTPUT` in a process of its own (`options`: subprocess.run's cwd, env)."""
    return subprocess.run(
        [sys.executable, "-m", "flexpar", "export", str(checkpoint), "-o", str(output)],
        capture_output=True,
        text=True,
        timeout=120,
        **options,
    )


def test_export_round_trips(tmp_path):
    model, path = _checkpoint(tmp_path)
    output = export.export(path, str(tmp_path / "out" / "model.safetensors"))
    fresh = Tied()
    fresh.load_state_dict(safetensors_torch.load_file(output))
    for (name, want), (_, got) in zip(model.state_dict().items(), fresh.state_dict().items()):
        assert torch.equal(want, got), name
    assert fresh.out.weight is fresh.embed.weight


def test_the_command_line_exports(tmp_path):
    model, path = _checkpoint(tmp_path)
    output = tmp_path / "model.safetensors"
    result = _export_command(path, output)
    assert result.returncode == 0, result.stderr
    assert f"wrote {output}" in result.stdout
    loaded = safetensors_torch.load_file(str(output))
    assert torch.equal(loaded["norm.running_mean"], model.norm.running_mean)


def test_a_checkpoint_with_no_frozen_weight_exports_without_the_script(tmp_path):
    """A factory defined in the training script (`__main__`) is needed only to rebuild frozen weights:
    a checkpoint that holds every weight is written as it is, with no --script."""
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    # What a worker recorded for a model with nothing frozen and no buffer, built by the training script.
    entry = {"digests": {}, "complete": False, "factory": {"name": "__mp_main__:build"}, "seed": 0, "peft": False}
    state = training_state.capture(model, optimizer, None, 12, {"frozen": entry})
    path = checkpoints.write(str(tmp_path), 12, checkpoints.cpu_copy(state))
    output = tmp_path / "model.safetensors"
    result = _export_command(path, output)
    assert result.returncode == 0 and "--script" not in result.stderr, result.stderr
    loaded = safetensors_torch.load_file(str(output))
    assert set(loaded) == set(model.state_dict())
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded[name], tensor), name
    # With frozen weights stored as digests only, the factory is still needed, and asked for.
    frozen_entry = {**entry, "digests": {"0.weight": "0" * 64}}
    state = training_state.capture(model, optimizer, None, 13, {"frozen": frozen_entry})
    path = checkpoints.write(str(tmp_path), 13, checkpoints.cpu_copy(state))
    with pytest.raises(ValueError, match="defined in the training script: flexpar export .* --script SCRIPT"):
        export.export(path, str(tmp_path / "frozen.safetensors"))


def test_the_exported_file_follows_the_umask(tmp_path):
    """safetensors writes owner-only files; an exported model gets the mode torch.save's files get."""
    _, path = _checkpoint(tmp_path)
    previous = os.umask(0o027)
    try:
        output = export.export(path, str(tmp_path / "model.safetensors"))
        compare = tmp_path / "torch.pt"
        torch.save({}, compare)
    finally:
        os.umask(previous)
    assert stat.S_IMODE(os.stat(output).st_mode) == 0o640 == stat.S_IMODE(os.stat(compare).st_mode)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o666 & ~previous, "checkpoints follow the umask too"


def test_export_says_what_is_wrong(tmp_path):
    with pytest.raises(ValueError, match="no such checkpoint"):
        export.export(str(tmp_path / "missing.pt"), str(tmp_path / "x.safetensors"))
    (tmp_path / "junk.pt").write_bytes(b"not torch")
    with pytest.raises(ValueError, match="not a readable flexpar checkpoint"):
        export.export(str(tmp_path / "junk.pt"), str(tmp_path / "x.safetensors"))
    torch.save({"step": 1}, tmp_path / "plain.pt")
    with pytest.raises(ValueError, match="no model state"):
        export.export(str(tmp_path / "plain.pt"), str(tmp_path / "x.safetensors"))


def test_without_safetensors_the_error_names_the_package(monkeypatch, tmp_path):
    import builtins

    real_import = builtins.__import__

    def refuse(name, *args, **kwargs):
        if name.startswith("safetensors"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", refuse)
    with pytest.raises(ImportError, match=r'pip install safetensors \(or pip install -e "\.\[safetensors\]"'):
        export.export(str(tmp_path / "x.pt"), str(tmp_path / "x.safetensors"))


def test_a_checkpoint_of_a_real_job_exports_the_returned_model(train, tmp_path):
    """fit() on two devices writes its last step's checkpoint; exported and loaded into a fresh model, it is
    the model fit() returned, tensor for tensor."""
    import pieces

    job = pieces.make_job(virtual_workers=4)
    model, summary = train(job, steps=5, devices=2, checkpoint_every=5, checkpoint_dir=str(tmp_path / "ck"))
    checkpoint = checkpoints.latest_checkpoint(str(tmp_path / "ck"))
    assert checkpoint.endswith("step-00000005.pt") and summary["steps"] == 5
    assert checkpoints.read_checkpoint(checkpoint, "cpu")["extra"]["frozen"]["complete"], "nothing is left out"
    # `flexpar export` where the job's code (tests/pieces.py) cannot be imported: none is needed.
    output = str(tmp_path / "model.safetensors")
    result = _export_command(
        checkpoint,
        output,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(export.__file__))},
    )
    assert result.returncode == 0, result.stderr
    fresh = job.model()
    fresh.load_state_dict(safetensors_torch.load_file(output))
    returned = model.state_dict()
    assert list(fresh.state_dict()) == list(returned)
    for name, tensor in fresh.state_dict().items():
        assert torch.equal(tensor, returned[name]), name
