"""A benchmark's command line and entry point."""

from __future__ import annotations

import argparse
import signal
import sys
from typing import Any, Callable

from .processes import end_descendants


def base_parser(description: str) -> argparse.ArgumentParser:
    """An argparse parser that already has `--json PATH` and `--quick`, the flags every benchmark takes."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--json", metavar="PATH", default=None, help="write the results as JSON here")
    parser.add_argument("--quick", action="store_true", help="small, fast version for smoke testing")
    return parser


def _exit_on_sigterm(signum, _frame) -> None:
    raise SystemExit(128 + signum)


def run(main: Callable[[], Any]) -> None:
    """A benchmark script's entry point: `harness.run(main)` under `if __name__ == "__main__":`.

    Runs `main()`. However it ends (it returns, raises, Ctrl-C, or SIGTERM,
    turned into SystemExit here so that every `finally` runs), the processes
    it started and left running are killed (`end_descendants`). Exits with
    main's return value when that is an int (an exit status), else 0.
    """
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        result = main()
    finally:
        end_descendants()
        signal.signal(signal.SIGTERM, previous)
    sys.exit(result if isinstance(result, int) else 0)
