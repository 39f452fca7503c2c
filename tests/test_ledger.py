"""The sample ledger counts what each committed step consumed; the audit finds lost and repeated samples."""

import pieces
from flexpar import batching, ledger


def _true_entries(seed, size, global_batch, steps):
    return {step: sorted(batching.global_batch_indices(seed, step, size, global_batch).tolist())
            for step in range(steps)}


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
    model, summary = train(job, steps=30, devices=2, max_devices=3, schedule="2:+1,20:-1",
                           faults="9:local-0:sync", sample_ledger=True)
    entries = ledger.read(summary["sample_ledger"])
    assert ledger.audit(entries, job.seed, len(job.dataset), job.global_batch, 30).clean
    pieces.assert_same_parameters(model, pieces.reference(job, 30))
