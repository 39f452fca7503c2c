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
