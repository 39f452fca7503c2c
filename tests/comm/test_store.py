"""The control plane's store: where it listens, how a client that finds no job says so, and its channels."""

import datetime
import os
import socket
import threading

import pytest
import torch.distributed as dist

from flexpar.comm.channel import HOLE_GRACE_S, Channel
from flexpar.comm.store import Unreachable, _c10_log_level, connect, connect_client, native_log_quieted


def _listening_addresses(port):
    """Local addresses in LISTEN state on `port`, from the kernel's socket tables."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = open(table).read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            local, state = line.split()[1], line.split()[3]
            address, port_hex = local.split(":")
            if state == "0A" and int(port_hex, 16) == port:
                found.append(address)
    return found


def test_the_store_listens_on_loopback_only_by_default():
    store = connect("127.0.0.1", 0, 5.0, server=True)
    addresses = _listening_addresses(store.port)
    assert addresses == ["0100007F"], f"127.0.0.1 only, got {addresses} (00000000 would be every interface)"
    client = connect("127.0.0.1", store.port, 5.0)
    client.set("key", "value")
    assert store.get("key") == b"value"


def test_a_port_in_use_is_a_clear_error():
    store = connect("127.0.0.1", 0, 5.0, server=True)
    with pytest.raises(ValueError, match="cannot listen on 127.0.0.1:.*choose another --port"):
        connect("127.0.0.1", store.port, 5.0, server=True)


def test_a_client_with_no_job_to_reach_gets_one_line():
    with pytest.raises(Unreachable) as raised:
        connect_client("127.0.0.1", 1, 0.5)
    assert "no flexpar job answers at 127.0.0.1:1" in str(raised.value) and "\n" not in str(raised.value)


class _DictStore:
    """The store calls a Channel makes, in a dict."""

    def __init__(self):
        self.values = {}

    def add(self, key, amount):
        self.values[key] = self.values.get(key, 0) + amount
        return self.values[key]

    def set(self, key, value):
        self.values[key] = value

    def get(self, key):
        return self.values[key].encode()

    def check(self, keys):
        return all(key in self.values for key in keys)

    def delete_key(self, key):
        del self.values[key]


def test_a_channel_skips_the_index_of_a_writer_killed_before_it_wrote():
    store, now = _DictStore(), [0.0]
    reader = Channel(store, "metrics", clock=lambda: now[0])
    writer = Channel(store, "metrics")
    writer.send({"step": 1})
    store.add("metrics/count", 1)  # a writer took index 2 and was killed before writing it
    writer.send({"step": 3})
    assert reader.receive() == [{"step": 1}], "a message being written is waited for"
    now[0] = HOLE_GRACE_S / 2
    assert reader.receive() == []
    now[0] = HOLE_GRACE_S + 0.1
    assert reader.receive() == [{"step": 3}] and reader.skipped == 1
    writer.send({"step": 4})
    assert reader.receive() == [{"step": 4}]


def test_a_channel_reads_a_late_writer_that_wrote_within_the_grace():
    store, now = _DictStore(), [0.0]
    reader = Channel(store, "events", clock=lambda: now[0])
    index = store.add("events/count", 1)
    assert reader.receive() == []
    now[0] = HOLE_GRACE_S - 0.1
    store.set(f"events/{index}", '{"type": "ready"}')
    assert reader.receive() == [{"type": "ready"}] and reader.skipped == 0


def test_once_every_writer_is_done_a_hole_is_skipped_at_once():
    """The job is over ("done" was written after rank 0 sent everything): an empty index is a dead
    rank 0's, and what a later rank 0 wrote after it must not wait out the grace (it would be lost)."""
    store, now = _DictStore(), [0.0]
    reader = Channel(store, "metrics", clock=lambda: now[0])
    store.add("metrics/count", 1)  # taken by a rank 0 killed before it wrote
    Channel(store, "metrics").send({"step": 5})
    assert reader.receive() == []
    assert reader.receive(writers_done=True) == [{"step": 5}] and reader.skipped == 1


def test_a_message_written_after_its_index_was_skipped_still_arrives():
    """A writer stopped (SIGSTOP) between taking its index and writing it is late, not dead."""
    store, now = _DictStore(), [0.0]
    reader = Channel(store, "events", clock=lambda: now[0])
    index = store.add("events/count", 1)
    Channel(store, "events").send({"type": "after"})
    assert reader.receive() == []
    now[0] = HOLE_GRACE_S + 0.1
    assert reader.receive() == [{"type": "after"}] and reader.skipped == 1
    store.set(f"events/{index}", '{"type": "late"}')
    assert reader.receive() == [{"type": "late"}]
    assert reader.receive() == [] and f"events/{index}" not in store.values


def test_a_second_driver_at_a_live_jobs_address_is_refused_with_one_line():
    store = connect("127.0.0.1", 0, 5.0, server=True)
    store.set("job/version", "x")  # what every flexpar job publishes first
    with pytest.raises(ValueError) as raised:
        connect("127.0.0.1", store.port, 5.0, server=True)
    message = str(raised.value)
    assert f"a flexpar job is already running at 127.0.0.1:{store.port} (its driver answers)" in message
    assert "a second driver there is refused" in message and "\n" not in message


def _a_port_nothing_listens_on() -> int:
    with socket.socket() as probe:  # closed again: a client's connect there is refused until it times out
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _a_timed_out_handshake(port: int) -> None:
    """What a device meets when a driver dies as it connects: c10d logs its error and a C++ frame dump."""
    with pytest.raises(RuntimeError):
        dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=0.3))


def test_a_reconnecting_device_shows_its_own_lines_and_none_of_c10d_s_frame_dumps(capfd):
    """A quiet wait for a restarted driver: a handshake that times out inside `reconnect` (a driver between
    its listen and its store) logs c10d's error with a C++ frame dump straight to descriptor 2: quieted;
    every other line written meanwhile is kept, in order; c10's log level is back afterwards."""
    level = _c10_log_level()
    assert level is not None, "torch's libc10 no longer exposes FLAGS_caffe2_log_level: c10d's dumps would show"
    before = level.value
    with native_log_quieted():
        os.write(2, b"flexpar: device local-0: a line of its own\n")
        _a_timed_out_handshake(_a_port_nothing_listens_on())
        os.write(2, b"flexpar: device local-0: and another\n")
    err = capfd.readouterr().err
    assert err == "flexpar: device local-0: a line of its own\nflexpar: device local-0: and another\n", err
    assert level.value == before


def test_lines_written_while_another_thread_quiets_c10d_go_out_at_once_each_in_order(capfd):
    """The flaky kill -9 test's lost lines: a device's follower thread was inside a handshake (descriptor 2
    pointed at a pipe, for up to 2 s) while its main thread said that it waited for a driver and then
    that none came back, and exited: the lines held in the pipe went with the process. Every line, the
    user's blank ones too, now reaches stderr while the other thread is still inside, as written."""
    inside, done = threading.Event(), threading.Event()
    port = _a_port_nothing_listens_on()

    def follower():  # as StoreFollower._find_driver (flexpar/worker/link_follower.py), looking for a restarted driver
        with native_log_quieted():
            inside.set()
            done.wait()
            _a_timed_out_handshake(port)

    def user_thread():  # print() in a worker process ends in a write to descriptor 2 (pytest patches sys.stderr)
        for line in ("user line 1", "", "user line 2"):
            os.write(2, f"{line}\n".encode())

    thread = threading.Thread(target=follower)
    thread.start()
    try:
        assert inside.wait(timeout=60)
        os.write(2, b"flexpar: device local-0: the job's driver is gone; waiting\n")
        writer = threading.Thread(target=user_thread)
        writer.start()
        writer.join()
        os.write(2, b"flexpar: device local-0: none came back\n")
        said = capfd.readouterr().err  # the follower is still inside: before, this read nothing
    finally:
        done.set()
        thread.join()
    lines = said.splitlines()
    assert [line for line in lines if line.startswith("flexpar:")] == [
        "flexpar: device local-0: the job's driver is gone; waiting",
        "flexpar: device local-0: none came back",
    ], said
    assert [line for line in lines if not line.startswith("flexpar:")] == ["user line 1", "", "user line 2"], said
    assert capfd.readouterr().err == ""  # and the handshake's error and frame dump were not shown
