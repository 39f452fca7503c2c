"""What flexpar/data/sources.py makes of a dataset: its shards and state, and the one-line refusals."""

import os

import pytest
import stream_pieces as sp
import torch.distributed as dist
from torch.utils.data import IterableDataset

from flexpar.data import VirtualWorkerStreams, describe
from flexpar.errors import ArgumentError


class ReadsTheRank(IterableDataset):
    def __iter__(self):
        rank, size = dist.get_rank(), dist.get_world_size()
        yield from range(rank, 100, size)


class ReadsTheEnvironment(IterableDataset):
    def __iter__(self):
        yield from range(int(os.environ.get("RANK", 0)), 100, 2)


class ShardsWithoutShard(IterableDataset):
    n_shards = 4

    def __iter__(self):
        yield from range(10)


def _keep_odd(sample):
    return sample


def test_kinds_shards_and_state(tmp_path):
    paths = sp.write_tar_shards(tmp_path, [3, 3, 3])
    seen = {
        "plain": describe(sp.CountingStream([5])),
        "sharded": describe(sp.ShardedStream([2, 2, 2])),
        "packing": describe(sp.PackingStream()),
        "huggingface": describe(sp.huggingface_stream(rows=12, shards=3)),
        "webdataset": describe(sp.webdataset_stream(paths)),
    }
    got = {name: (source.kind, source.shards, source.stateful) for name, source in seen.items()}
    assert got == {
        "plain": ("plain", None, False),
        "sharded": ("sharded", 3, False),
        "packing": ("stateful", None, True),
        "huggingface": ("huggingface", 3, True),
        "webdataset": ("webdataset", 3, False),
    }
    assert "single_node_only" in seen["webdataset"].note


@pytest.mark.parametrize(
    "make, says",
    [
        (lambda paths: ReadsTheRank(), "get_rank"),
        (lambda paths: ReadsTheEnvironment(), "RANK"),
        (lambda paths: ShardsWithoutShard(), "no shard"),
        (
            lambda paths: sp.webdataset_stream(paths, nodesplitter=__import__("webdataset").split_by_node),
            "split_by_node",
        ),
        (lambda paths: sp.webdataset_stream(paths).shuffle(10), "no seed"),
        (lambda paths: __import__("webdataset").WebDataset(paths, shardshuffle=False).map(_rank_stage), "get_rank"),
        (lambda paths: _split_by_node(sp.huggingface_stream(rows=12, shards=4)), "split_dataset_by_node"),
        (lambda paths: sp.huggingface_stream(rows=12, shards=4).map(_rank_stage), "get_rank"),
        (lambda paths: iter(sp.CountingStream([5])), "iterator"),
    ],
    ids=[
        "get_rank",
        "RANK",
        "n_shards-only",
        "wds-split_by_node",
        "wds-unseeded-shuffle",
        "wds-stage",
        "hf-split",
        "hf-map",
        "iterator",
    ],
)
def test_pipelines_that_split_by_rank_or_differ_by_device_are_refused_in_one_line(make, says, tmp_path):
    paths = sp.write_tar_shards(tmp_path, [2, 2])
    with pytest.raises(ArgumentError, match=says) as refused:
        VirtualWorkerStreams(make(paths), 2, 1)
    assert "\n" not in str(refused.value)


def _rank_stage(sample):
    sample["rank"] = dist.get_rank()
    return sample


def _split_by_node(dataset):
    from datasets.distributed import split_dataset_by_node

    return split_dataset_by_node(dataset, rank=0, world_size=2)


def test_num_workers_must_be_a_whole_number():
    with pytest.raises(ArgumentError, match="num_workers=-1"):
        VirtualWorkerStreams(sp.CountingStream([10]), 2, 1, num_workers=-1)


def test_webdataset_default_node_splitter_is_neutralised(tmp_path, monkeypatch):
    """WebDataset's single_node_only would raise in a multi-process group: flexpar replaces it (and says so)."""
    paths = sp.write_tar_shards(tmp_path, [3, 3])
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    dataset = sp.webdataset_stream(paths)
    with pytest.raises(ValueError):
        next(iter(dataset))  # as it is: refused by WebDataset itself
    reader = VirtualWorkerStreams(dataset, 2, 3)
    reader.hold([0, 1], 0)
    keys = [item["__key__"] for v in (0, 1) for item in reader.items(0, v)]
    assert sorted(keys) == [f"s{shard:03d}_{index:05d}" for shard in range(2) for index in range(3)]


def test_webdataset_detshuffle_takes_the_pass_as_its_epoch(tmp_path):
    paths = sp.write_tar_shards(tmp_path, [4, 4, 4, 4])
    dataset = sp.webdataset_stream(paths, shardshuffle=4, detshuffle=True, seed=3)
    expected, reader = sp.reference_items(dataset, 1, 4, 8)  # 4 passes of 4 steps
    orders = [[dict(item)["__key__"][:4] for item in step[0]] for step in expected]
    shard_orders = [tuple(order[0] for order in orders[p * 4 : (p + 1) * 4]) for p in range(2)]
    assert shard_orders[0] != shard_orders[1]  # another shard order on the next pass
    again, _ = sp.reference_items(sp.webdataset_stream(paths, shardshuffle=4, detshuffle=True, seed=3), 1, 4, 8)
    assert again == expected
