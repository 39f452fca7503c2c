"""One part of benchmarks/gpu_check.py: a command run with a time budget, and its record.

`run_part` runs the command in a process group of its own (harness.run_in_own_group:
killed with all it started when it runs past its budget) and records how it
ended, the tail of its output and the JSON it wrote; for a pytest run, the
counts of its JUnit XML (`pytest_counts`). A part that fails is recorded, never
raised: the check goes on with the next.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ElementTree
from typing import List, Optional

import harness

TAIL_CHARS = 4000  # of a part's output, in its record


def _tail(path: str) -> str:
    try:
        with open(path, "rb") as handle:
            handle.seek(0, os.SEEK_END)
            handle.seek(max(0, handle.tell() - TAIL_CHARS))
            return handle.read().decode(errors="replace")
    except OSError:
        return ""


def _read_json(path: str):
    try:
        with open(path) as handle:
            return json.load(handle)
    except (OSError, ValueError):
        return None


def pytest_counts(junit_path: str) -> Optional[dict]:
    """Passed, failed, errors and skipped from pytest's JUnit XML, and the skips' reasons; None without it."""
    try:
        root = ElementTree.parse(junit_path).getroot()
    except (OSError, ElementTree.ParseError):
        return None
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts = {
        key: sum(int(suite.get(key, 0)) for suite in suites) for key in ("tests", "failures", "errors", "skipped")
    }
    reasons = sorted({skip.get("message", "") for skip in root.iter("skipped")})
    return {
        "passed": counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"],
        "failed": counts["failures"],
        "errors": counts["errors"],
        "skipped": counts["skipped"],
        "skip_reasons": reasons,
    }


def run_part(
    name: str,
    arguments: List[str],
    budget_s: float,
    work_dir: str,
    result_path: str,
    env: Optional[dict] = None,
    pytest: bool = False,
    cwd: Optional[str] = None,
) -> dict:
    """Run `sys.executable arguments...` (in `cwd`, with `env`) in its own process group for at most `budget_s`.

    The record: status (ok, failed or timed_out), error, exit_status, wall_s,
    the output's tail, and `result`, the JSON the part wrote to `result_path`
    (`pytest`: the counts of the JUnit XML pytest wrote there).
    """
    command = [sys.executable, *arguments]
    log_path = os.path.join(work_dir, f"{name}.log")
    started = time.monotonic()
    with open(log_path, "wb") as log:
        try:
            exit_status = harness.run_in_own_group(
                command, budget_s, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=cwd
            )
        except OSError as error:  # the interpreter or a folder is missing
            exit_status, log_error = -1, f"could not start: {error}"
        else:
            log_error = None
    record = {
        "command": command,
        "budget_s": round(budget_s, 1),
        "wall_s": round(time.monotonic() - started, 1),
        "exit_status": exit_status,
        "output_tail": _tail(log_path),
    }
    record["result"] = pytest_counts(result_path) if pytest else _read_json(result_path)
    if log_error is not None:
        record.update(status="failed", error=log_error)
    elif exit_status is None:
        record.update(status="timed_out", error=f"ran past its budget of {budget_s:.0f} s and was killed")
    elif pytest:
        record.update(_tests_status(exit_status, record["result"]))
    elif exit_status != 0:
        record.update(status="failed", error=f"exit status {exit_status} (the output's tail says why)")
    elif record["result"] is None:
        record.update(status="failed", error="it exited 0 but wrote no JSON")
    else:
        record["status"] = "ok"
    return record


def _tests_status(exit_status: int, counts: Optional[dict]) -> dict:
    if counts is None:
        return {"status": "failed", "error": f"pytest exited {exit_status} and wrote no report"}
    if exit_status != 0 or counts["failed"] or counts["errors"]:
        return {
            "status": "failed",
            "error": f"pytest exited {exit_status}: {counts['failed']} failed, {counts['errors']} errors",
        }
    if counts["passed"] == 0:
        return {"status": "skipped", "reason": "pytest skipped every test: " + "; ".join(counts["skip_reasons"])}
    return {"status": "ok"}
