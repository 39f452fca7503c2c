"""How flexpar.hf refuses: one line, `flexpar.hf.Trainer: MESSAGE`, raised as flexpar's ArgumentError."""

from __future__ import annotations

from typing import Optional

from flexpar.errors import ArgumentError
from flexpar.job import show_to_the_user


def refused(message: Optional[str]) -> None:
    """Raise the refusal `message` (nothing when None), shown as one line without a traceback."""
    if message:
        raise show_to_the_user(ArgumentError(f"flexpar.hf.Trainer: {message}"))
