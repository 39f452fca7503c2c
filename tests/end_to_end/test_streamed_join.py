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
SHARDED_MB = 0.001  # a sharded joiner receives 2/3 of the (optimizer) state only, from two holders at once
DELAY_S = 0.02  # per VW: steps long enough for the joiner to warm up while the members train


def _run(train, tmp_path, name, job, **options):
    path = tmp_path / f"{name}.jsonl"
    options.setdefault("steps", STEPS)
    options.setdefault("join_stream_mb", STREAM_MB)
    model, summary = train(job, metrics=str(path), **options)
    records = pieces.metrics_records(path)
    return model, summary, records


def _steps(records):
    return [record for record in records if record["kind"] == "step"]


def _events(records, kind):
    return [record for record in records if record["kind"] == "event" and record["event"] == kind]


def _assert_streamed(records, joiner="local-2", steps=3):
    """The join streamed: the joiner listened (0 VWs) for `steps` steps or more, then took VWs."""
    joins = _events(records, "join")
    assert joins and "streamed to" in joins[0]["detail"], joins
    assert _events(records, "stream"), "the stream's end is an event"
    listening = [r["step"] for r in _steps(records) if joiner in r["devices"] and r["assignment"][-1] == 0]
    working = [r["step"] for r in _steps(records) if joiner in r["devices"] and r["assignment"][-1] > 0]
    assert len(listening) >= steps and working and max(listening) < min(working), (listening, working)


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


def adafactor(parameters):
    return torch.optim.Adafactor(parameters, lr=0.01)


RECIPES = {
    "sgd_momentum": lambda: pieces.make_job(virtual_workers=6, delay_s=DELAY_S, deterministic=True),
    "adamw_scheduler": lambda: pieces.make_job(
        optimizer=pieces.adamw, virtual_workers=6, lr_scheduler=pieces.step_decay, delay_s=DELAY_S, deterministic=True
    ),
    "adafactor": lambda: pieces.make_job(optimizer=adafactor, virtual_workers=6, delay_s=DELAY_S, deterministic=True),
    "bf16_clipping_token_weighted": lambda: recipe_pieces.token_job(
        loss=recipe_pieces.TokenLoss(DELAY_S), mixed_precision="bf16", max_grad_norm=0.5, deterministic=True
    ),
}


@pytest.mark.parametrize("recipe", [name for name in RECIPES if name != "adafactor"])  # adafactor: sharded below
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


def _sharded(by=True, recipe="adamw_scheduler"):
    """A recipe with its optimizer state sharded at redundancy 2 (by elements, or by parameters)."""
    return dataclasses.replace(RECIPES[recipe](), shard_optimizer=by, shard_redundancy=2)


@pytest.mark.parametrize(
    "by,recipe", [(True, "adamw_scheduler"), ("parameters", "adafactor")], ids=["by_elements", "by_parameters"]
)
def test_a_sharded_job_streams_its_join_and_keeps_every_bit_of_the_one_device_run(train, tmp_path, by, recipe):
    """Sharded optimizer state: the joiner's chunks stream from their holders, parameter values come
    with every step's broadcast; the run keeps every bit of the plain (unsharded) one-device run. By
    parameters with Adafactor, whose row and column factors are not one value per element."""
    reference = _reference(train, tmp_path, recipe)
    # By parameters, a piece is a whole parameter: at 100 bytes per step, each travels in a round of its own.
    stream_mb = SHARDED_MB if by is True else 0.0001
    options = {"devices": 2, "max_devices": 3, "schedule": "1:+1", "join_stream_mb": stream_mb}
    streamed = _run(train, tmp_path, "sharded", _sharded(by, recipe), **options)
    _assert_streamed(streamed[2])
    assert "sharded" in _events(streamed[2], "join")[0]["detail"]
    _assert_same_bits(streamed, reference)


@pytest.mark.parametrize("victim", ["local-2", "local-1"], ids=["kill_the_joiner", "kill_a_sender"])
def test_a_kill_during_a_sharded_stream_loses_nothing(train, tmp_path, victim):
    """kill -9 of the joiner or of a holder as it posts its first pieces: every member drops what it
    received, holds its old chunks again, and the normal sharded levelling runs; every bit is kept."""
    reference = _reference(train, tmp_path, "adamw_scheduler")
    faults = f"1:{victim}:stream:kill"
    options = {"devices": 2, "max_devices": 3, "schedule": "1:+1", "join_stream_mb": SHARDED_MB}
    run = _run(train, tmp_path, "fault", _sharded(), faults=faults, **options)
    failures = _events(run[2], "failure")
    assert failures and victim in failures[0]["detail"], failures
    _assert_same_bits(run, reference)


@pytest.mark.parametrize("faults", [None, "12:local-1:stream:kill"], ids=["whole", "kill_a_holder_mid_stream"])
def test_a_sharded_join_of_a_fourth_device_moves_members_chunks_too(train, tmp_path, faults):
    """3 -> 4 devices at redundancy 2: the new cuts give an old member ranges it did not hold, which
    stream to it as the joiner's do (it steps them with the old holders until the new partition);
    a holder killed mid-stream (100 bytes a step: the stream outlasts step 12, the join comes before
    it) makes every member drop what it received, and nothing is lost."""
    reference = _reference(train, tmp_path, "adamw_scheduler")
    stream_mb = SHARDED_MB if faults is None else 0.0001
    options = {"devices": 3, "max_devices": 4, "schedule": "1:+1", "join_stream_mb": stream_mb}
    run = _run(train, tmp_path, "four", _sharded(), faults=faults, **options)
    join = _events(run[2], "join")[0]["detail"]
    assert "streamed to 1 listener" in join and "new chunks of 1 member too" in join, join
    if faults is None:
        _assert_streamed(run[2], joiner="local-3")
    else:
        assert "local-1" in _events(run[2], "failure")[0]["detail"]
    _assert_same_bits(run, reference)


def test_a_checkpoint_written_during_a_sharded_stream_resumes_every_bit(train, tmp_path):
    """The listener writes no part: the members' parts of their partition are the checkpoint, and a
    resume on another device count from the last one (written mid-stream) keeps every bit."""
    reference = _reference(train, tmp_path, "adamw_scheduler")
    directory = str(tmp_path / "checkpoints")
    options = {"devices": 2, "max_devices": 3, "schedule": "1:+1", "join_stream_mb": 0.0001}
    first = _run(
        train, tmp_path, "first", _sharded(), steps=10, checkpoint_every=1, checkpoint_dir=directory, **options
    )
    assert not _events(first[2], "stream") and any(r.get("joining") for r in _steps(first[2])), "still streaming"
    model, _, records = _run(train, tmp_path, "resumed", _sharded(), devices=3, checkpoint_dir=directory, resume=True)
    expected = _steps(reference[2])
    assert [r["digest"] for r in _steps(records)] == [r["digest"] for r in expected[10:]]
    for (name, got), want in zip(model.state_dict().items(), reference[0].state_dict().values()):
        assert torch.equal(got, want), name


def test_a_tampered_piece_of_a_sharded_stream_stops_the_job_naming_the_tensor(train, tmp_path):
    faults = "1:local-0:stream:tamper,1:local-1:stream:tamper"  # whichever holder sends first
    with pytest.raises(TrainingError, match=r"streamed join after step \d+: local-2's copy of '\d\.(weight|bias)'"):
        options = {"devices": 2, "max_devices": 3, "schedule": "1:+1", "faults": faults, "join_stream_mb": SHARDED_MB}
        _run(train, tmp_path, "tamper", _sharded(), **options)


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
