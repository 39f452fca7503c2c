"""Cluster simulator: flexpar's step loop over many devices, with elastic events.

The simulator runs the real balancer (``flexpar.core.balance``) on simulated
timings, so that what it predicts for 1024 devices is what the library would
do, with a closed-form cost model (``model.py``) that can be calibrated on
measurements (``calibration.py``). See docs/simulator.md.

Entry points: ``simulate_command`` (``flexpar simulate``), ``load_scenario``,
``simulate``, ``simulate_all``, ``scalability``, ``calibrate``.
"""

from .calibration import Calibration, calibrate, predict_elastic_stalls, predict_step_seconds, relative_error
from .cli import main, simulate_command
from .engine import simulate, simulate_all
from .joins import choose_join, join_inputs, simulate_stream
from .model import (
    ElasticCosts,
    JoinModel,
    ModelParameters,
    NetworkModel,
    RestartCosts,
    WorkloadModel,
    broadcast_seconds,
    failed_step_lost_seconds,
    failure_stall_seconds,
    host_contention,
    pg_formation_seconds,
    ring_all_reduce_seconds,
    step_seconds,
    uniform_assignment,
)
from .policies import POLICY_NAMES, BalanceSettings, Policy, make_policy
from .results import SimulationEvent, SimulationResult
from .scalability import ScalabilityResult, scalability, scaled_scenario
from .scenario import DeviceSpec, Event, ScalabilitySpec, Scenario
from .scenario_file import load_scenario, parse_scenario, shipped_scenarios
from .stream_course import StreamCourse

__all__ = [
    "BalanceSettings",
    "Calibration",
    "DeviceSpec",
    "ElasticCosts",
    "Event",
    "JoinModel",
    "ModelParameters",
    "NetworkModel",
    "POLICY_NAMES",
    "Policy",
    "RestartCosts",
    "ScalabilityResult",
    "ScalabilitySpec",
    "Scenario",
    "SimulationEvent",
    "SimulationResult",
    "StreamCourse",
    "WorkloadModel",
    "broadcast_seconds",
    "calibrate",
    "choose_join",
    "failed_step_lost_seconds",
    "failure_stall_seconds",
    "host_contention",
    "join_inputs",
    "load_scenario",
    "pg_formation_seconds",
    "main",
    "make_policy",
    "parse_scenario",
    "predict_elastic_stalls",
    "predict_step_seconds",
    "relative_error",
    "ring_all_reduce_seconds",
    "scalability",
    "scaled_scenario",
    "shipped_scenarios",
    "simulate",
    "simulate_all",
    "simulate_command",
    "simulate_stream",
    "step_seconds",
    "uniform_assignment",
]
