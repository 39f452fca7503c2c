"""benchmarks/gpu_check.py: its dry run end to end (no GPU used), and how it records a part that fails,
runs past its budget or is left out.

The dry run takes 20-40 s on the 2-core machine (quiet to loaded): pytest on test_cuda.py (every
test skips itself) and join_stream.py's tiny form; the CUDA parts are skipped.
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "benchmarks")
sys.path.insert(0, BENCHMARKS)

import determinism  # noqa: E402
import gpu_check  # noqa: E402
import gpu_check_host  # noqa: E402
import join_stream  # noqa: E402
import overhead  # noqa: E402

CUDA_PARTS = ("overhead_cuda", "determinism_cost_cuda")
CUDA_TESTS = Path(__file__).with_name("test_cuda.py")


def test_the_dry_run_writes_every_part_and_the_host(tmp_path):
    path = tmp_path / "check.json"
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, os.path.join(BENCHMARKS, "gpu_check.py"), "--dry-run", "--json", str(path)],
        capture_output=True,
        text=True,
        timeout=150,
    )
    wall = time.monotonic() - started
    report = json.loads(path.read_text())
    statuses = {name: record["status"] for name, record in report["parts"].items()}
    # Exit status 1 exactly when a part failed: here only join_stream's tiny run may, when on a loaded
    # machine its job ends before the joiner joins (join_stream.py's own verdict, recorded with its JSON).
    failed = {name for name, status in statuses.items() if status in ("failed", "timed_out")}
    assert failed <= {"join_stream_cpu"}, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.returncode == (1 if failed else 0), (statuses, done.stderr[-3000:])
    assert set(report) == {"dry_run", "started_utc", "total_budget_s", "host", "parts", "complete", "wall_s"}
    assert report["dry_run"] is True and report["complete"] is True
    assert 0 < report["wall_s"] <= wall
    host = report["host"]
    for key in ("cpu_cores", "cpu_model", "memory_bytes", "torch", "torch_cuda", "cuda_available", "gpus"):
        assert key in host
    for key in ("cudnn", "nccl", "nvidia_driver", "python", "platform", "flexpar", "flexpar_commit"):
        assert key in host
    assert host["cpu_cores"] >= 1 and host["memory_bytes"] > 0
    assert host["torch"] == torch.__version__ and host["torch_cuda"] == torch.version.cuda
    assert isinstance(host["gpus"], list)
    assert "cores" in done.stdout and f"torch {torch.__version__}" in done.stdout  # the host, printed too

    parts = report["parts"]
    assert set(parts) == {part.name for part in gpu_check.PARTS}
    for name in CUDA_PARTS:  # skipped, with the reason, and no figure
        assert parts[name]["status"] == "skipped"
        assert "dry run" in parts[name]["reason"]
        assert "result" not in parts[name] and "headline" not in parts[name]
    tests = parts["tests"]  # no GPU visible: pytest skips each test and says why
    assert tests["status"] == "skipped", tests
    cuda_tests = CUDA_TESTS.read_text().count("\ndef test_")  # test_cuda.py's tests, each skipped here
    assert tests["result"]["passed"] == 0 and tests["result"]["failed"] == 0
    assert tests["result"]["skipped"] == cuda_tests >= 4, tests["result"]
    assert any("CUDA" in reason for reason in tests["result"]["skip_reasons"])
    stream = parts["join_stream_cpu"]  # the tiny form, whatever the core count
    assert "--sizes" in stream["command"] and stream["dry_run_form"]
    assert stream["result"]["sizes_gb"] == ["0.01"], stream["output_tail"]
    if stream["status"] == "failed":  # the benchmark's verdict (exit status 1), its figures all the same
        assert stream["exit_status"] == 1 and stream["result"]["failed"], stream["output_tail"]
    assert set(stream["headline"]) >= {"members_lost_s_stream", "member_slowdown_max", "bitwise_equal"}
    for record in (tests, stream):
        assert record["wall_s"] <= record["budget_s"] and record["output_tail"]


def _python_part(name, code, budget_s=30.0):
    return gpu_check.Part(name, f"the {name} part", budget_s, lambda out: ["-c", code, out], None)


def test_a_part_that_fails_or_runs_past_its_budget_is_recorded_and_the_others_still_run(tmp_path):
    writes = "import json, sys; json.dump({'figure': 1.5}, open(sys.argv[1], 'w'))"
    parts = [
        _python_part("slow", "import time; print('started', flush=True); time.sleep(60)", budget_s=1.0),
        _python_part("broken", "print('it broke'); raise SystemExit(3)"),
        _python_part("silent", "pass"),
        _python_part("good", writes),
    ]
    seen = []
    records = gpu_check.run_parts(
        parts, False, False, 2, str(tmp_path), time.monotonic() + 120, lambda name, _: seen.append(name)
    )
    assert seen == ["slow", "broken", "silent", "good"]
    assert records["slow"]["status"] == "timed_out" and records["slow"]["wall_s"] < 30
    assert "budget" in records["slow"]["error"] and "started" in records["slow"]["output_tail"]
    assert records["broken"]["status"] == "failed" and records["broken"]["exit_status"] == 3
    assert "exit status 3" in records["broken"]["error"] and "it broke" in records["broken"]["output_tail"]
    assert records["silent"]["status"] == "failed" and "no JSON" in records["silent"]["error"]
    assert records["good"]["status"] == "ok" and records["good"]["result"] == {"figure": 1.5}

    late = gpu_check.run_parts(parts[-1:], False, False, 2, str(tmp_path), time.monotonic() + 1)
    assert late["good"]["status"] == "skipped" and "total budget" in late["good"]["reason"]


def test_parts_left_out_say_why():
    by_name = {part.name: part for part in gpu_check.PARTS}
    no_cuda = gpu_check.skip_reason(by_name["overhead_cuda"], False, False, 16)
    assert "no CUDA GPU" in no_cuda
    assert gpu_check.skip_reason(by_name["overhead_cuda"], False, True, 2) is None
    assert "fewer than 8" in gpu_check.skip_reason(by_name["join_stream_cpu"], False, True, 4)
    assert gpu_check.skip_reason(by_name["join_stream_cpu"], False, False, 8) is None
    assert gpu_check.skip_reason(by_name["join_stream_cpu"], True, False, 2) is None  # the dry run's tiny form
    assert gpu_check.skip_reason(by_name["tests"], False, False, 2) is None  # pytest says what it skipped


@pytest.mark.parametrize("dry_run", [False, True])
def test_the_commands_parse_with_the_benchmarks_own_command_lines(dry_run):
    parsers = {
        "overhead.py": overhead.parse_arguments,
        "determinism.py": determinism.parse_arguments,
        "join_stream.py": join_stream.parse_arguments,
    }
    parsed = {}
    for part in gpu_check.PARTS:
        build = part.dry_arguments if dry_run else part.arguments
        if build is None or part.pytest:
            continue
        arguments = build("out.json")
        parsed[part.name] = parsers[os.path.basename(arguments[0])](arguments[1:])
        assert parsed[part.name].json == "out.json"
    if dry_run:
        assert set(parsed) == {"join_stream_cpu"} and parsed["join_stream_cpu"].sizes_gb == (0.01,)
        return
    assert parsed["overhead_cuda"].device == "cuda" and parsed["overhead_cuda"].rounds == gpu_check.ROUNDS
    cost = parsed["determinism_cost_cuda"]
    assert cost.device == "cuda" and cost.cost_only and cost.rounds == gpu_check.ROUNDS
    assert parsed["join_stream_cpu"].quick and parsed["join_stream_cpu"].sizes_gb == join_stream.QUICK_SIZES_GB
    assert sum(part.budget_s for part in gpu_check.PARTS) < gpu_check.TOTAL_BUDGET_S <= 8 * 60 - 20


def test_the_host_names_its_gpus_and_versions_where_torch_sees_them():
    """The GPU side of the host's description with a stand-in for torch.cuda (this machine has no GPU)."""
    from types import SimpleNamespace

    properties = SimpleNamespace(name="NVIDIA H100 80GB HBM3", total_memory=80 << 30, major=9, minor=0)
    fake = SimpleNamespace(
        cuda=SimpleNamespace(
            device_count=lambda: 1,
            get_device_properties=lambda _: properties,
            nccl=SimpleNamespace(version=lambda: (2, 27, 3)),
        ),
        backends=SimpleNamespace(cudnn=SimpleNamespace(version=lambda: 91000)),
    )
    info = {**gpu_check_host.host_info(), "cuda_available": True, "torch_cuda": "12.8"}
    gpu_check_host.describe_gpus(info, fake)
    assert info["gpus"] == [{"name": "NVIDIA H100 80GB HBM3", "memory_bytes": 80 << 30, "capability": "9.0"}]
    assert info["nccl"] == "2.27.3" and info["cudnn"] == 91000
    line = gpu_check_host.describe_host(info)
    assert "1 GPU (NVIDIA H100 80GB HBM3, 80 GiB)" in line and "CUDA 12.8" in line and "NCCL 2.27.3" in line
    assert f"{info['cpu_cores']} cores" in line
