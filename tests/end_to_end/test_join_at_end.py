"""A joiner still on its way when the job ends leaves quietly: no failure, no lost state, exit 0.

Soak seed 253, run 27: two joiners scheduled late were still starting when
the job ended; the members' normal exits were taken for a failure of all of
them, and a joiner reported the optimizer state lost. Here the joiner's start
is held back (tests/pieces.py `HeldBackModel`) until the job has ended, so
that it is on its way at the end whatever the host's speed.
"""

import pieces
import pytest

import flexpar
from flexpar.driver.local_devices import LocalDevices


class _HoldJoiners(flexpar.Callback):
    """Holds back any device built after step 0 (the joiner); lets it go once the job has ended."""

    def __init__(self, hold: str, release: str):
        self.hold, self.release = hold, release

    def on_step(self, record):
        if record["step"] == 0:  # before the schedule's entry for step 1 spawns the joiner
            open(self.hold, "w").close()

    def on_end(self, summary):
        open(self.release, "w").close()


@pytest.mark.parametrize("shard", [True, False], ids=["sharded", "unsharded"])
def test_a_joiner_on_its_way_at_the_end_exits_quietly(train, tmp_path, metrics_file, monkeypatch, shard):
    exit_codes = {}
    shutdown = LocalDevices.shutdown

    def recording_shutdown(self, grace_s=5.0):  # the driver's last look at this host's workers
        shutdown(self, grace_s)
        exit_codes.update({device: process.exitcode for device, process in self.processes.items()})

    monkeypatch.setattr(LocalDevices, "shutdown", recording_shutdown)
    hold, release = str(tmp_path / "hold"), str(tmp_path / "release")
    job = pieces.make_job(
        optimizer=pieces.adamw,
        virtual_workers=4,
        # Steps of about 0.2 s: the driver spawns the joiner at step 1 before the job has ended, however
        # loaded the host (with steps of milliseconds it read the records late, and refused the +1 instead).
        delay_s=0.1,
        model=pieces.HeldBackModel(hold, release),
        shard_optimizer=shard,
        shard_redundancy=2 if shard else None,
    )
    steps = 4
    model, summary = train(
        job,
        steps=steps,
        devices=2,
        max_devices=3,
        schedule="1:+1",
        callbacks=[_HoldJoiners(hold, release)],
    )
    assert summary["steps"] == steps and summary["devices"] == ["local-0", "local-1"]
    records = pieces.metrics_records(metrics_file)
    assert [r["step"] for r in records if r["kind"] == "step"] == list(range(steps)), "every step once, in order"
    events = [r for r in records if r["kind"] == "event"]
    assert [r["event"] for r in events] == ["start", "schedule"], events
    assert "never applied: the job ended at step 4 while its device was still warming up" in events[1]["detail"]
    assert summary["generations"] == 1
    # The joiner exits by itself, 0, within the driver's shutdown grace (it was killed there: -9). Its one
    # line goes to the stderr of the session's fork server, which capfd does not see.
    assert exit_codes == {"local-0": 0, "local-1": 0, "local-2": 0}
