"""flexpar: elastic, load-balanced data parallelism for single-device PyTorch code.

job = flexpar.Job(model=make_model, optimizer=make_optimizer, loss=loss,
                  dataset=dataset, global_batch=256, virtual_workers=8)
model, summary = job.fit(steps=1000)
"""

from flexpar.callbacks import STOP, Callback, CallbackError
from flexpar.errors import ArgumentError, TrainingError, UserCodeError
from flexpar.options import FitOptions
from flexpar.version import __version__

# Job and FitResult are imported on first use: flexpar.job imports the driver and the worker (torch
# and its compiler's modules, most of a second), which a command line tool such as `flexpar status`
# (python -m flexpar imports this package first) does not need.
_LAZY = {"Job": "flexpar.job", "FitResult": "flexpar.job"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'flexpar' has no attribute {name!r}")


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
