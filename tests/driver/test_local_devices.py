"""LocalDevices starts worker processes without holding the driver's loop (flexpar/driver/local_devices.py).

A fork server answers a start only once it has imported torch; a re-adopting
driver's server is still importing when its first join comes, and a blocking
start held the loop (a device's leave waited 18 of the soak's steps, seed 46).
These fakes stand for `multiprocessing.Process`: their start waits on an event.
"""

import threading

from flexpar.driver.local_devices import LocalDevices

HANG_GUARD_S = 30  # only against a hang: nothing here waits on a clock otherwise


class HeldProcess:
    """A `multiprocessing.Process` stand-in whose `start` returns once `release` is set."""

    def __init__(self, release: threading.Event, fail: bool = False, **_):
        self.release, self.fail, self.name = release, fail, "fake"
        self.started, self.killed, self.exitcode = False, False, None

    def start(self):
        assert self.release.wait(HANG_GUARD_S)
        if self.fail:
            raise OSError("the fork server is gone")
        self.started = True

    def is_alive(self):
        return self.started and not self.killed

    def kill(self):
        assert self.started, "killed before it started"
        self.killed, self.exitcode = True, -9

    def join(self, timeout=None):
        pass


class HeldContext:
    def __init__(self, fail: bool = False):
        self.release, self.fail, self.made = threading.Event(), fail, []

    def Process(self, **kwargs):  # noqa: N802 (multiprocessing's name)
        self.made.append(HeldProcess(self.release, self.fail))
        return self.made[-1]


def spawned(context) -> LocalDevices:
    devices = LocalDevices(context, "127.0.0.1", 1, "secret", "cpu", 1, ())
    done = threading.Thread(target=devices.spawn, args=(["local-3"],), daemon=True)
    done.start()
    done.join(HANG_GUARD_S)
    assert not done.is_alive(), "spawn waited for the fork server's answer"
    return devices


def test_spawn_returns_while_the_fork_server_has_not_answered_and_the_device_counts_as_alive():
    context = HeldContext()
    devices = spawned(context)
    assert devices.processes["local-3"].is_alive() and devices.exits() == []
    context.release.set()
    devices.processes["local-3"].join(HANG_GUARD_S)
    assert context.made[0].started and devices.processes["local-3"].is_alive()


def test_a_device_stopped_while_starting_is_killed_once_started():
    context = HeldContext()
    devices = spawned(context)
    devices.stop("local-3")
    assert devices.exits() == []  # still starting: not ended yet
    context.release.set()
    devices.processes["local-3"].join(HANG_GUARD_S)
    assert context.made[0].killed and devices.exits() == ["local-3"]
    assert devices.exit_codes == {"local-3": -9}


def test_a_start_that_fails_ends_the_device_with_exit_code_1(capsys):
    context = HeldContext(fail=True)
    devices = spawned(context)
    context.release.set()
    devices.processes["local-3"].join(HANG_GUARD_S)
    assert devices.exits() == ["local-3"] and devices.exit_codes == {"local-3": 1}
    assert "could not start: the fork server is gone" in capsys.readouterr().err
