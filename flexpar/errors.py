"""The errors flexpar raises for the user, at the bottom of the package: any module may import them.

`ArgumentError`: an argument the user gave is unusable (the message names the
argument and the fix; shown as one line where Python prints it, see
flexpar/job.py's `show_to_the_user`). `UserCodeError`: a piece of the user's code raised or returned something
unusable (the message names the piece, the step and the fix). `TrainingError`:
the job stopped (a worker's error, or no device left).
"""


class ArgumentError(ValueError, TypeError):
    """An argument the user gave is unusable: a wrong value or a wrong kind of thing.

    The message names the argument and the fix, so no traceback is needed to
    act on it. It is a ValueError and a TypeError both (as numpy's AxisError is
    a ValueError and an IndexError): code that catches either keeps working.
    Only flexpar's own checks raise it, so a bug of flexpar's (any other error)
    keeps its traceback.
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


class DeterminismBreach(TrainingError):
    """Job(deterministic=True): two devices hold different parameters after the same step. The message
    names the step and the first tensor that differs."""
