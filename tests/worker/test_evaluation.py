"""Evaluation: the split of the evaluation set (pure, property-tested) and evaluations on real devices.

The promise: the metrics of an evaluation equal a single-process evaluation of
the whole set (`flexpar.worker.evaluator.evaluate_all`) on any device set, with a
join, or with a failure during the evaluation, each sample counted once.
"""

import json
import multiprocessing
import os
import time

import evaluation_pieces as ep
import pieces
import pytest
from conftest import free_port
from hypothesis import given, settings
from hypothesis import strategies as st

from flexpar.core import evaluation
from flexpar.worker.evaluator import evaluate_all
from flexpar.worker.link_follower import FOLLOW_ALL_S

# ------------------------------------------------------------------ the split (pure)


@settings(max_examples=300, deadline=None)
@given(
    size=st.integers(1, 5000), batch=st.integers(1, 300), shares=st.lists(st.integers(1, 64), min_size=1, max_size=12)
)
def test_every_sample_is_evaluated_exactly_once(size, batch, shares):
    ranges = evaluation.sample_ranges(size, shares, batch)
    assert len(ranges) == len(shares)
    covered = [index for part in ranges for index in part]
    assert covered == list(range(size)), "contiguous, in rank order, each sample once"
    for part in ranges:
        assert part.start % batch == 0 or part.start == size, "a device's range starts at a chunk"


@settings(max_examples=300, deadline=None)
@given(chunks=st.integers(0, 3000), shares=st.lists(st.integers(1, 64), min_size=1, max_size=12))
def test_chunks_follow_the_shares(chunks, shares):
    parts = evaluation.split_chunks(chunks, shares)
    assert sum(len(part) for part in parts) == chunks
    total = sum(shares)
    for part, share in zip(parts, shares):
        assert abs(len(part) - chunks * share / total) < 1.0, "within one chunk of the proportional share"


@given(
    size=st.integers(1, 2000),
    batch=st.integers(1, 100),
    shares=st.lists(st.integers(1, 16), min_size=1, max_size=6),
    other=st.lists(st.integers(1, 16), min_size=1, max_size=6),
)
def test_the_chunks_do_not_depend_on_the_device_set(size, batch, shares, other):
    """The batches evaluated are the same fixed chunks, whatever the split: the sums cannot depend on it."""

    def chunks_of(split):
        return [
            tuple(chunk)
            for part in evaluation.sample_ranges(size, split, batch)
            for chunk in evaluation.batches_of(part, batch)
        ]

    assert chunks_of(shares) == chunks_of(other) == chunks_of([1])


def test_split_examples():
    assert evaluation.sample_ranges(997, [2, 1, 1], 12) == [range(0, 504), range(504, 756), range(756, 997)]
    assert evaluation.sample_ranges(5, [1, 1, 1], 4) == [range(0, 0), range(0, 4), range(4, 5)]
    assert evaluation.chunk_count(997, 12) == 84


@pytest.mark.parametrize("shares", [[], [0, 1], [1.5], [True]])
def test_split_refuses_bad_shares(shares):
    with pytest.raises(ValueError, match="shares"):
        evaluation.split_chunks(4, shares)


def test_metrics_are_checked_and_added_in_key_order():
    import torch

    numbers = evaluation.as_numbers({"count": 3, "loss_sum": torch.tensor(1.5), "correct": torch.tensor([2])})
    assert numbers == {"count": 3.0, "loss_sum": 1.5, "correct": 2.0}
    keys = ("correct", "count", "loss_sum")
    assert evaluation.metric_vector(numbers, keys) == [2.0, 3.0, 1.5]
    assert evaluation.metric_vector({}, keys) == [0.0, 0.0, 0.0]
    assert evaluation.metrics_of([2.0, 3.0, 1.5], keys) == {"correct": 2, "count": 3, "loss_sum": 1.5}
    assert evaluation.means({"correct": 2, "count": 4, "loss_sum": 1.0}) == {"correct": 0.5, "loss": 0.25}
    assert evaluation.means({"loss_sum": 1.0}) == {}
    for bad, message in [
        (1.0, "dict"),
        ({}, "dict"),
        ({"x": torch.ones(2)}, "shape"),
        ({"x": "a"}, "number"),
        ({1: 2.0}, "strings"),
    ]:
        with pytest.raises(evaluation.MetricsError, match=message):
            evaluation.as_numbers(bad)
    with pytest.raises(evaluation.MetricsError, match="same metrics"):
        evaluation.as_numbers({"a": 1}, keys=("a", "b"))


# ------------------------------------------------------------------ the job's checks


def test_an_evaluation_needs_both_pieces():
    with pytest.raises(ValueError, match="evaluate= too"):
        pieces.make_job(eval_dataset=ep.make_eval_dataset())
    with pytest.raises(ValueError, match="eval_dataset= too"):
        pieces.make_job(evaluate=ep.Evaluate())
    with pytest.raises(ValueError, match="eval_batch"):
        ep.make_job(eval_batch=0)


def test_eval_every_without_an_evaluation_set_is_refused_before_any_worker_starts(train):
    with pytest.raises(ValueError, match="eval_every=2 needs an evaluation set"):
        train(pieces.make_job(), steps=2, eval_every=2)


def test_a_bad_evaluate_is_reported_once_from_the_driver(train):
    job = pieces.make_job(eval_dataset=ep.make_eval_dataset(), evaluate=pieces.Loss())  # returns a tensor
    with pytest.raises(flexpar_user_error(), match="non-empty dict of summed metrics"):
        train(job, steps=2)


def flexpar_user_error():
    from flexpar import UserCodeError

    return UserCodeError


# ------------------------------------------------------------------ on real devices


def _evals(path):
    return [record for record in map(json.loads, open(path)) if record["kind"] == "eval"]


def _assert_equals_reference(job, evals, final_model, final_step):
    """Each evaluation equals one process evaluating the whole set with the reference model of its step.

    The last one is compared with the returned model too: the same parameters,
    so only the float64 order of additions differs (rtol 1e-6, counts exact).
    """
    for record in evals:
        want = ep.evaluate_reference(job, record["step"])
        # The trained parameters equal the reference's to about 1e-6 (float reduction order).
        ep.assert_metrics_equal(record["metrics"], want, rtol=1e-4)
        assert record["metrics"]["count"] == ep.EVAL_SIZE
    assert evals[-1]["step"] == final_step
    ep.assert_metrics_equal(evals[-1]["metrics"], evaluate_all(ep.without_delays(job), final_model))


@pytest.mark.parametrize("devices", [1, 2, 3])
def test_evaluation_equals_one_process_on_any_device_set(train, metrics_file, devices):
    job = ep.make_job(virtual_workers=6, eval_batch=20)
    model, summary = train(job, steps=8, devices=devices, eval_every=3)
    evals = _evals(metrics_file)
    assert [record["step"] for record in evals] == [3, 6, 8], "every 3 steps and after the last"
    assert all(len(record["devices"]) == devices for record in evals)
    _assert_equals_reference(job, evals, model, 8)
    assert summary["eval"] == {"step": 8, "metrics": evals[-1]["metrics"]}


class EvaluateUntilTheDeviceSetChanges(ep.Evaluate):
    """`ep.Evaluate`, held in generation 1's evaluation until the coordinator publishes generation 2.

    The deterministic handle on "during an evaluation": in a worker, while the
    job's store says the latest generation is still 1, the evaluation waits
    (reading `gen/latest`, which the coordinator writes when a joiner is ready
    or a leave is accepted), then leaves `waited-<process name>` in `folder`
    and finishes. So the change became ready while that evaluation ran on
    every device that left a marker. The driver's own call (the metric names)
    does not wait.
    """

    def __init__(self, port: int, folder: str, timeout_s: float = 90.0):
        super().__init__(0.0)
        self.port, self.folder, self.timeout_s = port, folder, timeout_s
        self._past = False
        self._store = None

    # In a worker the store client connects when the job is unpickled (the worker's start), so that
    # its first look at the generation, at the first evaluation batch, costs no connection.
    def __getstate__(self):
        return {**self.__dict__, "_store": None}

    def __setstate__(self, state):
        self.__dict__.update(state)
        if multiprocessing.current_process().name.startswith("flexpar-"):
            self._store = self._connect()

    def _connect(self):
        import datetime

        import torch.distributed as dist

        return dist.TCPStore("127.0.0.1", self.port, is_master=False, timeout=datetime.timedelta(seconds=30))

    def __call__(self, model, batch):
        if not self._past and multiprocessing.current_process().name.startswith("flexpar-"):
            self._wait_for_a_new_generation()
        return super().__call__(model, batch)

    def _wait_for_a_new_generation(self) -> None:
        store = self._store or self._connect()
        if store.get("gen/latest") == b"1":
            deadline = time.monotonic() + self.timeout_s
            while store.get("gen/latest") == b"1":
                if time.monotonic() > deadline:
                    raise RuntimeError(f"no generation 2 within {self.timeout_s} s of an evaluation in generation 1")
                time.sleep(0.02)
            # This read the store itself. The device's own follower thread (flexpar.worker.link_follower.StoreFollower)
            # sees the generation one poll (DEVICE_POLL_S) after the coordinator's notice, which follows
            # the key, and at the latest at its next full read (FOLLOW_ALL_S); the device then puts what it
            # saw into the next step's statistics. Held until the follower has had two full reads, "became
            # ready during this evaluation" means "applies at the next step boundary"; without the hold, a
            # short step could pass before the follower's poll (CI saw the leave at step 4, not 3).
            time.sleep(2 * FOLLOW_ALL_S)
            open(os.path.join(self.folder, f"waited-{multiprocessing.current_process().name}"), "w").close()
        self._past = True


def _held_job(folder, port, **extra):
    """ep.make_job's job whose evaluation waits for generation 2 (EvaluateUntilTheDeviceSetChanges)."""
    return pieces.make_job(
        eval_dataset=ep.make_eval_dataset(), evaluate=EvaluateUntilTheDeviceSetChanges(port, folder), **extra
    )


def _waited(folder):
    return sorted(name for name in os.listdir(folder) if name.startswith("waited-"))


def test_a_join_ready_during_an_evaluation_changes_nothing(train, metrics_file, tmp_path):
    """The join is asked after step 0 and its device becomes ready while both devices are inside the
    evaluation of step 1 (which waits for it); it joins at the next step boundary. The evaluations on
    two devices and on three equal the single-process evaluation."""
    port = free_port()
    job = _held_job(str(tmp_path), port, virtual_workers=6, eval_batch=12)
    model, summary = train(job, steps=8, devices=2, max_devices=3, eval_every=1, schedule="1:+1", port=port)
    assert _waited(tmp_path) == ["waited-flexpar-local-0", "waited-flexpar-local-1"], (
        "both devices were evaluating when the joiner became ready"
    )
    evals = _evals(metrics_file)
    assert [record["step"] for record in evals] == list(range(1, 9))
    assert [len(record["devices"]) for record in evals] == [2] + [3] * 7, "step 1's on two devices, then three"
    assert evals[0]["generation"] == 1 and evals[1]["generation"] == 2
    (join,) = [event for event in summary["events"] if event["event"] == "join"]
    assert join["step"] == 2, "at the step boundary after the evaluation"
    _assert_equals_reference(job, evals, model, 8)


def test_a_scheduled_leave_decided_during_an_evaluation_waits_for_its_step_boundary(train, metrics_file, tmp_path):
    """schedule "4:-1": the leave is decided (LEAVE_LEAD_STEPS ahead of its step) while all three devices
    evaluate step 2 (which waits for it); that evaluation completes on three devices, steps 2 and 3
    still train on three, the leaver goes at the boundary before step 4, and nothing is redone or
    counted twice."""
    port = free_port()
    job = _held_job(str(tmp_path), port, virtual_workers=6, eval_batch=20)
    model, summary = train(job, steps=6, devices=3, eval_every=2, schedule="4:-1", port=port)
    # The driver decides the leave when it reads the record that makes 2 steps committed, which rank
    # 0 sends as it starts evaluating: a device may find it published before its first evaluation
    # batch (CI saw local-0 do so). The evaluation cannot end before every device's does (their sums
    # meet in one all-reduce), so one device held until the leave was published is enough for
    # "decided during the evaluation"; that it still ran on all three devices is asserted below.
    waited = _waited(tmp_path)
    assert waited and set(waited) <= {f"waited-flexpar-local-{index}" for index in range(3)}, waited
    evals = _evals(metrics_file)
    assert [record["step"] for record in evals] == [2, 4, 6], "one record per evaluated step"
    assert [len(record["devices"]) for record in evals] == [3, 2, 2]
    steps = [record for record in map(json.loads, open(metrics_file)) if record["kind"] == "step"]
    assert [len(record["devices"]) for record in steps] == [3, 3, 3, 3, 2, 2]
    (leave,) = [event for event in summary["events"] if event["event"] in ("leave", "failure")]
    assert leave["event"] == "leave" and leave["step"] == 4, leave
    assert summary["schedule"][0]["status"] == "on time", summary["schedule"]
    _assert_equals_reference(job, evals, model, 6)
    pieces.assert_same_parameters(model, pieces.reference(job, 6))


def test_a_leave_asked_during_an_evaluation_waits_for_the_next_step_boundary(train, metrics_file):
    """SIGTERM (a preemption notice) to local-1 in the evaluation after step 4: the evaluation
    completes on the three devices, and local-1 leaves at the next step boundary."""
    job = ep.make_job(virtual_workers=6, eval_batch=20, delay_s=0.02)
    model, summary = train(job, steps=12, devices=3, eval_every=2, faults="4:local-1:eval:term")
    evals = _evals(metrics_file)
    assert [record["step"] for record in evals] == [2, 4, 6, 8, 10, 12]
    counts = [len(record["devices"]) for record in evals]
    assert counts[:2] == [3, 3] and counts[-1] == 2, counts
    (leave,) = [event for event in summary["events"] if event["event"] in ("leave", "failure")]
    assert leave["event"] == "leave" and leave["step"] > 4
    _assert_equals_reference(job, evals, model, 12)


@pytest.mark.parametrize(
    "fault", ["4:local-1:eval", "4:local-0:eval", "4:local-1:eval:stop"], ids=["killed", "rank-0-killed", "hung"]
)
def test_a_failure_during_an_evaluation_redoes_it(train, metrics_file, fault):
    """A device dies (kill -9; rank 0 too, which publishes the records) or hangs (SIGSTOP, found by its
    silent heartbeat) in the evaluation after step 4, before the sums are added: nothing of it is
    published; the survivors' new generation evaluates step 4 again, once, and the job goes on."""
    failed = fault.split(":")[1]
    job = ep.make_job(virtual_workers=6, eval_batch=20)
    model, summary = train(job, steps=6, devices=3, eval_every=2, faults=fault, heartbeat_timeout_s=1.0)
    evals = _evals(metrics_file)
    assert [record["step"] for record in evals] == [2, 4, 6], "one record per evaluated step"
    assert [len(record["devices"]) for record in evals] == [3, 2, 2]
    (failure,) = [
        record
        for record in map(json.loads, open(metrics_file))
        if record["kind"] == "event" and record["event"] == "failure"
    ]
    assert failure["detail"] == f"failed: {failed}" and failure["step"] == 4
    redone = evals[1]
    assert redone["generation"] == failure["generation"] > evals[0]["generation"], "the new generation's"
    assert failed not in redone["devices"]
    _assert_equals_reference(job, evals, model, 6)
    pieces.assert_same_parameters(model, pieces.reference(job, 6))


class RecordsPrecision:
    """Counts the batches evaluated under bf16 autocast, and the samples."""

    def __call__(self, model, batch):
        import torch

        under_bf16 = torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
        return {"bf16_batches": float(under_bf16), "count": len(batch[1])}


def test_evaluation_runs_under_the_jobs_autocast():
    """As Accelerate and Lightning do: mixed_precision covers evaluation too (flexpar/worker/evaluator.py)."""
    from flexpar.worker import evaluator

    for precision, batches in ((None, 0.0), ("bf16", 5.0)):
        job = pieces.make_job(
            eval_dataset=ep.make_eval_dataset(50), evaluate=RecordsPrecision(), eval_batch=10, mixed_precision=precision
        )
        assert evaluator.metric_keys(job, pieces.make_model()) == ("bf16_batches", "count")
        sums = evaluator.evaluate_samples(job, pieces.make_model(), range(50), ("bf16_batches", "count"))
        assert sums == {"bf16_batches": batches, "count": 50.0}, precision


def test_a_bf16_jobs_evaluation_on_devices_is_the_bf16_evaluation(train, metrics_file):
    """The devices evaluate under bf16 autocast: their metrics are evaluate_all's (which uses it too) of
    the returned model, and measurably not the float32 evaluation of that model."""
    import dataclasses

    job = ep.make_job(virtual_workers=4, eval_batch=50, mixed_precision="bf16")
    model, summary = train(job, steps=2, devices=2, eval_every=2)
    got = summary["eval"]["metrics"]
    ep.assert_metrics_equal(got, evaluate_all(job, model))
    full = evaluate_all(dataclasses.replace(job, mixed_precision=None), model)
    # bf16 against float32 on this model: 5.7e-5 relative (measured); the devices agree with evaluate_all
    # to 1e-6 (the float64 order of the chunks' sums).
    assert abs(got["loss_sum"] - full["loss_sum"]) > 1e-5 * abs(full["loss_sum"]), (got, full)


# ------------------------------------------------------------------ the eval record: file, display, plot

EVAL_RECORD = {
    "kind": "eval",
    "step": 4,
    "time": 1700000001.5,
    "elapsed_s": 1.5,
    "generation": 1,
    "devices": ["local-0", "local-1"],
    "eval_s": 0.25,
    "samples": 997,
    "metrics": {"correct": 750, "count": 997, "loss_sum": 402.6},
}


def test_eval_records_are_validated():
    from flexpar.observe.metrics import validate_record

    validate_record(EVAL_RECORD)
    validate_record({**EVAL_RECORD, "metrics": {"loss_sum": float("nan")}})  # a diverged model is recorded
    for change, message in [
        ({"metrics": {}}, "metrics"),
        ({"metrics": {"a": "x"}}, "must be a float"),
        ({"eval_s": -1.0}, "eval_s"),
        ({"extra": 1}, "not part of the schema"),
        ({"devices": []}, "at least one device"),
    ]:
        with pytest.raises(ValueError, match=message):
            validate_record({**EVAL_RECORD, **change})
    with pytest.raises(ValueError, match="'step', 'event' or 'eval'"):
        validate_record({**EVAL_RECORD, "kind": "evaluation"})


def test_the_display_logs_an_evaluation_as_means(caplog):
    import logging

    from flexpar.observe.display import LiveDisplay
    from flexpar.observe.log_lines import format_eval_line

    line = format_eval_line(EVAL_RECORD)
    assert line == "eval at step 4: correct 0.7523, loss 0.4038 (997 samples) | 2 devices, 0.25 s"
    # A token-weighted evaluation: its count is not a sample count, and the line does not call it one.
    tokens = {**EVAL_RECORD, "metrics": {"count": 4882, "loss_sum": 9764.0}}
    assert format_eval_line(tokens) == (
        "eval at step 4: loss 2 (means per count; count 4882 over 997 samples) | 2 devices, 0.25 s"
    )
    assert format_eval_line({**EVAL_RECORD, "metrics": {"auc_sum": 3.5}}).startswith("eval at step 4: auc_sum 3.5 |")
    with caplog.at_level(logging.INFO, logger="flexpar"):
        with LiveDisplay(10, force_terminal=False) as display:
            display.update(EVAL_RECORD)
    assert line in caplog.text


def test_the_display_panel_shows_the_latest_evaluation():
    pytest.importorskip("rich")
    import io

    from rich.console import Console

    from flexpar.observe.display import LiveDisplay

    console = Console(file=io.StringIO(), force_terminal=True, width=150)
    display = LiveDisplay(10, console=console)
    display.update(EVAL_RECORD)
    rendered = io.StringIO()
    Console(file=rendered, width=150).print(display._render())
    display.close()
    assert "eval at step 4: correct 0.7523, loss 0.4038" in rendered.getvalue()


def test_the_plot_marks_evaluations(tmp_path, metrics_file):
    pytest.importorskip("matplotlib")
    from flexpar.observe.metrics import MetricsWriter
    from flexpar.observe.plot import plot_timeline

    with MetricsWriter(metrics_file) as writer:
        for step in range(6):
            writer.write(
                {
                    "kind": "step",
                    "step": step,
                    "time": 1700000000.0 + step,
                    "elapsed_s": float(step),
                    "loss": 1.0 / (step + 1),
                    "samples_per_s": 10.0,
                    "step_time_s": 1.0,
                    "generation": 1,
                    "devices": ["local-0", "local-1"],
                    "assignment": [2, 2],
                    "busy_s": [0.5, 0.5],
                    "imbalance": 0.0,
                    "lr": 0.1,
                    **_issue_17_fields(),
                }
            )
            if step % 2 == 1:
                writer.write({**EVAL_RECORD, "step": step + 1, "elapsed_s": step + 0.5, "time": 1700000000.5 + step})
    output = tmp_path / "timeline.png"
    plot_timeline(metrics_file, output)
    assert output.stat().st_size > 10_000


def _issue_17_fields():
    """Step-record fields other work may add to the schema (given only when the schema has them)."""
    from flexpar.observe.metrics import STEP_KEYS

    return {"grad_norm": 1.0} if "grad_norm" in STEP_KEYS else {}
