"""One device's part of a sharded optimizer: the flat parameters, the slices it holds, and their state.

`ShardedOptimizer` wraps the optimizer the user's factory built on the whole
model, so a factory that sorts parameters into groups (weight decay by
shape, say) and the scheduler built on it work unchanged. The sharded
parameters (in the optimizer, trainable, with dense gradients) are moved into
one flat buffer per dtype (flexpar/core/shard_partition.py's `Space`), each
parameter a view of it, so that a chunk of the partition is one contiguous
range that its primary broadcasts in place after a step. Each param group then
steps the slices this device holds (`nn.Parameter` views of that buffer) and
its replicated parameters (sparse-gradient ones, which every device steps
itself, and frozen ones). Parameters and gradients stay whole on every device:
the VWs accumulate whole gradients and the gradient all-reduce is unchanged.

A slice is named by a segment `(k, start, stop)`: elements [start, stop) of
sharded parameter `k` (its position in `self.sharded`). With
`by="parameters"` every segment is a whole parameter and the slice is the
parameter itself, its state never cut. What the device holds changes at
boundaries only: `add` takes in received pieces next to what it holds,
`install` then keeps exactly its chunks of the new partition.

Nothing here talks to other processes: the pieces travel through
flexpar/comm/shard_transfer.py, the decisions are flexpar/core's
(shard_partition, shard_plan), the levelling that uses both is
flexpar/worker/shard_levelling.py.
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch
from torch import nn

from flexpar.core.shard_partition import Partition, merge, segments_of, spaces_of, subtract
from flexpar.core.shard_state import join_states, slice_state, state_nbytes
from flexpar.errors import UserCodeError


def sharding_by(job) -> str:
    """How a job's optimizer state is cut: "elements" (shard_optimizer=True) or "parameters"."""
    return "parameters" if job.shard_optimizer == "parameters" else "elements"


class ShardedOptimizer:
    """The user's optimizer, stepping only this device's slices of the sharded parameters.

    It owns this device's shard holdings: `slices` (the segments it holds and
    steps, with their optimizer state), `partition` (the partition of the
    generation it works with: its chunks of it are what `install` made it
    hold; None while it holds none of a partition) and `values_complete`
    (every sharded parameter's value here is at the committed step: False
    after a step until the chunks others stepped arrive by broadcast, and on
    a joiner until its first broadcast).
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        sparse: Iterable[nn.Parameter] = (),
        by: str = "elements",
    ):
        self.model = model
        self.optimizer = optimizer
        self.by = by
        named = list(model.named_parameters())
        self.parameters = [parameter for _, parameter in named]
        position = {id(parameter): index for index, parameter in enumerate(self.parameters)}
        stepped = [parameter for group in optimizer.param_groups for parameter in group["params"]]
        if any(id(parameter) not in position for parameter in stepped):
            raise UserCodeError(
                "shard_optimizer=True: the optimizer steps tensors that are not the model's parameters; "
                "build it on model.parameters() (or a subset of them)"
            )
        # torch.optim numbers parameters in param-group order: the numbering of its state_dict,
        # kept so that checkpoints are in the plain format.
        self.saved_order = [position[id(parameter)] for parameter in stepped]
        self.group_of = {
            position[id(parameter)]: number
            for number, group in enumerate(optimizer.param_groups)
            for parameter in group["params"]
        }
        sparse_ids = {id(parameter) for parameter in sparse}
        self.sharded = sorted(
            index
            for index in self.saved_order
            if self.parameters[index].requires_grad and id(self.parameters[index]) not in sparse_ids
        )
        self.names = [named[index][0] for index in self.sharded]
        sharded = set(self.sharded)
        self.replicated = [index for index in self.saved_order if index not in sharded]
        tensors = [self.parameters[index] for index in self.sharded]
        self.spaces = spaces_of(
            [tensor.numel() for tensor in tensors],
            [str(tensor.dtype).replace("torch.", "") for tensor in tensors],
            [tensor.element_size() for tensor in tensors],
        )
        self.space_of = {k: number for number, space in enumerate(self.spaces) for k in space.parameters}
        self.flat = [self._flatten(space) for space in self.spaces]
        self.slices: dict = {}  # segment (k, start, stop) -> the parameter the optimizer steps for it
        # The optimizer never stepped (a fresh job before its first update): every range's state
        # is the empty one, which every member holds. Travels with the replicated state.
        self.pristine = True
        self.partition: Optional[Partition] = None
        self.values_complete = True
        self._regroup()

    # ------------------------------------------------------------ layout

    def _flatten(self, space) -> torch.Tensor:
        """One buffer for the space's parameters; each parameter becomes a view of it (one at a time)."""
        first = self.parameters[self.sharded[space.parameters[0]]]
        buffer = torch.empty(space.size, dtype=first.dtype, device=first.device)
        for k, offset in zip(space.parameters, space.offsets):
            parameter = self.parameters[self.sharded[k]]
            view = buffer[offset : offset + parameter.numel()]
            view.copy_(parameter.detach().reshape(-1))
            parameter.data = view.view(parameter.shape)
        return buffer

    def _regroup(self) -> None:
        """Each param group steps its replicated parameters and the slices held of its sharded ones."""
        groups: list = [[] for _ in self.optimizer.param_groups]
        for index in self.replicated:
            groups[self.group_of[index]].append(self.parameters[index])
        for (k, _, _), piece in sorted(self.slices.items()):
            groups[self.group_of[self.sharded[k]]].append(piece)
        for group, params in zip(self.optimizer.param_groups, groups):
            group["params"] = params

    def everything(self) -> tuple:
        """Every element of every space, as (space, start, stop) intervals."""
        return merge((number, 0, space.size) for number, space in enumerate(self.spaces))

    def holdings(self) -> tuple:
        """The (space, start, stop) intervals whose optimizer state this device holds."""
        return merge(self._interval(segment) for segment in self.slices)

    def _interval(self, segment: tuple) -> tuple:
        k, start, stop = segment
        space = self.space_of[k]
        offset = self.spaces[space].offset_of(k)
        return (space, offset + start, offset + stop)

    def values(self, space: int, start: int, stop: int) -> torch.Tensor:
        """The parameter values of elements [start, stop) of `space`: a view of the flat buffer."""
        return self.flat[space][start:stop]

    def segments(self, intervals) -> list:
        return segments_of(self.spaces, intervals)

    # ------------------------------------------------------------ state of ranges

    def _slice_parameter(self, k: int, start: int, stop: int) -> nn.Parameter:
        parameter = self.parameters[self.sharded[k]]
        if self.by == "parameters":
            if (start, stop) != (0, parameter.numel()):
                raise ValueError(f"by='parameters' holds whole parameters, not elements {start}-{stop} of {k}")
            return parameter
        space = self.space_of[k]
        offset = self.spaces[space].offset_of(k)
        return nn.Parameter(self.flat[space][offset + start : offset + stop], requires_grad=True)

    def piece(self, k: int, start: int, stop: int, copy: bool = True) -> dict:
        """The optimizer state of elements [start, stop) of sharded parameter k (which this device holds).

        `copy=False` for sending: the tensors may be views of the held state.
        """
        parts, lengths, cursor = [], [], start
        for (held, low, high), slice_parameter in sorted(self.slices.items()):
            if held != k or high <= cursor or low >= stop:
                continue
            if low > cursor:
                break
            end = min(stop, high)
            state = self.optimizer.state.get(slice_parameter, {})
            if self.by == "parameters":
                parts.append({key: _copied(value) if copy else value for key, value in state.items()})
            else:
                parts.append(slice_state(state, cursor - low, end - low, high - low, copy=copy))
            lengths.append(end - cursor)
            cursor = end
        if cursor < stop:
            if self.pristine:  # never stepped: the empty state is every range's
                return {}
            raise KeyError(f"this device holds no optimizer state for elements {cursor}-{stop} of {self.names[k]}")
        return join_states(parts, lengths)

    def pieces_of(self, intervals, copy: bool = True) -> list:
        """[(segment, state)] for (space, start, stop) intervals this device holds."""
        return [((k, start, stop), self.piece(k, start, stop, copy)) for k, start, stop in self.segments(intervals)]

    def add(self, received: Iterable[tuple]) -> None:
        """Hold received pieces [(segment, state)] besides what is held (a boundary's first half).

        They never overlap what is held (the plan sends nothing a member holds);
        `install` then keeps exactly the new partition's chunks.
        """
        received = list(received)
        overlap = merge(self._interval(segment) for segment, _ in received)
        if merge(subtract(overlap, self.holdings())) != overlap:
            raise ValueError("a received optimizer-state piece overlaps one this device holds")
        for segment, state in received:
            piece = self._slice_parameter(*segment)
            self.slices[segment] = piece
            if state:
                self.optimizer.state[piece] = state
            else:
                self.optimizer.state.pop(piece, None)
        self._regroup()

    def drop(self) -> None:
        """Hold nothing (state of an older step, or a departing device's after its hand-off)."""
        for piece in self.slices.values():
            self.optimizer.state.pop(piece, None)
        self.slices = {}
        self.partition = None
        self._regroup()

    def work_with(self, partition: Optional[Partition]) -> None:
        """Work with `partition` while holding what it holds now (a sharded stream keeps the old one)."""
        self.partition = partition

    def values_received(self) -> None:
        """Every sharded parameter's value at the committed step is here (a broadcast, or a levelling)."""
        self.values_complete = True

    def values_outdated(self) -> None:
        """Some sharded parameter's value here is not the committed step's (a joiner before its first broadcast)."""
        self.values_complete = False

    def install(self, partition: Optional[Partition], rank: int) -> None:
        """Hold exactly `partition`'s chunks of `rank` (None: nothing), from the slices held now.

        A slice whose range does not change keeps its object and state (no
        copy); the others are cut from or joined out of the held ones.
        """
        target = partition.holdings(rank) if partition is not None else ()
        new_slices, new_state = {}, {}
        for segment in self.segments(target):
            if segment in self.slices:
                piece = self.slices[segment]
                state = self.optimizer.state.get(piece)
            else:
                state = self.piece(*segment)
                piece = self._slice_parameter(*segment)
            new_slices[segment] = piece
            if state:
                new_state[piece] = state
        kept = {id(self.parameters[index]) for index in self.replicated}
        for piece in list(self.optimizer.state):
            if id(piece) not in kept:
                del self.optimizer.state[piece]
        self.optimizer.state.update(new_state)
        self.slices = new_slices
        self.partition = partition
        self._regroup()

    # ------------------------------------------------------------ the step

    def step(self) -> None:
        """Step the held slices (and the replicated parameters) with the summed gradients in `.grad`."""
        if self.by != "parameters":
            for (k, start, stop), piece in self.slices.items():
                grad = self.parameters[self.sharded[k]].grad
                piece.grad = grad.reshape(-1)[start:stop] if grad is not None else None
        self.optimizer.step()
        self.pristine = False
        # The chunks others hold were stepped there: their values arrive by broadcast (if anyone lacks any).
        self.values_complete = self.partition.everyone_holds_everything

    def zero_grad(self, keep_gradient: bool = False) -> None:
        """Drop the gradients the optimizer steps; `keep_gradient` keeps the sharded parameters'
        summed gradient (a step this device may still have to apply: flexpar/worker/shard_levelling.py)."""
        kept = set(self.sharded) if keep_gradient else set()
        for index in self.saved_order:
            if index not in kept:
                self.parameters[index].grad = None
        if self.by != "parameters":  # views of the parameters' gradients (`step` points them anew)
            for piece in self.slices.values():
                piece.grad = None

    def state_bytes(self) -> int:
        """Bytes of the optimizer state this device holds (its slices' and the replicated parameters')."""
        return state_nbytes(self.optimizer.state.values())

    # ------------------------------------------------------------ the replicated part and the plain format

    def number_of(self, k: int) -> int:
        """torch.optim's number (in its state_dict) of sharded parameter k."""
        return self.saved_order.index(self.sharded[k])

    def plain_param_groups(self) -> list:
        """The param groups as torch.optim's state_dict writes them (hyperparameters, parameter numbers)."""
        numbers = {index: number for number, index in enumerate(self.saved_order)}
        return [
            {
                **{key: value for key, value in group.items() if key != "params"},
                "params": [numbers[index] for index in self.saved_order if self.group_of[index] == position],
            }
            for position, group in enumerate(self.optimizer.param_groups)
        ]

    def replicated_state(self) -> dict:
        """Everything of the model and optimizer but the sharded parameters and their state.

        Buffers, the parameters that are not sharded, each param group's
        hyperparameters and the replicated parameters' optimizer state (keyed by
        torch.optim's numbering), and whether the optimizer ever stepped.
        """
        sharded = {id(self.parameters[index]) for index in self.sharded}
        model = {
            name: value.detach()
            for name, value in self.model.state_dict(keep_vars=True).items()
            if id(value) not in sharded
        }
        numbers = {index: number for number, index in enumerate(self.saved_order)}
        state = {
            numbers[index]: dict(self.optimizer.state[self.parameters[index]])
            for index in self.replicated
            if self.optimizer.state.get(self.parameters[index])
        }
        return {
            "model": model,
            "optimizer": {"param_groups": self.plain_param_groups(), "state": state},
            "pristine": self.pristine,
        }

    def load_replicated(self, replicated: dict) -> None:
        """Take over another member's `replicated_state()` (the sharded parameters are not touched)."""
        missing, unexpected = self.model.load_state_dict(replicated["model"], strict=False)
        sharded_names = set(self.names)
        if unexpected or set(missing) - sharded_names:
            raise ValueError(
                f"the replicated state does not fit this model (missing {sorted(set(missing) - sharded_names)}, "
                f"unexpected {sorted(unexpected)})"
            )
        self.load_optimizer_plain(replicated["optimizer"])
        self.pristine = bool(replicated["pristine"])

    def load_optimizer_plain(self, saved: dict) -> None:
        """The hyperparameters and the replicated parameters' state from a plain optimizer state_dict."""
        if len(saved["param_groups"]) != len(self.optimizer.param_groups):
            raise ValueError(
                f"the saved optimizer has {len(saved['param_groups'])} param groups, this one "
                f"{len(self.optimizer.param_groups)}"
            )
        for group, stored in zip(self.optimizer.param_groups, saved["param_groups"]):
            group.update({key: value for key, value in stored.items() if key != "params"})
        states = saved.get("state", {})
        for index in self.replicated:
            number = self.saved_order.index(index)
            parameter = self.parameters[index]
            state = states.get(number, states.get(str(number)))
            if state:
                self.optimizer.state[parameter] = {
                    key: value.to(parameter.device) if isinstance(value, torch.Tensor) else value
                    for key, value in state.items()
                }
            else:
                self.optimizer.state.pop(parameter, None)


def _copied(value):
    return value.clone() if isinstance(value, torch.Tensor) else value


def zero_grad(optimizer, shards: Optional[ShardedOptimizer], keep_gradient: bool = False) -> None:
    """Drop the gradients the optimizer steps; a sharded job's `keep_gradient` keeps the summed gradient
    of a step this device may still have to apply (flexpar/worker/shard_levelling.py)."""
    if shards is None:
        optimizer.zero_grad(set_to_none=True)
    else:
        shards.zero_grad(keep_gradient)


def optimizer_bytes(optimizer, shards: Optional[ShardedOptimizer]) -> int:
    """Bytes of the optimizer state this device holds (sharded or not)."""
    if shards is not None:
        return shards.state_bytes()
    return state_nbytes(optimizer.state.values())
