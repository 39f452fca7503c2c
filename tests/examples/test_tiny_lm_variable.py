"""The variable-length tiny LM example: its units, dataset, loss and job (flexpar/examples/tiny_lm_variable.py)."""

from __future__ import annotations

import dataclasses
import pickle

import pieces
import pytest
import torch
import torch.nn.functional as F

from flexpar.core import batching
from flexpar.driver.job_checks import first_batch_check
from flexpar.examples import tiny_lm, tiny_lm_variable
from flexpar.worker.user_code import build_model

SMALL_BYTES = 60_000
SMALL_MODEL = tiny_lm_variable.ModelFactory(context=255, width=16, heads=2, layers=1, dropout=0.0)


@pytest.fixture(scope="module")
def units():
    return tiny_lm_variable.source_units(SMALL_BYTES, max_length=256)


def test_units_are_the_corpus_paragraphs_cut_at_the_maximum_length(units):
    assert units == tiny_lm_variable.source_units(SMALL_BYTES, max_length=256), "the same on every call"
    assert all(2 <= len(unit) <= 256 for unit in units)
    lengths = [len(unit) for unit in units]
    assert min(lengths) < 40 and lengths.count(256) < len(lengths) // 4, "lengths as they come"
    corpus = tiny_lm.read_stdlib_corpus(SMALL_BYTES)
    position = 0
    for unit in units:  # every unit is a piece of the corpus, in order, without blank lines inside
        position = corpus.index(unit, position) + len(unit)
        assert b"\n\n" not in unit
    with pytest.raises(ValueError, match="max_length=1"):
        tiny_lm_variable.source_units(SMALL_BYTES, max_length=1)


def test_the_dataset_gives_each_unit_at_its_own_length_and_counts_its_tokens(units):
    dataset = tiny_lm_variable.SourceUnits(units)
    assert len(dataset) == len(units)
    for index in (0, 1, len(units) - 1, -1):
        sample = dataset[index]
        assert sample.dtype == torch.int64 and bytes(sample.tolist()) == units[index]
        assert dataset.token_count(index % len(units)) == len(units[index]) - 1
    with pytest.raises(IndexError):
        dataset[len(units)]
    assert len(pickle.dumps(dataset)) < 2 * sum(map(len, units)) + 16 * len(units) + 10_000
    with pytest.raises(ValueError, match="fewer than 2 bytes"):
        tiny_lm_variable.SourceUnits([b"ab", b"c"])


def test_the_loss_sums_every_sample_at_its_own_length(units):
    dataset = tiny_lm_variable.SourceUnits(units)
    model = SMALL_MODEL()
    batch = tiny_lm_variable.collate_units([dataset[3], dataset[10], dataset[4]])
    assert [len(sample) for sample in batch] == [len(units[3]), len(units[10]), len(units[4])]
    total, count = tiny_lm_variable.loss_fn(model, batch)
    assert count == sum(len(sample) - 1 for sample in batch)
    expected = sum(F.cross_entropy(model(sample[None, :-1])[0], sample[1:], reduction="sum") for sample in batch)
    torch.testing.assert_close(total, expected)


def test_the_job_balances_by_token_count_and_passes_the_drivers_checks(units):
    dataset = tiny_lm_variable.SourceUnits(units)
    job = tiny_lm_variable.build_job(dataset, global_batch=8, virtual_workers=4, model=SMALL_MODEL)
    assert job.sample_cost(5) == len(units[5]) - 1
    first_batch_check(job, build_model(job))
    assert (
        tiny_lm_variable.build_job(
            dataset, by_cost=False, global_batch=8, virtual_workers=4, model=SMALL_MODEL
        ).sample_cost
        is None
    )
    default = tiny_lm_variable.build_job(dataset, global_batch=8, virtual_workers=4)
    assert default.model.context == max(len(unit) for unit in units) - 1
    pickle.loads(pickle.dumps(job))


@pytest.mark.timeout(300)
def test_two_devices_by_cost_match_the_reference(train, units):
    dataset = tiny_lm_variable.SourceUnits(units)
    job = tiny_lm_variable.build_job(dataset, global_batch=8, virtual_workers=8, model=SMALL_MODEL)
    # SGD: AdamW turns the float noise of the attention's key bias (whose gradient is exactly
    # zero: softmax ignores it) into lr-sized steps, by count as by cost, and nothing compares.
    job = dataclasses.replace(job, optimizer=pieces.sgd)
    model, _ = train(job, steps=4, devices=2)
    indices = batching.global_batch_indices(job.seed, 0, len(dataset), 8).tolist()
    assert len({len(units[index]) for index in indices}) > 4, "the samples of a step differ in length"
    pieces.assert_same_parameters(model, pieces.reference(job, 4))
