"""The device count in a resume command: the job as it is, not as it started.

A resume command (flexpar.driver.launch.resume_command) leaves flexpar's
`--devices` out: by the time it is printed the job may have grown or shrunk,
and a restarted driver re-adopts every device that waits for it. Two things
still need a count, and this module writes it:

- a driver stopped by SIGTERM: its devices end with it, so the command must
  start as many of this host's devices as the job ended with;
- a job started as `python train.py --devices 1` (the examples' own flag,
  which the command keeps after `--`): that count would start a job that had
  grown to 2 with 1 device should no device wait to be re-adopted. flexpar's
  own `--devices` overrides the script's (the command line overrides fit()),
  so the command gets the count of the job as it is.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence

DEVICES = "--devices"


def local_count(devices: Sequence[str]) -> int:
    """How many of `devices` are this host's ('local-N')."""
    return sum(1 for device in devices if str(device).startswith("local-"))


def script_position(words: Sequence[str]) -> int:
    """Where the script is in a resume command's words (a `.py` path or the placeholder SCRIPT);
    the words before it are flexpar's flags, those after it the script's own."""
    for index, word in enumerate(words):
        if index > 1 and (word.endswith(".py") or word == "SCRIPT"):
            return index
    return len(words)


def names_a_count(words: Sequence[str]) -> bool:
    """Whether `words` carry a device count (`--devices N` or `--devices=N`)."""
    return any(word == DEVICES or word.startswith(DEVICES + "=") for word in words)


def with_device_count(command: str, count: int, always: bool) -> str:
    """`command` with flexpar's `--devices COUNT` after its `--resume`, where the job's count is
    needed: `always` (a driver that ended the job), or where the script's own arguments name a count
    (the command would otherwise say the count the job started with). Unchanged where flexpar's own
    flags already name one, where `count` is under 1, or where the command is not a resume."""
    words = shlex.split(command)
    if count < 1 or "--resume" not in words:
        return command
    script = script_position(words)
    if names_a_count(words[:script]) or not (always or names_a_count(words[script + 1 :])):
        return command
    position = words.index("--resume") + 1
    return shlex.join(words[:position] + [DEVICES, str(count)] + words[position:])
