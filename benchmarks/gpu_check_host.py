"""The host of benchmarks/gpu_check.py: what its figures were measured on, for its JSON and its first line.

GPUs (name, memory, compute capability), CPU cores and model, memory, the
versions of Python, torch, the CUDA torch was built with, cuDNN, NCCL and the
NVIDIA driver, flexpar's version and commit. Nothing here can end the check:
a query that fails leaves its field None (a GPU query that raises: `gpu_error`).
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
from typing import List, Optional

import harness

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository (flexpar's commit)


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
            describe_gpus(info, torch)
        except Exception as error:  # a broken driver: say so, and let the parts show what runs
            info["gpu_error"] = f"{type(error).__name__}: {error}"
    return info


def describe_gpus(info: dict, torch) -> None:
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
