"""The GPU path: one process per GPU over NCCL, chosen automatically. Skipped where no GPU is visible.

The reference trains on the CPU, so the tolerance allows for GPU arithmetic.
With two GPUs a device joins mid-run, which sends the state over NCCL
(`flexpar.comm.state_transfer.send_state`, its CPU tensors moved to the GPU and back).
"""

import pieces
import pytest
import torch

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.skipif(GPUS < 1, reason="needs a CUDA GPU")
def test_one_gpu_matches_the_reference(train):
    job = pieces.make_job(optimizer=pieces.adamw, virtual_workers=4)
    model, summary = train(job, steps=6, devices=1)
    assert summary["steps"] == 6
    pieces.assert_same_parameters(model, pieces.reference(job, 6), rtol=1e-4, atol=1e-5)


@pytest.mark.skipif(GPUS < 2, reason="needs 2 CUDA GPUs")
def test_a_gpu_joins_and_the_result_still_matches(train):
    job = pieces.make_job(optimizer=pieces.adamw, virtual_workers=4)
    model, summary = train(job, steps=12, devices=1, schedule="2:+1", max_devices=2)
    assert summary["steps"] == 12
    pieces.assert_same_parameters(model, pieces.reference(job, 12), rtol=1e-4, atol=1e-5)


@pytest.mark.skipif(GPUS < 1, reason="needs a CUDA GPU")
def test_deterministic_on_a_gpu_gives_the_same_bits_twice(train, tmp_path):
    """Job(deterministic=True) on CUDA: the worker sets use_deterministic_algorithms and the cuBLAS
    workspace, so two runs (exact sums, int64 over NCCL) hold the same parameters and digests."""
    job = pieces.make_job(optimizer=pieces.adamw, virtual_workers=4, deterministic=True)
    runs = []
    for name in ("a", "b"):
        model, _ = train(job, steps=4, devices=1, metrics=str(tmp_path / f"{name}.jsonl"))
        digests = [r["digest"] for r in pieces.metrics_records(tmp_path / f"{name}.jsonl") if r["kind"] == "step"]
        runs.append((model, digests))
    assert runs[0][1] == runs[1][1]
    for first, second in zip(runs[0][0].state_dict().values(), runs[1][0].state_dict().values()):
        assert torch.equal(first, second)


@pytest.mark.skipif(GPUS < 1, reason="needs a CUDA GPU")
def test_the_start_digest_is_reduced_on_the_gpu_and_equals_the_cpus(monkeypatch):
    """The non-deterministic-factory check hashes a CUDA device's trainable part on the GPU (no copy of it to
    the host), and a CPU device holding the same values reports the same number."""
    from flexpar.core import device_digest, factory_checks

    generator = torch.Generator().manual_seed(0)
    state = {"w": torch.randn(3 * device_digest.BLOCK + 7, generator=generator), "b": torch.arange(5).half()}
    on_gpu = {name: tensor.cuda() for name, tensor in state.items()}
    expected = factory_checks.start_digest(state)
    copied = []
    original_to, original_cpu = torch.Tensor.to, torch.Tensor.cpu

    def to(self, *args, **kwargs):
        if self.is_cuda and "cpu" in [str(a) for a in args] + [str(kwargs.get("device"))]:
            copied.append(tuple(self.shape))
        return original_to(self, *args, **kwargs)

    def cpu(self, *args, **kwargs):
        copied.append(tuple(self.shape))
        return original_cpu(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", to)
    monkeypatch.setattr(torch.Tensor, "cpu", cpu)
    assert factory_checks.start_digest(on_gpu) == expected
    assert copied == []
