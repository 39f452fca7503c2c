"""The control plane's store: where it listens, how a client that finds no job says so, and its channels."""

import pytest

from flexpar.comm.channel import HOLE_GRACE_S, Channel
from flexpar.comm.store import Unreachable, connect, connect_client


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


def test_a_reconnecting_device_shows_its_own_lines_and_none_of_c10d_s_frame_dumps(capfd):
    """Issue 39: a handshake that times out inside `reconnect` (a driver between its listen and its store)
    logs c10d's error with a C++ frame dump straight to descriptor 2; the filter drops those lines and
    keeps every other line written meanwhile (another thread's), in order."""
    import datetime
    import os
    import socket

    import torch.distributed as dist

    from flexpar.comm.store import _native_log_filtered, is_native_log_line

    with socket.socket() as probe:  # a port nothing listens on: the client's connect times out
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with _native_log_filtered():
        os.write(2, b"flexpar: device local-0: a line of its own\n")
        with pytest.raises(RuntimeError):
            dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=0.3))
        os.write(2, b"flexpar: device local-0: and another\n")
    err = capfd.readouterr().err
    assert err == "flexpar: device local-0: a line of its own\nflexpar: device local-0: and another\n", err
    # A device that has a process group logs with its rank first.
    assert is_native_log_line("[rank0]:[E1206 01:16:12.094667371 socket.cpp:1028] [c10d] The client socket ...")
    assert not is_native_log_line("flexpar: device local-0: the job's driver is gone; ...")
