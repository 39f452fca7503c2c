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


def agree_on_source(committed_step: int, rank: int, world_size: int, device) -> tuple:
    """Who holds the latest committed state, and who must receive it.

    Every member puts its committed step in its own slot of one all-reduce (a
    joiner has none: -1). The source is the lowest rank holding the highest
    step; receivers are the ranks behind it. After a failure in the middle of
    a gradient sync some survivors may have committed the step and others not:
    this is where they are brought level again.
    """
    steps = torch.zeros(world_size, dtype=torch.int64, device=device)
    steps[rank] = committed_step + 1
    if world_size > 1:
        dist.all_reduce(steps)
    steps = (steps - 1).tolist()
    latest = max(steps)
    source = steps.index(latest)
    receivers = [r for r, step in enumerate(steps) if step < latest]
    return source, receivers, latest


def latest_commit(committed_wall: float, world_size: int, device) -> float:
    """The latest commit time (wall clock) among the members, known once every member is level.

    A boundary's stall runs from here to the end of this all-reduce: it
    starts when the last member finished its step (time another member
    spent waiting for it is rank skew, which an ordinary step absorbs in its
    all-reduce too) and ends when the slowest member, a receiver restoring
    the state, is ready. Members on different hosts compare wall clocks, so
    their offset (milliseconds under NTP) adds to it.
    """
    if world_size == 1:
        return committed_wall
    latest = torch.tensor([committed_wall], dtype=torch.float64, device=device)
    dist.all_reduce(latest, op=dist.ReduceOp.MAX)
    return float(latest.item())


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
