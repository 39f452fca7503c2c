"""Job(deterministic=True): bit-for-bit the same training on any device set and schedule (exact gradient sums).

Every comparison here is exact (torch.equal, equal digests), never a tolerance:
the exact sums make the applied gradient the same bits whichever devices
summed which VWs. The runs are short (6-8 steps) and small; the 1-device run
of each recipe is the reference.
"""

from __future__ import annotations

import dataclasses
import os
import random

import pieces
import pytest
import test_recipes as recipe_pieces
import torch
from torch import nn

from flexpar.errors import TrainingError


def _digests(path) -> list:
    return [(record["step"], record["digest"]) for record in pieces.metrics_records(path) if record["kind"] == "step"]


def _losses(path) -> list:
    return [record["loss"] for record in pieces.metrics_records(path) if record["kind"] == "step"]


def _run(train, tmp_path, name, job, steps, **options):
    """(model, digests, losses, records) of one run, its metrics in its own file."""
    path = tmp_path / f"{name}.jsonl"
    model, summary = train(job, steps=steps, metrics=str(path), **options)
    assert summary["steps"] == steps
    records = [record for record in pieces.metrics_records(path) if record["kind"] == "step"]
    return model, _digests(path), _losses(path), records


def _assert_bitwise_equal(model, expected):
    for (name, got), (_, want) in zip(model.state_dict().items(), expected.state_dict().items()):
        assert torch.equal(got, want), f"{name} differs (largest difference {(got - want).abs().max()})"


def _assert_same_run(first, second):
    model, digests, losses, _ = first
    other_model, other_digests, other_losses, _ = second
    assert digests == other_digests
    assert losses == other_losses, "every step's recorded loss is the same float"
    _assert_bitwise_equal(other_model, model)


def _mlp_job(**extra):
    return pieces.make_job(
        optimizer=pieces.adamw, virtual_workers=6, lr_scheduler=pieces.step_decay, deterministic=True, **extra
    )


def test_mlp_adamw_bitwise_equal_on_1_2_and_3_devices(train, tmp_path):
    job = _mlp_job()
    reference = _run(train, tmp_path, "one", job, 6, devices=1)
    assert len({digest for _, digest in reference[1]}) == 6, "a digest per step, each different"
    # 2 devices with 1 kB buckets: the last VW's hooks send several int64 buckets during its backward.
    _assert_same_run(reference, _run(train, tmp_path, "d2", job, 6, devices=2, bucket_mb=0.001))
    _assert_same_run(reference, _run(train, tmp_path, "d3", job, 6, devices=3))


def test_the_float_sums_differ_where_exact_sums_agree(train, tmp_path):
    """Without deterministic=True the same runs differ in their last bits: the test above is not vacuous."""
    job = dataclasses.replace(_mlp_job(), deterministic=False)
    one, _ = train(job, steps=6, devices=1, metrics=str(tmp_path / "a.jsonl"))
    three, _ = train(job, steps=6, devices=3, metrics=str(tmp_path / "b.jsonl"))
    assert not all(torch.equal(a, b) for a, b in zip(one.state_dict().values(), three.state_dict().values()))


def test_join_leave_and_kill_keep_the_bits(train, tmp_path):
    """+1 at step 2, -1 at step 5, kill -9 of local-1 during step 7's backward, against one device.

    The leave is decided at step 4 at the latest (one step before its own, to be exact): a joiner still
    on its way then is cancelled. Its step leaves the joiner the two steps it had when leaves came late."""
    job = _mlp_job(delay_s=0.02)
    steps = 10
    reference = _run(train, tmp_path, "one", job, steps, devices=1)
    # Steps slow until the joiner is in (the bits do not depend on it): a joiner whose start-up a loaded host
    # (three test processes on two cores) stretches past the leave's decision at step 4 would be cancelled.
    joining = dataclasses.replace(job, loss=pieces.SlowUntilJoined(job.loss, devices=3, waiting_s=0.6))
    elastic = _run(
        train,
        tmp_path,
        "elastic",
        joining,
        steps,
        devices=2,
        schedule="2:+1,5:-1",
        faults="7:local-1:backward",
        max_devices=3,
    )
    counts = [len(record["devices"]) for record in elastic[3]]
    assert max(counts) == 3 and counts[-1] == 1, counts
    events = [
        record["event"] for record in pieces.metrics_records(tmp_path / "elastic.jsonl") if record["kind"] == "event"
    ]
    assert {"join", "leave", "failure"} <= set(events), events
    assert [record["redone"] for record in elastic[3]] == [1] + [0] * (steps - 1), "the joiner got the exponents"
    _assert_same_run(reference, elastic)


def test_token_weighted_loss_and_sparse_embeddings(train, tmp_path):
    job = recipe_pieces.token_job(
        model=recipe_pieces.make_sparse_token_model, optimizer=recipe_pieces.plain_sgd, deterministic=True
    )
    reference = _run(train, tmp_path, "one", job, 6, devices=1)
    _assert_same_run(reference, _run(train, tmp_path, "three", job, 6, devices=3))


def test_bf16_with_clipping(train, tmp_path):
    job = recipe_pieces.token_job(mixed_precision="bf16", max_grad_norm=0.5, deterministic=True)
    reference = _run(train, tmp_path, "one", job, 6, devices=1)
    _assert_same_run(reference, _run(train, tmp_path, "two", job, 6, devices=2))


def test_fp16_with_the_loss_scaler_through_skipped_steps(train, tmp_path):
    job = pieces.make_job(virtual_workers=6, deterministic=True, **recipe_pieces.FP16)
    reference = _run(train, tmp_path, "one", job, 8, devices=1)
    assert any(
        record["grad_norm"] != record["grad_norm"] or record["grad_norm"] == float("inf") for record in reference[3]
    )
    _assert_same_run(reference, _run(train, tmp_path, "three", job, 8, devices=3))


def test_sharded_optimizer_state(train, tmp_path):
    job = _mlp_job(shard_optimizer=True)
    reference = _run(train, tmp_path, "one", job, 6, devices=1)
    _assert_same_run(reference, _run(train, tmp_path, "three", job, 6, devices=3, schedule="3:-1"))


class SpikeAt(recipe_pieces.OverflowingGradientAt):
    """Cross-entropy, times 1e6 for the batch that holds `sample`: a gradient far beyond the exact sums' scale."""

    def __call__(self, model, batch):
        loss = nn.functional.cross_entropy(model(batch[0]), batch[1])
        return loss * 1e6 if self.sample is not None and recipe_pieces._holds(batch, self.sample) else loss


def test_a_gradient_spike_is_redone_with_the_same_bits(train, tmp_path):
    """Step 0 is redone (no scale yet), and step 3, whose VW 4 multiplies its loss by 1e6: once each."""
    plain = pieces.make_job(optimizer=pieces.sgd, virtual_workers=6, max_grad_norm=1.0, deterministic=True)
    job = dataclasses.replace(plain, loss=SpikeAt(recipe_pieces._first_sample_of(plain, 3, 4)))
    reference = _run(train, tmp_path, "one", job, 6, devices=1)
    assert [record["redone"] for record in reference[3]] == [1, 0, 0, 1, 0, 0]
    two = _run(train, tmp_path, "two", job, 6, devices=2)
    assert [record["redone"] for record in two[3]] == [1, 0, 0, 1, 0, 0]
    _assert_same_run(reference, two)


class NoisySGD(torch.optim.SGD):
    """SGD that adds a device's own random noise to the first parameter: a breach of determinism."""

    def step(self, closure=None):
        result = super().step(closure)
        with torch.no_grad():
            self.param_groups[0]["params"][0].view(-1)[0] += random.Random(os.getpid()).random() * 1e-3
        return result


def noisy_sgd(parameters):
    return NoisySGD(parameters, lr=0.05)


def test_a_device_that_drifts_stops_the_job_naming_the_step_and_tensor(train, tmp_path):
    job = pieces.make_job(optimizer=noisy_sgd, virtual_workers=4, deterministic=True)
    with pytest.raises(TrainingError, match=r"determinism breach before step 1: .* parameter '0.weight'"):
        train(job, steps=4, devices=2)


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_deterministic_must_be_a_bool(value):
    with pytest.raises(ValueError, match=r"deterministic=.* must be True .* or False"):
        pieces.make_job(deterministic=value)


def test_lora_gpt2_frozen_weights(train, tmp_path):
    """A peft LoRA GPT-2 (99% frozen): only the adapters are summed, exactly."""
    pytest.importorskip("peft", reason="peft is not installed (flexpar[hf])")
    from flexpar.examples import hf_gpt, lora_gpt

    folder = lora_gpt.write_pretrained(str(tmp_path / "pretrained"), layers=2, width=32, heads=2, context=32)
    dataset, _ = hf_gpt.load_splits(context=32, max_bytes=30_000)
    job = lora_gpt.build_job(folder, 4, 12, 6, dataset=dataset, mixed_precision=None, max_grad_norm=0.5, rank=4)
    job = dataclasses.replace(job, deterministic=True)
    reference = _run(train, tmp_path, "one", job, 4, devices=1)
    _assert_same_run(reference, _run(train, tmp_path, "two", job, 4, devices=2))


def test_resume_from_a_checkpoint_continues_with_the_same_exponents(train, tmp_path):
    """The exact sums' exponents are training state: 3 steps on 2 devices, resumed on 3 devices to 6,
    give the unbroken one-device run's bits (a resumed run that relearned them would round otherwise)."""
    job = _mlp_job()
    reference = _run(train, tmp_path, "one", job, 6, devices=1)
    checkpoints = str(tmp_path / "ck")
    train(job, steps=3, devices=2, checkpoint_every=3, checkpoint_dir=checkpoints, metrics=str(tmp_path / "a.jsonl"))
    model, summary = train(
        job, steps=6, devices=3, checkpoint_dir=checkpoints, resume=True, metrics=str(tmp_path / "b.jsonl")
    )
    assert summary["resumed_from"] == 3
    assert _digests(tmp_path / "a.jsonl") + _digests(tmp_path / "b.jsonl")[-3:] == reference[1]
    redone = [r["redone"] for r in pieces.metrics_records(tmp_path / "b.jsonl") if r["kind"] == "step"]
    assert redone[-3:] == [0, 0, 0], "the resumed run knows the exponents: its first step is not redone"
    _assert_bitwise_equal(model, reference[0])


class GRUNet(nn.Module):
    """Embeddings, a GRU over the sequence, a linear head: a recurrent model with a token-weighted loss."""

    def __init__(self):
        super().__init__()
        self.embedding = nn.Embedding(recipe_pieces.VOCABULARY, 16)
        self.gru = nn.GRU(16, 24, batch_first=True)
        self.head = nn.Linear(24, recipe_pieces.VOCABULARY)

    def forward(self, tokens):
        hidden, _ = self.gru(self.embedding(tokens))
        return self.head(hidden)


def make_gru_model():
    return GRUNet()


def test_gru_with_embeddings(train, tmp_path):
    job = recipe_pieces.token_job(model=make_gru_model, max_grad_norm=1.0, deterministic=True)
    reference = _run(train, tmp_path, "one", job, 5, devices=1)
    _assert_same_run(reference, _run(train, tmp_path, "three", job, 5, devices=3))
