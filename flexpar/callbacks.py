"""Callbacks: user code the driver calls with the job's records, in step order.

    class EarlyStop:
        def __init__(self): self.best = float("inf")
        def on_eval(self, record):
            loss = record["metrics"]["loss_sum"] / record["metrics"]["count"]
            if loss >= self.best:
                return flexpar.STOP
            self.best = loss

    job.fit(steps=1000, eval_every=50, callbacks=[EarlyStop()])

A callback is any object with one or more of `on_step(record)`,
`on_event(record)`, `on_eval(record)` and `on_end(summary)` (subclassing
`Callback` is optional). They run in the driver process (the one that called
`fit()`), never in a worker, one at a time, in the order the records happen
(docs/metrics.md describes the records; each callback gets its own copy).
Trackers (`flexpar.observe.trackers`) are callbacks too.

Returning `flexpar.STOP` ends the job cleanly, as after its last step (final
evaluation, final checkpoint, the model returned):

- from `on_eval`: exactly at that evaluation's step. While a callback has
  `on_eval`, the devices wait after each periodic evaluation for the
  driver's verdict on it (one round trip through the store, milliseconds),
  so the model returned is the model evaluated: `summary["steps"] ==
  record["step"]`.
- from `on_step` or `on_event`: after the first step that starts once every
  device has seen the request. Training is not held up for the driver's
  verdict on every step, so steps already under way when the request
  arrives still commit (and reach `on_step`): `summary["steps"]` is the step
  count of the model returned, at least `record["step"] + 2` for a stop
  returned from `on_step(record)` (step records count from 0).

`summary["stopped"]` then names the callback, its hook and the step. A
callback whose `on_eval` never stops the job can say so with a class
attribute `never_stops = True` (the trackers do): the devices then do not
wait for the driver after an evaluation on its account. The attribute vouches
for the `on_eval` of the class that sets it (and those above it) only: a
subclass that overrides `on_eval` may stop, unless it sets `never_stops`
itself (`vouched_never_stops`).

An exception in a callback stops the job (the workers are stopped) and
`fit()` raises `CallbackError` with the callback's traceback in its message,
shown once.
"""

from __future__ import annotations

import copy
import traceback
from typing import Iterable, Optional

from flexpar.errors import TrainingError


class _Stop:
    """The value a callback returns to end the job cleanly."""

    _instance = None

    def __new__(cls):
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "flexpar.STOP"

    def __reduce__(self):
        return (_Stop, ())


STOP = _Stop()

HOOKS = ("on_step", "on_event", "on_eval", "on_end")

# Every stop a callback asks for starts so; workers evaluate at such a stop (not at a SIGTERM's).
CALLBACK_STOP = "a callback asked to stop"


class CallbackError(TrainingError):
    """A callback raised; the message holds its traceback."""


class Callback:
    """Optional base class: override the hooks you need; each may return `flexpar.STOP`."""

    def on_step(self, record: dict):
        """After each committed step, with its step record."""

    def on_event(self, record: dict):
        """After each event (start, join, leave, failure, rebalance, stop, ...), with its event record."""

    def on_eval(self, record: dict):
        """After each evaluation, with its eval record (`record["metrics"]`: the summed metrics)."""

    def on_end(self, summary: dict):
        """Once, when the job has ended well, with fit()'s summary."""


def _hooks_of(callback) -> tuple:
    return tuple(hook for hook in HOOKS if callable(getattr(callback, hook, None)))


def check_callbacks(callbacks) -> tuple:
    """The callbacks as a tuple; TypeError for one that has none of the hooks (or is a class)."""
    if callbacks is None:
        return ()
    if not isinstance(callbacks, (list, tuple)):
        raise TypeError(f"callbacks= must be a list of callback objects, got {type(callbacks).__name__}")
    for position, callback in enumerate(callbacks):
        if isinstance(callback, type):
            raise TypeError(
                f"callbacks[{position}] is the class {callback.__name__}; pass an instance: {callback.__name__}()"
            )
        if not _hooks_of(callback):
            raise TypeError(
                f"callbacks[{position}] ({type(callback).__name__}) has none of the methods {', '.join(HOOKS)}"
            )
    return tuple(callbacks)


def overrides(callback, hook: str) -> bool:
    """Whether `callback` has its own `hook` (not Callback's empty one)."""
    method = getattr(type(callback), hook, None)
    if method is None:
        return callable(getattr(callback, hook, None))
    return method is not getattr(Callback, hook, None)


def vouched_never_stops(callback) -> bool:
    """Whether `never_stops` covers the `on_eval` this callback really runs.

    An instance attribute speaks for the instance. A class attribute speaks
    for the class that sets it: an `on_eval` defined in a subclass below it
    (a Tracker subclass that returns STOP, say) is not covered.
    """
    own = getattr(callback, "__dict__", {})
    if "never_stops" in own:
        return bool(callback.never_stops)
    if "on_eval" in own:  # set on the instance: no class attribute vouches for it
        return False
    mro = type(callback).__mro__
    declared = next((klass for klass in mro if "never_stops" in vars(klass)), None)
    if declared is None or not declared.never_stops:
        return False
    defined = next((klass for klass in mro if "on_eval" in vars(klass)), None)
    return defined is None or mro.index(defined) >= mro.index(declared)


def _name(callback) -> str:
    return type(callback).__name__


class Dispatcher:
    """Calls the callbacks' hooks in order; turns STOP into a stop reason and errors into CallbackError."""

    def __init__(self, callbacks: Iterable = ()):
        self.callbacks = list(callbacks)
        self.stop_reason: Optional[str] = None  # the first stop asked for

    def __bool__(self) -> bool:
        return bool(self.callbacks)

    @property
    def can_stop_at_eval(self) -> bool:
        """Whether some callback's own `on_eval` may stop the job (the devices then wait for its verdict)."""
        return any(overrides(callback, "on_eval") and not vouched_never_stops(callback) for callback in self.callbacks)

    def call(self, hook: str, record: dict) -> Optional[str]:
        """Call `hook(record)` on each callback that has it; returns a stop reason if one returned STOP."""
        reason = None
        for callback in self.callbacks:
            method = getattr(callback, hook, None)
            if not callable(method):
                continue
            try:
                answer = method(copy.deepcopy(record))
            except Exception as error:
                raise self._error(callback, hook, record, error) from None
            if answer is STOP and reason is None and hook != "on_end":
                where = f" at step {record['step']}" if isinstance(record, dict) and "step" in record else ""
                reason = f"{CALLBACK_STOP} ({_name(callback)}.{hook}{where})"
        if reason is not None and self.stop_reason is None:
            self.stop_reason = reason
        return reason

    @staticmethod
    def _error(callback, hook: str, record, error: BaseException) -> CallbackError:
        # The callback's own frames: the first frame (this dispatcher) is left out.
        frames = traceback.format_exception(type(error), error, error.__traceback__.tb_next)
        where = f" at step {record['step']}" if isinstance(record, dict) and "step" in record else ""
        return CallbackError(
            f"callback {_name(callback)}.{hook} raised{where}: {type(error).__name__}: {error}; the job is "
            f"stopped.\n\n--- the callback's traceback ---\n{''.join(frames).rstrip()}"
        )

    def close(self, failed: bool = False) -> None:
        """End the trackers' runs and close their files; a tracker that cannot close does not hide
        the job's outcome (its error is printed)."""
        for callback in self.callbacks:
            finish = getattr(callback, "finish_tracking", None)
            if callable(finish):
                try:
                    finish(failed=failed)
                except Exception:
                    traceback.print_exc()
