"""Shared fixtures: every multi-process test goes through `train`, which runs a real
job (worker processes over gloo) with a time limit and always cleans up: fit()
kills its workers when it returns or raises, and the fixture checks none is left."""

import multiprocessing

import pytest


@pytest.fixture
def train(tmp_path):
    """train(job, steps=..., devices=..., **options) -> (model, summary), metrics in tmp_path."""

    def run(job, **options):
        options.setdefault("metrics", str(tmp_path / "metrics.jsonl"))
        options.setdefault("display", False)
        options.setdefault("quiet", True)
        options.setdefault("oversubscribe", True)
        options.setdefault("timeout_s", 10.0)
        return job.fit(**options)

    yield run
    leftovers = [child for child in multiprocessing.active_children() if child.name.startswith("flexpar-")]
    for child in leftovers:
        child.kill()
    assert not leftovers, f"worker processes left running: {[c.name for c in leftovers]}"


@pytest.fixture
def metrics_file(tmp_path):
    return tmp_path / "metrics.jsonl"
