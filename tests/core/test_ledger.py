"""The sample ledger counts what each committed step consumed; the audit finds lost and repeated samples."""

import dataclasses

import ledger_pieces
import pieces
import pytest
import torch

from flexpar.core import batching, ledger
from flexpar.worker.loader import VirtualWorkerLoader


def _true_entries(seed, size, global_batch, steps):
    return {
        step: sorted(batching.global_batch_indices(seed, step, size, global_batch).tolist()) for step in range(steps)
    }


def test_the_audit_counts_lost_repeated_and_missing():
    entries = _true_entries(7, 480, 48, 10)
    assert ledger.audit(entries, 7, 480, 48, 10).clean
    lost_one_vw = {**entries, 4: entries[4][12:]}
    assert ledger.audit(lost_one_vw, 7, 480, 48, 10) == ledger.Audit(0, 12, 0)
    doubled = {**entries, 5: entries[5] + entries[5][:12]}
    assert ledger.audit(doubled, 7, 480, 48, 10) == ledger.Audit(0, 0, 12)
    del entries[9]
    assert ledger.audit(entries, 7, 480, 48, 10) == ledger.Audit(1, 0, 0)


def test_consumed_repeats_an_index_as_often_as_it_was_counted():
    counts = ledger.count_vector(6)
    counts[[1, 4]] += 1.0
    counts[4] += 1.0
    assert ledger.consumed(counts) == [1, 4, 4]


def test_a_run_with_a_join_a_leave_and_a_kill_consumes_every_sample_once(train):
    job = pieces.make_job(virtual_workers=6, delay_s=0.01)
    model, summary = train(
        job, steps=30, devices=2, max_devices=3, schedule="2:+1,20:-1", faults="9:local-0:sync", sample_ledger=True
    )
    entries = ledger.read(summary["sample_ledger"])
    assert ledger.audit(entries, job.seed, len(job.dataset), job.global_batch, 30).clean
    pieces.assert_same_parameters(model, pieces.reference(job, 30))


def test_the_loader_hands_over_the_indices_it_loaded():
    job = pieces.make_job(virtual_workers=4, num_workers=0)
    plain = VirtualWorkerLoader(job, lambda step: range(4), total_steps=3)
    recording = VirtualWorkerLoader(job, lambda step: range(4), total_steps=3, record_indices=True)
    inputs = job.dataset.tensors[0]
    for step in range(3):
        for virtual_worker in (0, 2, 3):  # skipping VW 1: the loader restarts along the plan
            expected = batching.virtual_worker_indices(
                job.seed, step, virtual_worker, len(job.dataset), job.global_batch, job.virtual_workers
            )
            batch = recording.batch(step, virtual_worker)
            assert recording.loaded_indices == expected
            assert torch.equal(batch[0], inputs[expected])
            assert torch.equal(plain.batch(step, virtual_worker)[0], batch[0]), "the batch itself is unchanged"


@pytest.mark.parametrize("num_workers", [0, 1])
def test_a_stale_batch_shows_in_the_ledger_even_though_the_plan_is_right(train, num_workers):
    # The workers' loaders serve the previous step's samples at STALE_STEP while the plan
    # (what batching says) names the right ones: the ledger counts what was loaded (with
    # DataLoader worker processes too: the indices travel with the batch).
    job = dataclasses.replace(
        pieces.make_job(virtual_workers=6, num_workers=num_workers), loss=ledger_pieces.StaleBatchLoss()
    )
    _, summary = train(job, steps=6, devices=2, sample_ledger=True)
    entries = ledger.read(summary["sample_ledger"])
    stale = ledger_pieces.STALE_STEP
    assert entries[stale] == sorted(
        batching.global_batch_indices(job.seed, stale - 1, len(job.dataset), job.global_batch).tolist()
    )
    assert ledger.audit(entries, job.seed, len(job.dataset), job.global_batch, 6) == ledger.Audit(
        0, job.global_batch, job.global_batch
    )


def _stream_entries(split, batch, steps, lengths, pass_end="drop"):
    """The ledger a correct streaming job writes: each step's chunks of every group, and its pass ends."""
    from flexpar.core.stream_split import plan_chunks

    entries = {step: [] for step in range(steps)}
    ends = []
    for group in range(split.groups):
        chunks, group_ends = plan_chunks(lengths, split.chunk(batch), steps, pass_end, group)
        ends += [ended.to_dict() for ended in group_ends]
        for step, places in enumerate(chunks):
            entries[step] += [[group, pass_, index] for pass_, index in places]
    return entries, ends


def test_the_stream_audit_finds_lost_repeated_and_left_out_items():
    from flexpar.core.stream_split import split_stream

    split = split_stream(4, 8)  # 4 groups of one VW
    entries, ends = _stream_entries(split, 3, 7, [10])  # a pass of 10: 3 steps, 1 item left out per group
    audit = ledger.audit_stream(entries, ends, split, 3, 7)
    assert audit.clean and audit.items_left_out == 2 * 4 and audit.pass_ends_differing == 0, audit
    broken = {step: list(items) for step, items in entries.items()}
    broken[2] = broken[2][1:]  # an item lost
    broken[5] = broken[5] + [broken[5][0]]  # an item trained twice
    audit = ledger.audit_stream(broken, ends, split, 3, 7)
    assert (audit.samples_lost, audit.samples_repeated) == (1, 1), audit
    audit = ledger.audit_stream(entries, ends[1:], split, 3, 7)  # a pass end not recorded
    assert audit.pass_ends_differing >= 1 and not audit.clean, audit
    del entries[4]
    assert ledger.audit_stream(entries, ends, split, 3, 7).steps_missing == 1


def test_the_job_end_names_the_last_pass_leftovers_and_the_audit_accounts_for_every_item(tmp_path):
    """epochs=2, pass_end="drop", uneven groups: each group's passes are trained once or left out by a
    named pass end, the last pass's leftovers by the job-end line (read skips it, read_pass_ends takes it)."""
    from flexpar.core.stream_split import job_end_pass_ends, plan_chunks, split_stream, steps_for_passes

    split = split_stream(2, 2)  # 2 groups of one VW, a chunk of 3 items
    lengths = [[10, 11], [13, 14]]  # group 0: 6 steps; group 1: 8 steps, its pass 2 ends after the job's last
    steps = steps_for_passes(lengths, 3, "drop")
    assert steps == 8
    entries, ends = {step: [] for step in range(steps)}, []
    for group in range(2):
        chunks, group_ends = plan_chunks(lengths[group], 3, steps, "drop", group)
        ends += [ended.to_dict() for ended in group_ends]
        for step, places in enumerate(chunks):
            entries[step] += [[group, pass_, index] for pass_, index in places]
    path = tmp_path / "ledger.jsonl"
    with open(path, "w", encoding="utf-8") as handle:
        for step in range(steps):
            ledger.write_entry(handle, step, entries[step], [e for e in ends if e["step"] == step])
    final = job_end_pass_ends(lengths, 3, steps, "drop")
    assert [e.to_dict() for e in final] == [{"group": 1, "pass": 1, "items": 14, "step": 8, "left_out": [12, 14]}]
    ledger.write_job_end(path, steps, final)
    ledger.write_job_end(path, steps, final)  # once: a driver resumed at the last step adds none
    assert path.read_text().count("job_end") == 1 and sorted(ledger.read(path)) == list(range(steps))
    recorded = ledger.read_pass_ends(path)
    audit = ledger.audit_stream(ledger.read(path), recorded, split, 3, steps)
    assert audit.clean and audit.pass_ends_differing == 0 and audit.items_left_out == (1 + 2) + (1 + 2), audit
    # Every item of both passes of group 1 (the one whose passes fill the job) is trained or left out.
    trained = sum(1 for items in entries.values() for item in items if item[0] == 1 and item[1] < 2)
    left_out = sum(e["left_out"][1] - e["left_out"][0] for e in recorded if e["group"] == 1 and e["left_out"])
    assert trained + left_out == sum(lengths[1]) and left_out == 1 + 2
