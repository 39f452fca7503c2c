"""Streaming (iterable) datasets in real jobs: the parameters equal a plain loop over the same stream.

Each VW's stream position is training state (flexpar/worker/data_streams.py): committed with the step,
kept by every device, sent to joiners, restored for a redone step, checkpointed. The runs are short
(12 steps: a pass of these streams is 9, so each run crosses a pass end that drops the pass's last
items) and deterministic (exact sums): a run on another device set, through joins, leaves and a
kill -9, has the one-device run's digests.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import evaluation_pieces
import pieces
import pytest
import stream_pieces
import torch

import flexpar
from flexpar.core import ledger
from flexpar.core.stream_split import split_stream
from flexpar.errors import ArgumentError
from flexpar.worker.evaluator import evaluate_all

STEPS = 12
ATOL = 1e-6  # exact sums against the float loop: last-bit differences, a few ulps over 12 steps


def _digests(path) -> list:
    return [(record["step"], record["digest"]) for record in pieces.metrics_records(path) if record["kind"] == "step"]


def _events(path) -> list:
    return [record for record in pieces.metrics_records(path) if record["kind"] == "event"]


def _job(dataset, virtual_workers=6, **extra):
    return pieces.make_job(virtual_workers=virtual_workers, dataset=dataset, deterministic=True, **extra)


def _joined(path, devices) -> bool:
    """Some step ran on `devices` devices, every one of them running VWs (a joiner trained)."""
    return any(
        len(record["devices"]) == devices and all(record["assignment"])
        for record in pieces.metrics_records(path)
        if record["kind"] == "step"
    )


def _ledger_audit(directory, job, steps: int, shards=None):
    """The sample ledger of the run(s) under `directory` against the items each step should train."""
    paths = sorted(Path(directory).rglob("ledger.jsonl"))
    assert paths, f"no ledger under {directory}"
    entries = {step: items for path in paths for step, items in ledger.read(path).items()}
    ends = {(e["group"], e["pass"]): e for path in paths for e in ledger.read_pass_ends(path)}
    split = split_stream(job.virtual_workers, shards)
    return ledger.audit_stream(entries, list(ends.values()), split, job.micro_batch_size, steps)


def _steady_reads(path) -> list:
    """(items read, items left out at pass ends, devices running VWs) of every step that runs on the
    same generation and assignment as the step before (no stream moved: nothing skipped or read forward)."""
    steps = [record for record in pieces.metrics_records(path) if record["kind"] == "step"]
    return [
        (
            record["stream_items_read"],
            sum(end["left_out"][1] - end["left_out"][0] for end in record.get("pass_ends", []) if end["left_out"]),
            sum(1 for share in record["assignment"] if share),
        )
        for before, record in zip(steps, steps[1:])
        if (before["generation"], before["assignment"]) == (record["generation"], record["assignment"])
    ]


def test_plain_stream_on_1_device_and_through_joins_a_kill_and_a_leave(train, tmp_path):
    """No shards: round-robin, step s = items s*B .. (s+1)*B-1 of the pass, on 1 device, and on 2 with
    +2 (streamed joins: the joiners receive the positions with the state), a kill -9 of local-1 in
    step 8 (the step redone from the committed positions) and -2 (the last device reads on)."""
    stream = stream_pieces.PairStream()
    job = _job(stream)
    steps = 16
    expected = stream_pieces.stream_reference(job, steps, stream_pieces.round_robin_items(stream, 48, 6))
    one, summary = train(job, steps=steps, devices=1, metrics=str(tmp_path / "one.jsonl"))
    assert summary["steps"] == steps
    pieces.assert_same_parameters(one, expected, atol=ATOL)
    # Slow steps until the joiners are in (however long their start takes), fast from then on.
    job = dataclasses.replace(job, loss=pieces.SlowUntilJoined(pieces.Loss(), devices=4))
    elastic, _ = train(
        job,
        steps=steps,
        devices=2,
        schedule="2:+2,12:-2",
        faults="8:local-1:backward",
        max_devices=4,
        metrics=str(tmp_path / "elastic.jsonl"),
        sample_ledger=True,  # ledger.jsonl beside the metrics file (the one run with a ledger here)
        join_mode="stream",  # streamed joins (on a shared host "auto" takes the blocking way)
    )
    events = _events(tmp_path / "elastic.jsonl")
    assert {"join", "leave", "failure"} <= {record["event"] for record in events}, events
    assert any("streamed" in record["detail"] for record in events if record["event"] == "join"), events
    assert _joined(tmp_path / "elastic.jsonl", 4)
    assert pieces.device_counts(pieces.metrics_records(tmp_path / "elastic.jsonl"))[-1] == 1
    assert _digests(tmp_path / "elastic.jsonl") == _digests(tmp_path / "one.jsonl")
    # Round-robin: every device running VWs reads the whole stream (the pass end's dropped items too).
    steady = _steady_reads(tmp_path / "elastic.jsonl")
    assert len(steady) >= 4 and {devices for _, _, devices in steady} >= {1, 2}, steady
    assert all(read == devices * (48 + left_out) for read, left_out, devices in steady), steady
    # The ledger: every item of the stream trained once, in its step, through +2, the kill and -2;
    # the pass end at step 9 left out its last 24 items (456 = 9 * 48 + 24), recorded, not silent.
    audit = _ledger_audit(tmp_path, job, steps)
    assert audit.clean and audit.pass_ends_differing == 0, audit
    assert audit.items_left_out == 24, audit
    pieces.assert_same_parameters(elastic, expected, atol=ATOL)


def test_sharded_stream_on_1_device_and_through_a_blocking_join_and_a_kill(train, tmp_path):
    """6 shards, 6 VWs: VW v reads shard v. 1 device, then 2 with +1 (a blocking transfer: the state and
    the positions at once) and local-1 killed -9 in step 8; the second run evaluates a map-style
    evaluation set beside the stream (every 6 steps and after the last)."""
    stream = stream_pieces.ShardedPairs()
    job = _job(stream)
    expected = stream_pieces.stream_reference(job, STEPS, stream_pieces.shard_items(stream, 8))
    one, _ = train(job, steps=STEPS, devices=1, metrics=str(tmp_path / "one.jsonl"))
    pieces.assert_same_parameters(one, expected, atol=ATOL)
    job = dataclasses.replace(
        job,
        loss=pieces.SlowUntilJoined(pieces.Loss(), devices=3),
        eval_dataset=evaluation_pieces.make_eval_dataset(),
        evaluate=evaluation_pieces.Evaluate(),
    )
    three, _ = train(
        job,
        steps=STEPS,
        devices=2,
        schedule="2:+1",
        join_stream_mb=0,
        faults="8:local-1:forward",
        max_devices=3,
        eval_every=6,
        metrics=str(tmp_path / "three.jsonl"),
        sample_ledger=True,  # ledger.jsonl beside the metrics file (the one run with a ledger here)
    )
    evals = [record for record in pieces.metrics_records(tmp_path / "three.jsonl") if record["kind"] == "eval"]
    assert [record["step"] for record in evals] == [6, 12]
    evaluation_pieces.assert_metrics_equal(evals[-1]["metrics"], evaluate_all(job, expected), rtol=1e-4)
    events = _events(tmp_path / "three.jsonl")
    assert any("blocking" in record["detail"] for record in events if record["event"] == "join"), events
    assert [record["step"] for record in events if record["event"] == "failure"] == [8]
    assert _joined(tmp_path / "three.jsonl", 3)
    assert _digests(tmp_path / "three.jsonl") == _digests(tmp_path / "one.jsonl")
    # One VW per shard: each item is read once in the whole job, on 2 and 3 devices alike.
    steady = _steady_reads(tmp_path / "three.jsonl")
    assert len(steady) >= 4 and {devices for _, _, devices in steady} >= {3}, steady
    assert all(read == 48 + left_out for read, left_out, _ in steady), steady
    audit = _ledger_audit(tmp_path, job, STEPS, shards=6)
    assert audit.clean and audit.pass_ends_differing == 0, audit
    assert audit.items_left_out == 6 * 4, audit  # each shard's pass of 76 leaves 4 out at step 9
    pieces.assert_same_parameters(three, expected, atol=ATOL)


def test_a_stateful_stream_moves_by_its_own_state(train, tmp_path):
    """A dataset with state_dict()/load_state_dict() (a complete position): a blocking join at step 2
    and a resume from step 6 on another device count restore it by its state (no skipping)."""
    stream = stream_pieces.StatefulPairs()
    job = _job(stream)
    folder = str(tmp_path / "checkpoints")
    joining = dataclasses.replace(job, loss=pieces.SlowUntilJoined(pieces.Loss(), devices=3))
    train(
        joining,
        steps=6,
        devices=2,
        schedule="2:+1",
        join_stream_mb=0,
        max_devices=3,
        checkpoint_every=6,
        checkpoint_dir=folder,
        metrics=str(tmp_path / "a.jsonl"),
    )
    assert _joined(tmp_path / "a.jsonl", 3)
    joins = [record for record in _events(tmp_path / "a.jsonl") if record["event"] == "join"]
    assert joins and all("stream_skipped_items" not in record for record in joins), joins  # by its state
    model, summary = train(job, steps=STEPS, devices=1, checkpoint_dir=folder, resume=True)
    assert summary["resumed_from"] == 6
    expected = stream_pieces.stream_reference(job, STEPS, stream_pieces.round_robin_items(stream, 48, 6))
    pieces.assert_same_parameters(model, expected, atol=ATOL)


def test_a_webdataset_pipeline_over_tar_shards(train, tmp_path):
    """6 tar shards the test writes, one per VW; 3 devices, one killed -9 in step 5. WebDataset's default
    node splitter (single_node_only) is replaced, and the Job says so."""
    paths = stream_pieces.write_tar_shards(tmp_path, [76] * 6)
    rows = stream_pieces.TarRows()
    with pytest.warns(UserWarning, match="single_node_only"):
        job = _job(stream_pieces.webdataset_stream(paths), collate_fn=rows)
    model, _ = train(job, steps=STEPS, devices=3, faults="5:local-2:forward", metrics=str(tmp_path / "m.jsonl"))
    assert [record["step"] for record in _events(tmp_path / "m.jsonl") if record["event"] == "failure"] == [5]
    expected = stream_pieces.stream_reference(job, STEPS, stream_pieces.tar_items(76, 8))
    pieces.assert_same_parameters(model, expected, atol=ATOL)


def test_dataloader_processes_keep_the_bits(train, tmp_path):
    """num_workers=2: each stream group read behind a DataLoader of 2 processes (its order is that
    loader's); 2 devices, one killed -9 in step 3, have the one device's digests."""
    job = _job(stream_pieces.ShardedPairs(), num_workers=2)
    train(job, steps=8, devices=1, metrics=str(tmp_path / "one.jsonl"))
    train(job, steps=8, devices=2, faults="3:local-1:forward", metrics=str(tmp_path / "two.jsonl"))
    assert [record["event"] for record in _events(tmp_path / "two.jsonl")].count("failure") == 1
    assert _digests(tmp_path / "two.jsonl") == _digests(tmp_path / "one.jsonl")
    assert len({digest for _, digest in _digests(tmp_path / "one.jsonl")}) == 8


def test_resume_on_another_device_count_continues_at_the_next_item(train, tmp_path):
    """A Hugging Face stream, to_iterable_dataset(num_shards=6) with a shuffle buffer (its own state
    leaves the buffer out: positioned by skipping). 2 devices checkpoint step 6; the resume on 3
    devices (then -2: one) trains the items a plain loop trains from step 6 on."""
    stream = stream_pieces.huggingface_pairs()
    job = _job(stream, collate_fn=stream_pieces.collate_rows)
    folder = str(tmp_path / "checkpoints")
    train(job, steps=6, devices=2, checkpoint_every=3, checkpoint_dir=folder, metrics=str(tmp_path / "a.jsonl"))
    model, summary = train(
        job,
        steps=STEPS,
        devices=3,
        schedule="9:-2",
        checkpoint_dir=folder,
        resume=True,
        metrics=str(tmp_path / "b.jsonl"),
    )
    assert summary["resumed_from"] == 6
    assert pieces.device_counts(pieces.metrics_records(tmp_path / "b.jsonl")) == [3, 1]
    # The shuffled stream's state is not complete: each of the 6 groups skips its 6 * 8 items, in the
    # resume's boundary, and its start event says so.
    start = [record for record in _events(tmp_path / "b.jsonl") if record["event"] == "start"]
    assert [record.get("stream_skipped_items") for record in start] == [6 * 6 * 8], start
    assert start[0]["stream_skip_s"] >= 0.0, start
    items = stream_pieces.huggingface_items(stream, 6, 8, STEPS)
    pieces.assert_same_parameters(model, stream_pieces.stream_reference(job, STEPS, items), atol=ATOL)


def test_a_carried_pass_end_on_2_devices_through_a_kill(train, tmp_path):
    """pass_end="carry": the step holding the end of pass 0 (456 = 9 * 48 + 24 items) fills from pass 1,
    nothing is left out; 2 devices, local-1 killed -9 in step 9 (that very step); the ledger finds every
    item once and no item left out. The evaluation set is an iterable one (read once where the Job is
    built), evaluated at steps 6 and 12 as the plain loop's model."""
    from flexpar.data import VirtualWorkerStreams

    stream = stream_pieces.PairStream()
    evaluation_stream = stream_pieces.PairStream(size=40)  # an iterable evaluation set: read once, here
    job = _job(stream, pass_end="carry", eval_dataset=evaluation_stream, evaluate=evaluation_pieces.Evaluate())
    assert len(job.eval_dataset) == 40 and torch.equal(job.eval_dataset[3][0], evaluation_stream.inputs[3])
    reader = VirtualWorkerStreams(stream_pieces.PairStream(), 6, 8, pass_end="carry", virtual_worker_ids=range(6))
    chunks = {(step, v): reader.items(step, v) for step in range(STEPS) for v in range(6)}
    model, _ = train(
        job,
        steps=STEPS,
        devices=2,
        faults="9:local-1:forward",
        metrics=str(tmp_path / "m.jsonl"),
        sample_ledger=True,
        eval_every=6,
    )
    assert [record["step"] for record in _events(tmp_path / "m.jsonl") if record["event"] == "failure"] == [9]
    expected = stream_pieces.stream_reference(job, STEPS, lambda step, v: chunks[(step, v)])
    pieces.assert_same_parameters(model, expected, atol=ATOL)
    evals = [record for record in pieces.metrics_records(tmp_path / "m.jsonl") if record["kind"] == "eval"]
    assert [record["step"] for record in evals] == [6, 12]
    evaluation_pieces.assert_metrics_equal(evals[-1]["metrics"], evaluate_all(job, expected), rtol=1e-4)
    records = [r for r in pieces.metrics_records(tmp_path / "m.jsonl") if r["kind"] == "step"]
    assert [end["left_out"] for r in records for end in r.get("pass_ends", [])] == [[]], records
    split = split_stream(6, None)
    ends = ledger.read_pass_ends(tmp_path / "ledger.jsonl")
    audit = ledger.audit_stream(ledger.read(tmp_path / "ledger.jsonl"), ends, split, 8, STEPS, pass_end="carry")
    assert audit.clean and audit.items_left_out == 0 and audit.pass_ends_differing == 0, audit


def test_a_packing_dataset_carries_its_leftover_tokens_through_a_join_and_a_kill(train, tmp_path):
    """A stateful packing stream (documents of random length cut into 8-token sequences; the leftover
    tokens are its state and carry into the next pass): 2 devices, a blocking join at step 2 (the
    joiner loads the stream's state) and local-0, rank 0, killed -9 in step 7 (the survivors redo
    it from their committed positions). 12 steps cross a pass end, whose leftover starts pass 1."""
    from flexpar.data import VirtualWorkerStreams

    def packing():
        return stream_pieces.PackingStream(documents=30, sequence=8)

    job = _job(packing(), virtual_workers=3, global_batch=6, collate_fn=stream_pieces.TokenFeatures())
    job = dataclasses.replace(job, loss=pieces.SlowUntilJoined(pieces.Loss(), devices=3))
    reader = VirtualWorkerStreams(packing(), 3, 2, virtual_worker_ids=range(3))
    chunks = {}
    for step in range(STEPS):
        chunks.update({(step, v): reader.items(step, v) for v in range(3)})
        reader.commit(step + 1)
    assert len(reader.pass_ends()) == 1  # a pass of 48 sequences: 8 steps
    model, _ = train(
        job,
        steps=STEPS,
        devices=2,
        schedule="2:+1",
        join_stream_mb=0,
        faults="7:local-0:forward",
        max_devices=3,
        metrics=str(tmp_path / "m.jsonl"),
        sample_ledger=True,
    )
    assert _joined(tmp_path / "m.jsonl", 3)
    assert [record["step"] for record in _events(tmp_path / "m.jsonl") if record["event"] == "failure"] == [7]
    expected = stream_pieces.stream_reference(job, STEPS, lambda step, v: chunks[(step, v)])
    pieces.assert_same_parameters(model, expected, atol=ATOL)
    assert _ledger_audit(tmp_path, job, STEPS).clean


def test_what_a_streaming_job_refuses_before_any_process_starts(train):
    stream = stream_pieces.PairStream()
    with pytest.raises(ArgumentError, match="sample_cost="):
        pieces.make_job(dataset=stream, sample_cost=len)
    with pytest.raises(ArgumentError, match="shard_optimizer="):
        pieces.make_job(dataset=stream, shard_optimizer=True)
    with pytest.raises(ArgumentError, match="pass_end='keep' must be one of"):
        pieces.make_job(dataset=stream, pass_end="keep")
    with pytest.raises(ArgumentError, match="is for an iterable dataset="):
        pieces.make_job(pass_end="carry")
    with pytest.raises(ArgumentError, match="is an iterator"):
        pieces.make_job(dataset=iter(stream))
    with pytest.raises(ArgumentError, match="get_rank"):
        pieces.make_job(dataset=stream_pieces.SplitsByRank())
    assert flexpar.Job is type(pieces.make_job(dataset=stream))


def test_epochs_over_a_stream_train_each_item_once_per_pass_through_a_join(train, tmp_path):
    """epochs=2 over a stream of unknown length (432 items, 9 steps a pass: its passes counted before the
    devices start, flexpar/data/pass_count.py) on 2 devices with +1 in step 3: 18 steps, equal to a plain
    loop over the same items (pass 1 rotated by set_epoch(1)), and the ledger names every item exactly
    twice, once per pass."""
    stream = stream_pieces.PairStream(size=432)
    job = dataclasses.replace(_job(stream), loss=pieces.SlowUntilJoined(pieces.Loss(), devices=3))
    model, summary = train(
        job, epochs=2, devices=2, schedule="3:+1", max_devices=3, sample_ledger=True, metrics=str(tmp_path / "m.jsonl")
    )
    assert summary["steps"] == 18
    assert _joined(tmp_path / "m.jsonl", 3)
    expected = stream_pieces.stream_reference(job, 18, stream_pieces.round_robin_items(stream, 48, 6))
    pieces.assert_same_parameters(model, expected, atol=ATOL)
    (path,) = Path(tmp_path).rglob("ledger.jsonl")
    trained = [tuple(item) for items in ledger.read(path).values() for item in items]
    assert sorted(trained) == sorted((0, pass_, index) for pass_ in (0, 1) for index in range(432))
    assert _ledger_audit(tmp_path, job, 18).clean


def test_a_resumed_epochs_job_reads_no_pass_again_shows_its_pass_and_names_every_item(train, tmp_path, capfd, caplog):
    """epochs=2 over a stream (456 items: 9 steps a pass, 24 left out): 2 devices stop after step 10 (a
    checkpoint every 5); the resume on 1 device takes the pass lengths from the run's record
    (stream-passes.json: its driver reads no pass), shows pass 2/2 from its first step, trains the 18 steps
    of one run, and the ledger names every item of both passes as trained once or left out, the last
    pass's 24 by the job's end."""
    reads = tmp_path / "reads"
    stream = stream_pieces.ReadLoggedPairs(reads)
    job = _job(stream)
    folder = str(tmp_path / "checkpoints")

    def driver_reads() -> int:
        return reads.read_text().split().count(str(os.getpid())) if reads.exists() else 0

    _, first = train(
        job,
        epochs=2,
        devices=2,
        checkpoint_every=5,
        checkpoint_dir=folder,
        sample_ledger=True,
        callbacks=[stream_pieces.StopAfter(10)],
    )
    assert first["stopped"] and (Path(folder) / "stream-passes.json").exists()
    counted = driver_reads()  # the 2 passes counted, and whatever else the driver reads of it
    capfd.readouterr()
    caplog.clear()
    model, summary = train(
        job, epochs=2, devices=1, checkpoint_dir=folder, resume=True, sample_ledger=True, quiet=False, log_every=1
    )
    said = capfd.readouterr().err
    assert driver_reads() - counted == counted - 2, said  # the resumed driver read no pass to count it
    assert "2 passes of 1 stream group taken from the run's record, not read again" in said, said
    assert summary["steps"] == 18 and 10 <= summary["resumed_from"] < 18, summary
    steps = [entry.getMessage() for entry in caplog.records if "done, " in entry.getMessage()]
    assert steps and all("pass 2/2" in line for line in steps), steps  # never pass 1 again
    expected = stream_pieces.stream_reference(job, 18, stream_pieces.round_robin_items(stream, 48, 6))
    pieces.assert_same_parameters(model, expected, atol=ATOL)
    audit = _ledger_audit(tmp_path, job, 18)
    assert audit.clean and audit.pass_ends_differing == 0 and audit.items_left_out == 2 * 24, audit
    (path,) = Path(tmp_path).rglob("ledger.jsonl")
    trained = sorted(tuple(item) for items in ledger.read(path).values() for item in items)
    left = [(0, e["pass"], k) for e in ledger.read_pass_ends(path) for k in range(*e["left_out"])]
    assert sorted(trained + left) == [(0, pass_, k) for pass_ in (0, 1) for k in range(456)]


# A streaming job of epochs=2 whose driver is killed -9 in step 6's forward; the devices wait, the resume
# command they print restarts the driver, which re-adopts them with their stream positions.
DRIVER_KILLED = """
import stream_pieces
import torch
if __name__ == "__main__":
    import os, torch
    stream = stream_pieces.ReadLoggedPairs("reads")
    job = pieces.make_job(virtual_workers=6, dataset=stream, delay_s=0.02)
    model, summary = job.fit(
        epochs=2, devices=2, port=int(os.environ["TEST_PORT"]), faults="6:driver:forward", driver_grace_s=60,
        sample_ledger=True,
    )
    torch.save(model.state_dict(), "final.pt")
"""


@pytest.mark.timeout(300)
def test_a_driver_killed_and_restarted_re_adopts_the_devices_with_their_positions(
    tmp_path, command_line_job, monkeypatch
):
    """The restarted driver takes the pass lengths its predecessor counted (no pass read while the devices
    wait for it), and its ledger adds the last pass's leftovers at the job's end: 18 steps of one run."""
    from conftest import free_port
    from test_driver_loss import _restart_until_done

    monkeypatch.setenv("TEST_PORT", str(free_port()))
    drivers, records, said = _restart_until_done(tmp_path, command_line_job, DRIVER_KILLED, 1)
    out = "".join(drivers[-1].output())
    assert "re-adopted 2 devices (local-0, local-1)" in out and "no checkpoint read" in out, out
    assert "2 passes of 1 stream group taken from the run's record, not read again" in out, out
    readers = (tmp_path / "reads").read_text().split()
    first, restarted = (readers.count(str(driver.process.pid)) for driver in drivers)
    assert first - restarted == 2, readers  # the first driver counted the 2 passes, the restarted none
    assert [record["event"] for record in records if record["kind"] == "event"].count("adopt") == 1
    assert [record["step"] for record in records if record["kind"] == "step"] == list(range(18))
    model = pieces.make_model()
    model.load_state_dict(torch.load(tmp_path / "final.pt", weights_only=True))
    stream = stream_pieces.PairStream()
    job = pieces.make_job(virtual_workers=6, dataset=stream)
    expected = stream_pieces.stream_reference(job, 18, stream_pieces.round_robin_items(stream, 48, 6))
    pieces.assert_same_parameters(model, expected, atol=ATOL)
    audit = _ledger_audit(tmp_path, job, 18)  # both drivers' ledgers: each step once, each item once
    assert audit.clean and audit.pass_ends_differing == 0 and audit.items_left_out == 2 * 24, audit
