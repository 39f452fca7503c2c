"""The validation's inputs: balance.py's and elastic.py's JSON (given, or run now) and flexpar's metrics files."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence

from harness import json_lines, progress

BENCHMARKS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_progress = progress("sim_validation")


def run_benchmark(script: str, json_path: str, quick: bool, extra: Sequence[str] = ()) -> dict:
    """Run benchmarks/<script> as a subprocess writing `json_path`; return its JSON."""
    command = [sys.executable, os.path.join(BENCHMARKS, script), "--json", json_path, *extra]
    if quick:
        command.append("--quick")
    _progress(f"running {' '.join(os.path.basename(part) if part.endswith('.py') else part for part in command[1:])}")
    started = time.perf_counter()
    completed = subprocess.run(command, stdout=sys.stderr, stderr=sys.stderr, check=False)
    if completed.returncode != 0:
        raise RuntimeError(f"{script} exited with status {completed.returncode}")
    _progress(f"{script} took {time.perf_counter() - started:.0f} s")
    return load_json(json_path)


def load_json(path: str) -> dict:
    with open(path, encoding="utf-8") as handle:
        return json.load(handle)


def read_step_records(path: str) -> list[dict]:
    """Records of a flexpar metrics file (JSON lines); [] when it is gone."""
    return json_lines(path) if path else []


def gather_inputs(options, scratch: str) -> tuple:
    """The two benchmarks' JSON (given, or run now) and balance.py's metrics folder, if any."""
    metrics_dir = options.balance_metrics
    if options.balance_json:
        balance = load_json(options.balance_json)
    else:
        metrics_dir = os.path.join(scratch, "balance-metrics")
        os.makedirs(metrics_dir, exist_ok=True)
        # The rounds the simulator predicts only: not the V=128 round or balancing by cost,
        # which it does not model (they more than double balance.py's time).
        balance = run_benchmark(
            "balance.py",
            os.path.join(scratch, "balance.json"),
            options.quick,
            ["--keep-metrics", metrics_dir, "--fine-virtual-workers", "0", "--variable-length", "skip"],
        )
    if options.elastic_json:
        elastic = load_json(options.elastic_json)
    else:
        elastic = run_benchmark("elastic.py", os.path.join(scratch, "elastic.json"), options.quick)
    return balance, elastic, metrics_dir


JOIN_SIZES = "0.1"
"""The state size (GB) at which join_stream.py runs for the validation's join rows (a round is about a
minute at 0.1 GB; the members' step is about 0.1 s)."""


def gather_join_stream(options, scratch: str) -> dict | None:
    """join_stream.py's JSON (given, or run now at JOIN_SIZES); None with `--join-stream-json skip`."""
    given = getattr(options, "join_stream_json", None)
    if given == "skip":
        return None
    if given:
        return load_json(given)
    return run_benchmark(
        "join_stream.py", os.path.join(scratch, "join_stream.json"), options.quick, ["--sizes", JOIN_SIZES]
    )
