"""Folders for a run's files (metrics, results of baseline processes, checkpoints)."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from typing import Iterator, Optional


@contextlib.contextmanager
def run_folder(prefix: str, keep: Optional[str] = None) -> Iterator[str]:
    """A fresh temporary folder, removed at the end even on error or Ctrl-C.

    `keep`: a folder the caller wants to keep the files in instead (created if
    needed, never removed).
    """
    if keep is not None:
        os.makedirs(keep, exist_ok=True)
        yield keep
        return
    folder = tempfile.mkdtemp(prefix=prefix)
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def unique_path(folder: str, suffix: str) -> str:
    """A new, empty file in `folder` whose name no other call returns (for one run's output)."""
    descriptor, path = tempfile.mkstemp(suffix=suffix, dir=folder)
    os.close(descriptor)
    return path
