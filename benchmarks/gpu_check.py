"""One command for a host with a CUDA GPU: what the CPU-only development machine cannot measure, in one JSON file.

Run from a checkout of the repository (any folder), on a host with one CUDA GPU, torch with CUDA,
flexpar and pytest installed (the tests need nothing else); no network is needed:

    python benchmarks/gpu_check.py [--json PATH] [--dry-run]

It takes under 8 minutes and writes one JSON file (default ``gpu_check.json``
in the current folder; rewritten after every part, so an interrupted check
keeps the parts it finished). The parts run one after another, each as a
subprocess with a time budget of its own: a part that fails or runs past its
budget is recorded with its error and the tail of its output, and the others
still run. The budgets add up to less than ``TOTAL_BUDGET_S``; a part gets at
most what is left of it.

1. ``tests``: tests/end_to_end/test_cuda.py under pytest (one GPU: two tests
   run, the two-GPU test skips itself): passed, failed and skipped counts,
   pytest's reasons for skips, the output's tail.
2. ``overhead_cuda``: ``overhead.py --device cuda``: flexpar on one GPU with
   16 VWs against the hand-written accumulation loop on the same GPU
   (``accumulation_ratio``, goal >= 0.97), 3 alternating rounds (``ROUNDS``).
3. ``determinism_cost_cuda``: ``determinism.py --cost-only --device cuda``:
   float sums against exact int64 sums on one GPU with 16 VWs
   (``step_time_ratio``: float step time / exact's, 1.0 when exact sums are
   free), 3 alternating rounds: the figure that decides whether
   ``deterministic=True`` can be the default.
4. ``join_stream_cpu``: where the host has 8 cores or more,
   ``join_stream.py --quick`` with CPU devices: the members' lost time and
   slowdown while a state streams to a joiner, without three processes
   sharing two cores, and the way the default (``join_mode="auto"``) took
   there with its lost time against the better forced way's.

The JSON: ``host`` (GPUs, CPU cores and model, memory, torch, CUDA, cuDNN,
NCCL and driver versions, flexpar's version and commit), ``parts`` (name ->
``status``: ok, failed, timed_out or skipped; ``reason`` or ``error``;
``command``, ``budget_s``, ``wall_s``, ``exit_status``, ``output_tail``,
``result``: the part's own JSON, ``headline``: its deciding figures; in a
dry run ``dry_run_form``), ``dry_run``, ``started_utc``, ``total_budget_s``,
``wall_s``, ``complete``. A skipped part says why and holds no figure.

``--dry-run``: the same check end to end with no GPU used (every part's
process sees ``CUDA_VISIBLE_DEVICES=""``), for a CPU machine: the CUDA
parts are skipped (recorded so, with the reason), the tests run (pytest skips
them, and says so), and join_stream runs a tiny form (one 0.01 GB state,
one round) whatever the core count, so that the subprocesses, budgets and the
JSON's assembly are exercised. A dry run's figures are not the check's.

Exit status: 0 when no part failed or ran past its budget, else 1.

The pieces: gpu_check_host.py (the host's description), gpu_check_run.py (one
part run with its budget, and its record).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import sys
import time
from typing import Callable, Dict, List, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_check_host
import gpu_check_run
import harness

BENCHMARKS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(BENCHMARKS)
DEFAULT_JSON = "gpu_check.json"
TOTAL_BUDGET_S = 460.0  # all parts together; with start-up and the host's description, under 8 minutes
MIN_PART_S = 15.0  # a part is not started with less than this left of the total budget
ROUNDS = 3  # alternating rounds of the two CUDA comparisons (overhead.py's full run has 5)
MIN_CORES_FOR_JOIN_STREAM = 8
STARTED = time.monotonic()

progress = harness.progress("gpu_check")


@dataclasses.dataclass(frozen=True)
class Part:
    """One part of the check: a command (after the interpreter) with its budget.

    `arguments` and `dry_arguments` take the path of the file the part writes
    (its JSON; with `pytest`, its JUnit XML); `dry_arguments` None: skipped in
    a dry run.
    """

    name: str
    what: str
    budget_s: float
    arguments: Callable[[str], List[str]]
    dry_arguments: Optional[Callable[[str], List[str]]]
    needs_cuda: bool = False
    min_cores: int = 0
    cpu_only: bool = False  # its processes never see a GPU (CUDA_VISIBLE_DEVICES="")
    pytest: bool = False  # a pytest run: its result is the counts of its JUnit XML


def _script(name: str) -> str:
    return os.path.join(BENCHMARKS, name)


def _pytest_arguments(junit_path: str) -> List[str]:
    test_file = os.path.join(ROOT, "tests", "end_to_end", "test_cuda.py")
    return ["-m", "pytest", test_file, "-q", "-rs", "-p", "no:cacheprovider", f"--junitxml={junit_path}"]


PARTS = (
    Part(
        "tests",
        "tests/end_to_end/test_cuda.py under pytest",
        90.0,
        _pytest_arguments,
        _pytest_arguments,
        pytest=True,
    ),
    Part(
        "overhead_cuda",
        "overhead.py on one GPU: flexpar 16 VWs / the hand-written accumulation loop (accumulation_ratio)",
        130.0,
        lambda out: [_script("overhead.py"), "--device", "cuda", "--rounds", str(ROUNDS), "--json", out],
        None,
        needs_cuda=True,
    ),
    Part(
        "determinism_cost_cuda",
        "determinism.py's cost part on one GPU, 16 VWs: float sums / exact int64 sums (step_time_ratio)",
        110.0,
        lambda out: [
            _script("determinism.py"),
            "--cost-only",
            "--device",
            "cuda",
            "--rounds",
            str(ROUNDS),
            "--json",
            out,
        ],
        None,
        needs_cuda=True,
    ),
    Part(
        "join_stream_cpu",
        "join_stream.py --quick with CPU devices: streamed joins vs the blocking transfer",
        120.0,
        lambda out: [_script("join_stream.py"), "--quick", "--json", out],
        lambda out: [_script("join_stream.py"), "--sizes", "0.01", "--rounds", "1", "--json", out],
        min_cores=MIN_CORES_FOR_JOIN_STREAM,
        cpu_only=True,
    ),
)


# ---------------------------------------------------------------- the check


def headline(name: str, result) -> dict:
    """The figures of a part that decide something (all of them are in its `result`)."""
    if not isinstance(result, dict):
        return {}
    if name == "tests":  # pytest's counts
        return {key: result.get(key) for key in ("passed", "failed", "errors", "skipped")}
    if name == "overhead_cuda":
        keys = (
            "accumulation_ratio",
            "accumulation_ratio_best_rounds",
            "flexpar_16x_samples_per_s",
            "loop_16x_samples_per_s",
        )
        return {key: result.get(key) for key in keys}
    if name == "determinism_cost_cuda":
        return {
            "step_time_ratio_16vw": result.get("step_time_ratios", {}).get("16vw"),
            "peak_rss_ratio_16vw": result.get("peak_memory_ratios", {}).get("16vw"),  # host memory, not the GPU's
        }
    if name == "join_stream_cpu":
        sizes = result.get("sizes_gb") or [None]
        largest = sizes[-1]
        lost = result.get("members_lost_s", {})
        return {
            "largest_gb": largest,
            "members_lost_s_stream": lost.get("stream", {}).get(largest),
            "members_lost_s_blocking": lost.get("blocking", {}).get(largest),
            "members_lost_s_auto": lost.get("auto", {}).get(largest),
            "auto_choice": result.get("auto_choice", {}).get(largest),
            "auto_lost_ratio": result.get("auto_lost_ratio", {}).get(largest),
            "member_slowdown_max": result.get("member_slowdown_max"),
            "boundary_stall_s": result.get("boundary_stall_s", {}).get(largest),
            "bitwise_equal": result.get("bitwise_equal"),
        }
    return {}


# ---------------------------------------------------------------- the check


def skip_reason(part: Part, dry_run: bool, cuda_available: bool, cores: int) -> Optional[str]:
    """Why `part` does not run here (None: it runs)."""
    if dry_run:
        if part.dry_arguments is None:
            return "dry run: the CUDA parts are skipped (no GPU is used)"
        return None
    if part.needs_cuda and not cuda_available:
        return "no CUDA GPU is visible to torch: torch.cuda.is_available() is False"
    if cores < part.min_cores:
        return (
            f"{cores} cores, fewer than {part.min_cores}: the devices would share too few cores, the case this "
            "part is here to avoid"
        )
    return None


def run_parts(
    parts, dry_run: bool, cuda_available: bool, cores: int, work_dir: str, deadline: float, on_part=None
) -> Dict[str, dict]:
    """Every part in turn, each within min(its budget, what is left until `deadline`); name -> its record.

    `on_part(name, record)`: called after each part (the check rewrites its JSON there).
    """
    records: Dict[str, dict] = {}
    for part in parts:
        reason = skip_reason(part, dry_run, cuda_available, cores)
        left = deadline - time.monotonic()
        if reason is None and left < MIN_PART_S:
            reason = f"the check's total budget was spent ({max(0.0, left):.0f} s left)"
        if reason is not None:
            record = {"status": "skipped", "reason": reason, "what": part.what}
        else:
            progress(f"{part.name}: {part.what} (budget {min(part.budget_s, left):.0f} s)")
            env = dict(os.environ, PYTHONUNBUFFERED="1")
            if dry_run or part.cpu_only:
                env["CUDA_VISIBLE_DEVICES"] = ""
            result_path = os.path.join(work_dir, f"{part.name}.{'xml' if part.pytest else 'json'}")
            build = part.dry_arguments if dry_run else part.arguments
            record = {
                "what": part.what,
                **gpu_check_run.run_part(
                    part.name,
                    build(result_path),
                    min(part.budget_s, left),
                    work_dir,
                    result_path,
                    env,
                    part.pytest,
                    ROOT,
                ),
            }
            record["headline"] = headline(part.name, record["result"])
            if dry_run:
                record["dry_run_form"] = "no GPU visible, the tiny form where there is one: not the check's figures"
        records[part.name] = record
        if on_part is not None:
            on_part(part.name, record)
    return records


def summary_rows(records: Dict[str, dict]) -> List[dict]:
    rows = []
    for name, record in records.items():
        figures = ", ".join(
            f"{key} {harness.fmt(value) if isinstance(value, float) else value}"
            for key, value in record.get("headline", {}).items()
        )
        rows.append(
            {
                "part": name,
                "status": record["status"],
                "wall_s": record.get("wall_s"),
                "budget_s": record.get("budget_s"),
                "figures, or why not": figures
                if record["status"] == "ok"
                else record.get("reason") or record.get("error"),
            }
        )
    return rows


def parse_arguments(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--json", metavar="PATH", default=DEFAULT_JSON, help=f"write the results here (default: {DEFAULT_JSON})"
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="no GPU used: the CUDA parts skipped, the others in a tiny form (checks the plumbing on a CPU machine)",
    )
    return parser.parse_args(argv)


def main() -> int:
    arguments = parse_arguments()
    deadline = STARTED + TOTAL_BUDGET_S
    started_utc = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    host = gpu_check_host.host_info()
    print(f"gpu_check{' (dry run)' if arguments.dry_run else ''}: {gpu_check_host.describe_host(host)}", flush=True)
    if not host["cuda_available"] and not arguments.dry_run:
        print("gpu_check: torch sees no CUDA GPU: the CUDA parts will be skipped (a CPU-only torch?)", flush=True)
    report = {
        "dry_run": arguments.dry_run,
        "started_utc": started_utc,
        "total_budget_s": TOTAL_BUDGET_S,
        "host": host,
        "parts": {},
        "complete": False,
    }

    def save(name: str, record: dict) -> None:
        report["parts"][name] = record
        report["wall_s"] = round(time.monotonic() - STARTED, 1)
        harness.write_json(arguments.json, report)
        why = record.get("reason") or record.get("error")
        progress(f"{name}: {record['status']}" + (f" ({why})" if why else ""))

    harness.write_json(arguments.json, report)
    with harness.run_folder("flexpar-gpu-check-") as work_dir:
        records = run_parts(
            PARTS, arguments.dry_run, host["cuda_available"], host["cpu_cores"], work_dir, deadline, save
        )
    report["complete"] = True
    report["wall_s"] = round(time.monotonic() - STARTED, 1)
    harness.write_json(arguments.json, report)
    harness.print_table(
        summary_rows(records),
        ["part", "status", "wall_s", "budget_s", "figures, or why not"],
        "gpu_check" + (" (dry run: no GPU used, not the check's figures)" if arguments.dry_run else ""),
    )
    print(f"{report['wall_s']:.0f} s in all; written to {os.path.abspath(arguments.json)}")
    return 1 if any(record["status"] in ("failed", "timed_out") for record in records.values()) else 0


if __name__ == "__main__":
    harness.run(main)
