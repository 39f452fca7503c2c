"""VirtualWorkerStreams: a step's items do not depend on which readers hold which VWs, nor on moves,
failures and resumes; passes end as flexpar/core/stream_split.py says; positions are plain data."""

import collections
import pickle

import pytest
import stream_pieces as sp
import torch
from torch.utils.data._utils.collate import default_collate

from flexpar.data import VirtualWorkerStreams, describe

STEPS = 12


def _plain():
    return sp.CountingStream([50, 37])


def _sharded_one_per_vw():
    return sp.ShardedStream([5, 7, 6, 9, 4, 8, 6, 5])  # 8 shards, V=4: a group per VW, shards of unequal sizes


def _sharded_shared():
    return sp.ShardedStream([9, 7, 8, 10, 6, 9])  # 6 shards, V=4: 2 groups of 2 VWs


def _huggingface():
    return sp.huggingface_stream(rows=96, shards=4)


def _huggingface_not_multiple():
    return sp.huggingface_stream(rows=90, shards=6)


def _huggingface_shuffled():
    return sp.huggingface_stream(rows=96, shards=4, shuffle_buffer=16)


def _packing():
    return sp.PackingStream(documents=30, sequence=8)


KINDS = {
    # name: (dataset factory, V, per-VW batch)
    "plain": (_plain, 4, 3),
    "sharded-one-per-vw": (_sharded_one_per_vw, 4, 2),
    "sharded-shared": (_sharded_shared, 4, 2),
    "huggingface": (_huggingface, 4, 3),
    "huggingface-6-shards-4-vws": (_huggingface_not_multiple, 4, 3),
    "huggingface-shuffled": (_huggingface_shuffled, 4, 3),
    "packing": (_packing, 3, 2),
}


@pytest.fixture(scope="module")
def tar_paths(tmp_path_factory):
    return sp.write_tar_shards(tmp_path_factory.mktemp("shards"), [10, 12, 9, 11, 10, 8])


def _dataset(kind, tar_paths):
    if kind == "webdataset":
        return sp.webdataset_stream(tar_paths), 3, 2
    if kind == "webdataset-detshuffle":
        return sp.webdataset_stream(tar_paths, shardshuffle=4, detshuffle=True, seed=5), 2, 3
    make, virtual_workers, batch = KINDS[kind]
    return make(), virtual_workers, batch


ALL_KINDS = [*KINDS, "webdataset", "webdataset-detshuffle"]


@pytest.mark.parametrize("kind", ALL_KINDS)
def test_a_steps_items_are_the_same_on_any_schedule_of_devices(kind, tar_paths):
    """Random VW subsets on 1-4 readers, moves by state()/load(), joins, leaves, failures mid-step redone
    from the committed positions, resumes: every step's items, VW by VW, are those of one reader."""
    dataset, virtual_workers, batch = _dataset(kind, tar_paths)
    expected, reference = sp.reference_items(dataset, virtual_workers, batch, STEPS)
    assert reference.pass_ends(), "the steps reach a pass end"
    events = collections.Counter()
    for seed in (1, 2):
        items, played = sp.schedule_items(dataset, virtual_workers, batch, STEPS, seed)
        assert items == expected, seed
        events += played
    assert events["moved"] and events["failure"] and events["resume"] and events["passes"], events


@pytest.mark.parametrize("kind", ["plain", "sharded-shared", "huggingface-shuffled", "webdataset"])
def test_carried_passes_too(kind, tar_paths):
    dataset, virtual_workers, batch = _dataset(kind, tar_paths)
    expected, _ = sp.reference_items(dataset, virtual_workers, batch, STEPS, pass_end="carry")
    assert sp.schedule_items(dataset, virtual_workers, batch, STEPS, 3, pass_end="carry")[0] == expected


@pytest.mark.parametrize("kind", ["plain", "sharded-one-per-vw", "huggingface-shuffled", "webdataset"])
def test_lost_positions_come_back_from_the_pass_ends_alone(kind, tar_paths):
    """A failed device's groups restored from position_at(step, pass ends): no replicated position needed."""
    dataset, virtual_workers, batch = _dataset(kind, tar_paths)
    expected, _ = sp.reference_items(dataset, virtual_workers, batch, STEPS)
    items, events = sp.schedule_items(dataset, virtual_workers, batch, STEPS, 4, lost_positions=True)
    assert items == expected and events["failure"], events


def test_num_workers_streams_are_the_same_on_any_schedule(tmp_path):
    """Each group's stream behind a DataLoader of 2 processes (its order: the loader's), moved,
    failed over and resumed (by skipping: a worker process's dataset state is not this process's)."""
    dataset = sp.webdataset_stream(sp.write_tar_shards(tmp_path, [4, 5, 3, 4]))  # V=2: 2 groups of 2 shards
    expected, reference = sp.reference_items(dataset, 2, 2, 6, num_workers=2)
    plain_order, _ = sp.reference_items(dataset, 2, 2, 6)
    assert expected != plain_order  # the processes interleave their shards: another order, fixed for the job
    assert reference.pass_ends()
    cycle = ("rebalance", "failure", "resume")
    items, events = sp.schedule_items(dataset, 2, 2, 6, 0, num_workers=2, events=cycle)
    assert items == expected and events["moved"] and events["failure"] and events["resume"], events


def test_round_robin_step_s_trains_items_s_b_to_s_plus_1_b_of_the_datasets_order():
    dataset = sp.CountingStream([1000])
    order = [item["index"] for item in dataset]
    expected, _ = sp.reference_items(dataset, 4, 3, 5)
    for step, per_vw in enumerate(expected):
        for v, items in enumerate(per_vw):
            assert [dict(item)["index"] for item in items] == [order[v + 4 * (step * 3 + j)] for j in range(3)]


def test_a_pass_rollover_drops_the_unfinished_step_and_says_which_items():
    dataset = sp.CountingStream([14, 14])
    expected, reader = sp.reference_items(dataset, 2, 3, 5)  # B = 6: two steps per pass, 2 items left
    (first, second) = reader.pass_ends()[:2]
    assert (first.group, first.pass_, first.items, first.step, first.left_out) == (0, 0, 14, 2, (12, 14))
    assert (second.pass_, second.step, second.left_out) == (1, 4, (12, 14))
    passes = [{dict(item)["pass"] for items in step for item in items} for step in expected]
    assert passes == [{0}, {0}, {1}, {1}, {2}]  # every pass starts a step
    pass0 = [item["index"] for item in sp.CountingStream([14])]
    trained = [dict(item)["index"] for step in expected[:2] for v in range(2) for item in step[v]]
    assert sorted(trained) == sorted(pass0[:12]) and set(pass0[12:]).isdisjoint(trained)
    assert reader.source.dataset.epochs_set == []  # set_epoch is called on the readers' copies, not the user's


def test_item_ids_name_each_item_by_group_pass_and_index():
    """The ledger's names: every item of a pass is trained (item_ids) or left out (PassEnd), once."""
    reader = VirtualWorkerStreams(sp.ShardedStream([5, 7]), 4, 1)  # 2 groups (a shard each) of 2 lanes
    reader.hold(range(4), 0)
    named = [reader.item_ids(step, v) for step in range(6) for v in range(4)]
    for step in range(6):
        for v in range(4):
            items = [(dict(item)["shard"], dict(item)["pass"], dict(item)["index"]) for item in reader.items(step, v)]
            assert items == reader.item_ids(step, v)  # group g reads shard g alone: the index is the shard's
    flat = [name for names in named for name in names]
    assert len(flat) == len(set(flat))
    for ended in reader.pass_ends():
        in_pass = {i for g, p, i in flat if (g, p) == (ended.group, ended.pass_)}
        left = set(range(*ended.left_out)) if ended.left_out else set()
        assert in_pass | left == set(range(ended.items)) and not in_pass & left


def test_carry_fills_the_step_from_the_next_pass():
    expected, reader = sp.reference_items(sp.CountingStream([14, 14]), 2, 3, 4, pass_end="carry")
    ends = reader.pass_ends()
    assert [(e.pass_, e.step, e.left_out) for e in ends] == [(0, 2, ())]
    step2 = [dict(item) for items in expected[2] for item in items]
    assert sorted(item["pass"] for item in step2) == [0, 0, 1, 1, 1, 1]
    total = [dict(item)["pass"] for step in expected for items in step for item in items]
    assert total.count(0) == 14  # the whole first pass, nothing left out


def test_uneven_shards_end_each_groups_pass_on_its_own():
    """Group 0 (4 items) starts its next pass while group 1 (9 items) is still in its first."""
    expected, reader = sp.reference_items(sp.ShardedStream([4, 9]), 2, 2, 5)
    ends = [(e.group, e.pass_, e.items, e.step, e.left_out) for e in reader.pass_ends()]
    assert (0, 0, 4, 2, ()) in ends and (1, 0, 9, 4, (8, 9)) in ends
    group0_passes = [dict(item)["pass"] for step in expected for item in step[0]]
    group1_passes = [dict(item)["pass"] for step in expected for item in step[1]]
    assert group0_passes[4:6] == [1, 1] and group1_passes[4:6] == [0, 0]


def test_a_redone_step_reads_the_same_items_without_reading_again():
    reader = VirtualWorkerStreams(sp.CountingStream([40]), 2, 4)
    reader.hold([0, 1], 0)
    first = [sp.plain(item) for item in reader.items(0, 1)]
    assert [sp.plain(item) for item in reader.items(0, 1)] == first  # the step again, before its commit
    reader.items(1, 0)
    reader.commit(1)
    with pytest.raises(RuntimeError, match="committed"):
        reader.items(0, 0)


@pytest.mark.parametrize(
    "make, how", [(_huggingface, "state"), (_packing, "state"), (_plain, "skip"), (_huggingface_shuffled, "skip")]
)
def test_a_complete_state_restores_without_skipping(make, how):
    reader = VirtualWorkerStreams(make(), 1, 4)
    reader.hold([0], 0)
    for step in range(3):
        reader.items(step, 0)
    state = reader.state(3)
    pickle.loads(pickle.dumps(state))  # plain data
    moved = VirtualWorkerStreams(make(), 1, 4)
    moved.load(pickle.loads(pickle.dumps(state)))
    moved.hold([0], 3)
    restore = moved.restores[-1]
    assert restore.how == how and restore.skipped == (0 if how == "state" else 12)
    assert [sp.plain(i) for i in moved.items(3, 0)] == [sp.plain(i) for i in reader.items(3, 0)]


def test_a_dataset_whose_passes_hand_on_state_needs_its_state_beyond_the_first_pass():
    expected, reference = sp.reference_items(_packing(), 1, 4, 30)
    (ended, *_) = reference.pass_ends()
    reader = VirtualWorkerStreams(_packing(), 1, 4)
    reader.load(reader.position_at(0, ended.step - 1, []))  # still in pass 0: skipping is exact
    reader.hold([0], ended.step - 1)
    assert [sp.plain(i) for i in reader.items(ended.step - 1, 0)] == expected[ended.step - 1][0]
    late = VirtualWorkerStreams(_packing(), 1, 4)
    late.load(late.position_at(0, ended.step + 1, [ended]))
    with pytest.raises(ValueError, match="passes are not independent"):
        late.hold([0], ended.step + 1)


def test_huggingface_shuffled_state_is_not_complete_and_flexpar_skips_instead():
    """HF's state_dict() leaves the shuffle buffer out: restored from it, the stream goes on with other items."""
    dataset = _huggingface_shuffled()
    assert describe(dataset).stateful is False and describe(_huggingface()).stateful is True
    stream = iter(dataset)
    for _ in range(20):
        next(stream)
    state = dataset.state_dict()
    uninterrupted = [next(stream)["index"] for _ in range(10)]
    restored = _huggingface_shuffled()
    restored.load_state_dict(state)
    assert [row["index"] for row in restored][:10] != uninterrupted


def test_a_batch_is_collated_like_a_map_style_batch():
    reader = VirtualWorkerStreams(_huggingface(), 4, 3)
    reader.hold(range(4), 0)
    batch = reader.batch(0, 2)
    expected = default_collate(reader.items(0, 2))
    assert set(batch) == {"index", "x"} and torch.equal(batch["index"], expected["index"])
    assert [v for v, _ in reader.batches(0)] == [0, 1, 2, 3]
    packed = VirtualWorkerStreams(_packing(), 3, 2, virtual_worker_ids=[1])
    assert packed.batch(0, 1).shape == (2, 8)  # two token sequences


def test_state_of_another_split_is_refused():
    reader = VirtualWorkerStreams(_plain(), 4, 3)
    reader.hold(range(4), 0)
    state = reader.state(0)
    with pytest.raises(ValueError, match="another split"):
        VirtualWorkerStreams(_plain(), 4, 2).load(state)
    with pytest.raises(ValueError, match="another split"):
        VirtualWorkerStreams(_plain(), 4, 3, num_workers=1).load(state)  # another order
    with pytest.raises(RuntimeError, match="no position"):
        VirtualWorkerStreams(_plain(), 4, 3).hold([0], 5)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_a_position_of_an_older_boundary_reads_forward_to_the_same_items(kind, tar_paths):
    """A group opened from a position several steps before the one held reads those chunks forward
    (counted in items_read and the Restore's `replayed`) and yields the uninterrupted stream's items."""
    make, virtual_workers, batch = KINDS[kind]
    expected, _ = sp.reference_items(make(), virtual_workers, batch, STEPS)
    early = VirtualWorkerStreams(make(), virtual_workers, batch, virtual_worker_ids=range(virtual_workers))
    for step in range(3):
        for v in range(virtual_workers):
            early.items(step, v)
        early.commit(step + 1)
    old = early.state(3, range(virtual_workers))
    late = VirtualWorkerStreams(make(), virtual_workers, batch)
    late.load(old)
    late.hold(range(virtual_workers), 7)  # four steps past the loaded positions
    assert {restore.replayed for restore in late.restores} == {4 * late.chunk}
    assert late.items_read >= 4 * late.chunk * late.split.groups
    for step in range(7, STEPS):
        assert [[sp.plain(item) for item in late.items(step, v)] for v in range(virtual_workers)] == expected[step]
        late.commit(step + 1)
    early.close(), late.close()
