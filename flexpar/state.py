"""Training state: capture, send to peers in memory, restore, checkpoint.

The state is everything a device needs to take part from the next step on:
parameters, buffers, optimizer state, LR-scheduler state, the committed step
and the balancer's shared timings. The data position follows from the step.
It travels as one byte buffer written by torch.save and read back with
`weights_only=True`, so a peer or a checkpoint file can only hand over
tensors and plain containers, never code.
"""

from __future__ import annotations

import io
import os
import re
import warnings
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist


def capture(model, optimizer, scheduler, step: int, extra: dict) -> dict:
    """The training state after `step` committed steps."""
    return {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict() if scheduler is not None else None,
        "step": step,
        "extra": extra,
    }


def restore(model, optimizer, scheduler, state: dict) -> None:
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    if scheduler is not None and state["scheduler"] is not None:
        scheduler.load_state_dict(state["scheduler"])


def to_bytes(state: dict) -> bytes:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue()


def from_bytes(data: bytes, device: torch.device) -> dict:
    return torch.load(io.BytesIO(data), map_location=device, weights_only=True)


@dataclass(frozen=True)
class Stock:
    """What the members of a new generation hold, agreed in one collective.

    `source`: the lowest rank holding the highest committed step `latest_step`;
    `receivers`: the ranks behind it. `last_commit_wall`: the latest commit
    time (wall clock) among members that hold a committed step.
    """

    source: int
    receivers: tuple
    latest_step: int
    last_commit_wall: float


def take_stock(committed_step: int, committed_wall: float, rank: int, world_size: int, device) -> Stock:
    """Who holds the latest state, who must receive it, and when the last member committed.

    Every member puts its committed step (a joiner has none: -1) and its
    commit time in its own slots of one all-reduce. After a failure in the
    middle of a gradient sync some survivors may have committed the step and
    others not: this is where they are brought level again. A joiner's
    construction time is not a commit, so it does not count towards the last
    commit. A boundary's stall starts at `last_commit_wall`: time another
    member spent waiting for the last one is rank skew, which an ordinary step
    absorbs in its all-reduce too. Members on different hosts compare wall
    clocks, so their offset (milliseconds under NTP) adds to it.
    Steps travel as float64, exact below 2**53.
    """
    slots = torch.zeros(2 * world_size, dtype=torch.float64, device=device)
    slots[rank] = committed_step + 1
    slots[world_size + rank] = committed_wall if committed_step >= 0 else 0.0
    if world_size > 1:
        dist.all_reduce(slots)
    return stock_of(slots.tolist(), committed_wall)


def stock_of(slots: list, own_wall: float) -> Stock:
    """Read the summed slots of `take_stock`: steps + 1 by rank, then commit times by rank.

    With no member holding a commit (a fresh set), `own_wall` stands in.
    """
    world_size = len(slots) // 2
    steps = [round(value) - 1 for value in slots[:world_size]]
    latest = max(steps)
    return Stock(
        source=steps.index(latest),
        receivers=tuple(r for r, step in enumerate(steps) if step < latest),
        latest_step=latest,
        last_commit_wall=max(slots[world_size:]) or own_wall,
    )


def all_level(world_size: int, device) -> None:
    """Returns once every member has passed its part of the state transfer (receivers: restored)."""
    if world_size > 1:
        dist.all_reduce(torch.zeros(1, device=device))


def send(data: bytes, receivers: list, device, after_size=None) -> None:
    """Send the state bytes to each receiver (size first, then the bytes)."""
    # gloo only reads the buffer: no copy into a writable bytearray.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "the given buffer is not writable"
        payload = torch.frombuffer(data, dtype=torch.uint8).to(device)
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    for receiver in receivers:
        dist.send(size, receiver)
        if after_size is not None:
            after_size()
        dist.send(payload, receiver)


def receive(source: int, device) -> bytes:
    size = torch.zeros(1, dtype=torch.int64, device=device)
    dist.recv(size, source)
    payload = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    dist.recv(payload, source)
    return payload.cpu().numpy().tobytes()


# ---------------------------------------------------------------- checkpoints

_CHECKPOINT = re.compile(r"^step-(\d+)\.pt$")


def write_checkpoint(directory: str, state_bytes: bytes, step: int) -> str:
    """Write atomically (temporary file, then rename): a crash never leaves half a file."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"step-{step:08d}.pt")
    temporary = path + ".tmp"
    with open(temporary, "wb") as handle:
        handle.write(state_bytes)
    os.replace(temporary, path)
    return path


def latest_checkpoint(directory: str) -> Optional[str]:
    if not os.path.isdir(directory):
        return None
    found = sorted(
        (int(match.group(1)), name)
        for name in os.listdir(directory)
        if (match := _CHECKPOINT.match(name))
    )
    return os.path.join(directory, found[-1][1]) if found else None


def read_checkpoint(path: str, device) -> dict:
    with open(path, "rb") as handle:
        return from_bytes(handle.read(), device)
