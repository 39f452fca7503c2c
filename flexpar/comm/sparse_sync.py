"""Sparse gradient synchronisation: indices and values on the wire, never dense.

DESIGN.md section 3: the gradients of ``nn.Embedding(sparse=True)`` (and
``nn.EmbeddingBag(sparse=True)``) are sent as indices plus values. A dense
all-reduce of an embedding table moves every row every step, although a step
touches only the rows its samples look up; this module moves only those rows.

The scheme, for one sparse gradient on every rank of a group:

1. Coalesce locally. Gradient accumulation over a device's virtual workers
   (VWs) concatenates sparse gradients, so the same row appears once per
   lookup; coalescing first sums those duplicates here, so each touched row
   crosses the wire once per rank.
2. ``all_gather`` one small int64 header per rank: the number of stored rows
   (nnz) and the layout (sparse dims, shape, value element size). Every rank
   then knows the largest nnz and can check that all ranks agree on the
   gradient's shape, and raise the same clear error on every rank instead of
   hanging in a mismatched collective.
3. ``all_gather`` indices and values, each padded to the largest nnz (the
   collective needs equal sizes on every rank). Padding is cut off again
   using the gathered nnz counts.
4. Sum the parts in rank order (see "Determinism" below) into a coalesced
   sparse COO tensor, the same on every rank.

A rank that has no gradient (``grad=None``, for example because its VWs never
reached the embedding) or an empty one still takes part in every collective:
collectives must be entered by all ranks, in the same order, or they hang.
Callers must therefore call :func:`all_reduce_sparse` for every parameter of
:func:`sparse_parameters`, on every rank, in the same order, whatever the
gradient is, and pass ``like=parameter`` so that a rank without a gradient
knows the shape, dtype and device of the empty one it contributes.

Determinism and float reduction order
-------------------------------------
Every rank receives the same gathered parts and runs the same sequence of
operations on them, so the result is bit-identical on every rank. The sum is
not left to ``coalesce()`` of the concatenation: its kernel's summation order
for duplicate indices is an implementation detail (a parallel sort, or CUDA
atomics, could order additions differently from one call to another). Instead,
each rank's part is already coalesced (each row at most once), so the output is
built by adding rank 0's rows, then rank 1's, and so on: each output row is
``((g_0 + g_1) + g_2) + ...`` over the ranks that touched it, a fixed order.

The consequence: the summed gradient is exactly the same on every rank of a
step, but it depends on how the global batch was grouped into per-device
partial sums. A different device set, or a different VW assignment, groups the
same per-VW gradients differently, so results agree across device sets only up
to float reduction order (as with a dense all-reduce). DESIGN.md section 2
promises exactly that.

Tensors stay on the gradient's device: on NCCL every buffer (the header too)
is a CUDA tensor, on gloo a CPU one.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn

MAX_GRADIENT_DIMS = 8
"""Most dimensions a gradient may have; the header has one slot per dimension.

The header must have the same length on every rank (all_gather needs equal
sizes), so the shape is stored in a fixed number of slots. Embedding tables
have two dimensions; eight leaves room for any parameter in practice.
"""

# Header slots: nnz, sparse dims, number of dims, value element size, then
# MAX_GRADIENT_DIMS slots for the sizes (unused slots hold -1).
_HEADER_FIXED_SLOTS = 4
HEADER_LENGTH = _HEADER_FIXED_SLOTS + MAX_GRADIENT_DIMS
"""Number of int64 values in the per-rank header that is all-gathered first."""

_HEADER_BYTES = HEADER_LENGTH * 8


# --------------------------------------------------------------------------
# which parameters have sparse gradients
# --------------------------------------------------------------------------


def _is_sparse_embedding(module: nn.Module) -> bool:
    """True for an Embedding or EmbeddingBag that produces sparse gradients."""
    return isinstance(module, (nn.Embedding, nn.EmbeddingBag)) and bool(module.sparse)


def sparse_parameters(model: nn.Module) -> List[nn.Parameter]:
    """The parameters of ``model`` whose gradients are sparse COO tensors.

    These are the ``weight`` parameters of ``nn.Embedding`` and
    ``nn.EmbeddingBag`` modules built with ``sparse=True`` that require a
    gradient. Each parameter appears once (a table shared by two modules is
    listed once), in ``model.named_parameters()`` order, so every rank, holding
    the same model, gets the same list in the same order: the order in which
    the ranks must call :func:`all_reduce_sparse`.

    Frozen tables (``requires_grad=False``) are left out: no rank ever has a
    gradient for them, so there is nothing to synchronise.

    A sparse table whose weight is also used densely elsewhere (weight tying
    with an output ``nn.Linear``) gets a dense gradient from autograd; the
    caller should route each gradient by ``grad.layout`` at sync time, and
    :func:`all_reduce_sparse` refuses dense gradients.
    """
    sparse_weight_ids = {id(module.weight) for module in model.modules() if _is_sparse_embedding(module)}
    # named_parameters() deduplicates shared parameters and fixes the order.
    return [
        parameter
        for _, parameter in model.named_parameters()
        if id(parameter) in sparse_weight_ids and parameter.requires_grad
    ]


# --------------------------------------------------------------------------
# header: what each rank tells the others before sending rows
# --------------------------------------------------------------------------


def _empty_sparse(shape: Sequence[int], sparse_dims: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A coalesced sparse COO tensor of ``shape`` with no stored entries."""
    indices = torch.zeros((sparse_dims, 0), dtype=torch.int64, device=device)
    values = torch.zeros((0, *shape[sparse_dims:]), dtype=dtype, device=device)
    # Tensors built here are coalesced by construction (sorted, unique,
    # in-bounds indices), so the invariant check would only cost time.
    return torch.sparse_coo_tensor(indices, values, tuple(shape), is_coalesced=True, check_invariants=False)


def _local_gradient(grad: Optional[torch.Tensor], like: Optional[torch.Tensor]) -> torch.Tensor:
    """This rank's contribution as a coalesced sparse COO tensor.

    ``None`` becomes an empty gradient shaped like ``like``, with the row-sparse
    layout of embedding gradients (one sparse dimension). Its layout does not
    have to match the other ranks' (see ``_agreed_sparse_dims``).
    """
    if grad is None:
        if like is None:
            raise ValueError(
                "all_reduce_sparse(grad=None) needs like=<the parameter> so that this rank can "
                "contribute an empty gradient of the right shape, dtype and device"
            )
        return _empty_sparse(tuple(like.shape), 1, like.dtype, like.device)
    if grad.layout != torch.sparse_coo:
        raise TypeError(
            f"all_reduce_sparse needs a sparse COO gradient, got layout {grad.layout} of shape "
            f"{tuple(grad.shape)}; dense gradients belong to the dense all-reduce"
        )
    if like is not None and tuple(like.shape) != tuple(grad.shape):
        raise ValueError(f"gradient shape {tuple(grad.shape)} differs from like.shape {tuple(like.shape)}")
    if grad.dim() > MAX_GRADIENT_DIMS:
        raise ValueError(f"gradient has {grad.dim()} dimensions; at most {MAX_GRADIENT_DIMS} are supported")
    return grad.coalesce()


def _header(local: torch.Tensor) -> torch.Tensor:
    """The int64 header of this rank: nnz, sparse dims, ndim, element size, sizes."""
    sizes = list(local.shape) + [-1] * (MAX_GRADIENT_DIMS - local.dim())
    slots = [local._nnz(), local.sparse_dim(), local.dim(), local.element_size()] + sizes
    return torch.tensor(slots, dtype=torch.int64, device=local.device)


def _check_agreement(headers: List[List[int]]) -> None:
    """Raise the same ValueError on every rank unless shapes and dtypes agree.

    Every rank runs this on the same gathered headers, so either all ranks
    raise or none does; none is left waiting in the next collective.
    """
    reference = headers[0]
    for rank, header in enumerate(headers):
        if header[2:] != reference[2:]:
            raise ValueError(
                "ranks disagree on the sparse gradient: rank 0 has ndim/element size/shape "
                f"{reference[2:]}, rank {rank} has {header[2:]}"
            )
    # Only ranks that send rows must agree on how many dimensions are sparse;
    # an empty gradient (often a stand-in for None) can be of any layout.
    senders = [(rank, header[1]) for rank, header in enumerate(headers) if header[0] > 0]
    for rank, sparse_dims in senders:
        if sparse_dims != senders[0][1]:
            raise ValueError(
                f"ranks disagree on sparse dimensions: rank {senders[0][0]} has {senders[0][1]}, "
                f"rank {rank} has {sparse_dims}"
            )


def _agreed_sparse_dims(headers: List[List[int]]) -> int:
    """Sparse dims of the result: those of the ranks that send rows, else rank 0's."""
    for header in headers:
        if header[0] > 0:
            return header[1]
    return headers[0][1]


# --------------------------------------------------------------------------
# the exchange
# --------------------------------------------------------------------------


def _all_gather(tensor: torch.Tensor, world_size: int, group) -> List[torch.Tensor]:
    """All ranks' ``tensor`` (equal shapes) in group-rank order."""
    gathered = [torch.empty_like(tensor) for _ in range(world_size)]
    dist.all_gather(gathered, tensor.contiguous(), group=group)
    return gathered


def _padded(local: torch.Tensor, sparse_dims: int, padded_nnz: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Indices ``(sparse_dims, padded_nnz)`` and values ``(padded_nnz, *dense)``.

    The first ``nnz`` entries are this rank's rows; the rest is zero padding.
    An empty local gradient may have a different layout from the agreed one,
    which is harmless because it contributes only padding.
    """
    dense_shape = tuple(local.shape[sparse_dims:])
    indices = torch.zeros((sparse_dims, padded_nnz), dtype=torch.int64, device=local.device)
    values = torch.zeros((padded_nnz, *dense_shape), dtype=local.dtype, device=local.device)
    nnz = local._nnz()
    if nnz > 0:
        indices[:, :nnz] = local._indices()
        values[:nnz] = local._values()
    return indices, values


def _linear_indices(indices: torch.Tensor, sparse_shape: Sequence[int]) -> torch.Tensor:
    """Row-major position of each column of ``indices`` within ``sparse_shape``.

    Sorting by this number is the order ``coalesce()`` produces.
    """
    linear = torch.zeros(indices.shape[1], dtype=torch.int64, device=indices.device)
    for dimension, size in enumerate(sparse_shape):
        linear = linear * size + indices[dimension]
    return linear


def _unravel(linear: torch.Tensor, sparse_shape: Sequence[int]) -> torch.Tensor:
    """Inverse of ``_linear_indices``: ``(len(sparse_shape), n)`` indices."""
    rows = []
    remainder = linear
    for size in reversed(sparse_shape):
        rows.append(remainder % size)
        remainder = torch.div(remainder, size, rounding_mode="floor")
    return torch.stack(list(reversed(rows))) if rows else linear.new_zeros((0, linear.numel()))


def _sum_in_rank_order(
    parts: List[Tuple[torch.Tensor, torch.Tensor]], shape: Sequence[int], sparse_dims: int
) -> torch.Tensor:
    """Coalesced sum of per-rank coalesced parts, added in rank order.

    Each part holds every index at most once, so writing one part's values into
    the output touches each output row at most once: no two additions race, and
    each row is summed as ``((part_0 + part_1) + part_2) + ...``.
    """
    sparse_shape = tuple(shape[:sparse_dims])
    linear_parts = [_linear_indices(indices, sparse_shape) for indices, _ in parts]
    unique_linear, positions = torch.unique(torch.cat(linear_parts), sorted=True, return_inverse=True)
    reference_values = parts[0][1]
    summed = torch.zeros(
        (unique_linear.numel(), *shape[sparse_dims:]), dtype=reference_values.dtype, device=reference_values.device
    )
    offset = 0
    for linear, (_, values) in zip(linear_parts, parts):
        part_positions = positions[offset : offset + linear.numel()]
        offset += linear.numel()
        # Unique positions within one part: a plain gather-add-scatter is exact.
        summed[part_positions] = summed[part_positions] + values
    indices = _unravel(unique_linear, sparse_shape)
    return torch.sparse_coo_tensor(indices, summed, tuple(shape), is_coalesced=True, check_invariants=False)


def all_reduce_sparse(grad: Optional[torch.Tensor], group=None, *, like: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The coalesced sum of ``grad`` over all ranks of ``group``, as sparse COO.

    ``grad`` is this device's sparse COO gradient (already accumulated over its
    VWs and scaled by 1/V), or ``None`` when this device has none; then
    ``like`` (normally the parameter) gives its shape, dtype and device. Every
    rank of ``group`` (default: the default process group) must call this, in
    the same order for the same parameters, or the collectives hang.

    Only indices and values travel: one int64 header per rank, then the
    locally coalesced indices and values padded to the largest nnz. No dense
    tensor of the gradient's shape is built. The result is bit-identical on
    every rank (module docstring, "Determinism"), on the gradient's device.

    Raises ``TypeError`` for a dense gradient, and ``ValueError`` (on every
    rank alike) when ranks disagree on the gradient's shape or element size.
    """
    local = _local_gradient(grad, like)
    world_size = dist.get_world_size(group)

    headers = [header.tolist() for header in _all_gather(_header(local), world_size, group)]
    _check_agreement(headers)
    shape = tuple(headers[0][_HEADER_FIXED_SLOTS : _HEADER_FIXED_SLOTS + headers[0][2]])
    sparse_dims = _agreed_sparse_dims(headers)
    nnz_per_rank = [header[0] for header in headers]
    padded_nnz = max(nnz_per_rank)
    if padded_nnz == 0:
        # Every rank sees the same headers, so all of them skip the row
        # exchange together.
        return _empty_sparse(shape, sparse_dims, local.dtype, local.device)

    indices, values = _padded(local, sparse_dims, padded_nnz)
    gathered_indices = _all_gather(indices, world_size, group) if indices.numel() else [indices] * world_size
    # Values with no elements (a dense part of size 0) need no exchange.
    gathered_values = _all_gather(values, world_size, group) if values.numel() else [values] * world_size
    parts = [
        (rank_indices[:, :nnz], rank_values[:nnz])
        for rank_indices, rank_values, nnz in zip(gathered_indices, gathered_values, nnz_per_rank)
    ]
    return _sum_in_rank_order(parts, shape, sparse_dims)


# --------------------------------------------------------------------------
# wire accounting (for the benchmark's bytes ratio)
# --------------------------------------------------------------------------


def _world_size_of(nnz_per_rank: Sequence[int]) -> int:
    if len(nnz_per_rank) == 0:
        raise ValueError("nnz_per_rank is empty; give one nnz per rank")
    for rank, nnz in enumerate(nnz_per_rank):
        if isinstance(nnz, bool) or not isinstance(nnz, int) or nnz < 0:
            raise ValueError(f"nnz_per_rank[{rank}]={nnz!r} is not a non-negative int")
    return len(nnz_per_rank)


def sparse_wire_bytes(
    nnz_per_rank: Sequence[int],
    embedding_dim: int,
    index_dtype_bytes: int = 8,
    value_dtype_bytes: int = 4,
) -> int:
    """Bytes one rank sends per step for one embedding gradient in this scheme.

    What is counted: the payload an all-gather must move, in its ring form,
    where each rank forwards ``world_size - 1`` blocks of the per-rank size:

    - the header: ``HEADER_LENGTH`` int64 values per rank;
    - indices and values, padded to ``max(nnz_per_rank)`` rows, each row one
      index (embedding gradients have one sparse dimension) and
      ``embedding_dim`` values; skipped when every nnz is zero, as the code
      skips it.

    Not counted: transport framing, TCP/IP headers, and gloo's control
    messages. ``nnz_per_rank`` are the row counts after local coalescing (the
    distinct rows each rank touched). With one rank nothing is sent: 0.
    Compare with :func:`dense_all_reduce_wire_bytes`, which counts the same way.
    """
    world_size = _world_size_of(nnz_per_rank)
    for name, value in (
        ("embedding_dim", embedding_dim),
        ("index_dtype_bytes", index_dtype_bytes),
        ("value_dtype_bytes", value_dtype_bytes),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} is not a positive int")
    padded_nnz = max(nnz_per_rank)
    block_bytes = _HEADER_BYTES
    if padded_nnz > 0:
        block_bytes += padded_nnz * (index_dtype_bytes + embedding_dim * value_dtype_bytes)
    return (world_size - 1) * block_bytes


def dense_all_reduce_wire_bytes(element_count: int, world_size: int, value_dtype_bytes: int = 4) -> int:
    """Bytes one rank sends for a ring all-reduce of ``element_count`` values.

    A ring all-reduce (reduce-scatter then all-gather) sends
    ``2 * (world_size - 1) / world_size`` of the tensor per rank; rounded up to
    whole bytes. The baseline for :func:`sparse_wire_bytes`: the same counting
    rules (payload only), for the same table sent densely.
    """
    for name, value, minimum in (
        ("element_count", element_count, 0),
        ("world_size", world_size, 1),
        ("value_dtype_bytes", value_dtype_bytes, 1),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ValueError(f"{name}={value!r} is not an int >= {minimum}")
    numerator = 2 * (world_size - 1) * element_count * value_dtype_bytes
    return -(-numerator // world_size)
