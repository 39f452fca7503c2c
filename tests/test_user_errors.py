"""A mistake in the user's own arguments gets one line naming it and the fix; flexpar's own bugs keep their traceback.

Under `python train.py` and `flexpar run train.py` the line is all there is; in a notebook
(IPython keeps its own excepthook) the error is raised as usual, with a traceback cut to the
user's own frames.
"""

import subprocess
import sys
import textwrap
import traceback

import pieces
import pytest
import torch
from conftest import TESTS, flexpar_command
from torch import nn

import flexpar
from flexpar import cli
from flexpar import job as job_module

BAD_JOB_SCRIPT = textwrap.dedent(f"""
    import sys
    sys.path.insert(0, {TESTS!r})
    import torch
    import pieces

    if __name__ == "__main__":
        if sys.argv[1] == "global_batch":
            pieces.make_job(global_batch="48")
        else:
            optimizer = torch.optim.AdamW(pieces.make_model().parameters(), lr=0.001)
            pieces.make_job(optimizer=optimizer).fit(steps=2, display=False)
""")


def test_a_bad_job_argument_is_one_line_under_python_and_under_flexpar_run(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(BAD_JOB_SCRIPT)
    plain = subprocess.run(
        [sys.executable, str(script), "global_batch"], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert plain.returncode == 1
    assert plain.stderr == "flexpar: global_batch='48' must be a positive whole number\n", plain.stderr
    launched = flexpar_command("run", str(script), "optimizer", timeout_s=120, cwd=str(tmp_path))
    assert launched.returncode == 1
    assert launched.stderr.count("\n") == 1 and "Traceback" not in launched.stderr, launched.stderr
    # The fix, written out: a def (a lambda cannot be sent to the devices), with the optimizer's own rate.
    assert launched.stderr.startswith("flexpar: optimizer= takes a function that builds the optimizer"), launched.stderr
    assert "`def make_optimizer(parameters): return torch.optim.AdamW(parameters, lr=0.001)`" in launched.stderr


def _bad_jobs():
    """Each a call of Job() with one mistake in the user's arguments, and the words its error must hold."""
    model = pieces.make_model()
    return [
        (lambda: pieces.make_job(global_batch="48"), "global_batch='48' must be a positive whole number"),
        (lambda: pieces.make_job(virtual_workers=5), "not divisible by virtual_workers=5"),
        (lambda: pieces.make_job(dataset=pieces.make_dataset(40)), "dataset has 40 samples"),
        (lambda: pieces.make_job(optimizer=torch.optim.SGD(model.parameters(), lr=0.1)), "def make_optimizer"),
        (lambda: pieces.make_job(model=model), "model= takes a function that builds the model"),
        (lambda: pieces.make_job(micro_batch="12", virtual_workers=None), "micro_batch='12' must be a positive"),
        (lambda: pieces.make_job(num_workers="2"), "num_workers='2' must be a whole number"),
    ]


def test_every_mistake_in_jobs_arguments_is_an_argument_error_with_a_short_traceback(monkeypatch):
    """ArgumentError is a ValueError and a TypeError (code that caught either still does); its traceback
    starts where Job() was called, so a notebook shows the user's line and the message."""
    notebook_hook = lambda *exc_info: None  # noqa: E731  (IPython keeps a hook of its own)
    monkeypatch.setattr(sys, "excepthook", notebook_hook)
    for make, words in _bad_jobs():
        with pytest.raises(flexpar.ArgumentError, match=words) as caught:
            make()
        assert isinstance(caught.value, ValueError) and isinstance(caught.value, TypeError)
        assert caught.value.flexpar_message
        inner = [frame.name for frame in traceback.extract_tb(caught.value.__traceback__)]
        assert inner[-1] == "__post_init__" and not any(name.startswith("_check") for name in inner), inner
    assert sys.excepthook is notebook_hook, "a hook someone else installed is left alone"


def test_a_bug_of_flexpars_own_keeps_its_traceback(monkeypatch):
    def broken(device_type):
        raise TypeError("a bug inside flexpar")

    monkeypatch.setattr(job_module.recipes, "compile_problem", broken)
    with pytest.raises(TypeError, match="a bug inside flexpar") as caught:
        pieces.make_job(compile=True)
    assert not isinstance(caught.value, flexpar.ArgumentError)
    assert not getattr(caught.value, "flexpar_message", False)
    assert "broken" in [frame.name for frame in traceback.extract_tb(caught.value.__traceback__)]


def test_a_mistyped_flag_is_answered_with_the_closest_one(monkeypatch, capsys):
    monkeypatch.setattr(cli, "_exit_on_early_sigterm", lambda: None)  # not in the test's own process
    for argv, meant in (
        (["run", "--device", "2", "train.py"], "--devices"),
        (["run", "--checkpoint-evry=5", "train.py"], "--checkpoint-every"),
        (["status", "--jsn"], "--json"),
    ):
        with pytest.raises(SystemExit) as stopped:
            cli.main(argv)
        assert stopped.value.code == 2
        error = capsys.readouterr().err.splitlines()[-1]
        assert error.endswith(f"unrecognized arguments: {argv[1]}; did you mean {meant}?"), error
    with pytest.raises(SystemExit):
        cli.main(["run", "--zzz", "train.py"])
    assert capsys.readouterr().err.splitlines()[-1].endswith("unrecognized arguments: --zzz")


def test_more_devices_than_max_devices_says_so_without_a_schedule():
    with pytest.raises(ValueError, match=r"^devices=2 is more than max_devices=1, .*at most 1 device \(--devices\)"):
        flexpar.FitOptions(steps=1, devices=2, max_devices=1)
    # The default device count (every GPU) over max_devices: the same words, no schedule named.
    with pytest.raises(
        ValueError, match=r"^devices=4 \(every GPU here, the default\) is more than max_devices=2"
    ) as caught:
        flexpar.FitOptions(steps=1, max_devices=2).validate_devices(4, 4, "cuda", virtual_workers=8)
    assert "schedule" not in str(caught.value)


def test_nn_module_instance_is_not_mistaken_for_a_factory():
    with pytest.raises(
        flexpar.ArgumentError, match=r"not a model \(Linear\): define `def make_model\(\): return Linear"
    ):
        pieces.make_job(model=nn.Linear(12, 3))


def test_a_mistyped_fit_option_is_answered_with_the_closest_one():
    with pytest.raises(
        flexpar.ArgumentError, match=r"^fit\(\) has no option chekpoint_every=; did you mean checkpoint_every=\?"
    ):
        pieces.make_job().fit(steps=1, chekpoint_every=3, display=False)
