"""flexpar: elastic, load-balanced data parallelism for single-device PyTorch code.

job = flexpar.Job(model=make_model, optimizer=make_optimizer, loss=loss,
                  dataset=dataset, global_batch=256, virtual_workers=8)
model, summary = job.fit(steps=1000)
"""

from flexpar.callbacks import STOP, Callback, CallbackError
from flexpar.errors import ArgumentError, TrainingError, UserCodeError
from flexpar.job import FitResult, Job
from flexpar.options import FitOptions
from flexpar.version import __version__

__all__ = [
    "Job",
    "FitResult",
    "FitOptions",
    "ArgumentError",
    "TrainingError",
    "UserCodeError",
    "__version__",
    "STOP",
    "Callback",
    "CallbackError",
]
