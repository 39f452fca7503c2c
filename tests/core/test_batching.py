"""Property tests of the pure batching core."""

from hypothesis import given, settings
from hypothesis import strategies as st

from flexpar.core import batching


@st.composite
def layouts(draw):
    virtual_workers = draw(st.integers(1, 8))
    micro = draw(st.integers(1, 6))
    global_batch = virtual_workers * micro
    dataset_size = draw(st.integers(global_batch, global_batch * 5 + 7))
    return draw(st.integers(0, 2**31)), dataset_size, global_batch, virtual_workers


@settings(max_examples=60, deadline=None)
@given(layouts(), st.integers(0, 20))
def test_slices_partition_the_global_batch(layout, step):
    seed, size, global_batch, virtual_workers = layout
    slices = [
        batching.virtual_worker_indices(seed, step, v, size, global_batch, virtual_workers)
        for v in range(virtual_workers)
    ]
    flat = [index for part in slices for index in part]
    assert sorted(flat) == sorted(batching.global_batch_indices(seed, step, size, global_batch).tolist())
    assert all(len(part) == global_batch // virtual_workers for part in slices)


@settings(max_examples=40, deadline=None)
@given(layouts())
def test_no_sample_twice_in_an_epoch(layout):
    seed, size, global_batch, _ = layout
    per_epoch = batching.steps_per_epoch(size, global_batch)
    seen = [
        i for step in range(per_epoch) for i in batching.global_batch_indices(seed, step, size, global_batch).tolist()
    ]
    assert len(seen) == len(set(seen)) == per_epoch * global_batch


@settings(max_examples=40, deadline=None)
@given(layouts(), st.integers(1, 8), st.integers(0, 30))
def test_samples_do_not_depend_on_device_count(layout, devices, step):
    """Whatever the assignment of VWs to devices, each VW's samples are the same."""
    seed, size, global_batch, virtual_workers = layout
    devices = min(devices, virtual_workers)
    assignment = [virtual_workers // devices + (1 if r < virtual_workers % devices else 0) for r in range(devices)]
    by_device = {}
    for rank in range(devices):
        for v in batching.virtual_workers_of(assignment, rank):
            by_device[v] = batching.virtual_worker_indices(seed, step, v, size, global_batch, virtual_workers)
    alone = {
        v: batching.virtual_worker_indices(seed, step, v, size, global_batch, virtual_workers)
        for v in range(virtual_workers)
    }
    assert by_device == alone


@given(st.integers(0, 2**40), st.integers(0, 10**6), st.integers(0, 4096))
def test_seeds_are_pure_and_distinct_between_streams(seed, step, virtual_worker):
    assert batching.virtual_worker_seed(seed, step, virtual_worker) == batching.virtual_worker_seed(
        seed, step, virtual_worker
    )
    assert batching.virtual_worker_seed(seed, step, virtual_worker) != batching.data_seed(seed, step, virtual_worker)


def test_order_is_a_function_of_seed_and_epoch():
    assert batching.epoch_permutation(1, 0, 100).tolist() == batching.epoch_permutation(1, 0, 100).tolist()
    assert batching.epoch_permutation(1, 0, 100).tolist() != batching.epoch_permutation(1, 1, 100).tolist()
