"""The reports a device writes while it waits for a restarted driver, as `flexpar status` reads them."""

import subprocess
import sys
import time

from flexpar.comm import waiting


def test_status_sees_live_devices_within_their_grace_and_drops_stale_reports(tmp_path):
    now = time.time()
    report = {"device_id": "local-1", "address": "127.0.0.1:29500", "since": now - 3, "until": now + 57, "step": 41}
    waiting.write(29500, report, base=str(tmp_path))
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / "29500" / "local-9.json"
    stale.write_text(
        '{"device_id": "local-9", "pid": %d, "process_start": 1, "since": 0, "until": 1e12, "step": 3}' % dead.pid
    )
    other = {"device_id": "local-2", "address": "x:29501", "since": now, "until": now + 1, "step": 1}
    waiting.write(29501, other, base=str(tmp_path))  # another job's port: not this one's

    found = waiting.read(29500, now=now, base=str(tmp_path))
    assert [r["device_id"] for r in found] == ["local-1"]
    assert not stale.exists(), "a report whose process is gone is removed"
    assert waiting.read(29500, now=now + 60, base=str(tmp_path)) == []  # past its grace
    line = waiting.describe("127.0.0.1:29500", found, now)
    # The words: "no driver; N devices waiting since T".
    assert line.startswith("no driver; 1 device waiting since ") and "at 127.0.0.1:29500" in line
    assert "local-1 (step 41)" in line and "(up to 57 s more)" in line
    assert "\n" not in line
    waiting.remove(29500, "local-1", base=str(tmp_path))
    assert waiting.read(29500, now=now, base=str(tmp_path)) == []


def test_status_repeats_the_resume_command_the_devices_printed(tmp_path):
    """During a driver gap `flexpar status` says how to restart the driver: the devices' own resume command."""
    now = time.time()
    command = "flexpar run --resume --checkpoint-dir /ckpt --port 29500 train.py"
    for device_id, resume in (("local-0", command), ("local-1", "")):  # local-1 holds no committed step yet
        report = {"device_id": device_id, "address": "127.0.0.1:29500", "since": now, "until": now + 60, "step": 4}
        waiting.write(29500, dict(report, resume=resume), base=str(tmp_path))
    line = waiting.describe("127.0.0.1:29500", waiting.read(29500, now=now, base=str(tmp_path)), now)
    assert line.endswith(f"; restart the driver to re-adopt them: {command}"), line
