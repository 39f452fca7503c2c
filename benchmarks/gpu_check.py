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
   (``accumulation_ratio``, goal >= 0.97), alternating rounds.
3. ``determinism_cost_cuda``: ``determinism.py --cost-only --device cuda``:
   float sums against exact int64 sums on one GPU with 16 VWs
   (``step_time_ratio``: float step time / exact's, 1.0 when exact sums are
   free): the figure that decides whether ``deterministic=True`` can be the
   default.
4. ``join_stream_cpu``: where the host has 8 cores or more,
   ``join_stream.py --quick`` with CPU devices: the members' lost time and
   slowdown while a state streams to a joiner, without three processes
   sharing two cores.

The JSON: ``host`` (GPUs, CPU cores and model, memory, torch, CUDA, cuDNN,
NCCL and driver versions, flexpar's version and commit), ``parts`` (name ->
``status``: ok, failed, timed_out or skipped; ``reason`` or ``error``;
``command``, ``budget_s``, ``wall_s``, ``exit_status``, ``output_tail``,
``result``: the part's own JSON, ``headline``: its deciding figures),
``dry_run``, ``started_utc``, ``wall_s``, ``complete``. A skipped part says
why and holds no figure.

``--dry-run``: the same check end to end with no GPU used (every part's
process sees ``CUDA_VISIBLE_DEVICES=""``), for a CPU machine: the CUDA
parts are skipped (recorded so, with the reason), the tests run (pytest skips
them, and says so), and join_stream runs a tiny form (one 0.01 GB state,
one round) whatever the core count, so that the subprocesses, budgets and the
JSON's assembly are exercised. A dry run's figures are not the check's.

Exit status: 0 when no part failed or ran past its budget, else 1.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import time
import xml.etree.ElementTree as ElementTree
from typing import Callable, Dict, List, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness

BENCHMARKS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(BENCHMARKS)
DEFAULT_JSON = "gpu_check.json"
TOTAL_BUDGET_S = 460.0  # all parts together; with start-up and the host's description, under 8 minutes
MIN_PART_S = 15.0  # a part is not started with less than this left of the total budget
ROUNDS = 3  # alternating rounds of the two CUDA comparisons (overhead.py's full run has 5)
MIN_CORES_FOR_JOIN_STREAM = 8
TAIL_CHARS = 4000
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


# ---------------------------------------------------------------- the host


def _run_quietly(command: List[str], timeout_s: float = 10.0) -> Optional[str]:
    """A short command's stdout, stripped; None when it is missing, fails or hangs."""
    if shutil.which(command[0]) is None:
        return None
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, cwd=ROOT)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def _cpu_model() -> Optional[str]:
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def _memory_bytes() -> Optional[int]:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def host_info() -> dict:
    """What the figures were measured on: GPUs, cores, memory, the versions of torch, CUDA and flexpar."""
    import torch

    import flexpar

    info = {
        "cpu_cores": harness.cpu_count(),  # the cores this process may run on (what flexpar counts)
        "cpu_cores_online": os.cpu_count(),
        "cpu_model": _cpu_model(),
        "memory_bytes": _memory_bytes(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,  # the CUDA torch was built with (None: a CPU-only torch)
        "cuda_available": torch.cuda.is_available(),
        "gpus": [],
        "cudnn": None,
        "nccl": None,
        "nvidia_driver": None,
        "flexpar": flexpar.__version__,
        "flexpar_commit": _run_quietly(["git", "rev-parse", "--short", "HEAD"]),
    }
    if info["cuda_available"]:
        try:
            _describe_gpus(info, torch)
        except Exception as error:  # a broken driver: say so, and let the parts show what runs
            info["gpu_error"] = f"{type(error).__name__}: {error}"
    return info


def _describe_gpus(info: dict, torch) -> None:
    """The GPUs, cuDNN, NCCL and the driver into `info`."""
    for index in range(torch.cuda.device_count()):
        properties = torch.cuda.get_device_properties(index)
        info["gpus"].append(
            {
                "name": properties.name,
                "memory_bytes": properties.total_memory,
                "capability": f"{properties.major}.{properties.minor}",
            }
        )
    info["cudnn"] = torch.backends.cudnn.version()
    try:
        version = torch.cuda.nccl.version()
        info["nccl"] = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
    except Exception:  # a torch built without NCCL
        info["nccl"] = None
    driver = _run_quietly(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
    info["nvidia_driver"] = driver.splitlines()[0] if driver else None


def describe_host(info: dict) -> str:
    """The host in one line."""
    gib = 1 << 30
    if info["gpus"]:
        names = sorted({gpu["name"] for gpu in info["gpus"]})
        gpus = f"{len(info['gpus'])} GPU ({', '.join(names)}, {info['gpus'][0]['memory_bytes'] / gib:.0f} GiB)"
    else:
        gpus = "no CUDA GPU visible"
    memory = f"{info['memory_bytes'] / gib:.0f} GiB memory" if info["memory_bytes"] else "memory unknown"
    return (
        f"{gpus}; {info['cpu_cores']} cores ({info['cpu_model']}); {memory}; torch {info['torch']}, "
        f"CUDA {info['torch_cuda']}, cuDNN {info['cudnn']}, NCCL {info['nccl']}, driver {info['nvidia_driver']}; "
        f"flexpar {info['flexpar']} ({info['flexpar_commit']})"
    )


# ---------------------------------------------------------------- one part


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


def headline(name: str, result) -> dict:
    """The figures of a part that decide something (all of them are in its `result`)."""
    if not isinstance(result, dict):
        return {}
    if name == "tests":  # pytest's counts
        return {key: result.get(key) for key in ("passed", "failed", "errors", "skipped")}
    if name == "overhead_cuda":
        keys = ("accumulation_ratio", "accumulation_ratio_best_rounds", "flexpar_16x_samples_per_s")
        return {key: result.get(key) for key in keys + ("loop_16x_samples_per_s",)}
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
            "member_slowdown_max": result.get("member_slowdown_max"),
            "boundary_stall_s": result.get("boundary_stall_s", {}).get(largest),
            "bitwise_equal": result.get("bitwise_equal"),
        }
    return {}


def run_part(
    name: str,
    arguments: List[str],
    budget_s: float,
    work_dir: str,
    result_path: str,
    env: Optional[dict] = None,
    pytest: bool = False,
) -> dict:
    """Run `sys.executable arguments...` in its own process group for at most `budget_s`; its record.

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
                command, budget_s, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT
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
    record["headline"] = headline(name, record["result"])
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
                **run_part(
                    part.name, build(result_path), min(part.budget_s, left), work_dir, result_path, env, part.pytest
                ),
            }
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
    host = host_info()
    print(f"gpu_check{' (dry run)' if arguments.dry_run else ''}: {describe_host(host)}", flush=True)
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
