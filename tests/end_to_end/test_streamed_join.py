"""Streamed joins (flexpar/worker/streaming.py): the joiner listens while the state streams to it.

The members never stop for the transfer: at the join boundary only the small
state travels; then the joiner runs no VWs (its assignment is 0) and applies
each step's summed gradient, while the members send it a slice of the state
after each update (`join_stream_mb` tiny here, so a stream lasts several
steps). Exactness is checked by digest against the one-device run
(`Job(deterministic=True)`: every step's digest and the final parameters are
the same bits), and a float job against the plain single-process loop.
"""

from __future__ import annotations

import dataclasses

import pieces
import pytest
import test_recipes as recipe_pieces
import torch

from flexpar.errors import TrainingError

STEPS = 24
STREAM_MB = 0.002  # about 2 kB per sender per step: the test models' states take several steps
DELAY_S = 0.02  # per VW: steps long enough for the joiner to warm up while the members train


def _run(train, tmp_path, name, job, **options):
    path = tmp_path / f"{name}.jsonl"
    options.setdefault("steps", STEPS)
    model, summary = train(job, metrics=str(path), join_stream_mb=STREAM_MB, **options)
    records = pieces.metrics_records(path)
    return model, summary, records


def _steps(records):
    return [record for record in records if record["kind"] == "step"]


def _events(records, kind):
    return [record for record in records if record["kind"] == "event" and record["event"] == kind]


def _assert_streamed(records, joiner="local-2"):
    """The join streamed: the joiner listened (0 VWs) for several steps, then took VWs."""
    joins = _events(records, "join")
    assert joins and "streamed to" in joins[0]["detail"], joins
    assert _events(records, "stream"), "the stream's end is an event"
    listening = [r["step"] for r in _steps(records) if joiner in r["devices"] and r["assignment"][-1] == 0]
    working = [r["step"] for r in _steps(records) if joiner in r["devices"] and r["assignment"][-1] > 0]
    assert len(listening) >= 3 and working and max(listening) < min(working), (listening, working)


_REFERENCES: dict = {}  # recipe -> its one-device run, made once for the tests below


def _reference(train, tmp_path, recipe):
    """The one-device run of RECIPES[recipe] (without the VWs' delay: the bits do not depend on it)."""
    if recipe not in _REFERENCES:
        job = RECIPES[recipe]()
        _REFERENCES[recipe] = _run(train, tmp_path, "one", dataclasses.replace(job, loss=type(job.loss)()), devices=1)
    return _REFERENCES[recipe]


def _assert_same_bits(run, reference):
    model, _, records = run
    expected_model, _, expected_records = reference
    assert [r["digest"] for r in _steps(records)] == [r["digest"] for r in _steps(expected_records)]
    assert [r["loss"] for r in _steps(records)] == [r["loss"] for r in _steps(expected_records)]
    for (name, got), want in zip(model.state_dict().items(), expected_model.state_dict().values()):
        assert torch.equal(got, want), name


RECIPES = {
    "sgd_momentum": lambda: pieces.make_job(virtual_workers=6, delay_s=DELAY_S, deterministic=True),
    "adamw_scheduler": lambda: pieces.make_job(
        optimizer=pieces.adamw, virtual_workers=6, lr_scheduler=pieces.step_decay, delay_s=DELAY_S, deterministic=True
    ),
    "bf16_clipping_token_weighted": lambda: recipe_pieces.token_job(
        loss=recipe_pieces.TokenLoss(DELAY_S), mixed_precision="bf16", max_grad_norm=0.5, deterministic=True
    ),
}


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_a_streamed_join_keeps_every_bit_of_the_one_device_run(train, tmp_path, recipe):
    reference = _reference(train, tmp_path, recipe)
    streamed = _run(train, tmp_path, "streamed", RECIPES[recipe](), devices=2, max_devices=3, schedule="1:+1")
    _assert_streamed(streamed[2])
    _assert_same_bits(streamed, reference)


def test_a_float_job_matches_the_plain_loop(train, tmp_path):
    job = pieces.make_job(optimizer=pieces.adamw, virtual_workers=6, lr_scheduler=pieces.step_decay, delay_s=DELAY_S)
    model, _, records = _run(train, tmp_path, "float", job, devices=2, max_devices=3, schedule="1:+1")
    _assert_streamed(records)
    pieces.assert_same_parameters(model, pieces.reference(job, STEPS))


def test_two_joiners_listen_at_once(train, tmp_path):
    reference = _reference(train, tmp_path, "adamw_scheduler")
    job = RECIPES["adamw_scheduler"]()
    streamed = _run(train, tmp_path, "two", job, devices=2, max_devices=4, schedule="1:+2")
    assert any(r["assignment"][2:] == [0, 0] for r in _steps(streamed[2])), "both listened together"
    _assert_same_bits(streamed, reference)


@pytest.mark.parametrize(
    "victim,signal",
    [("local-2", "kill"), ("local-1", "kill"), ("local-2", "term"), ("local-1", "term")],
    ids=["kill_the_joiner", "kill_a_sender", "sigterm_the_joiner", "sigterm_a_sender"],
)
def test_a_failure_or_a_leave_during_the_stream_loses_nothing(train, tmp_path, victim, signal):
    """kill -9 (a failure) or SIGTERM (a leave at the next boundary) of the joiner or of a sender as it
    posts its first slice: the stream ends with that generation, and the result keeps every bit."""
    reference = _reference(train, tmp_path, "adamw_scheduler")
    faults = f"1:{victim}:stream:{signal}"
    job = RECIPES["adamw_scheduler"]()
    run = _run(train, tmp_path, "fault", job, devices=2, max_devices=3, schedule="1:+1", faults=faults)
    changes = _events(run[2], "failure" if signal == "kill" else "leave")
    assert changes and victim in changes[0]["detail"], _events(run[2], "failure") + _events(run[2], "leave")
    _assert_same_bits(run, reference)


@pytest.mark.parametrize("victim", ["local-1", "local-0"], ids=["a_sender", "rank_0"])
def test_a_sender_lost_during_the_stream_leaves_its_slices_to_the_others(train, tmp_path, victim):
    """kill -9 of a sender (rank 0 too) as it posts a round: the stream goes on from the survivors (the
    joiner keeps what landed, the rest is planned again among them), and the result keeps every bit."""
    reference = _reference(train, tmp_path, "adamw_scheduler")
    job = RECIPES["adamw_scheduler"]()
    options = {"devices": 3, "max_devices": 4, "schedule": "1:+1", "faults": f"3:{victim}:stream:kill"}
    run = _run(train, tmp_path, "replan", job, **options)
    records = run[2]
    survivors = ", ".join(device for device in ("local-0", "local-1", "local-2") if device != victim)
    failures = _events(records, "failure")
    assert failures and f"the stream to local-3 goes on from {survivors}" in failures[0]["detail"], failures
    shares = [record["joining"]["local-3"] for record in _steps(records) if record.get("joining")]
    assert shares == sorted(shares) and shares[-1] > 0, f"the joiner kept what had landed: {shares}"
    assert len(_events(records, "stream")) == 1 and len(_events(records, "join")) == 1
    _assert_streamed(records, joiner="local-3")
    _assert_same_bits(run, reference)


def test_a_sharded_job_joins_with_the_blocking_transfer_and_says_why(train, tmp_path):
    job = pieces.make_job(virtual_workers=6, delay_s=DELAY_S, shard_optimizer=True)
    _, _, records = _run(train, tmp_path, "sharded", job, steps=12, devices=2, max_devices=3, schedule="1:+1")
    joins = _events(records, "join")
    assert joins and "blocking transfer: sharded optimizer state (shard_optimizer=True)" in joins[0]["detail"]


class StepwiseSGD(torch.optim.SGD):
    """An optimizer class flexpar does not know (a user's own): it may read other parameters' state."""


def stepwise_sgd(parameters):
    return StepwiseSGD(parameters, lr=0.05, momentum=0.9)


def test_an_optimizer_not_known_to_be_per_parameter_joins_blocking_and_says_why(train, tmp_path):
    job = pieces.make_job(optimizer=stepwise_sgd, virtual_workers=6, delay_s=DELAY_S)
    model, _, records = _run(train, tmp_path, "unknown", job, steps=12, devices=2, max_devices=3, schedule="1:+1")
    joins = _events(records, "join")
    assert (
        joins
        and "blocking transfer: the optimizer StepwiseSGD is not known to update each parameter" in (joins[0]["detail"])
    ), joins
    assert all(min(r["assignment"]) >= 1 for r in _steps(records)), "nobody listened"


def test_a_tampered_slice_stops_the_job_naming_the_tensor(train, tmp_path):
    job = RECIPES["sgd_momentum"]()
    with pytest.raises(TrainingError, match=r"streamed join after step \d+: local-2's copy of '0\.weight'"):
        options = {"devices": 2, "max_devices": 3, "schedule": "1:+1", "faults": "1:local-0:stream:tamper"}
        _run(train, tmp_path, "tamper", job, **options)


def test_join_stream_mb_0_keeps_the_blocking_transfer(train, tmp_path):
    job = pieces.make_job(virtual_workers=6, delay_s=DELAY_S)
    path = tmp_path / "blocking.jsonl"
    train(job, steps=12, metrics=str(path), devices=2, max_devices=3, schedule="1:+1", join_stream_mb=0)
    records = pieces.metrics_records(path)
    joins = _events(records, "join")
    assert joins and "blocking transfer: join_stream_mb=0" in joins[0]["detail"], joins
    assert all(min(r["assignment"]) >= 1 for r in _steps(records))


def test_join_stream_mb_must_not_be_negative():
    with pytest.raises(ValueError, match=r"join_stream_mb=-1 must be >= 0"):
        pieces.make_job().fit(steps=1, join_stream_mb=-1)
