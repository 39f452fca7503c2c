"""The packaged demos: data, models, losses and the pieces' ability to travel.

Most checks are single-process and fast; one end-to-end test trains the
digits demo for a few steps on one device through `Job.fit`.
"""

from __future__ import annotations

import io
import math
import pickle

import pytest
import torch
import torch.nn.functional as F

from flexpar.examples import digits, tiny_lm


def _needs_sklearn():
    pytest.importorskip("sklearn", reason="the digits data set ships with scikit-learn")


# ---------------------------------------------------------------- digits


@pytest.fixture(scope="module")
def digits_splits():
    _needs_sklearn()
    return digits.load_splits()


def test_digits_splits_cover_all_images_once_with_the_promised_types(digits_splits):
    train, held_out = digits_splits
    assert len(train) + len(held_out) == 1797  # load_digits has 1797 images
    assert len(held_out) == round(1797 * 0.2)
    images, labels = train.tensors
    assert images.shape[1:] == (1, 8, 8) and images.dtype == torch.float32
    assert labels.dtype == torch.int64 and set(labels.tolist()) == set(range(10))
    assert float(images.min()) == 0.0 and float(images.max()) == 1.0
    # No image is in both splits: compare the images row by row.
    train_rows = {tuple(row.tolist()) for row in train.tensors[0].flatten(1)}
    overlap = sum(tuple(row.tolist()) in train_rows for row in held_out.tensors[0].flatten(1))
    assert overlap <= 5  # load_digits holds a handful of exact duplicate images


def test_digits_splits_are_the_same_on_every_call(digits_splits):
    again_train, again_held_out = digits.load_splits()
    assert torch.equal(again_train.tensors[0], digits_splits[0].tensors[0])
    assert torch.equal(again_held_out.tensors[1], digits_splits[1].tensors[1])


def test_digits_split_fraction_is_checked():
    with pytest.raises(ValueError, match="held_out_fraction=1.5"):
        digits.load_splits(held_out_fraction=1.5)


def test_digits_model_forward_backward_gives_scalar_loss_and_gradients(digits_splits):
    torch.manual_seed(0)
    model = digits.make_model()
    batch = digits_splits[0][:32]
    assert model(batch[0]).shape == (32, 10)
    loss = digits.loss_fn(model, batch)
    assert loss.dim() == 0 and math.isfinite(float(loss.detach()))
    loss.backward()
    assert all(parameter.grad is not None for parameter in model.parameters())


def test_digits_model_has_no_batch_statistic_buffers():
    assert list(digits.make_model().buffers()) == []


def test_digits_optimizer_step_lowers_the_loss_of_a_fixed_batch(digits_splits):
    torch.manual_seed(0)
    model = digits.make_model().eval()  # eval: no dropout, so the loss is a function of the weights
    optimizer = digits.make_optimizer(model.parameters())
    batch = digits_splits[0][:128]
    with torch.no_grad():
        before = float(digits.loss_fn(model, batch))
    for _ in range(5):
        optimizer.zero_grad()
        digits.loss_fn(model, batch).backward()
        optimizer.step()
    with torch.no_grad():
        assert float(digits.loss_fn(model, batch)) < before


class _ConstantClassifier(torch.nn.Module):
    """Predicts class `label` for every image."""

    def __init__(self, label):
        super().__init__()
        self.label = label

    def forward(self, images):
        return F.one_hot(torch.full((len(images),), self.label), 10).float()


def test_digits_evaluate_is_the_fraction_of_correct_labels(digits_splits):
    held_out = digits_splits[1]
    model = _ConstantClassifier(3).train()
    expected = float((held_out.tensors[1] == 3).float().mean())
    assert digits.evaluate(model, held_out, batch_size=50) == pytest.approx(expected)
    assert model.training  # the previous mode is restored


def test_digits_pieces_pickle_by_reference(digits_splits):
    for piece in (digits.make_model, digits.make_optimizer, digits.loss_fn):
        assert pickle.loads(pickle.dumps(piece)) is piece
    train = pickle.loads(pickle.dumps(digits_splits[0]))
    assert torch.equal(train.tensors[0], digits_splits[0].tensors[0])


def test_digits_build_job_passes_the_drivers_checks(digits_splits):
    from flexpar.driver import job_checks
    from flexpar.worker import user_code

    job = digits.build_job(global_batch=128, virtual_workers=4, dataset=digits_splits[0])
    assert job.micro_batch_size == 32
    job_checks.pickle_pieces(job)  # raises if any piece cannot travel to workers
    model = user_code.build_model(job)
    job_checks.first_batch_check(job, model)


def test_digits_command_line_defaults_and_flags():
    arguments = digits.parse_arguments(["--steps", "7", "--devices", "2", "--schedule", "3:+1"])
    assert (arguments.steps, arguments.devices, arguments.schedule) == (7, 2, "3:+1")
    assert (arguments.global_batch, arguments.virtual_workers) == (256, 8)


def test_digits_fit_end_to_end_on_one_device_lowers_the_loss(digits_splits, tmp_path):
    """A short real run through Job.fit: one worker process, 25 steps."""
    train = digits_splits[0]
    job = digits.build_job(global_batch=128, virtual_workers=4, dataset=train)
    torch.manual_seed(job.seed)
    initial = digits.make_model().eval()
    model, summary = job.fit(steps=25, devices=1, quiet=True, metrics=str(tmp_path / "metrics.jsonl"))
    assert summary["steps"] == 25
    whole_train = train[:]
    with torch.no_grad():
        before = float(digits.loss_fn(initial, whole_train))
        after = float(digits.loss_fn(model.eval(), whole_train))
    assert after < before - 0.2, (before, after)  # observed: 2.31 -> 1.80


# ---------------------------------------------------------------- tiny_lm


def test_stdlib_files_are_sorted_and_exclude_installed_packages():
    files = tiny_lm.stdlib_source_files()
    root = tiny_lm.stdlib_root()
    relative = [path.relative_to(root).as_posix() for path in files]
    assert relative == sorted(relative)
    assert "os.py" in relative
    assert not any("site-packages" in name or "dist-packages" in name for name in relative)


def test_stdlib_corpus_is_capped_deterministic_and_starts_with_the_first_file():
    corpus = tiny_lm.read_stdlib_corpus(max_bytes=20_000)
    assert len(corpus) == 20_000
    assert corpus == tiny_lm.read_stdlib_corpus(max_bytes=20_000)
    first = tiny_lm.stdlib_source_files()[0].read_bytes()
    assert corpus.startswith(first[:1000])


def test_stdlib_corpus_cap_is_checked():
    with pytest.raises(ValueError, match="max_bytes=1 "):
        tiny_lm.read_stdlib_corpus(max_bytes=1)


def test_byte_windows_target_is_the_input_shifted_by_one_byte():
    data = bytes(range(200)) * 3
    windows = tiny_lm.ByteWindows(data, context=16)
    assert len(windows) == (len(data) - 1) // 16
    tokens, targets = windows[5]
    assert tokens.dtype == torch.int64 and tokens.shape == targets.shape == (16,)
    assert tokens.tolist() == list(data[80:96])
    assert targets.tolist() == list(data[81:97])
    last_tokens, last_targets = windows[len(windows) - 1]
    assert int(last_targets[-1]) == data[len(windows) * 16]  # the last target byte exists
    with pytest.raises(IndexError):
        windows[len(windows)]


def test_byte_windows_refuse_data_shorter_than_one_window():
    with pytest.raises(ValueError, match="10 bytes make no window of context=16"):
        tiny_lm.ByteWindows(b"0123456789", context=16)


def test_byte_windows_pickle_only_their_own_bytes():
    big = torch.zeros(1_000_000, dtype=torch.uint8)
    windows = tiny_lm.ByteWindows(big[:1000], context=10)
    restored = pickle.loads(pickle.dumps(windows))
    assert len(pickle.dumps(windows)) < 10_000  # not the million-byte storage it was cut from
    assert torch.equal(restored[3][0], windows[3][0])


def test_tiny_lm_splits_take_the_tail_as_held_out():
    train, held_out = tiny_lm.load_splits(context=32, max_bytes=64_000, held_out_fraction=0.25)
    corpus = tiny_lm.read_stdlib_corpus(max_bytes=64_000)
    assert bytes(train.data.tolist()) == corpus[:48_000]
    assert bytes(held_out.data.tolist()) == corpus[48_000:]


def _small_model(dropout=0.0):
    torch.manual_seed(0)
    return tiny_lm.TinyLM(tiny_lm.ModelConfig(context=16, width=32, heads=2, layers=2, dropout=dropout))


def test_tiny_lm_is_causal():
    """Changing a later byte must not change the logits of earlier positions."""
    model = _small_model().eval()
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    changed = tokens.clone()
    changed[:, 10] = (changed[:, 10] + 1) % 256
    with torch.no_grad():
        original, perturbed = model(tokens), model(changed)
    assert torch.allclose(original[:, :10], perturbed[:, :10], atol=1e-6)
    assert not torch.allclose(original[:, 10:], perturbed[:, 10:])


def test_tiny_lm_refuses_sequences_longer_than_its_context():
    with pytest.raises(ValueError, match="17 tokens is longer than the context of 16"):
        _small_model()(torch.zeros(1, 17, dtype=torch.long))


def test_tiny_lm_default_model_loss_is_scalar_near_uniform_and_backpropagates():
    train, _ = tiny_lm.load_splits(max_bytes=40_000)
    torch.manual_seed(0)
    model = tiny_lm.make_model()
    batch = tuple(torch.stack(parts) for parts in zip(*(train[index] for index in range(8))))
    loss = tiny_lm.loss_fn(model, batch)
    assert loss.dim() == 0
    assert abs(float(loss.detach()) - math.log(256)) < 1.0  # an untrained model guesses about uniformly
    loss.backward()
    assert all(parameter.grad is not None for parameter in model.parameters())
    assert list(model.buffers()) == []
    assert tiny_lm.bits_per_byte(math.log(256)) == pytest.approx(8.0)


def test_tiny_lm_evaluate_matches_the_loss_of_one_batch():
    model = _small_model()
    windows = tiny_lm.ByteWindows(bytes(range(256)) * 2, context=16)
    tokens = torch.stack([windows[index][0] for index in range(len(windows))])
    targets = torch.stack([windows[index][1] for index in range(len(windows))])
    model.eval()
    with torch.no_grad():
        expected = float(tiny_lm.loss_fn(model, (tokens, targets)))
    model.train()
    assert tiny_lm.evaluate(model, windows, batch_size=7) == pytest.approx(expected, rel=1e-5)
    assert model.training


def test_model_config_is_validated_with_the_numbers():
    with pytest.raises(ValueError, match="width=30 is not divisible by heads=4"):
        tiny_lm.ModelConfig(width=30, heads=4)


def test_warmup_cosine_factor_warms_up_then_decays_to_the_floor():
    factor = tiny_lm.WarmupCosineFactor(warmup_steps=10, total_steps=110, floor=0.1)
    assert factor(0) == pytest.approx(0.1)
    assert factor(9) == pytest.approx(1.0)
    assert factor(10) == pytest.approx(1.0)
    assert factor(60) == pytest.approx(0.55)
    assert factor(110) == pytest.approx(0.1) and factor(500) == pytest.approx(0.1)
    decay = [factor(step) for step in range(10, 111)]
    assert all(later <= earlier for earlier, later in zip(decay, decay[1:]))


def test_warmup_cosine_scheduler_drives_the_optimizer_and_its_state_loads_safely():
    schedule = tiny_lm.WarmupCosine(total_steps=50, warmup_steps=5)
    assert pickle.loads(pickle.dumps(schedule)) == schedule
    optimizer = tiny_lm.make_optimizer(_small_model().parameters())
    peak = optimizer.param_groups[0]["lr"]
    scheduler = schedule(optimizer)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(peak / 5)
    for _ in range(7):
        optimizer.step()
        scheduler.step()
    buffer = io.BytesIO()
    torch.save(scheduler.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)  # the factor's fields are plain numbers
    fresh = schedule(tiny_lm.make_optimizer(_small_model().parameters()))
    fresh.load_state_dict(state)
    assert fresh.last_epoch == 7 and fresh.get_last_lr() == scheduler.get_last_lr()


def test_warmup_cosine_is_validated():
    with pytest.raises(ValueError, match="total_steps=0"):
        tiny_lm.WarmupCosine(total_steps=0)


def test_sample_greedy_is_deterministic_and_temperature_sampling_leaves_global_rng_alone():
    model = _small_model()
    greedy = tiny_lm.sample(model, "def ", 20)
    assert len(greedy) == 20 and greedy == tiny_lm.sample(model, b"def ", 20)
    state = torch.get_rng_state()
    hot = tiny_lm.sample(model, "x" * 40, 30, temperature=1.0, seed=3)  # prompt longer than context
    assert torch.equal(torch.get_rng_state(), state)
    assert hot == tiny_lm.sample(model, "x" * 40, 30, temperature=1.0, seed=3)
    assert len(hot) == 30 and model.training


def test_tiny_lm_pieces_pickle_by_reference_and_build_a_valid_job():
    from flexpar.driver import job_checks
    from flexpar.worker import user_code

    for piece in (tiny_lm.make_model, tiny_lm.make_optimizer, tiny_lm.loss_fn):
        assert pickle.loads(pickle.dumps(piece)) is piece
    train, _ = tiny_lm.load_splits(max_bytes=200_000)
    job = tiny_lm.build_job(steps=30, global_batch=64, virtual_workers=4, dataset=train)
    assert job.lr_scheduler == tiny_lm.WarmupCosine(total_steps=30, warmup_steps=20)
    job_checks.pickle_pieces(job)
    model = user_code.build_model(job)
    optimizer, scheduler = user_code.build_optimizer(job, model)
    assert isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR)
    job_checks.first_batch_check(job, model)


def test_tiny_lm_command_line_defaults_and_flags():
    arguments = tiny_lm.parse_arguments(["--steps", "9", "--max-bytes", "5000"])
    assert (arguments.steps, arguments.max_bytes, arguments.devices) == (9, 5000, None)


# ---------------------------------------------------------------- hf_gpt, run as a script


@pytest.mark.parametrize(
    "script,hidden,message",
    [
        (
            "hf_gpt.py",
            "transformers",
            'examples/hf_gpt.py needs Hugging Face transformers: pip install -e ".[hf]" in flexpar\'s checkout',
        ),
        (
            "lora_gpt.py",
            "peft",
            'examples/lora_gpt.py needs transformers and peft: pip install -e ".[hf]" in flexpar\'s checkout',
        ),
    ],
)
def test_hf_script_without_its_extra_names_the_extra_to_install(script, hidden, message):
    """`python examples/hf_gpt.py` (or lora_gpt.py) on an install without the [hf] extra: one line naming it,
    exit 1, before any argument is read or any process starts (the package hidden from the import system)."""
    import os
    import subprocess
    import sys

    path = os.path.join(
        os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "examples", script
    )
    hide = (
        f"import runpy, sys; sys.modules[{hidden!r}] = None; sys.argv = [sys.argv[1], '--steps', '1']; "
        "runpy.run_path(sys.argv[0], run_name='__main__')"
    )
    run = subprocess.run([sys.executable, "-c", hide, path], capture_output=True, text=True, timeout=120)
    assert run.returncode == 1
    assert run.stderr.strip() == message
