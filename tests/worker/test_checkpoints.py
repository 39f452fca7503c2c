"""Checkpoints off the critical path: a copy in the step loop, the file on a thread, the newest K kept."""

import os
import threading

import pieces
import pytest
import torch

from flexpar.comm import state_transfer as training_state
from flexpar.worker import checkpoints


def _state(value=1.0):
    model = torch.nn.Linear(3, 2)
    with torch.no_grad():
        model.weight.fill_(value)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    return model, optimizer, training_state.capture(model, optimizer, None, 5, {"note": "x"})


def test_the_copy_is_the_state_at_the_time_it_was_taken():
    model, optimizer, state = _state()
    copy = checkpoints.cpu_copy(state)
    with torch.no_grad():
        model.weight.add_(1.0)  # the next step changes the live tensors in place
    optimizer.step()
    assert not torch.equal(copy["model"]["weight"], model.weight)
    assert copy["model"]["weight"].data_ptr() != model.weight.data_ptr()
    assert copy["extra"] == {"note": "x"} and copy["step"] == 5
    assert copy["model"]._metadata == state["model"]._metadata  # load_state_dict reads module versions


def test_the_writer_keeps_exactly_the_newest_k(tmp_path):
    _, _, state = _state()
    writer = checkpoints.CheckpointWriter(keep=3)
    for step in range(1, 8):
        path = writer.submit(str(tmp_path), step, checkpoints.cpu_copy(state))
        assert writer.pending == path
    writer.wait()
    assert sorted(os.listdir(tmp_path)) == ["step-00000005.pt", "step-00000006.pt", "step-00000007.pt"]
    loaded = checkpoints.read_checkpoint(str(tmp_path / "step-00000007.pt"), "cpu")
    torch.testing.assert_close(loaded["model"]["weight"], state["model"]["weight"])


def test_submit_returns_before_the_file_is_written(tmp_path, monkeypatch):
    _, _, state = _state()
    release = threading.Event()
    real_save = torch.save

    def slow_save(*args, **kwargs):
        release.wait(10)
        return real_save(*args, **kwargs)

    monkeypatch.setattr(torch, "save", slow_save)
    writer = checkpoints.CheckpointWriter()
    path = writer.submit(str(tmp_path), 1, state)
    assert writer.busy and not os.path.exists(path), "the step loop goes on while the file is written"
    release.set()
    writer.wait()
    assert sorted(os.listdir(tmp_path)) == [os.path.basename(path)], "no temporary file is left"


def test_a_failed_write_is_raised_at_the_next_wait(tmp_path):
    _, _, state = _state()
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    writer = checkpoints.CheckpointWriter()
    writer.submit(str(blocker), 1, state)
    with pytest.raises(RuntimeError, match="writing a checkpoint failed"):
        writer.wait()
    writer.wait()  # reported once


def test_prune_ignores_other_files(tmp_path):
    for name in ("step-00000001.pt", "step-00000002.pt", "notes.txt", "step-00000003.pt.tmp"):
        (tmp_path / name).write_text("")
    checkpoints.prune(str(tmp_path), 1)
    assert sorted(os.listdir(tmp_path)) == ["notes.txt", "step-00000002.pt", "step-00000003.pt.tmp"]


def test_a_job_keeps_the_newest_k_and_its_last_checkpoint_is_its_model(train, tmp_path):
    folder = tmp_path / "checkpoints"
    job = pieces.make_job(virtual_workers=4)
    model, summary = train(job, steps=11, devices=2, checkpoint_every=2, checkpoint_dir=str(folder), keep_checkpoints=3)
    assert sorted(os.listdir(folder)) == ["step-00000008.pt", "step-00000010.pt", "step-00000011.pt"]
    last = checkpoints.read_checkpoint(str(folder / "step-00000011.pt"), "cpu")
    pieces.assert_same_parameters(model, _loaded(job, last["model"]), rtol=0, atol=0)


def test_checkpoint_frozen_needs_a_folder_and_the_flag_maps_onto_it():
    from flexpar.cli import build_parser
    from flexpar.options import FitOptions

    with pytest.raises(ValueError, match="checkpoint_frozen=True needs checkpoint_dir"):
        FitOptions(steps=1, checkpoint_frozen=True)
    arguments = build_parser().parse_args(["run", "--checkpoint-frozen", "--checkpoint-dir", "ck", "train.py"])
    assert arguments.checkpoint_frozen is True
    assert build_parser().parse_args(["run", "train.py"]).checkpoint_frozen is None  # the script's own choice stands


def test_keep_checkpoints_needs_a_folder():
    from flexpar import FitOptions

    with pytest.raises(ValueError, match="keep_checkpoints=2 needs checkpoint_dir"):
        FitOptions(steps=1, keep_checkpoints=2)
    with pytest.raises(ValueError, match="keep_checkpoints=0"):
        FitOptions(steps=1, keep_checkpoints=0, checkpoint_dir="x")


def _loaded(job, state_dict):
    model = job.model()
    model.load_state_dict(state_dict)
    return model


def test_a_fresh_run_refuses_a_folder_with_checkpoints_and_a_resume_takes_it(tmp_path):
    """The driver's check (flexpar/driver/job_checks.py): where this run's checkpoints go must hold none
    unless it resumes; other files there are no checkpoints, and many steps are named in short."""
    from flexpar import FitOptions
    from flexpar.driver.job_checks import check_checkpoint_folder

    folder = tmp_path / "ck"
    folder.mkdir()
    (folder / "notes.txt").write_text("")
    (folder / "step-00000003.pt.123-4.tmp").write_text("")  # a write that never finished
    check_checkpoint_folder(FitOptions(steps=1, checkpoint_dir=str(folder)))
    for step in range(10, 110, 10):
        (folder / f"step-{step:08d}.pt").write_text("")
    (folder / "step-00000110.optimizer").mkdir()  # a sharded checkpoint's parts, its step-N.pt not written yet
    with pytest.raises(ValueError) as refused:
        check_checkpoint_folder(FitOptions(steps=1, checkpoint_dir=str(folder)))
    assert str(refused.value) == (
        f"checkpoint_dir {folder} holds another run's checkpoints (steps 10, 20, 30, ..., 100, 110; 11 in all): "
        "continue that run with --resume (fit(resume=True)), or give this run another folder"
    )
    check_checkpoint_folder(FitOptions(steps=1, checkpoint_dir=str(folder), resume=True))
    # Without checkpoint_dir, a driver-lost rescue goes to the run directory: the metrics file's folder.
    with pytest.raises(ValueError, match=rf"the run directory {folder} .* holds another run's checkpoints"):
        check_checkpoint_folder(FitOptions(steps=1, metrics=str(folder / "metrics.jsonl")))
    check_checkpoint_folder(FitOptions(steps=1, metrics=str(tmp_path / "metrics.jsonl")))


def test_a_folder_of_unfinished_checkpoints_alone_is_refused_without_offering_resume(tmp_path):
    """A sharded job killed while writing its first checkpoint leaves parts and no complete step-N.pt:
    --resume has nothing to take there (it refuses such a folder), so the refusal does not offer it."""
    from flexpar import FitOptions
    from flexpar.driver.job_checks import check_checkpoint_folder

    folder = tmp_path / "ck"
    (folder / "step-00000100.optimizer").mkdir(parents=True)  # the parts, step-00000100.pt never written
    (folder / "step-00000200.optimizer").mkdir()
    (folder / "step-00000200.pt").write_bytes(b"")  # rank 0's file, but no partition of its parts is whole
    assert checkpoints.latest_checkpoint(str(folder)) is None
    with pytest.raises(ValueError) as refused:
        check_checkpoint_folder(FitOptions(steps=1, checkpoint_dir=str(folder)))
    assert str(refused.value) == (
        f"checkpoint_dir {folder} holds another run's unfinished checkpoints (steps 100, 200), which --resume "
        "cannot continue from: remove its step-* files and folders, or give this run another folder"
    )


def _sharded_step(folder, step: int, recorded, counts) -> str:
    """A sharded checkpoint of `step` whose step-N.pt records `recorded` parts, with every part of each count."""
    path = checkpoints.checkpoint_path(str(folder), step)
    sharded = (
        {"by": "elements", "shapes": {}} if recorded is None else {"by": "elements", "shapes": {}, "parts": recorded}
    )
    checkpoints.write_file(path, {"model": {}, "optimizer": {"state": {}, "sharded": sharded}, "step": step})
    for count in counts:
        for index in range(count):
            checkpoints.write_file(checkpoints.part_path(str(folder), step, index, count), {"parts": count})
    return path


def test_a_step_written_again_with_another_part_count_is_read_with_its_own_parts_only(tmp_path):
    # Step 6 written by 2 devices, then again by 3 (a rollback, a resume on another count): both sets complete.
    path = _sharded_step(tmp_path, 6, recorded=3, counts=(2, 3))
    assert [os.path.basename(part) for part in checkpoints.complete_parts(path)] == [
        "part-0-of-3.pt",
        "part-1-of-3.pt",
        "part-2-of-3.pt",
    ]
    # The new set not complete yet: the stale complete set is not taken instead.
    os.unlink(checkpoints.part_path(str(tmp_path), 6, 2, 3))
    assert checkpoints.complete_parts(path) is None
    # A checkpoint written before the count was recorded: one complete set is taken, two are not sure.
    older = _sharded_step(tmp_path, 9, recorded=None, counts=(2,))
    assert len(checkpoints.complete_parts(older)) == 2
    assert checkpoints.complete_parts(_sharded_step(tmp_path, 12, recorded=None, counts=(2, 3))) is None
    # The common file's writer removes the other partition's parts once step-N.pt is written.
    writer = checkpoints.CheckpointWriter()
    writer.submit_files(str(tmp_path), 15, [(_sharded_step(tmp_path, 15, 2, (2, 3)), {})], other_partitions=2)
    writer.wait()
    assert sorted(os.listdir(checkpoints.parts_folder(checkpoints.checkpoint_path(str(tmp_path), 15)))) == [
        "part-0-of-2.pt",
        "part-1-of-2.pt",
    ]
