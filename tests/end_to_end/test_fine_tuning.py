"""Fine-tuning with frozen weights: a frozen "pretrained" trunk and a peft LoRA GPT-2.

Each job goes through a schedule (kill -9, +1, -1) and must end with the
parameters of the plain single-process reference; the frozen part never
travels (the join event's bytes), a joiner whose frozen weights differ is
refused naming the tensor, checkpoints hold the trainable state, a resume from
one equals the uninterrupted run, and `export` writes a peft adapter that
`PeftModel.from_pretrained` loads with the same logits.
"""

import dataclasses
import math
import os
import shutil
import stat
import subprocess
import sys
import uuid

import frozen_pieces
import pieces
import pytest
import torch
from conftest import TESTS, free_port

import flexpar
from flexpar.worker import checkpoints

JOIN_HEADROOM_S = 6.0  # as tests/end_to_end/test_elastic.py: a joiner's start on a busy host
ATOL = 1e-6  # summation order over dozens of SGD-momentum steps (test_elastic's LONG_RUN_ATOL)


_records = pieces.metrics_records
_device_counts = pieces.device_counts


def _schedule(delay_s: float, virtual_workers: int):
    """kill -9 local-1 at step 2 (2 -> 1 devices), +1 at step 3, -1 once the joiner surely trains; total steps."""
    headroom = math.ceil(JOIN_HEADROOM_S / (virtual_workers * delay_s))
    leave = 3 + headroom
    return "2:local-1:backward", f"3:+1,{leave}:-1", leave + 4


class StartJoiner(flexpar.Callback):
    """At the first step, `flexpar join` a device whose frozen trunk differs (its own copy of the factory's module).

    Stops the job once the joiner has exited and step `until` has committed: a
    joiner's start takes seconds on a busy host, and the job must outlive it.
    """

    def __init__(self, until, arguments, environment):
        self.until, self.arguments, self.environment, self.process = until, arguments, environment, None

    def on_step(self, record):
        if self.process is None:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "flexpar", "join", *self.arguments],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=self.environment,
            )
        if record["step"] + 1 >= self.until and self.process.poll() is not None:
            return flexpar.STOP
        return None


def _other_trunk_script(directory):
    """A script whose frozen_pieces builds the trunk with trunk.2.weight changed (another "pretrained" file)."""
    directory.mkdir()
    source = open(os.path.join(TESTS, "frozen_pieces.py")).read()
    built = "        return FrozenTrunkModel(torch.load(self.path, weights_only=True))"
    assert built in source
    changed = built.replace("return FrozenTrunkModel(", "weights = (").replace(
        "weights_only=True))", "weights_only=True))"
    )
    (directory / "frozen_pieces.py").write_text(
        source.replace(
            built, changed + '\n        weights["2.weight"][0, 0] += 1e-3\n        return FrozenTrunkModel(weights)'
        )
    )
    (directory / "train.py").write_text(f"import sys\nsys.path.append({TESTS!r})\nimport frozen_pieces  # noqa\n")
    return str(directory / "train.py")


@pytest.mark.timeout(240)
def test_frozen_trunk_elastic_run_refusal_checkpoint_and_resume(train, metrics_file, tmp_path):
    trunk = tmp_path / "trunk.pt"
    frozen_pieces.write_trunk(trunk)
    job = pieces.make_job(
        optimizer=pieces.sgd,  # with momentum: optimizer state the joiner receives
        virtual_workers=6,
        delay_s=0.03,
        model=frozen_pieces.FrozenTrunk(str(trunk)),
        max_grad_norm=0.05,
    )
    faults, schedule, steps = _schedule(0.03, 6)
    port, secret = free_port(), uuid.uuid4().hex
    joiner = StartJoiner(
        steps,
        [f"127.0.0.1:{port}", "--script", _other_trunk_script(tmp_path / "other")],
        {**os.environ, "FLEXPAR_SECRET": secret},
    )
    folder = tmp_path / "checkpoints"
    model, summary = train(
        job,
        steps=steps + 200,  # until the refused joiner has exited (StartJoiner stops the job)
        devices=2,
        max_devices=3,
        faults=faults,
        schedule=schedule,
        port=port,
        secret=secret,
        callbacks=(joiner,),
        checkpoint_dir=str(folder),
        checkpoint_every=4,
    )
    records = _records(metrics_file)
    assert _device_counts(records) == [2, 1, 2, 1], _device_counts(records)
    steps = summary["steps"]
    trace = {}
    reference_job = dataclasses.replace(job, loss=pieces.Loss(0.0))
    pieces.assert_same_parameters(model, pieces.reference(reference_job, steps, trace), atol=ATOL)
    # Clipping and the step statistics see the trainable parameters only, as the reference's
    # clip_grad_norm_ over model.parameters() does (frozen ones have no gradient).
    norms = [record["grad_norm"] for record in records if record["kind"] == "step"]
    assert norms == pytest.approx(trace["grad_norm"], rel=1e-4)
    # The joiner received the head and its momentum, not the 277 kB trunk.
    joins = [record for record in records if record["kind"] == "event" and record["event"] == "join"]
    assert joins and 0 < joins[0]["state_bytes_sent"] < 100_000, joins
    # The joiner with another trunk was refused, naming the tensor that differs.
    code, refusal = joiner.process.wait(timeout=60), joiner.process.stderr.read()
    assert code == 3, refusal
    assert "trunk.2.weight" in refusal and "trunk.0.weight" not in refusal, refusal

    # Checkpoints hold the trainable state and the frozen digests.
    state = checkpoints.read_checkpoint(checkpoints.checkpoint_path(str(folder), 4), torch.device("cpu"))
    assert set(state["model"]) == {name for name in model.state_dict() if name.startswith("head.")}
    assert "trunk.2.weight" in state["extra"]["frozen"]["digests"]
    # A resume from it (another folder, 1 device, complete checkpoints this time) equals the uninterrupted run.
    resumed_folder = tmp_path / "resumed"
    resumed_folder.mkdir()
    shutil.copy(checkpoints.checkpoint_path(str(folder), 4), resumed_folder)
    resumed, _ = train(
        reference_job,
        steps=8,
        devices=1,
        resume=True,
        checkpoint_dir=str(resumed_folder),
        checkpoint_frozen=True,
        checkpoint_every=4,
        metrics=str(tmp_path / "resumed.jsonl"),
    )
    uninterrupted = checkpoints.read_checkpoint(checkpoints.checkpoint_path(str(folder), 8), torch.device("cpu"))
    for name, value in uninterrupted["model"].items():
        torch.testing.assert_close(resumed.state_dict()[name], value, rtol=1e-5, atol=ATOL)
    complete = checkpoints.read_checkpoint(checkpoints.checkpoint_path(str(resumed_folder), 8), torch.device("cpu"))
    assert set(complete["model"]) == set(model.state_dict()) and complete["extra"]["frozen"]["complete"]
    assert torch.equal(complete["model"]["trunk.2.weight"], model.state_dict()["trunk.2.weight"])
    # A resume whose factory builds another trunk is refused before any worker starts, naming it (its
    # steps reach past the folder's newest checkpoint, which a resume with nothing to train refuses first).
    other = tmp_path / "other-trunk.pt"
    frozen_pieces.write_trunk(other, perturbed="0.weight")
    with pytest.raises(ValueError, match=r"trunk\.0\.weight"):
        dataclasses.replace(reference_job, model=frozen_pieces.FrozenTrunk(str(other))).fit(
            steps=10_000, devices=1, resume=True, checkpoint_dir=str(folder), display=False, quiet=True
        )


@pytest.mark.timeout(240)
def test_lora_elastic_run_matches_reference_and_exports_a_peft_adapter(train, metrics_file, tmp_path):
    pytest.importorskip("peft", reason="peft is not installed (flexpar[hf])")
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import GPT2LMHeadModel

    from flexpar import export
    from flexpar.examples import hf_gpt, lora_gpt

    folder = lora_gpt.write_pretrained(str(tmp_path / "pretrained"), layers=2, width=32, heads=2, context=32)
    dataset, _ = hf_gpt.load_splits(context=32, max_bytes=30_000)
    delay_s = 0.05
    faults, schedule, steps = _schedule(delay_s, 6)

    def job_with(delay):  # fp32: bf16 rounds differently as the device set changes (README)
        loss = frozen_pieces.SlowLoss(hf_gpt.loss_fn, delay)
        return lora_gpt.build_job(
            folder, steps, 12, 6, dataset=dataset, mixed_precision=None, max_grad_norm=0.5, rank=4, loss=loss
        )

    checkpoint_folder = tmp_path / "checkpoints"
    model, summary = train(
        job_with(delay_s),
        steps=steps,
        devices=2,
        max_devices=3,
        faults=faults,
        schedule=schedule,
        checkpoint_dir=str(checkpoint_folder),
        checkpoint_every=steps,
    )
    assert _device_counts(_records(metrics_file)) == [2, 1, 2, 1]
    pieces.assert_same_parameters(model, pieces.reference(job_with(0.0), steps), atol=ATOL)
    # The checkpoint holds the adapters only; export rebuilds the model by the recorded factory.
    last = checkpoints.checkpoint_path(str(checkpoint_folder), steps)
    state = checkpoints.read_checkpoint(last, torch.device("cpu"))
    assert state["model"] and all("lora_" in name for name in state["model"])
    output, adapter = export.export_with_adapter(last, str(tmp_path / "lora.safetensors"))
    assert adapter == str(tmp_path / "lora-adapter")
    umask = os.umask(0o022)
    os.umask(umask)
    for written in (output, os.path.join(adapter, "adapter_model.safetensors")):  # not safetensors' owner-only
        assert stat.S_IMODE(os.stat(written).st_mode) == 0o666 & ~umask, written
    loaded = PeftModel.from_pretrained(GPT2LMHeadModel.from_pretrained(folder), adapter).eval()
    tokens = torch.stack([dataset[index][0] for index in range(4)])
    with torch.no_grad():
        want = model.eval()(input_ids=tokens).logits
        torch.testing.assert_close(loaded(input_ids=tokens).logits, want, rtol=0, atol=0)
        whole = lora_gpt.PretrainedLoRA(folder, rank=4)().eval()
        whole.load_state_dict(load_file(output))
        torch.testing.assert_close(whole(input_ids=tokens).logits, want, rtol=0, atol=0)


class Unfreezes(pieces.Loss):
    """The loss, which unfreezes the trunk at its fourth call (the driver's checks and the warm-up call it too)."""

    def __init__(self):
        super().__init__(0.0)
        self.calls = 0

    def __call__(self, model, batch):
        self.calls += 1
        if self.calls == 4:
            model.trunk[0].weight.requires_grad_(True)
        return super().__call__(model, batch)


def test_changing_requires_grad_during_training_stops_naming_the_parameter(train, tmp_path):
    trunk = tmp_path / "trunk.pt"
    frozen_pieces.write_trunk(trunk)
    job = pieces.make_job(virtual_workers=1, global_batch=8, model=frozen_pieces.FrozenTrunk(str(trunk)))
    job = dataclasses.replace(job, loss=Unfreezes())
    with pytest.raises(
        flexpar.TrainingError, match=r"trunk\.0\.weight became trainable \(requires_grad=True\) at step \d"
    ):
        train(job, steps=5, devices=1)
