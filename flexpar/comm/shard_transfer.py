"""What moves between the members of a sharded job: reports, pieces of state, parameter values.

Three collectives, used by flexpar/worker/shard_levelling.py at boundaries
and after every step:

- `gather_reports`: what each member holds (a few integers and its
  intervals), on every member, in two all-gathers of int64 tensors. No
  pickle crosses between peers.
- `exchange`: many-to-many, all pairs at once: each member sends a message
  (a dict of tensors and plain values, as `send_state` sends a state) to
  some peers and receives one from others, plus raw tensors whose place both
  sides know from the plan (parameter values, received straight into the
  flat parameter buffer). Messages are posted with `batch_isend_irecv` in the
  same order on both sides of every pair, which is what gloo and NCCL match
  on; several sources send to one member at the same time.
- `broadcast_chunks`: after a step, each chunk's primary broadcasts its
  updated parameter values in place, one broadcast per chunk.

Every wait goes through `wait_for_collective` (broadcasts) or
`wait_for_transfers` (sends and receives, whose gloo works never report
themselves completed before `wait()`), so a peer the coordinator reports
dead fails the transfer at once (`PeerFailure`).
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

from flexpar.comm.collectives import collective, wait_for_collective, wait_for_transfers
from flexpar.comm.state_transfer import as_bytes, assemble_state, decode_header, dtype_named, encode_state


def gather_reports(
    numbers: Sequence[int], intervals: Sequence[tuple], world_size: int, device, peer_lost=lambda: None
) -> list:
    """Every member's (numbers, intervals); `numbers` has the same length on every member."""
    header = torch.tensor([len(intervals), *numbers], dtype=torch.int64, device=device)
    if world_size == 1:
        return [(list(numbers), [tuple(interval) for interval in intervals])]
    headers = [torch.empty_like(header) for _ in range(world_size)]
    wait_for_collective(collective(lambda: dist.all_gather(headers, header, async_op=True)), peer_lost)
    longest = max(int(row[0]) for row in headers)
    padded = torch.zeros(max(1, longest) * 3, dtype=torch.int64, device=device)
    if intervals:
        padded[: 3 * len(intervals)] = torch.tensor(intervals, dtype=torch.int64).reshape(-1)
    rows = [torch.empty_like(padded) for _ in range(world_size)]
    wait_for_collective(collective(lambda: dist.all_gather(rows, padded, async_op=True)), peer_lost)
    result = []
    for row, flat in zip(headers, rows):
        count = int(row[0])
        values = flat[: 3 * count].reshape(-1, 3).tolist()
        result.append(([int(value) for value in row[1:].tolist()], [tuple(value) for value in values]))
    return result


def _post(operations: list, peer_lost) -> None:
    if operations:
        wait_for_transfers(collective(lambda: dist.batch_isend_irecv(operations)), peer_lost)


def exchange(
    outgoing: dict,
    incoming: Sequence[int],
    device,
    raw_out: Optional[dict] = None,
    raw_in: Optional[dict] = None,
    peer_lost: Callable[[], Optional[str]] = lambda: None,
) -> tuple:
    """Send `outgoing[peer]` (a dict) to each peer and receive one message from each peer in `incoming`.

    `raw_out[peer]` / `raw_in[peer]`: tensors sent after that pair's message,
    received straight into the given tensors (same sizes, in the same order
    on both sides). Returns ({peer: message}, bytes this member sent).
    """
    raw_out, raw_in = raw_out or {}, raw_in or {}
    prepared = {}
    sent = 0
    for peer, message in sorted(outgoing.items()):
        header, payloads = encode_state(message, device)
        payloads += [as_bytes(tensor, device) for tensor in raw_out.get(peer, ())]
        prepared[peer] = (header, payloads)
        sent += 8 + header.numel() + sum(payload.numel() for payload in payloads)
    peers_in = sorted(incoming)
    sizes = {peer: torch.zeros(1, dtype=torch.int64, device=device) for peer in peers_in}
    size_out = {
        peer: torch.tensor([header.numel()], dtype=torch.int64, device=device) for peer, (header, _) in prepared.items()
    }
    _post(
        [dist.P2POp(dist.isend, size_out[peer], peer) for peer in prepared]
        + [dist.P2POp(dist.irecv, sizes[peer], peer) for peer in peers_in],
        peer_lost,
    )
    headers = {peer: torch.empty(int(sizes[peer].item()), dtype=torch.uint8, device=device) for peer in peers_in}
    _post(
        [dist.P2POp(dist.isend, header, peer) for peer, (header, _) in prepared.items()]
        + [dist.P2POp(dist.irecv, headers[peer], peer) for peer in peers_in],
        peer_lost,
    )
    described = {peer: decode_header(headers[peer]) for peer in peers_in}
    received = {
        peer: [torch.empty(shape, dtype=dtype_named(dtype), device=device) for dtype, shape, _ in entry["tensors"]]
        for peer, entry in described.items()
    }
    operations = [
        dist.P2POp(dist.isend, payload, peer)
        for peer, (_, payloads) in prepared.items()
        for payload in payloads
        if payload.numel()
    ]
    for peer in peers_in:
        for tensor in list(received[peer]) + list(raw_in.get(peer, ())):
            if tensor.numel():
                operations.append(dist.P2POp(dist.irecv, _receivable(tensor), peer))
    _post(operations, peer_lost)
    messages = {peer: assemble_state(described[peer], received[peer]) for peer in peers_in}
    return messages, sent


def _receivable(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's memory as flat bytes (it must be contiguous: received in place)."""
    if not tensor.is_contiguous():
        raise ValueError("a tensor received in place must be contiguous")
    return tensor.reshape(-1).view(torch.uint8)


def broadcast_chunks(flat: Sequence[torch.Tensor], chunks: Sequence, peer_lost=lambda: None) -> None:
    """Each chunk's primary sends its parameter values to every member, in place (all at once)."""
    works = [
        collective(
            lambda chunk=chunk: dist.broadcast(
                flat[chunk.space][chunk.start : chunk.stop], chunk.holders[0], async_op=True
            )
        )
        for chunk in chunks
        if chunk.size
    ]
    for work in works:
        wait_for_collective(work, peer_lost)
