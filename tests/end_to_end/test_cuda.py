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
