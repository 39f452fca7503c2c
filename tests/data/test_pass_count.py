"""epochs= over a stream of unknown length: its passes counted (flexpar/data/pass_count.py) and the steps
they fill (flexpar/core/stream_split.steps_for_passes), checked against what a reader then trains."""

import dataclasses

import pieces
import pytest
import stream_pieces as sp

from flexpar.core.stream_split import EmptyPass, steps_for_passes
from flexpar.data import VirtualWorkerStreams
from flexpar.data.pass_count import pass_lengths


def _trained(stream, virtual_workers, batch, steps, pass_end):
    """(group, pass, index) of every item the first `steps` steps train, one reader holding every VW."""
    reader = VirtualWorkerStreams(
        stream, virtual_workers, batch, pass_end=pass_end, virtual_worker_ids=range(virtual_workers)
    )
    try:
        return [item for step in range(steps) for vw in range(virtual_workers) for item in reader.item_ids(step, vw)]
    finally:
        reader.close()


@pytest.mark.parametrize("pass_end, steps", [("drop", 8), ("carry", 10)])
def test_one_group_ends_with_the_step_that_trains_the_last_item_of_pass_n(pass_end, steps):
    stream = sp.CountingStream([53, 38, 60])
    lengths = pass_lengths(stream, 2, 5, passes=2)
    assert lengths == [[53, 38]]
    assert stream.epochs_set == []  # counted on flexpar's copies, as a device reads them
    assert steps_for_passes(lengths, 10, pass_end) == steps
    trained = _trained(stream, 2, 5, steps, pass_end)
    if pass_end == "drop":  # every full chunk of both passes, nothing of pass 3
        assert sorted(trained) == sorted([(0, 0, k) for k in range(50)] + [(0, 1, k) for k in range(30)])
    else:  # every item of both passes; the last step (91 items in) starts pass 3 with 9
        assert {(g, p, k) for g, p, k in trained if p < 2} == {
            (0, p, k) for p, n in ((0, 53), (1, 38)) for k in range(n)
        }
        assert sorted(k for _, p, k in trained if p == 2) == sorted(k for _, p, k in trained[-9:])
        assert len(trained) == 100 and {p for _, p, _ in trained[-9:]} == {2}


def test_uneven_groups_end_when_the_longest_has_ended_pass_n_the_others_start_their_next():
    stream = sp.ShardedStream([20, 40])  # group 0: 4 steps a pass, group 1: 8
    lengths = pass_lengths(stream, 2, 5, passes=2)
    assert lengths == [[20, 20], [40, 40]]
    assert steps_for_passes(lengths, 5, "drop") == 16
    trained = _trained(stream, 2, 5, 16, "drop")
    assert sorted(k for g, p, k in trained if g == 1 and p == 1) == list(range(40))
    assert {p for g, p, _ in trained if g == 1} == {0, 1}
    assert {p for g, p, _ in trained if g == 0} == {0, 1, 2, 3}  # the shorter group trains on, into passes 3-4


def test_a_pass_too_short_for_a_step_is_refused_naming_it():
    with pytest.raises(EmptyPass, match="pass 1 of stream group 0 has 7 items"):
        steps_for_passes([[20, 7]], 10, "drop")
    assert steps_for_passes([[20, 7]], 10, "carry") == 3


def test_a_job_counts_its_stream_for_epochs_and_its_length_for_a_map_style_dataset():
    stream = sp.PairStream(size=456)  # 9 steps of 48 a pass, 24 items left out
    job = pieces.make_job(dataset=stream, virtual_workers=6)
    assert job.steps_for_epochs(2) == 18
    assert stream.epoch == 0  # the user's dataset is not iterated or set
    assert pieces.make_job().steps_for_epochs(3) == 3 * pieces.make_job().steps_per_epoch()


def test_the_note_says_what_was_counted_and_what_no_step_meets():
    from flexpar.data.pass_count import count_epochs, epochs_note

    counted = count_epochs(pieces.make_job(dataset=sp.PairStream(size=456), virtual_workers=6), 2)
    steps, note = counted.steps, counted.note
    assert steps == 18 and counted.lengths == ((456, 456),) and counted.chunk == 48 and not counted.reused
    assert note == (
        "epochs=2 over a stream: 2 passes of 1 stream group counted (456 items a pass): 18 steps; the last "
        "pass's final 24 items fill no step and are left out (no step meets that pass end)"
    )
    # Uneven groups: group 0 (4 steps a pass) meets its pass ends inside the job; group 1's last 3 items are unmet.
    assert epochs_note([[20, 20], [40, 43]], 5, "drop", 16, 2).endswith(
        "final 3 items fill no step and are left out (no step meets that pass end)"
    )
    assert (
        epochs_note([[20, 23]], 5, "carry", 9, 2)
        == "epochs=2 over a stream: 2 passes of 1 stream group counted (20-23 items a pass): 9 steps"
    )


class ReadCounting(sp.CountingStream):
    """A CountingStream that counts how often it (or a copy of it) is iterated."""

    reads = 0

    def __iter__(self):
        type(self).reads += 1
        return super().__iter__()


def test_a_resumed_driver_takes_the_recorded_count_when_job_and_dataset_are_the_same(tmp_path):
    """pass_record: the first count is kept in the run's folder; the same job and dataset reuse it (no read,
    fewer passes too); another chunk, pass_end or dataset counts again and says which fields differ."""
    from flexpar.data import pass_record
    from flexpar.data.pass_count import count_epochs

    job = pieces.make_job(dataset=ReadCounting([53, 38, 60]), virtual_workers=2, global_batch=10)
    first = count_epochs(job, 3)
    assert ReadCounting.reads == 3 and first.lengths == ((53, 38, 60),)
    pass_record.write(str(tmp_path), first.fingerprint, [list(group) for group in first.lengths])
    record = pass_record.read(str(tmp_path))
    again = count_epochs(job, 3, record)
    assert ReadCounting.reads == 3 and again.reused and again.steps == first.steps
    assert "3 passes of 1 stream group taken from the run's record, not read again (38-60 items" in again.note
    fewer = count_epochs(job, 2, record)
    assert ReadCounting.reads == 3 and fewer.reused and fewer.lengths == ((53, 38),)
    more = count_epochs(job, 4, record)
    assert ReadCounting.reads == 7 and not more.reused and "counted again: the recorded count covers fewer" in more.note
    other = count_epochs(dataclasses.replace(job, pass_end="carry"), 3, record)
    assert not other.reused and "(pass_end differ)" in other.note
    assert "no count recorded" in count_epochs(job, 3, {}).note
    assert pass_record.read(str(tmp_path / "none")) is None
    assert "at 0x" not in first.fingerprint["description"]  # the object's address differs per run
