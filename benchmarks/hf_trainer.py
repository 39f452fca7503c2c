"""A transformers.Trainer script trained by transformers.Trainer and by flexpar.hf.Trainer (issue 45).

The same script (benchmarks/hf_trainer_script.py: a 2-layer GPT-2 of width 128, random initialisation,
nothing downloaded; per-device batch 8 x accumulation 2, AdamW with the Trainer's decay rule, cosine
with warm-up, clipping at 1.0, the item-normalised causal-LM loss), its import switched, on CPU:

- `step_time_ratio`: the Trainer's median step time / flexpar's, one CPU process each, in alternating
  runs (the Trainer's steps timed between its on_step_end callbacks; flexpar's are its step records'
  `step_time_s`, the device's wall time per step). Goal >= 0.95.
- `max_rel_err`: the largest |trainer - flexpar| / |trainer| (2-norms) over every parameter tensor after
  20 steps, for 1 device and for 2 devices with a join and a leave (the larger). Goal <= 3e-4.
- `loss_curve_max_abs_diff`: the largest difference between the Trainer's and flexpar's per-step
  training losses (logging_steps=1), over both flexpar runs.
- `elastic_bitwise_equal`: with FLEXPAR_HF_OPTIONS='{"deterministic": true}', the last step's parameter
  digest of 1 device equals that of 3 devices with one killed (kill -9) at step 5, and so do the
  trained parameters, bit for bit (both runs with --max-devices 3: the same VWs).

Run: `python benchmarks/hf_trainer.py [--quick] [--json PATH]` (needs flexpar[hf]). --quick: one timing
round of 20 steps (else three of 40).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import subprocess
import sys
import tempfile

import torch

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hf_trainer_script.py")
STEPS = 20


def run(folder: str, name: str, command: list, steps: int = STEPS, **environment) -> dict:
    """Run the script once (`command`: the launcher's words before it); its result.pt."""
    output = os.path.join(folder, name)
    env = {**os.environ, "HF_BENCH_OUTPUT": output, "HF_BENCH_STEPS": str(steps), **environment}
    completed = subprocess.run([*command, SCRIPT], env=env, cwd=folder, capture_output=True, text=True)
    if completed.returncode != 0:
        raise SystemExit(f"{name} failed:\n{completed.stderr[-4000:]}")
    result = torch.load(os.path.join(output, "result.pt"), weights_only=False)
    result["records"] = _records(output)
    return result


def _records(output: str) -> list:
    paths = glob.glob(os.path.join(output, "flexpar-runs", "*", "metrics.jsonl"))
    return [json.loads(line) for path in paths for line in open(path)]


def _python() -> list:
    return [sys.executable]


def _flexpar(*flags) -> list:
    return [sys.executable, "-m", "flexpar", "run", "--no-display", "--oversubscribe", *flags]


def relative_errors(expected: dict, got: dict) -> dict:
    return {
        name: float((tensor.float() - got[name].float()).norm() / (tensor.float().norm() + 1e-12))
        for name, tensor in expected.items()
    }


def losses(result: dict) -> list:
    return [entry["loss"] for entry in result["log_history"] if "loss" in entry]


def trainer_step_time(result: dict) -> float:
    times = result["step_times"]
    return statistics.median(b - a for a, b in zip(times[1:], times[2:]))  # the first step's warm-up left out


def flexpar_step_time(result: dict) -> float:
    steps = [record["step_time_s"] for record in result["records"] if record["kind"] == "step"]
    return statistics.median(steps[1:])


def digest(result: dict) -> str:
    return [record for record in result["records"] if record["kind"] == "step"][-1].get("digest")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one timing round of 20 steps")
    parser.add_argument("--json", help="write the figures here")
    arguments = parser.parse_args()
    rounds, timing_steps = (1, 20) if arguments.quick else (3, 40)
    with tempfile.TemporaryDirectory() as folder:
        ratios = []
        for index in range(rounds):  # alternating: the Trainer, then flexpar
            trainer = run(folder, f"time-trainer-{index}", _python(), timing_steps, HF_BENCH_BASELINE="1")
            flexpar = run(folder, f"time-flexpar-{index}", _flexpar("--devices", "1"), timing_steps)
            ratios.append(trainer_step_time(trainer) / flexpar_step_time(flexpar))
            print(
                f"round {index}: trainer {trainer_step_time(trainer):.4f} s/step, "
                f"flexpar {flexpar_step_time(flexpar):.4f} s/step",
                flush=True,
            )
        baseline = run(folder, "trainer", _python(), HF_BENCH_BASELINE="1")
        one = run(folder, "flexpar-1", _flexpar("--devices", "1"))
        elastic = run(
            folder,
            "flexpar-elastic",
            _flexpar(
                "--devices", "2", "--max-devices", "3", "--schedule", "2:+1,16:-1", "--emulate-speeds", "0.1,0.1,0.1"
            ),
        )
        events = [record["event"] for record in elastic["records"] if record["kind"] == "event"]
        errors = {**relative_errors(baseline["state"], one["state"])}
        elastic_errors = relative_errors(baseline["state"], elastic["state"])
        worst = max(errors, key=errors.get)
        print(
            f"1 device: largest error {errors[worst]:.2e} ({worst}); elastic {events}: "
            f"{max(elastic_errors.values()):.2e} ({max(elastic_errors, key=elastic_errors.get)})",
            flush=True,
        )
        for label, found in (("1 device", errors), ("elastic", elastic_errors)):
            others = [value for name, value in found.items() if not name.endswith("c_attn.bias")]
            print(f"{label}: largest error of the tensors other than c_attn.bias: {max(others):.2e}", flush=True)
        curve = max(abs(a - b) for run_ in (one, elastic) for a, b in zip(losses(baseline), losses(run_)))
        deterministic = json.dumps({"deterministic": True})
        # The same --max-devices: the VWs follow the most devices a run may reach (docs/guide.md), and
        # runs compared bit for bit need the same cut.
        exact_one = run(
            folder, "exact-1", _flexpar("--devices", "1", "--max-devices", "3"), FLEXPAR_HF_OPTIONS=deterministic
        )
        killed = json.dumps({"deterministic": True, "faults": "5:local-1:backward"})
        exact_three = run(folder, "exact-3", _flexpar("--devices", "3"), FLEXPAR_HF_OPTIONS=killed)
        failures = [record for record in exact_three["records"] if record.get("event") == "failure"]
        bitwise = (
            digest(exact_one) is not None
            and digest(exact_one) == digest(exact_three)
            and all(torch.equal(tensor, exact_three["state"][name]) for name, tensor in exact_one["state"].items())
        )
        print(f"deterministic: digests {digest(exact_one)} / {digest(exact_three)}, {len(failures)} failure(s)")
    figures = {
        "step_time_ratio": round(statistics.median(ratios), 4),
        "max_rel_err": max(max(errors.values()), max(elastic_errors.values())),
        "loss_curve_max_abs_diff": curve,
        "elastic_bitwise_equal": bool(bitwise and failures),
    }
    print(json.dumps(figures, indent=2))
    if arguments.json:
        with open(arguments.json, "w") as handle:
            json.dump(figures, handle, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
