"""The errors flexpar raises for the user, at the bottom of the package: any module may import them.

`UserCodeError`: a piece of the user's code raised or returned something
unusable (the message names the piece, the step and the fix). `TrainingError`:
the job stopped (a worker's error, or no device left).
"""


class UserCodeError(Exception):
    """A piece of the user's code raised, or returned something unusable."""


class TrainingError(RuntimeError):
    """The job stopped: a worker's error, or no device left. The message says which."""


class ShardStateLost(RuntimeError):
    """Every copy of some part of a sharded optimizer's state is gone (Job(shard_optimizer=True)).

    The job stops: its message names what was lost, the latest checkpoint and
    the command that resumes from it. It never goes on with a partial state.
    """
