"""The owners of one device's state, handed together to the parts of the worker that carry out its work."""

from __future__ import annotations

from typing import NamedTuple, Optional

from flexpar.worker.committed import CommittedStep
from flexpar.worker.cost_planner import CostPlanner
from flexpar.worker.data_streams import DataStreams
from flexpar.worker.determinism import ExactSteps
from flexpar.worker.evaluator import Evaluation
from flexpar.worker.fault_injection import FaultSchedule
from flexpar.worker.gradient import AppliedGradient
from flexpar.worker.membership import Membership
from flexpar.worker.records import RecordQueue
from flexpar.worker.state_keeping import Checkpoints, TrainingState
from flexpar.worker.stream_session import StreamSession


class Owners(NamedTuple):
    """Each field owns one piece of the device's state, holds it in its own fields, changes it through
    its own methods and says its invariant in its docstring. The `Worker` builds them once; the
    boundaries, the joins and the steps (boundaries.py, streaming.py, shard_levelling.py,
    shard_streaming.py, step_loop.py, step_run.py) take from this bundle the owners they use, in their
    constructors, and change the state only through them."""

    membership: Membership  # the generation, its members, this rank
    committed: CommittedStep  # the committed step, its wall time and balancer state, the step in flight
    records: RecordQueue  # the records the driver has not acknowledged
    faults: FaultSchedule  # the scheduled faults not fired yet
    streams: StreamSession  # the streamed join in flight
    state: TrainingState  # the whole training state captured and restored (owns nothing itself)
    checkpoints: Checkpoints  # the checkpoint writer and what it last wrote
    evaluation: Evaluation  # the last evaluation and the callbacks' verdict
    gradient: AppliedGradient  # the gradient a step applies
    exact_steps: Optional[ExactSteps]  # Job(deterministic=True): the exact sums' checks and digests
    cost_planner: Optional[CostPlanner]  # Job(sample_cost=...): the cost rates and VW plans
    data_streams: Optional[DataStreams] = None  # an iterable dataset: every VW stream and its committed position
