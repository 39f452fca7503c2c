"""The user's side: bad input gets one clear error, before workers start where possible."""

import subprocess
import sys
import textwrap
import time

import pieces
import pytest
import torch
from torch import nn

import flexpar
from flexpar.core import batching
from flexpar.observe.metrics import read_records


def test_global_batch_not_divisible():
    with pytest.raises(ValueError, match=r"global_batch=48 is not divisible by virtual_workers=5"):
        pieces.make_job(virtual_workers=5)


def test_micro_batch_sets_virtual_workers():
    job = flexpar.Job(
        model=pieces.make_model,
        optimizer=pieces.sgd,
        loss=pieces.Loss(),
        dataset=pieces.make_dataset(),
        global_batch=48,
        micro_batch=12,
    )
    assert job.virtual_workers == 4


def test_dataset_shorter_than_one_batch():
    with pytest.raises(ValueError, match=r"dataset has 40 samples, fewer than one global batch of 48"):
        pieces.make_job(dataset=pieces.make_dataset(40))


def broken_model():
    raise ZeroDivisionError("bad layer size")


def test_model_factory_error_is_raised_once_in_the_driver(train):
    job = pieces.make_job(model=broken_model)
    with pytest.raises(ZeroDivisionError, match="bad layer size"):
        train(job, steps=2, devices=2)


def vector_loss(model, batch):
    inputs, labels = batch
    return nn.functional.cross_entropy(model(inputs), labels, reduction="none")


def test_non_scalar_loss(train):
    job = flexpar.Job(
        model=pieces.make_model,
        optimizer=pieces.sgd,
        loss=vector_loss,
        dataset=pieces.make_dataset(),
        global_batch=48,
        virtual_workers=4,
    )
    with pytest.raises(flexpar.UserCodeError, match=r"must return a scalar tensor.*returned \(12,\)"):
        train(job, steps=2, devices=2)


def test_lambda_pieces_are_named(train):
    job = flexpar.Job(
        model=lambda: nn.Linear(12, 3),
        optimizer=pieces.sgd,
        loss=pieces.Loss(),
        dataset=pieces.make_dataset(),
        global_batch=48,
        virtual_workers=4,
    )
    with pytest.raises(flexpar.UserCodeError, match=r"model= cannot be sent.*define model at module level"):
        train(job, steps=2, devices=2)


def test_more_devices_than_cores(train):
    job = pieces.make_job(virtual_workers=48)
    with pytest.raises(ValueError, match=r"asked for 40 CPU devices but this machine has \d+ cores"):
        train(job, steps=2, devices=40, oversubscribe=False)


def test_bad_schedule_is_refused_before_start():
    with pytest.raises(ValueError, match=r"schedule leaves 0 devices after step 3"):
        flexpar.FitOptions(steps=5, devices=1, schedule="3:-1").validate_devices(1, 2, "cpu")
    with pytest.raises(ValueError, match="is not STEP:"):
        flexpar.FitOptions(steps=5, schedule="3:x")


def _poisoned_dataset():
    dataset = pieces.make_dataset()
    dataset.tensors[0][100, 0] = float("nan")
    return dataset


def test_nonfinite_loss_names_step_and_virtual_worker(train):
    job = pieces.make_job(dataset=_poisoned_dataset())
    size = len(job.dataset)
    where = next(
        (step, virtual_worker)
        for step in range(size // job.global_batch)
        for virtual_worker in range(job.virtual_workers)
        if 100 in batching.virtual_worker_indices(job.seed, step, virtual_worker, size, 48, 4)
    )
    if where == (0, 0):
        pytest.skip("the poisoned sample falls in the driver's first-batch check")
    with pytest.raises(flexpar.TrainingError, match=rf"not finite .* at step {where[0]}, virtual worker {where[1]}"):
        train(job, steps=size // job.global_batch, devices=2)


def test_missing_main_guard_gives_a_clear_error(tmp_path):
    script = tmp_path / "unguarded.py"
    script.write_text(
        textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(pieces.__file__.rsplit("/", 1)[0])!r})
        import pieces
        job = pieces.make_job()
        job.fit(steps=2, devices=2, oversubscribe=True, display=False, metrics={str(tmp_path / "m.jsonl")!r})
    """)
    )
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert 'if __name__ == "__main__":' in result.stderr


# ---------------------------------------------------------------- BatchNorm


def make_batchnorm_model():
    return nn.Sequential(nn.Linear(pieces.FEATURES, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, pieces.CLASSES))


@pytest.mark.parametrize("devices", [1, 2])
def test_batchnorm_rule(train, devices):
    """Parameters match the reference on any device set; buffers exactly on one device,
    and as the average of per-device running statistics on several."""
    job = pieces.make_job(model=make_batchnorm_model, virtual_workers=4)
    model, _ = train(job, steps=6, devices=devices)
    expected = pieces.reference(job, 6)
    for (name, got), (_, want) in zip(model.named_parameters(), expected.named_parameters()):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7, msg=name)
    running_mean, reference_mean = model[1].running_mean, expected[1].running_mean
    if devices == 1:
        torch.testing.assert_close(running_mean, reference_mean, rtol=1e-5, atol=1e-7)
    else:
        # Each device's running average saw half the VWs: same direction, smaller steps.
        similarity = torch.nn.functional.cosine_similarity(running_mean, reference_mean, dim=0)
        assert similarity > 0.95 and running_mean.norm() < reference_mean.norm()
        assert int(model[1].num_batches_tracked) == 6 * 4 // devices


# ---------------------------------------------------------------- checkpoints


def test_checkpoint_and_resume(train, tmp_path):
    job = pieces.make_job(optimizer=pieces.adamw)
    checkpoints = tmp_path / "checkpoints"
    train(job, steps=6, devices=2, checkpoint_every=3, checkpoint_dir=str(checkpoints))
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step-00000003.pt", "step-00000006.pt"]
    # A fresh run into the folder is refused before any worker starts: its checkpoints would land
    # beside these, and --resume or export would take the wrong run's.
    with pytest.raises(ValueError) as refused:
        train(job, steps=4, devices=2, checkpoint_every=2, checkpoint_dir=str(checkpoints))
    message = str(refused.value)
    assert "\n" not in message and f"checkpoint_dir {checkpoints} holds another run's checkpoints" in message
    assert "(steps 3, 6)" in message and "--resume" in message and "another folder" in message, message
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step-00000003.pt", "step-00000006.pt"]
    # As if the job died while step 6 was written (a part of a sharded checkpoint never came): resumed
    # from step 3, the run writes step 6 anew (its file replaced, the stale parts gone), never skips it.
    stale = checkpoints / "step-00000006.optimizer"
    stale.mkdir()
    torch.save({}, stale / "part-0-of-2.pt")
    resumed_at = time.time()
    # Into a metrics file of its own (a requeued SLURM job's fresh run directory): it holds the steps
    # this run committed, not the earlier run's that the checkpoint kept for a new rank 0 to re-send.
    resumed_metrics = tmp_path / "resumed.jsonl"
    model, summary = train(
        job,
        steps=10,
        devices=1,
        checkpoint_every=3,
        checkpoint_dir=str(checkpoints),
        resume=True,
        metrics=str(resumed_metrics),
    )
    assert summary["steps"] == 10 and summary["resumed_from"] == 3
    pieces.assert_same_parameters(model, pieces.reference(job, 10))
    names = sorted(p.name for p in checkpoints.iterdir())
    assert names == ["step-00000003.pt", "step-00000006.pt", "step-00000009.pt", "step-00000010.pt"], names
    rewritten = torch.load(checkpoints / "step-00000006.pt", weights_only=True)
    assert rewritten["extra"]["committed_wall"] > resumed_at, "step 6's file is the resumed run's"
    steps = [record["step"] for record in pieces.metrics_records(resumed_metrics) if record["kind"] == "step"]
    assert steps == list(range(3, 10))


def test_a_resume_with_nothing_to_train_says_so_and_one_past_its_steps_is_refused(train, tmp_path, capfd):
    """`--resume --steps 40` on a folder at step 60 ended 0 with final_loss NaN and no word."""
    job = pieces.make_job()
    checkpoints = tmp_path / "checkpoints"
    _, first = train(job, steps=4, devices=1, checkpoint_every=2, checkpoint_dir=str(checkpoints))
    newest = checkpoints / "step-00000004.pt"
    with pytest.raises(ValueError) as refused:
        train(job, steps=2, devices=1, checkpoint_dir=str(checkpoints), resume=True)
    assert str(refused.value) == (
        f"resume: the newest checkpoint, {newest}, is step 4, past this run's last step 2: nothing to train; "
        f"ask for more than 4 steps to train on, or `flexpar export {newest}` for its model"
    )
    capfd.readouterr()
    model, summary = train(job, steps=4, devices=1, checkpoint_dir=str(checkpoints), resume=True, quiet=False)
    said = capfd.readouterr().err
    assert f"flexpar: nothing to train: the newest checkpoint, {newest}, is step 4, this run's last step\n" in said
    # The job's last loss (the checkpoint keeps its last step records for a new rank 0 to re-send), not NaN.
    assert summary["steps"] == 4 and summary["final_loss"] == first["final_loss"]
    pieces.assert_same_parameters(model, pieces.reference(job, 4))


def test_a_resume_from_a_checkpoint_records_and_calls_back_each_step_and_evaluation_once(train, tmp_path):
    """Each record delivered once: the resumed job redoes steps 3-5 and evaluates steps 3 and 6 again; its metrics
    file (appended) and its callbacks get each step and evaluation once."""
    import evaluation_pieces

    job = evaluation_pieces.make_job(optimizer=pieces.adamw)
    checkpoints = tmp_path / "checkpoints"
    train(job, steps=7, devices=2, checkpoint_every=3, checkpoint_dir=str(checkpoints), eval_every=3)
    (checkpoints / "step-00000006.pt").unlink()  # as if the job died after step 3... then resumed
    recorder = evaluation_pieces.Recorder()
    train(job, steps=10, devices=2, checkpoint_dir=str(checkpoints), resume=True, eval_every=3, callbacks=[recorder])
    records = read_records(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records if r["kind"] == "step"] == list(range(10))
    assert [r["step"] for r in records if r["kind"] == "eval"] == [3, 6, 7, 9, 10]
    assert [r["step"] for r in recorder.of("on_step")] == [7, 8, 9]
    assert [r["step"] for r in recorder.of("on_eval")] == [9, 10]


def test_a_record_fault_is_the_drivers_own():
    """STEP:driver:record (tests of each record delivered once): the driver dies as that step's record
    arrives; no device has that phase."""
    from flexpar.options import parse_faults

    assert [(f.step, f.device, f.phase) for f in parse_faults("8:driver:record")] == [(8, "driver", "record")]
    with pytest.raises(ValueError, match=r"record is a phase of the driver only \(STEP:driver:record\)"):
        parse_faults("8:local-1:record")


def test_no_more_devices_than_virtual_workers():
    options = flexpar.FitOptions(steps=5, devices=2, schedule="3:+2", oversubscribe=True)
    with pytest.raises(ValueError, match="the schedule's peak is 4 but the job has 3 virtual workers"):
        options.validate_devices(2, 2, "cpu", virtual_workers=3)
    with pytest.raises(ValueError, match="max_devices is 8 but the job has 4 virtual workers"):
        flexpar.FitOptions(steps=5, max_devices=8).validate_devices(1, 2, "cpu", virtual_workers=4)
    # A default maximum (every GPU) is capped at the virtual workers instead.
    assert flexpar.FitOptions(steps=5).validate_devices(2, 8, "cuda", virtual_workers=4) == 4


def test_the_core_count_follows_a_container_cpu_quota(tmp_path):
    from flexpar.options import cpu_count

    unlimited = cpu_count(str(tmp_path / "absent"))
    quota = tmp_path / "cpu.max"
    quota.write_text("150000 100000\n")  # 1.5 CPUs: two processes' worth, rounded up
    assert cpu_count(str(quota)) == min(unlimited, 2)
    quota.write_text("max 100000\n")
    assert cpu_count(str(quota)) == unlimited
