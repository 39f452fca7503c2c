"""Which way a join takes, decided alike on every member of the boundary (flexpar/core/join_choice.py).

Every member of a join boundary - the joiners included - decides on its own
whether the joiners listen while the state streams or receive it whole now,
and a divergent answer would hang the job (the senders would post slices the
joiners never receive). So the decision is taken from numbers every member
holds alike: one small all-reduce at the join boundary (only where the join
could stream at all), in which

- every rank writes where it runs into its own slots: a digest of its host's
  name, the host's cores (`flexpar.worker.host.cpu_count`), its intra-op threads,
  and whether it computes on the CPU;
- the stock's source (the member that holds the latest state, and the
  balancer's state with it) writes the measurements: the members' median step
  time, the slowest member's VW compute in it (the balancer's prediction),
  the streamed state's bytes and the rest, the link's bandwidth (measured on
  this device's last blocking transfer of the state, else the backend's
  conservative figure), the boundary's stall so far, and the stream's planned
  steps.

Every slot is written by one rank only, so the sums are exact and identical
everywhere; `join_choice.choose` is pure, so every member takes the same way.
"""

from __future__ import annotations

import hashlib
import math
import socket
import time
from typing import Optional

import torch
import torch.distributed as dist

from flexpar.comm.collectives import collective, wait_for_collective
from flexpar.core import join_choice
from flexpar.worker import stream_rules
from flexpar.worker.host import cpu_count

PLACE_SLOTS = 4
"""Each rank's slots: its host's digest, the host's cores, its threads, whether it computes on the CPU."""

SOURCE_SLOTS = 7
"""The source's: step_s, compute_s, state_bytes, small_state_bytes, link bytes/s, boundary_s, stream steps."""

MAX_FIRST_VW_S = join_choice.MAX_FIRST_VW_S
"""With `join_mode="auto"`, a stream whose joiner would take its first VWs later than this (and later than
the blocking transfer's) is not taken, however little it is predicted to cost the members (the simulator
assumes the same bound)."""

MIN_MEASURED_BYTES = 1 << 20
"""A blocking transfer smaller than this measures the link's latency, not its bandwidth: not kept."""

DEFAULT_STEP_S = 0.1
"""The members' step time taken while none is measured yet (a join after the first step)."""


def host_digest(name: Optional[str] = None) -> float:
    """The host's name as a float64 that holds it exactly (48 bits of its SHA-256)."""
    name = socket.gethostname() if name is None else name
    return float(int.from_bytes(hashlib.sha256(name.encode()).digest()[:6], "big"))


def place_numbers(device) -> list:
    """This rank's slots: where it runs."""
    threads = torch.get_num_threads() if device.type == "cpu" else 1
    return [host_digest(), float(cpu_count()), float(max(1, threads)), 1.0 if device.type == "cpu" else 0.0]


def state_bytes(model, optimizer) -> tuple:
    """(the streamed state's bytes: trainable parameters and their optimizer tensors; the rest of the
    model's state: buffers and untrained parameters)."""
    streamed = stream_rules.streamed_parameters(model)
    travelling = sum(
        tensor.numel() * tensor.element_size()
        for parameter in streamed.values()
        for tensor in stream_rules.travelling(optimizer, parameter)
        if tensor.dim() > 0
    )
    ids = {id(parameter) for parameter in streamed.values()}
    rest = sum(
        tensor.numel() * tensor.element_size()
        for tensor in list(model.parameters()) + list(model.buffers())
        if id(tensor) not in ids
    )
    return float(travelling), float(rest)


def source_numbers(
    settings, balance_state, step_s: float, sizes: tuple, link_bytes_per_s: float, boundary_s: float, senders: int
) -> list:
    """The source's slots (`SOURCE_SLOTS`), from what it measured."""
    streamed, rest = sizes
    compute_s = stream_rules.predicted_step_s(balance_state)
    if step_s <= 0:
        step_s = max(compute_s, DEFAULT_STEP_S)
    compute_s = min(max(compute_s, 0.0), step_s)
    per_step = stream_rules.sender_bytes(settings, balance_state)
    steps = join_choice.planned_stream_steps(streamed, senders, max(1, int(per_step)))
    link = link_bytes_per_s if link_bytes_per_s > 0 else stream_rules.assumed_link(settings)
    return [step_s, compute_s, streamed, rest, link, max(0.0, boundary_s), float(steps)]


def gather(world: int, rank: int, source: int, place: list, source_slots: Optional[list], device, peer_lost) -> list:
    """One all-reduce: every rank's place, the source's measurements (each slot written by one rank)."""
    slots = torch.zeros(PLACE_SLOTS * world + SOURCE_SLOTS, dtype=torch.float64)
    slots[PLACE_SLOTS * rank : PLACE_SLOTS * (rank + 1)] = torch.tensor(place, dtype=torch.float64)
    if rank == source:
        slots[PLACE_SLOTS * world :] = torch.tensor(source_slots, dtype=torch.float64)
    if world > 1:
        slots = slots.to(device)
        collective(lambda: wait_for_collective(dist.all_reduce(slots, async_op=True), peer_lost or (lambda: None)))
    return slots.cpu().tolist()


def inputs_of(slots: list, group: tuple, receivers: tuple) -> join_choice.JoinInputs:
    """The choice's inputs from `gather`'s sums (the same on every member)."""
    world = len(group)
    places = [slots[PLACE_SLOTS * rank : PLACE_SLOTS * (rank + 1)] for rank in range(world)]
    step_s, compute_s, streamed, rest, link, boundary_s, steps = slots[PLACE_SLOTS * world :]
    senders = [rank for rank in range(world) if rank not in receivers]
    return join_choice.JoinInputs(
        step_s=step_s,
        compute_s=min(compute_s, step_s),
        state_bytes=streamed,
        link_bytes_per_s=link,
        boundary_s=boundary_s,
        stream_steps=max(1, int(round(steps))),
        senders=max(1, len(senders)),
        small_state_bytes=rest,
        shared=shared_cores(places, group, receivers),
    )


def shared_cores(places: list, group: tuple, receivers: tuple) -> Optional[join_choice.SharedCores]:
    """Where a CPU joiner runs on a member's host: that host's cores and busy processes, counted in the
    joiner's threads (a member of 4 threads is 2 busy processes to a joiner of 2). The most crowded
    joiner's host counts."""
    worst = None
    for joiner in receivers:
        host, cores, threads, cpu = places[joiner]
        if not cpu:
            continue  # its work runs on its own accelerator
        same = [rank for rank in range(len(group)) if rank != joiner and places[rank][0] == host]
        members = [rank for rank in same if rank not in receivers]
        if not members:
            continue
        busy = math.ceil(sum(places[rank][2] for rank in same) / threads - 1e-9)
        shared = join_choice.SharedCores(group[members[0]], cores / threads, max(1, int(busy)))
        if worst is None or shared.members / shared.cores > worst.members / worst.cores:
            worst = shared
    return worst


def decide(
    stock, rank: int, group: tuple, settings, measure, device, peer_lost, receivers: Optional[tuple] = None
) -> join_choice.JoinChoice:
    """Every member of a join boundary: the way the join takes (the same everywhere).

    `measure()`: the source's slots (`source_numbers`), called on the source only. `receivers`: the
    joiners' ranks (default: the stock's receivers).
    """
    receivers = tuple(stock.receivers if receivers is None else receivers)
    source_slots = measure() if rank == stock.source else None
    slots = gather(len(group), rank, stock.source, place_numbers(device), source_slots, device, peer_lost)
    mode = settings.join_mode if settings.join_mode in join_choice.MODES else "auto"
    return join_choice.choose(inputs_of(slots, group, receivers), mode, MAX_FIRST_VW_S)


def choose_at_boundary(stock, rank: int, group: tuple, settings, owners, sizes, device, peer_lost, receivers: tuple):
    """A join that may stream (unsharded or sharded): which way it takes, the same on every member; the
    stream session keeps it for the join event. `owners`: the boundary's (`committed`, `records`,
    `streams`); `sizes()`: the source's (streamed bytes, the rest's bytes); `receivers`: the joiners' ranks."""
    senders = len(group) - len(receivers)
    committed, records, streams = owners

    def measure():
        return source_numbers(
            settings,
            committed.balance,
            records.median_step_time(),
            sizes(),
            streams.link_bytes_per_s,
            boundary_so_far(stock),
            senders,
        )

    choice = decide(stock, rank, group, settings, measure, device, peer_lost, receivers)
    streams.chose(choice)
    return choice


def sharded_state_bytes(model, members: int) -> tuple:
    """A sharded join's estimate of what a joiner receives: its share of an Adam-like optimizer state
    (two moments per trainable element) among `members` (the new generation's), and the buffers."""
    streamed = sum(
        parameter.numel() * parameter.element_size() for parameter in stream_rules.streamed_parameters(model).values()
    )
    rest = sum(buffer.numel() * buffer.element_size() for buffer in model.buffers())
    return float(2 * streamed / max(1, members)), float(rest)


def boundary_so_far(stock) -> float:
    """The boundary's stall so far (the source's clock): from the last member's commit."""
    return max(0.0, time.time() - stock.last_commit_wall)


def event_fields(choice: Optional[join_choice.JoinChoice]) -> dict:
    """The join event's (and the stream event's) record of the choice: the way and both predictions."""
    if choice is None:
        return {}
    return {
        "join_way": choice.way,
        "predicted_stream_lost_s": round(choice.stream.members_lost_s, 6),
        "predicted_blocking_lost_s": round(choice.blocking.members_lost_s, 6),
    }
