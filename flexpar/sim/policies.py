"""The policies the simulator compares: how work is split, and how changes are paid for.

A policy is two independent rules, so that a comparison can tell which part
makes a difference:

- an *assignment rule*: which device runs how many VWs this step.
  ``BalancedAssignment`` is flexpar's balancer itself: it calls
  ``flexpar.core.balance.next_assignment`` and ``flexpar.core.balance.observe`` (the
  functions the real workers run, imported, not copied), fed with the
  simulated busy times. ``UniformAssignment`` is the equal split of DDP
  (equal per-GPU batches), the remainder going to the first ranks.
- an *elasticity rule*: what a join, a leave or a failure costs.
  ``InPlaceElasticity`` is flexpar's (DESIGN.md section 4): a joiner warms up
  off the critical path, then one new process group and one state broadcast; a
  leave costs a new group; a failure costs detection, the step in flight and a
  new group. ``RestartElasticity`` is checkpoint-restart (torchrun-like): every
  change stops and restarts all workers, and a failure also loses the work
  since the last periodic checkpoint.

The three named policies:

===========  =====================  ==========================================
name         assignment             elasticity
===========  =====================  ==========================================
flexpar      balanced               in-place
uniform      uniform (DDP split)    in-place (so that flexpar vs uniform shows
                                    the balancing alone)
restart      uniform (DDP split)    checkpoint-restart (torchrun)
===========  =====================  ==========================================
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence, Tuple

from flexpar.core import balance

from .model import (
    ModelParameters,
    failure_restart_seconds,
    join_stall_seconds,
    pg_formation_seconds,
    planned_restart_seconds,
    uniform_assignment,
)

POLICY_NAMES: Tuple[str, ...] = ("flexpar", "uniform", "restart")

# A smoothed per-VW time within this relative distance of the measured one
# counts as converged: further smoothing cannot move it by anything a step
# time in seconds would show, so the simulator may skip identical steps.
SETTLED_RELATIVE_TOLERANCE = 1e-9


@dataclass(frozen=True)
class BalanceSettings:
    """Parameters handed to ``flexpar.core.balance`` (same meaning and defaults as there).

    ``interval_steps``: observe and re-assign every this many steps, with the
    busy times averaged over the interval. 1 is what the real workers do; a
    larger value is only a way to make huge noisy simulations cheaper (each
    call into the balancer costs about 14 ms at 1024 devices).
    """

    smoothing: float = 0.5
    hysteresis: float = 0.05
    interval_steps: int = 1

    def __post_init__(self) -> None:
        if not (isinstance(self.smoothing, (int, float)) and 0.0 < self.smoothing <= 1.0):
            raise ValueError(f"balance.smoothing: expected a number in (0, 1], got {self.smoothing!r}")
        if not (isinstance(self.hysteresis, (int, float)) and 0.0 <= self.hysteresis < 1.0):
            raise ValueError(f"balance.hysteresis: expected a number in [0, 1), got {self.hysteresis!r}")
        if not (
            isinstance(self.interval_steps, int)
            and not isinstance(self.interval_steps, bool)
            and self.interval_steps >= 1
        ):
            raise ValueError(f"balance.interval_steps: expected an integer >= 1, got {self.interval_steps!r}")


# --------------------------------------------------------------------------
# assignment rules
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class UniformAssignment:
    """DDP's equal split; needs no memory between steps (its state is ``None``)."""

    name = "uniform"

    def initial_state(self) -> None:
        return None

    def assign(self, state: None, device_ids: Tuple[str, ...], virtual_workers: int) -> Tuple[int, ...]:
        return uniform_assignment(len(device_ids), virtual_workers)

    def observe(self, state: None, device_ids, assignment, busy_seconds) -> None:
        return None

    def is_settled(self, state: None, device_ids, seconds_per_vw: Sequence[float]) -> bool:
        return True


@dataclass(frozen=True)
class BalancedAssignment:
    """flexpar's balancer: every decision is a call into ``flexpar.core.balance``."""

    settings: BalanceSettings = BalanceSettings()
    name = "balanced"

    def initial_state(self) -> balance.BalanceState:
        return balance.BalanceState()

    def assign(self, state: balance.BalanceState, device_ids: Tuple[str, ...], virtual_workers: int) -> Tuple[int, ...]:
        return balance.next_assignment(state, device_ids, virtual_workers, hysteresis=self.settings.hysteresis)

    def observe(
        self,
        state: balance.BalanceState,
        device_ids: Tuple[str, ...],
        assignment: Sequence[int],
        busy_seconds: Sequence[float],
    ) -> balance.BalanceState:
        return balance.observe(state, device_ids, assignment, busy_seconds, smoothing=self.settings.smoothing)

    def is_settled(
        self, state: balance.BalanceState, device_ids: Tuple[str, ...], seconds_per_vw: Sequence[float]
    ) -> bool:
        """True when the smoothed time of every device equals its true one (to 1e-9).

        Only then does one more noise-free observation leave the state (and so
        the next assignment) unchanged, which is what skipping steps needs.
        """
        if not balance.noise_known(state, device_ids):
            return False  # the next measurements can still lift the balancer's wait
        known = state.seconds_per_vw
        for device_id, seconds in zip(device_ids, seconds_per_vw):
            smoothed = known.get(device_id)
            if smoothed is None or not math.isclose(smoothed, seconds, rel_tol=SETTLED_RELATIVE_TOLERANCE):
                return False
        return True


# --------------------------------------------------------------------------
# elasticity rules
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class ChangeCost:
    """What one step boundary's membership change costs.

    ``stall_s``: wall time from the boundary (or from the failure) until the
    remaining devices can run the next step. ``rolls_back``: the job resumes
    from its last checkpoint and redoes the steps since (the simulator adds
    that lost work to the stall). ``checkpoints``: the change itself saves a
    checkpoint (a planned restart does), so nothing before it can be lost later.
    """

    stall_s: float
    rolls_back: bool = False
    checkpoints: bool = False


@dataclass(frozen=True)
class InPlaceElasticity:
    """flexpar: running processes never restart (DESIGN.md section 4)."""

    name = "in-place"
    keeps_state_in_memory = True
    # Survivors learn of a failure in the step's all-reduce (the engine charges
    # the step and the detection up to then).
    notices_failures_in_collective = True

    def admission_delay_s(self, parameters: ModelParameters) -> float:
        """A joiner warms up for this long before it can be let in (off the critical path)."""
        return parameters.elastic.warmup_s

    def change_cost(
        self,
        joined: int,
        left: int,
        failed: int,
        devices_after: int,
        parameters: ModelParameters,
        join_stall_s: Optional[float] = None,
    ) -> ChangeCost:
        """One new process group for all changes of a boundary together.

        Plus the state broadcast when someone joined (a leaver takes nothing
        with it), plus the recovery notice when someone failed. The step in
        flight and the detection are charged by the simulator, which knows
        when in the step the failure happened. ``join_stall_s``: a join's
        boundary as the join's way prices it (sim/joins.py: streamed or
        blocking), instead of the blocking transfer.
        """
        if joined == 0 and left == 0 and failed == 0:
            return ChangeCost(0.0)
        if joined and join_stall_s is not None:
            stall = join_stall_s
        elif joined:
            stall = join_stall_seconds(devices_after, parameters)
        else:
            stall = pg_formation_seconds(devices_after, parameters.elastic)
        if failed:
            stall += parameters.elastic.recovery_notice_s
        return ChangeCost(stall)

    def checkpoint_every_steps(self, parameters: ModelParameters) -> Optional[int]:
        """In-place elasticity keeps no periodic checkpoint on the critical path."""
        return None


@dataclass(frozen=True)
class RestartElasticity:
    """Checkpoint-restart: any change restarts every worker from a checkpoint."""

    name = "checkpoint-restart"
    keeps_state_in_memory = False
    # The elastic agent watches its worker processes and stops them all at a death.
    notices_failures_in_collective = False

    def admission_delay_s(self, parameters: ModelParameters) -> float:
        """A joiner triggers the restart at once; its start-up is part of the restart."""
        return 0.0

    def change_cost(
        self,
        joined: int,
        left: int,
        failed: int,
        devices_after: int,
        parameters: ModelParameters,
        join_stall_s: Optional[float] = None,
    ) -> ChangeCost:
        """One restart for all changes of a boundary together (``join_stall_s`` is not used: a restart moves
        the state by checkpoint).

        After a failure: detection, then a restart without a final save, and
        the job rolls back to its last checkpoint. A planned change (join,
        leave) saves a checkpoint first, so it loses nothing.
        """
        if failed:
            return ChangeCost(
                parameters.elastic.detection_s + failure_restart_seconds(devices_after, parameters),
                rolls_back=True,
            )
        if joined or left:
            return ChangeCost(planned_restart_seconds(devices_after, parameters), checkpoints=True)
        return ChangeCost(0.0)

    def checkpoint_every_steps(self, parameters: ModelParameters) -> Optional[int]:
        return parameters.restart.checkpoint_every_steps


# --------------------------------------------------------------------------
# named policies
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class Policy:
    """One compared strategy: a name, a human label, and its two rules."""

    name: str
    label: str
    assignment: object
    elasticity: object


def make_policy(name: str, settings: BalanceSettings = BalanceSettings()) -> Policy:
    """The policy called ``name`` (one of ``POLICY_NAMES``)."""
    if name == "flexpar":
        return Policy("flexpar", "flexpar (balanced, in-place)", BalancedAssignment(settings), InPlaceElasticity())
    if name == "uniform":
        return Policy("uniform", "uniform split (DDP)", UniformAssignment(), InPlaceElasticity())
    if name == "restart":
        return Policy("restart", "checkpoint-restart (torchrun)", UniformAssignment(), RestartElasticity())
    raise ValueError(f"unknown policy {name!r}; expected one of {list(POLICY_NAMES)}")


def make_policies(names: Sequence[str], settings: BalanceSettings = BalanceSettings()) -> Tuple[Policy, ...]:
    return tuple(make_policy(name, settings) for name in names)


def describe_policies(policies: Sequence[Policy]) -> Mapping[str, str]:
    """``name -> label``, for tables and plots."""
    return {policy.name: policy.label for policy in policies}
