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
import re

import conftest
import pieces
import pytest
import test_driver_loss as driver_loss
import test_recipes as recipe_pieces
import torch

from flexpar.errors import TrainingError
from flexpar.options import FitOptions, cpu_count

STEPS = 24
STREAM_MB = 0.002  # about 2 kB per sender per step: the test models' states take several steps
SHARDED_MB = 0.001  # a sharded joiner receives 2/3 of the (optimizer) state only, from two holders at once
DELAY_S = 0.02  # per VW: steps long enough for the joiner to warm up while the members train


def _run(train, tmp_path, name, job, **options):
    path = tmp_path / f"{name}.jsonl"
    options.setdefault("steps", STEPS)
    options.setdefault("join_stream_mb", STREAM_MB)
    if options["join_stream_mb"] != 0:  # these tests are of streaming: on a shared host "auto" takes the blocking way
        options.setdefault("join_mode", "stream")
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
    # The join event says the stream's plan as a plan; the stream event, at its end, what happened.
    assert joins and re.search(
        r"streaming to \d+ listeners?: \d+ bytes( of optimizer state)?, planned in \d+ steps? from", joins[0]["detail"]
    )
    assert "streamed to" not in joins[0]["detail"], joins
    # What the joiner's start took, each part (a late join's cause): start-up, model build, warm-up.
    assert re.search(rf"{joiner} \(start-up [\d.]+ s, model build [\d.]+ s, warm-up [\d.]+ s[,)]", joins[0]["detail"])
    streams = _events(records, "stream")
    assert streams and re.search(r"bytes streamed over \d+ steps?", streams[0]["detail"]), streams
    # A listener's optimizer_bytes is what it holds: nothing at 0% of its stream, then more round by round.
    held = [
        (r["joining"][joiner], r["optimizer_bytes"][r["devices"].index(joiner)])
        for r in _steps(records)
        if joiner in (r.get("joining") or {})
    ]
    assert held and all(size == 0 for share, size in held if share == 0), held
    assert [size for _, size in held] == sorted(size for _, size in held), held
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


LEAVE_STEP = 16  # 14 steps of 0.6 s after the scheduled join: the joiners' headroom (test_elastic's is 6 s)
LONG_STREAM_MB = 0.0002  # about 200 bytes per sender per step: a stream outlasts the leave by far


@pytest.mark.parametrize(
    "devices,leaving",
    [(3, 2), (2, 1)],
    ids=["the_joiner_and_a_sender", "one_of_two_joiners"],
)
def test_a_scheduled_leave_during_the_stream_keeps_every_bit(train, tmp_path, devices, leaving):
    """A scheduled -K takes the newest members first: the joiner with a sender (devices=3, +1, -2), or the
    newer of two joiners (devices=2, +2, -1), leave exactly at their step while the stream is in flight.
    A joiner that leaves never held the state; where no listener stays the stream ends with that
    generation (no `stream` event); a joiner that stays keeps what landed and its stream goes on (the
    leave event says so), and the run keeps every bit."""
    reference = _reference(train, tmp_path, "adamw_scheduler")
    job = dataclasses.replace(RECIPES["adamw_scheduler"](), loss=pieces.SlowUntilJoined(pieces.Loss(), devices=4))
    schedule = f"1:+{4 - devices},{LEAVE_STEP}:-{leaving}"
    options = {"devices": devices, "max_devices": 4, "schedule": schedule, "join_stream_mb": LONG_STREAM_MB}
    run = _run(train, tmp_path, "leave", job, **options)
    _, summary, records = run
    assert [(entry["status"], entry["applied_step"]) for entry in summary["schedule"]][1] == ("on time", LEAVE_STEP)
    joiners = {f"local-{index}" for index in range(devices, 4)}  # in the order they warmed up
    before, after = (next(r for r in _steps(records) if r["step"] == step) for step in (LEAVE_STEP - 1, LEAVE_STEP))
    assert set(before["devices"][devices:]) == joiners and before["assignment"][devices:] == [0] * len(joiners)
    assert set(before["joining"]) == joiners and all(0 <= share < 1 for share in before["joining"].values()), before
    leavers = before["devices"][-leaving:]
    staying = [device for device in before["devices"] if device not in leavers]
    assert all(r["devices"] == staying for r in _steps(records) if r["step"] >= LEAVE_STEP)
    listening = [device for device in staying if device in joiners]
    (leave,) = _events(records, "leave")
    assert leave["step"] == LEAVE_STEP and leave["detail"].startswith("left: " + ", ".join(leavers)), leave
    if listening:  # the other joiner keeps what landed: its stream goes on from the members
        (joiner,) = listening
        senders = ", ".join(device for device in staying if device != joiner)
        assert f"; the stream to {joiner} goes on from {senders}: " in leave["detail"], leave
        assert after["assignment"][-1] == 0 and after["joining"][joiner] >= before["joining"][joiner], after
        shares = [r["joining"][joiner] for r in _steps(records) if joiner in r.get("joining", {})]
        assert shares == sorted(shares), f"{joiner}'s stream never started over: {shares}"
    else:
        assert leave["detail"] == "left: " + ", ".join(leavers), leave
        assert not _events(records, "stream"), "no joiner came to hold the state"
    _assert_same_bits(run, reference)


# About 10 steps a stream: the devices go on for a step or two before they notice the driver's loss (the
# stream must still be in flight then), and the stream that starts over ends well before the last step.
DRIVER_KILLED_STREAM_MB = 0.001
# RECIPES["adamw_scheduler"] under `flexpar run` (a driver of its own, which a test can kill), whose driver
# dies as rank 0 posts the stream's first slice (a STEP:driver:stream fault fires at a stream's round).
DRIVER_KILLED_JOB = """
import dataclasses
import os
import torch
if __name__ == "__main__":
    job = pieces.make_job(
        optimizer=pieces.adamw, virtual_workers=6, lr_scheduler=pieces.step_decay, deterministic=True
    )
    # The joiner joins a step or two after it is warm, however long that takes: its stream outlasts
    # the devices' notice of the driver's loss, and the one that starts over ends before the last step.
    job = dataclasses.replace(job, loss=pieces.SlowUntilJoined(pieces.Loss(), devices=3))
    model, summary = job.fit(
        steps={steps}, devices=2, max_devices=3, port=int(os.environ["TEST_PORT"]), schedule="1:+1",
        faults="1:driver:stream", driver_grace_s=60, join_stream_mb={stream_mb}, join_mode="stream",
    )
    torch.save(model.state_dict(), "final.pt")
"""


@pytest.mark.timeout(120)
def test_a_driver_killed_during_the_stream_re_adopts_the_joiner_as_a_joiner(
    train, tmp_path, command_line_job, monkeypatch
):
    """kill -9 of the driver as the first slice leaves: the devices wait, the driver restarted with the
    resume command they printed re-adopts the members, and the listener (which holds no committed state)
    as a joiner (flexpar/core/adoption.py): it joins at the adoption's boundary, listens to a stream that
    starts over, then takes VWs. Every step is recorded once, with the one-device run's digests and final bits."""
    reference = _reference(train, tmp_path, "adamw_scheduler")
    monkeypatch.setenv("TEST_PORT", str(conftest.free_port()))
    script = DRIVER_KILLED_JOB.format(steps=STEPS, stream_mb=DRIVER_KILLED_STREAM_MB)
    drivers, records, said = driver_loss._restart_until_done(tmp_path, command_line_job, script, 1)
    assert re.search(r"fault: driver gets SIGKILL at step \d+ \(stream\)", said), said
    model = pieces.make_model()
    model.load_state_dict(torch.load(tmp_path / "final.pt", weights_only=True))
    assert [r["step"] for r in _steps(records)] == list(range(STEPS)), "every step recorded once"
    _assert_same_bits((model, None, records), reference)
    # The listener said it held no committed state, was re-adopted as a joiner and listened again from the start.
    assert "device local-2: the job's driver is gone;" in said and "holds no committed state yet" in said, said
    assert "device local-2: re-adopted by the restarted driver" in said, said
    assert "re-adopted 2 devices (local-0, local-1) holding step" in drivers[-1].output()[0], drivers[-1].output()
    assert "joining with them: local-2" in drivers[-1].output()[0], drivers[-1].output()
    (adopted,) = _events(records, "adopt")
    assert adopted["detail"].startswith("re-adopted by a restarted driver: local-0, local-1 (generation")
    assert adopted["detail"].endswith("; joined: local-2"), adopted
    first, again_joined = _events(records, "join")
    assert first["step"] < adopted["step"] == again_joined["step"], (first, adopted, again_joined)
    assert (
        again_joined["detail"].startswith("joined: local-2") and "; streaming to 1 listener" in again_joined["detail"]
    )
    again = next(r for r in _steps(records) if r["step"] == adopted["step"])
    assert again["assignment"][-1] == 0 and again["joining"] == {"local-2": 0.0}, again
    (streamed,) = _events(records, "stream")
    assert streamed["step"] > adopted["step"] and "local-2 holds the training state" in streamed["detail"]
    working = [r["step"] for r in _steps(records) if r["assignment"][-1] > 0 and "local-2" in r["devices"]]
    assert working and min(working) == streamed["step"], working


LORA_STEPS = 16


@pytest.mark.timeout(180)
def test_a_lora_model_streams_only_its_adapters(train, tmp_path):
    """test_fine_tuning's peft LoRA GPT-2 (frozen base weights): the join streams the adapters and their
    AdamW state only, and the run keeps every bit of the one-device run."""
    pytest.importorskip("peft", reason="peft is not installed (flexpar[hf])")
    from flexpar.examples import hf_gpt, lora_gpt

    folder = lora_gpt.write_pretrained(str(tmp_path / "pretrained"), layers=2, width=32, heads=2, context=32)
    dataset, _ = hf_gpt.load_splits(context=32, max_bytes=30_000)

    def job_with(loss):  # fp32, as test_fine_tuning's
        job = lora_gpt.build_job(
            folder, LORA_STEPS, 12, 6, dataset=dataset, mixed_precision=None, max_grad_norm=0.5, rank=4, loss=loss
        )
        return dataclasses.replace(job, deterministic=True)

    one = _run(train, tmp_path, "lora-one", job_with(hf_gpt.loss_fn), steps=LORA_STEPS, devices=1)
    job = job_with(pieces.SlowUntilJoined(hf_gpt.loss_fn, devices=3))  # the joiner imports transformers: seconds
    streamed = _run(train, tmp_path, "lora", job, steps=LORA_STEPS, devices=2, max_devices=3, schedule="1:+1")
    _assert_streamed(streamed[2])
    _assert_same_bits(streamed, one)
    model = lora_gpt.PretrainedLoRA(folder, rank=4)()
    adapters = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    frozen = sum(p.numel() * p.element_size() for p in model.parameters() if not p.requires_grad)
    (join,), (stream,) = _events(streamed[2], "join"), _events(streamed[2], "stream")
    # The stream: the adapters with their two AdamW moments (and the step count) and nothing else; the
    # boundary: the small state (no tensor of the 139 kB base model).
    assert 3 * adapters <= stream["state_bytes_sent"] < 4 * adapters, (adapters, stream)
    assert join["state_bytes_sent"] < frozen / 10, (frozen, join)


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
    assert "streaming to 1 listener" in join and "new chunks of 1 member too" in join, join
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


# ------------------------------------------------------------ the join's way (flexpar/core/join_choice.py)


def _two_to_three(train, tmp_path, name, **options):
    """The join-mode tests' run: AdamW with a schedule, 2 -> 3 devices at step 1 (`options`: the join's)."""
    return _run(
        train, tmp_path, name, RECIPES["adamw_scheduler"](), devices=2, max_devices=3, schedule="1:+1", **options
    )


def _join_way(records):
    """The join event's way, its detail, and the stream event (None where the join was blocking)."""
    joins, streams = _events(records, "join"), _events(records, "stream")
    assert len(joins) == 1, joins
    return joins[0], (streams[0] if streams else None)


def _assert_blocking(records):
    assert all(min(r["assignment"]) >= 1 for r in _steps(records)), "a blocking joiner takes VWs at once"
    assert not _events(records, "stream")


def test_auto_takes_the_blocking_transfer_where_the_joiner_shares_the_members_cores(train, tmp_path):
    """2 -> 3 CPU devices: on a host with fewer cores than the three processes' threads (this 2-core
    machine), "auto" takes the blocking transfer and says why; elsewhere it takes the way it predicts
    cheaper. Either way the join event holds both predictions, and the run is the one-device run's bits."""
    reference = _reference(train, tmp_path, "adamw_scheduler")
    run = _two_to_three(train, tmp_path, "auto", join_mode="auto", join_stream_mb=None)
    join, stream = _join_way(run[2])
    assert join["join_way"] in ("stream", "blocking") and join["predicted_stream_lost_s"] > 0, join
    assert join["predicted_blocking_lost_s"] > 0, join
    cores = cpu_count()
    if 3 * max(1, cores // 3) > cores:  # the three processes' threads oversubscribe the host
        assert join["join_way"] == "blocking", join
        assert re.search(
            r"blocking transfer: predicted [\d.e-]+ s against [\d.e-]+ s streaming "
            r"\(the joiner shares local-0's cores\)",
            join["detail"],
        ), join
    if join["join_way"] == "blocking":
        assert join["lost_s"] == pytest.approx(join["stall_s"], abs=1e-5), join
        _assert_blocking(run[2])
    else:
        assert re.search(r"streamed: predicted [\d.e-]+ s lost against [\d.e-]+ s blocking", join["detail"]), join
        assert stream is not None and "lost_s" in stream
    _assert_same_bits(run, reference)


def test_join_mode_stream_streams_and_records_what_it_cost(train, tmp_path):
    reference = _reference(train, tmp_path, "adamw_scheduler")
    run = _two_to_three(train, tmp_path, "forced")
    _assert_streamed(run[2])
    join, stream = _join_way(run[2])
    assert join["join_way"] == "stream" and "(join mode stream)" in join["detail"], join
    assert join["detail"].split("; ", 1)[1].startswith("streamed: predicted"), join
    assert stream["join_way"] == "stream" and stream["lost_s"] >= 0, stream
    assert stream["predicted_stream_lost_s"] == join["predicted_stream_lost_s"], stream
    assert "the members lost" in stream["detail"], stream
    _assert_same_bits(run, reference)


def test_join_mode_blocking_transfers_the_state_at_the_boundary(train, tmp_path):
    reference = _reference(train, tmp_path, "adamw_scheduler")
    run = _two_to_three(train, tmp_path, "blocking", join_mode="blocking")
    join, _ = _join_way(run[2])
    assert re.search(
        r"blocking transfer: predicted [\d.e-]+ s against [\d.e-]+ s streaming \(join mode blocking\)", join["detail"]
    ), join
    assert join["join_way"] == "blocking" and join["lost_s"] == pytest.approx(join["stall_s"], abs=1e-5), join
    _assert_blocking(run[2])
    _assert_same_bits(run, reference)


def test_contradictory_join_options_are_refused_before_any_process_starts():
    with pytest.raises(ValueError, match=r"join_mode='stream' contradicts join_stream_mb=0"):
        FitOptions(steps=1, join_mode="stream", join_stream_mb=0)
    with pytest.raises(ValueError, match=r"join_mode='sometimes': choose one of 'auto', 'stream', 'blocking'"):
        pieces.make_job().fit(steps=1, join_mode="sometimes")
    assert FitOptions(steps=1, join_mode="blocking", join_stream_mb=0).join_mode == "blocking"
    assert FitOptions(steps=1).join_mode == "auto"
