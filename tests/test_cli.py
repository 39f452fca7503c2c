"""The command line: `flexpar run` maps onto fit() one to one; `flexpar plot` draws the metrics."""

import os
import subprocess
import sys
import textwrap

TESTS = os.path.dirname(os.path.abspath(__file__))


def test_run_overrides_the_script_and_plot_draws_it(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {TESTS!r})
        import pieces
        if __name__ == "__main__":
            model, summary = pieces.make_job().fit(steps=50, devices=1)
            print("steps", summary["steps"], "generations", summary["generations"])
    """))
    metrics, picture = tmp_path / "m.jsonl", tmp_path / "timeline.png"
    run = subprocess.run([sys.executable, "-m", "flexpar", "run", "--devices", "2", "--steps", "4",
                          "--oversubscribe", "--no-display", "--metrics", str(metrics), str(script)],
                         capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stderr
    assert "steps 4 generations 1" in run.stdout
    from flexpar.metrics import read_records

    records = read_records(metrics)  # every record of the run validates against the schema
    steps = [record for record in records if record["kind"] == "step"]
    # The device set never changed. A rebalance between the two devices may happen
    # (it follows their measured speeds, which a busy host can skew): not a change.
    assert [r["event"] for r in records if r["kind"] == "event" and r["event"] != "rebalance"] == ["start"]
    assert [len(record["devices"]) for record in steps] == [2, 2, 2, 2]
    plot = subprocess.run([sys.executable, "-m", "flexpar", "plot", str(metrics), "-o", str(picture)],
                          capture_output=True, text=True, timeout=120)
    assert plot.returncode == 0, plot.stderr
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bad_flag_is_refused_before_the_script_runs(tmp_path):
    script = tmp_path / "never.py"
    script.write_text("raise SystemExit('the script ran')\n")
    run = subprocess.run([sys.executable, "-m", "flexpar", "run", "--schedule", "5:x", str(script)],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode != 0 and "is not STEP:+N" in run.stderr and "the script ran" not in run.stderr
