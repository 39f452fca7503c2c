"""Tests of flexpar.comm.sparse_sync: sparse gradients summed as indices + values.

Single-process tests use a world-size-1 gloo group built directly on a
FileStore (``ProcessGroupGloo``), so they leave no default process group
behind in the pytest process. The multi-process test spawns three processes
with a real default gloo group over a TCPStore on 127.0.0.1.
"""

from __future__ import annotations

import os
import traceback
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as multiprocessing
from torch import nn

from flexpar.comm.sparse_sync import (
    HEADER_LENGTH,
    all_reduce_sparse,
    dense_all_reduce_wire_bytes,
    sparse_parameters,
    sparse_wire_bytes,
)

WORLD_SIZE = 3
TABLE_ROWS = 20
EMBEDDING_DIM = 5
JOIN_TIMEOUT_SECONDS = 90


# --------------------------------------------------------------------------
# helpers shared by the parent and the spawned ranks
# --------------------------------------------------------------------------


def _embedding_gradient(rank: int, lookups: int, dtype=torch.float32) -> torch.Tensor:
    """An uncoalesced sparse gradient like gradient accumulation produces.

    Rows are drawn with repetition, so the same row appears several times,
    as after several VWs looked up the same token.
    """
    generator = torch.Generator().manual_seed(1000 + rank)
    rows = torch.randint(0, TABLE_ROWS, (lookups,), generator=generator)
    values = torch.randn((lookups, EMBEDDING_DIM), generator=generator, dtype=dtype)
    return torch.sparse_coo_tensor(rows.unsqueeze(0), values, (TABLE_ROWS, EMBEDDING_DIM), check_invariants=True)


# Per rank: number of lookups; in the main scenario rank 1 has no gradient at all.
_LOOKUPS_BY_RANK = {0: 12, 1: 0, 2: 7}
# Every rank sends rows, many of them shared, so the order of the sum matters.
_LOOKUPS_BY_RANK_ALL_SEND = {0: 12, 1: 9, 2: 7}


def _rank_gradient(rank: int, lookups_by_rank=None):
    lookups = (lookups_by_rank or _LOOKUPS_BY_RANK)[rank]
    return _embedding_gradient(rank, lookups) if lookups else None


def _rank_order_dense_sum(gradients) -> torch.Tensor:
    """Dense sum of per-rank (locally coalesced) gradients, added in rank order."""
    total = torch.zeros((TABLE_ROWS, EMBEDDING_DIM))
    for gradient in gradients:
        if gradient is not None:
            total = total + gradient.coalesce().to_dense()
    return total


# float32: 1 + 4e-8 rounds back to 1 (half an ulp of 1 is 6e-8), but
# 4e-8 + 4e-8 = 8e-8 does not vanish when added to 1. So rank order
# ((1 + 4e-8) + 4e-8) gives exactly 1, the reverse order 1 + 1.19e-7.
_ROUNDING_VALUES = (1.0, 4e-8, 4e-8)
_ROUNDING_ROW = 3


def _rounding_gradient(rank: int) -> torch.Tensor:
    values = torch.full((1, EMBEDDING_DIM), _ROUNDING_VALUES[rank], dtype=torch.float32)
    indices = torch.tensor([[_ROUNDING_ROW]])
    return torch.sparse_coo_tensor(indices, values, (TABLE_ROWS, EMBEDDING_DIM), check_invariants=True)


def _plain(result: torch.Tensor) -> dict:
    """A sparse result as plain tensors (loadable with weights_only=True)."""
    return {
        "indices": result._indices().clone(),
        "values": result._values().clone(),
        "shape": list(result.shape),
        "is_coalesced": result.is_coalesced(),
    }


def _rank_main(rank: int, port: int, output_dir: str) -> None:
    """One spawned rank: run every scenario, save the results, exit 0 on success."""
    try:
        store = dist.TCPStore("127.0.0.1", port, None, is_master=False, timeout=timedelta(seconds=30))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD_SIZE, timeout=timedelta(seconds=30))
        like = torch.zeros((TABLE_ROWS, EMBEDDING_DIM))
        results = {}

        # Main scenario: different gradients, rank 1 has none.
        results["main"] = _plain(all_reduce_sparse(_rank_gradient(rank), like=like))

        results["all_send"] = _plain(all_reduce_sparse(_rank_gradient(rank, _LOOKUPS_BY_RANK_ALL_SEND)))

        # Values chosen so that the order of the sum shows in the result.
        results["rounding"] = _plain(all_reduce_sparse(_rounding_gradient(rank)))

        # Rank 1 sends an empty tensor of another layout (2 sparse dims, as
        # torch.sparse_coo_tensor(size=...) makes); it only contributes padding.
        other_layout = torch.sparse_coo_tensor(size=(TABLE_ROWS, EMBEDDING_DIM), check_invariants=True)
        gradient = other_layout if rank == 1 else _rank_gradient(rank)
        results["empty_other_layout"] = _plain(all_reduce_sparse(gradient, like=like))

        # Nobody has a gradient: an empty result, and no rank hangs.
        results["all_empty"] = _plain(all_reduce_sparse(None, like=like))

        # Disagreeing shapes: every rank raises the same ValueError.
        rows = TABLE_ROWS + 1 if rank == 2 else TABLE_ROWS
        try:
            all_reduce_sparse(torch.sparse_coo_tensor(size=(rows, EMBEDDING_DIM), check_invariants=True))
            results["mismatch_error"] = ""
        except ValueError as error:
            results["mismatch_error"] = str(error)

        # After the error the group still works (nobody is stuck half-way).
        results["after_error"] = _plain(all_reduce_sparse(_rank_gradient(rank), like=like))

        torch.save(results, os.path.join(output_dir, f"rank{rank}.pt"))
        dist.destroy_process_group()
    except BaseException:
        with open(os.path.join(output_dir, f"rank{rank}.error"), "w") as handle:
            handle.write(traceback.format_exc())
        raise


# --------------------------------------------------------------------------
# single process, world size 1
# --------------------------------------------------------------------------


@pytest.fixture
def single_rank_group(tmp_path):
    store = dist.FileStore(str(tmp_path / "store"), 1)
    return dist.ProcessGroupGloo(store, 0, 1)


def test_single_rank_sum_equals_dense_sum_and_is_coalesced(single_rank_group):
    gradient = _embedding_gradient(rank=0, lookups=30)
    assert not gradient.is_coalesced()

    result = all_reduce_sparse(gradient, single_rank_group)

    assert result.layout == torch.sparse_coo
    assert result.is_coalesced()
    assert result.shape == gradient.shape
    # Duplicates were summed: each row stored once, in sorted order.
    rows = result._indices()[0]
    assert torch.equal(rows, torch.unique(gradient._indices()[0]))
    torch.testing.assert_close(result.to_dense(), gradient.to_dense(), rtol=1e-6, atol=1e-7)


def test_single_rank_real_embedding_gradient(single_rank_group):
    torch.manual_seed(0)
    embedding = nn.Embedding(TABLE_ROWS, EMBEDDING_DIM, sparse=True)
    for tokens in (torch.tensor([1, 4, 4, 7]), torch.tensor([4, 19])):
        (embedding(tokens) ** 2).sum().backward()  # two accumulated "VWs"
    dense_reference = embedding.weight.grad.to_dense()

    result = all_reduce_sparse(embedding.weight.grad, single_rank_group, like=embedding.weight)

    assert result._nnz() == 4  # rows 1, 4, 7, 19
    torch.testing.assert_close(result.to_dense(), dense_reference, rtol=1e-6, atol=1e-7)


def test_single_rank_hybrid_gradient_with_two_sparse_dims(single_rank_group):
    indices = torch.tensor([[0, 2, 0, 1], [1, 0, 1, 3]])
    values = torch.arange(8, dtype=torch.float64).reshape(4, 2)
    gradient = torch.sparse_coo_tensor(indices, values, (3, 4, 2), check_invariants=True)

    result = all_reduce_sparse(gradient, single_rank_group)

    assert result.sparse_dim() == 2 and result.dtype == torch.float64
    assert result._nnz() == 3  # (0, 1) appears twice
    torch.testing.assert_close(result.to_dense(), gradient.to_dense())


def test_single_rank_none_gradient_gives_empty_result(single_rank_group):
    parameter = nn.Parameter(torch.zeros((TABLE_ROWS, EMBEDDING_DIM), dtype=torch.float64))

    result = all_reduce_sparse(None, single_rank_group, like=parameter)

    assert result.layout == torch.sparse_coo
    assert result._nnz() == 0
    assert result.shape == parameter.shape and result.dtype == torch.float64


def test_none_gradient_without_like_is_refused(single_rank_group):
    with pytest.raises(ValueError, match="like="):
        all_reduce_sparse(None, single_rank_group)


def test_dense_gradient_is_refused(single_rank_group):
    with pytest.raises(TypeError, match="sparse COO"):
        all_reduce_sparse(torch.ones((3, 2)), single_rank_group)


def test_like_with_other_shape_is_refused(single_rank_group):
    with pytest.raises(ValueError, match=r"\(20, 5\)"):
        all_reduce_sparse(_embedding_gradient(0, 4), single_rank_group, like=torch.zeros((21, 5)))


# --------------------------------------------------------------------------
# three real processes over gloo
# --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def three_rank_results(tmp_path_factory):
    """Spawn three ranks, run the scenarios of ``_rank_main``, load their results."""
    output_dir = str(tmp_path_factory.mktemp("sparse_ranks"))
    # The parent holds the store's server, so its port (chosen by the OS) is
    # free and known before any rank starts.
    store = dist.TCPStore("127.0.0.1", 0, None, is_master=True, timeout=timedelta(seconds=30), wait_for_workers=False)
    context = multiprocessing.get_context("spawn")
    processes = [context.Process(target=_rank_main, args=(rank, store.port, output_dir)) for rank in range(WORLD_SIZE)]
    try:
        for process in processes:
            process.start()
        for process in processes:
            process.join(JOIN_TIMEOUT_SECONDS)
        errors = []
        for rank, process in enumerate(processes):
            error_path = os.path.join(output_dir, f"rank{rank}.error")
            if os.path.exists(error_path):
                with open(error_path) as handle:
                    errors.append(f"rank {rank}:\n{handle.read()}")
            elif process.exitcode != 0:
                errors.append(f"rank {rank}: exit code {process.exitcode}")
        assert not errors, "\n".join(errors)
    finally:
        for process in processes:
            if process.is_alive():
                process.terminate()
                process.join(5)
            if process.is_alive():
                process.kill()
                process.join(5)
    return [torch.load(os.path.join(output_dir, f"rank{rank}.pt"), weights_only=True) for rank in range(WORLD_SIZE)]


def _dense(plain: dict) -> torch.Tensor:
    return torch.sparse_coo_tensor(plain["indices"], plain["values"], plain["shape"], check_invariants=True).to_dense()


def _assert_identical_on_every_rank(results, scenario):
    first = results[0][scenario]
    for rank, result in enumerate(results[1:], start=1):
        assert torch.equal(result[scenario]["indices"], first["indices"]), f"rank {rank} indices differ"
        assert torch.equal(result[scenario]["values"], first["values"]), f"rank {rank} values differ"


_LOOKUPS_BY_SCENARIO = {
    "main": _LOOKUPS_BY_RANK,
    "all_send": _LOOKUPS_BY_RANK_ALL_SEND,
    "empty_other_layout": _LOOKUPS_BY_RANK,
    "after_error": _LOOKUPS_BY_RANK,
}


def _expected_sum(scenario: str) -> torch.Tensor:
    lookups_by_rank = _LOOKUPS_BY_SCENARIO[scenario]
    return _rank_order_dense_sum([_rank_gradient(rank, lookups_by_rank) for rank in range(WORLD_SIZE)])


@pytest.mark.parametrize("scenario", sorted(_LOOKUPS_BY_SCENARIO))
def test_three_ranks_sum_equals_dense_sum(three_rank_results, scenario):
    expected = _expected_sum(scenario)
    for rank, results in enumerate(three_rank_results):
        result = results[scenario]
        assert result["is_coalesced"], f"rank {rank}"
        assert result["shape"] == [TABLE_ROWS, EMBEDDING_DIM]
        torch.testing.assert_close(_dense(result), expected, rtol=1e-6, atol=1e-7)
        # The rows stored are exactly the rows some rank touched, once each.
        touched = torch.nonzero(expected.abs().sum(dim=1)).flatten()
        assert torch.equal(result["indices"][0], touched), f"rank {rank}"


def test_three_ranks_results_are_bit_identical_across_ranks(three_rank_results):
    for scenario in _LOOKUPS_BY_SCENARIO:
        _assert_identical_on_every_rank(three_rank_results, scenario)


def test_three_ranks_sum_in_rank_order_bit_for_bit(three_rank_results):
    # The documented order: ((rank 0 + rank 1) + rank 2) per row, which is what
    # a dense rank-order sum of the locally coalesced gradients computes too.
    expected = _expected_sum("all_send")
    for results in three_rank_results:
        assert torch.equal(_dense(results["all_send"]), expected)


def test_three_ranks_sum_in_rank_order_where_order_changes_rounding(three_rank_results):
    in_rank_order = torch.tensor(1.0) + torch.tensor(4e-8) + torch.tensor(4e-8)
    reversed_order = torch.tensor(4e-8) + torch.tensor(4e-8) + torch.tensor(1.0)
    assert in_rank_order != reversed_order  # the premise of this test
    for results in three_rank_results:
        assert torch.equal(results["rounding"]["indices"], torch.tensor([[_ROUNDING_ROW]]))
        assert torch.equal(results["rounding"]["values"], torch.full((1, EMBEDDING_DIM), in_rank_order.item()))


def test_three_ranks_all_empty_gives_empty_result(three_rank_results):
    for results in three_rank_results:
        assert results["all_empty"]["values"].shape == (0, EMBEDDING_DIM)
        assert results["all_empty"]["shape"] == [TABLE_ROWS, EMBEDDING_DIM]


def test_three_ranks_disagreeing_shapes_raise_on_every_rank(three_rank_results):
    messages = [results["mismatch_error"] for results in three_rank_results]
    assert all(messages), messages
    assert len(set(messages)) == 1
    assert "rank 2" in messages[0] and str(TABLE_ROWS + 1) in messages[0]


# --------------------------------------------------------------------------
# sparse_parameters
# --------------------------------------------------------------------------


class _Mixed(nn.Module):
    def __init__(self):
        super().__init__()
        self.dense_embedding = nn.Embedding(10, 3)
        self.sparse_embedding = nn.Embedding(10, 3, sparse=True)
        self.linear = nn.Linear(3, 3)
        self.dense_bag = nn.EmbeddingBag(10, 3)
        self.sparse_bag = nn.EmbeddingBag(10, 3, sparse=True, mode="sum")
        self.shared = self.sparse_embedding  # same module reached twice
        self.frozen = nn.Embedding(10, 3, sparse=True)
        self.frozen.weight.requires_grad_(False)


def test_sparse_parameters_finds_sparse_tables_only_once_in_order():
    model = _Mixed()
    found = sparse_parameters(model)
    assert [id(parameter) for parameter in found] == [id(model.sparse_embedding.weight), id(model.sparse_bag.weight)]


def test_sparse_parameters_of_dense_model_is_empty():
    model = nn.Sequential(nn.Embedding(10, 3), nn.Linear(3, 1))
    assert sparse_parameters(model) == []


def test_sparse_parameters_match_the_gradients_autograd_makes_sparse():
    model = _Mixed()
    tokens = torch.tensor([[1, 2], [3, 3]])
    loss = (
        model.dense_embedding(tokens).sum()
        + model.linear(model.sparse_embedding(tokens)).sum()
        + model.dense_bag(tokens).sum()
        + model.sparse_bag(tokens).sum()
    )
    loss.backward()
    with_sparse_gradients = [
        parameter for parameter in model.parameters() if parameter.grad is not None and parameter.grad.is_sparse
    ]
    assert [id(p) for p in sparse_parameters(model)] == [id(p) for p in with_sparse_gradients]


# --------------------------------------------------------------------------
# wire accounting
# --------------------------------------------------------------------------


def test_sparse_wire_bytes_counts_header_and_padded_rows():
    # 3 ranks, padded to 10 rows; each row 8 index bytes + 16 * 4 value bytes;
    # each rank forwards 2 blocks in a ring all-gather.
    header_bytes = HEADER_LENGTH * 8
    assert sparse_wire_bytes([10, 0, 4], 16) == 2 * (header_bytes + 10 * (8 + 16 * 4))
    assert sparse_wire_bytes([10, 0, 4], 16, index_dtype_bytes=4, value_dtype_bytes=2) == 2 * (
        header_bytes + 10 * (4 + 16 * 2)
    )


def test_sparse_wire_bytes_edge_cases():
    assert sparse_wire_bytes([50], 16) == 0  # one rank sends nothing
    assert sparse_wire_bytes([0, 0], 16) == HEADER_LENGTH * 8  # only headers travel
    with pytest.raises(ValueError, match=r"nnz_per_rank\[1\]=-1"):
        sparse_wire_bytes([3, -1], 16)
    with pytest.raises(ValueError, match="embedding_dim=0"):
        sparse_wire_bytes([3], 0)
    with pytest.raises(ValueError, match="empty"):
        sparse_wire_bytes([], 4)


def test_sparse_beats_dense_when_few_rows_are_touched():
    rows, dim, world_size = 100_000, 64, 4
    dense = dense_all_reduce_wire_bytes(rows * dim, world_size)
    assert dense == 2 * 3 * rows * dim * 4 // 4
    assert sparse_wire_bytes([500] * world_size, dim) < dense / 50
    assert dense_all_reduce_wire_bytes(rows * dim, 1) == 0
