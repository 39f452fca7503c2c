"""Whether a device's message lets it into the job: pure checks of what it says about itself.

The coordinator (flexpar/driver/coordinator.py) reads the devices' messages,
checks each one's proof of the job's secret, and asks here what the rest
means: whether a warm device runs the job's flexpar version, model and frozen
weights (`ready_problem`), what a device that outlived its driver reports
(`device_report`), and how many devices a scale request adds or removes
(`scale_delta`). The answers are data; membership.decide acts on them.
"""

from __future__ import annotations

from typing import Callable, Optional

from flexpar.core import adoption, factory_checks, frozen

WRONG_SECRET = "wrong job secret: pass the job's secret (--secret-file, FLEXPAR_SECRET or FLEXPAR_SECRET_FILE)"
ADOPTION_PROOF_MISMATCH = (
    "its proof does not match this job's secret: restart the driver with the job's secret "
    "(--secret-file, FLEXPAR_SECRET or FLEXPAR_SECRET_FILE)"
)


def ready_problem(
    message: dict,
    version: str,
    job_digest: str,
    job_shapes: Optional[list],
    frozen_reference: Callable[[], Optional[dict]] = lambda: None,
) -> str:
    """Why a warm device (its "ready" or "adopt" message) cannot train with this job; "" when it can.

    The checks, in order: its flexpar `version`; its model's digest (`job_digest`; a refusal names
    the differing parameters when the job's `job_shapes` are known); its frozen weights' digests
    against `frozen_reference()`, called only when the model matched (None: no content check).
    """
    if message.get("version") != version:
        return (
            f"flexpar version {message.get('version')} differs from the job's {version}; "
            f"install flexpar=={version} on the joining host"
        )
    if message.get("digest") != job_digest:
        shapes = message.get("shapes")
        problem = ""
        if job_shapes is not None and isinstance(shapes, list):
            problem = factory_checks.shape_problem(job_shapes, shapes, f"device {message.get('device_id')}")
        return problem or (
            "the model differs from the job's (parameter names, shapes or dtypes do not match): "
            "join with the same script and model code"
        )
    reference = frozen_reference()
    if reference is not None and message.get("frozen_digest") != frozen.combined_digest(reference):
        reported = message.get("frozen_digests")
        if not isinstance(reported, dict):
            return "the device did not report its frozen weights' digests: install the job's flexpar version"
        return frozen.frozen_problem(reference, reported, where=f"device {message.get('device_id', '?')}")
    return ""


def device_report(message: dict) -> adoption.DeviceReport:
    """What a device that outlived its driver reported: its notice ("present") or its report ("adopt")."""
    return adoption.DeviceReport(
        message.get("device_id", ""),
        int(message.get("generation", 0)),
        tuple(message.get("members", ())),
        int(message.get("seen", 0)),
        int(message.get("committed", -1)),
        bool(message.get("warm", False)),
        float(message.get("lost_at", 0.0)),
        bool(message.get("abandoned", False)),
        message.get("type") == "adopt",
    )


def scale_delta(request: dict, device_count: int) -> int:
    """The devices a scale request adds (negative: removes): its `delta`, or its `devices` less those there are."""
    if "delta" in request:
        return int(request["delta"])
    return int(request["devices"]) - device_count
