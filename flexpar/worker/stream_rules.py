"""What a streamed join decides, from what every member holds alike: whether a join streams, and how much.

flexpar/worker/streaming.py and shard_streaming.py carry the stream out;
these are its rules, functions of the job's settings, the boundary's stock,
the model and optimizer, and the balancer's state, so that every member
reaches the same answer without a word between them.
"""

from __future__ import annotations

from typing import Optional

import torch

from flexpar.core import balance, stream_plan

STREAM_SHARE = 0.1
"""A sender's step may take about this share of a step longer while it streams."""

LINK_BYTES_PER_S = {"gloo": 1.0e9, "nccl": 1.0e10}
"""What a sender's link is taken to carry (bytes/s): gloo over TCP, NCCL within a node."""


def common_refusal(settings, by_cost: bool, joiners, latest_step: int) -> Optional[str]:
    """Why no join of this job may stream at this boundary, sharded or not (None: it may)."""
    if settings.join_stream_mb == 0:
        return "join_stream_mb=0"
    if by_cost:
        return "sample_cost= plans every device's VWs ahead"
    if 0 in joiners:
        return "the joiner would be rank 0"
    if latest_step >= settings.total_steps:
        return "the job is at its last step"
    return None


def refusal(stock, settings, by_cost: bool, model, optimizer) -> Optional[str]:
    """None if this boundary's receivers may listen while the (unsharded) state streams; else why not."""
    if not stock.receivers or set(stock.receivers) != set(stock.joiners):
        return "not a join"
    common = common_refusal(settings, by_cost, stock.receivers, stock.latest_step)
    if common:
        return common
    refused = stream_plan.refusal([type(optimizer).__name__])
    if refused:
        return refused
    for name, parameter in streamed_parameters(model).items():
        if not all(tensor.is_contiguous() for tensor in travelling(optimizer, parameter)):
            return f"parameter {name!r} or its optimizer state is not contiguous in memory"
    return None


def streamed_parameters(model) -> dict:
    """The trainable parameters by state_dict name, in model order (what streams)."""
    return {name: parameter for name, parameter in model.named_parameters() if parameter.requires_grad}


def travelling(optimizer, parameter) -> list:
    """The parameter's values, then its optimizer state's tensors by key (0-dim ones, such as Adam's
    step, travel whole with every piece: a listener skips the updates of what it has not received)."""
    state = optimizer.state.get(parameter, {})
    return [parameter.data] + [state[key] for key in sorted(state) if torch.is_tensor(state[key])]


def sender_bytes(settings, balance_state) -> int:
    """`join_stream_mb` if set, else a share of the step time at the link's rate (the same on every member)."""
    if settings.join_stream_mb:
        return max(1, int(settings.join_stream_mb * (1 << 20)))
    return stream_plan.first_sender_bytes(assumed_link(settings), predicted_step_s(balance_state), STREAM_SHARE)


def assumed_link(settings) -> float:
    """The link rate a join assumes for the job's backend until one is measured (bytes per second)."""
    return float(LINK_BYTES_PER_S.get(settings.backend, LINK_BYTES_PER_S["gloo"]))


def predicted_step_s(state) -> float:
    """The balancer's predicted step time (identical on every member: shared state), 0 if unknown."""
    seconds = [state.seconds_per_vw.get(device, 0.0) for device in state.device_ids]
    if not state.assignment or not seconds or min(seconds) <= 0:
        return 0.0
    return balance.predicted_step_seconds(state.assignment, seconds)


def planned_note(listeners: int, size: int, rounds: int, senders: int, what: str = "", tail: str = "") -> str:
    """The join event's words for a stream that starts: its plan, said as a plan (the rounds may
    differ once it runs: the `stream` event, written at its end, says what happened)."""
    return (
        f"streaming to {listeners} listener{'s' if listeners != 1 else ''}: {size} bytes{what}, planned in "
        f"{rounds} step{'s' if rounds != 1 else ''} from {senders} sender{'s' if senders != 1 else ''}{tail}"
    )
