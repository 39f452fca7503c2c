"""The data of the byte-level demos: the Python standard library's own source, as byte windows.

The corpus is the `.py` files of the running interpreter's standard library,
which every Python installation ships, so the demos need no download
(flexpar/examples/tiny_lm.py, tiny_lm_variable.py, hf_gpt.py).
"""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path
from typing import List, Optional, Tuple, Union

import torch
from torch.utils.data import Dataset

VOCABULARY = 256  # one token per byte value
DEFAULT_CONTEXT = 64
DEFAULT_MAX_BYTES = 2_000_000
# Folders under the stdlib path that are not the standard library itself (the
# installed packages differ between machines) or hold no source.
_SKIPPED_FOLDERS = frozenset({"site-packages", "dist-packages", "__pycache__"})


def stdlib_root() -> Path:
    """The folder of the running interpreter's standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_source_files(root: Optional[Path] = None) -> List[Path]:
    """The standard library's `.py` files, sorted by their path relative to `root`.

    Sorting the relative POSIX paths (not the walk order of the file system)
    makes the corpus the same on every run of the same Python version.
    `_sysconfigdata*` files are skipped: they describe the build machine.
    """
    root = stdlib_root() if root is None else Path(root)
    found = []
    for folder, subfolders, names in os.walk(root):
        subfolders[:] = [name for name in subfolders if name not in _SKIPPED_FOLDERS]
        for name in names:
            if name.endswith(".py") and not name.startswith("_sysconfigdata"):
                found.append(Path(folder) / name)
    return sorted(found, key=lambda path: path.relative_to(root).as_posix())


def read_stdlib_corpus(max_bytes: int = DEFAULT_MAX_BYTES, root: Optional[Path] = None) -> bytes:
    """At most `max_bytes` of standard-library source, files joined by a blank line.

    Files are read in `stdlib_source_files` order until the cap is reached; the
    last file is cut at the cap. The cap keeps the demo fast, and reading stops
    early, so a small cap is also cheap.
    """
    if max_bytes < 2:
        raise ValueError(f"max_bytes={max_bytes} must be at least 2 (one input and one target byte)")
    pieces: List[bytes] = []
    total = 0
    for path in stdlib_source_files(root):
        text = path.read_bytes() + b"\n\n"
        pieces.append(text[: max_bytes - total])
        total += len(pieces[-1])
        if total >= max_bytes:
            break
    if total < 2:
        raise FileNotFoundError(f"found no Python source under {root or stdlib_root()}")
    return b"".join(pieces)


class ByteWindows(Dataset):
    """Non-overlapping windows of a byte string: sample `i` is (input, target).

    input  = bytes [i*context, (i+1)*context)        as int64 [context]
    target = the same window shifted by one byte     as int64 [context]

    The bytes are held as one uint8 tensor, so the dataset pickles compactly
    (its size in bytes) when it travels to worker processes.
    """

    def __init__(self, data: Union[bytes, torch.Tensor], context: int = DEFAULT_CONTEXT):
        if context < 1:
            raise ValueError(f"context={context} must be at least 1 byte")
        if isinstance(data, (bytes, bytearray)):
            data = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        if data.dtype != torch.uint8 or data.dim() != 1:
            raise TypeError(f"data must be bytes or a 1-D uint8 tensor (got {data.dtype}, {data.dim()}-D)")
        if len(data) < context + 1:
            raise ValueError(f"{len(data)} bytes make no window of context={context} (needs {context + 1} bytes)")
        # clone(): a slice of a larger tensor would otherwise pickle its whole storage.
        self.data = data.clone()
        self.context = context

    def __len__(self) -> int:
        # Each window needs one byte beyond it for the last target.
        return (len(self.data) - 1) // self.context

    def __getitem__(self, index: int) -> Tuple[torch.Tensor, torch.Tensor]:
        if not -len(self) <= index < len(self):
            raise IndexError(f"window {index} out of range for {len(self)} windows")
        start = (index % len(self)) * self.context
        window = self.data[start : start + self.context + 1].long()
        return window[:-1], window[1:]


def load_splits(
    context: int = DEFAULT_CONTEXT,
    max_bytes: int = DEFAULT_MAX_BYTES,
    held_out_fraction: float = 0.05,
) -> Tuple[ByteWindows, ByteWindows]:
    """Train and held-out windows; the held-out text is the corpus's tail.

    Cutting the text (not shuffling windows) keeps the held-out files unseen in
    training, apart from the one file the cut may fall inside.
    """
    if not 0.0 < held_out_fraction < 1.0:
        raise ValueError(f"held_out_fraction={held_out_fraction} must be strictly between 0 and 1")
    corpus = torch.frombuffer(bytearray(read_stdlib_corpus(max_bytes)), dtype=torch.uint8)
    cut = len(corpus) - int(len(corpus) * held_out_fraction)
    return ByteWindows(corpus[:cut], context), ByteWindows(corpus[cut:], context)
