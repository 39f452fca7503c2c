"""The errors flexpar raises for the user, at the bottom of the package: any module may import them.

`UserCodeError`: a piece of the user's code raised or returned something
unusable (the message names the piece, the step and the fix). `TrainingError`:
the job stopped (a worker's error, or no device left).
"""


class UserCodeError(Exception):
    """A piece of the user's code raised, or returned something unusable."""


class TrainingError(RuntimeError):
    """The job stopped: a worker's error, or no device left. The message says which."""
